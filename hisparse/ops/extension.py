"""Loads the compiled extension lazily and says which backends it carries."""

from __future__ import annotations

import functools

from hisparse.ops import limits

BUILD_HINT = (
    "build it from the source tree with `pip install --no-build-isolation -e .` "
    "(the CUDA backend needs nvcc and a CUDA build of torch at build time)"
)


class BackendUnavailableError(RuntimeError):
    """An op was called on a backend that this installation did not build."""


@functools.lru_cache(maxsize=None)
def load():
    """Import ``hisparse._C`` (registers the ops); None if it was not built."""
    try:
        import torch  # noqa: F401  (the extension links against torch's libraries)

        from hisparse import _C
    except ImportError:
        return None
    # Outside the try: a stale build must say so, not pass for a missing one.
    limits.check_extension(_C)
    return _C


def built_backends() -> list[str]:
    ext = load()
    if ext is None:
        return []
    return ["cpu", "cuda"] if getattr(ext, "WITH_CUDA", 0) else ["cpu"]


def require(device_type: str) -> None:
    """Raise a clear error if no kernel for ``device_type`` was built."""
    have = built_backends()
    if device_type in have:
        return
    if not have:
        raise BackendUnavailableError(f"hisparse._C is not built; {BUILD_HINT}")
    raise BackendUnavailableError(
        f"hisparse was built without its {device_type.upper()} backend (built: "
        f"{', '.join(have)}); {BUILD_HINT}"
    )
