"""zero's benchmarks, one tool: ``python -m benchmarks list``, ``python -m benchmarks <name> [options]``.

The benchmarks are registered in :mod:`benchmarks.registry`; they share the command line
(:mod:`benchmarks.kit.cli`), the report (:mod:`benchmarks.kit.report`) and the docs updater
(:mod:`benchmarks.kit.docs`). Results go to ``benchmarks/results/`` by default.
"""
