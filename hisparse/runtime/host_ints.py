"""Integer lists a caller hands the runtime (state rows, keys), checked and copied to the host
as int64 before any reaches an op."""

from __future__ import annotations

from typing import Sequence, Union

import torch

from hisparse.ops.limits import as_index

IntsLike = Union[Sequence[int], torch.Tensor]


def int64_cpu(name: str, values: IntsLike) -> torch.Tensor:
    """Flat int64 copy on the CPU; anything that is not a sequence of integers (floats,
    bools, values past int64) is refused by name instead of being truncated. Each element
    follows ``as_index``, the rule the scheduler and the step metadata apply as well."""
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {values.dtype}")
        return values.detach().reshape(-1).to("cpu", torch.int64)
    try:
        seq = list(values)
    except TypeError:
        raise ValueError(
            f"{name} must be a sequence of integers, got {type(values).__name__}"
        ) from None
    ints = [as_index(f"{name}[{i}]", v, -(2**63), 2**63 - 1) for i, v in enumerate(seq)]
    return torch.tensor(ints, dtype=torch.int64)
