"""The ops layer: the compiled extension's loader, the limits every size is checked against, and
the Python face of each op (resolve, gather, invalidate, save) with its fake kernel.

May import: torch and ``hisparse._C`` only. Everything else in hisparse sits above this layer.
The contract of each op is docs/ops.md.
"""

from hisparse.ops.calls import gather, invalidate, resolve_residency, save_rows

__all__ = ["gather", "invalidate", "resolve_residency", "save_rows"]
