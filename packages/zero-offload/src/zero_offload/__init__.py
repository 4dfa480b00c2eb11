"""CPU / NVMe placement of optimizer state and parameters, async swapping, CPU Adam."""
