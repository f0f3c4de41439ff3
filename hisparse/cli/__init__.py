"""The command line: ``hisparse info|demo|bench|plan|export-model``, their flags, and the work
behind each (the demo, the benchmark, the capacity model, the model export).

May import everything below it; nothing imports this package.
"""

from hisparse.cli.app import main

__all__ = ["main"]
