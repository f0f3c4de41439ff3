"""The ops layer: the compiled extension's loader, the limits every size is checked against, and
the Python face of each op (resolve, gather, invalidate, save, top-k slots) with its fake kernel.

May import: torch and ``hisparse._C`` only. Everything else in hisparse sits above this layer.
The contract of each op is docs/ops.md.

The op functions are loaded on first use: ``hisparse.ops.limits`` must import without torch
(the CLI's ``--help`` reads it), so importing this package must not import ``calls``.
"""

__all__ = ["bound_op", "gather", "invalidate", "resolve_residency", "save_rows", "topk_slots"]


def __getattr__(name: str):
    if name in __all__:
        from hisparse.ops import calls

        fn = globals()[name] = getattr(calls, name)  # later lookups skip this hook
        return fn
    raise AttributeError(f"module 'hisparse.ops' has no attribute {name!r}")
