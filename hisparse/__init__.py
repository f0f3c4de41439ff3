"""hisparse: HiSparse hot-buffering for sparse-attention inference.

Importing the package never fails because a compiled backend is missing; calling an op whose
backend was not built raises an error that says how to build it (see ``hisparse.ops``).
vLLM is never imported here.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
