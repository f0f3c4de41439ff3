"""The tokens of one forward as the DSA core reads them: each token's position and batch row,
each request's context and block table, all device tensors (no host reads in a decode step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenBatch:
    """The tokens of one forward: ``positions`` / ``req`` int64 [T] (each token's position and
    batch row), ``seq_lens`` int [R] (context after this step), ``block_table`` int [R, blocks]:
    position j of request r is slot ``block_table[r, j // block_size] * block_size + j %
    block_size`` (a key of the row store and of the index cache)."""

    positions: torch.Tensor
    req: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def max_context(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def slots(self, pos: torch.Tensor) -> torch.Tensor:
        """Slots of positions ``pos`` [T, K] of each token's request; -1 stays -1."""
        p = pos.clamp(min=0)
        bs = self.block_size
        blk = self.block_table[self.req[:, None], torch.div(p, bs, rounding_mode="floor")]
        return torch.where(pos >= 0, blk.long() * bs + p % bs, pos)

    def narrow(self, start: int, length: int) -> "TokenBatch":
        """Tokens start .. start + length (same requests)."""
        s = slice(start, start + length)
        return TokenBatch(
            self.positions[s], self.req[s], self.seq_lens, self.block_table, self.block_size
        )


def token_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each token's batch row, int64 [num_tokens], from the rows' first tokens [R + 1] (on the
    device, no host read)."""
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    return torch.searchsorted(query_start_loc[1:].contiguous(), t, right=True).long()
