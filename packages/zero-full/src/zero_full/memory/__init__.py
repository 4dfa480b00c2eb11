"""Memory per rank: the ZeRO formulas and the process's real memory."""
