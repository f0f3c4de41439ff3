"""One DSA layer's sparse attention for a whole batch, free of any serving framework: the indexer
and its top-k over a paged key cache, then MLA over the selected latent rows.

Every input is a device tensor (positions, each token's batch row, block tables), so a decode
step has no Python loop over requests and reads nothing back to the host. Two backends:

* ``torch``: the model math of ``hisparse.models.dsa`` (float32 index scores, rows decoded by
  ``decode_rows``); the CPU path and the oracle of the tests. On the CPU it takes each request's
  top-k over exactly its own context, as transformers does: ``topk``'s choice among equal scores
  (ReLU zeros are common) depends on the length of the row it ranks.
* ``triton`` (CUDA): the production formats' kernels (``hisparse.models.dsa.kernels``): the
  paged FP8 indexer where keys are fp8 (or DeepGEMM's paged logits where importable:
  ``indexer="deepgemm"``; ``"auto"`` measures it first); where rows are fp8, the one-pass FP8
  row read with batched products (``attention="bmm"``, which can also fetch a HiSparse step's
  misses), the fused sparse MLA kernel (``"fused"``) or FlashMLA's decode where importable
  (``"flashmla"``; ``"auto"`` measures it against "bmm"), the row encoding, and (``kernel_rows``
  passed to the projections) the norms and rotary embeddings in one launch each. Unquantized
  formats keep the torch math on CUDA too: they exist to compare with references.

Resident and HiSparse attend through the same call on the same row bytes in the same order (the
selection is sorted by position), so both modes give the same bits on one device. Which rows is
the caller's business: the resident cache by slot, or the hot buffers by the rows the connector
resolved.
"""

from __future__ import annotations

import weakref

import torch

from hisparse.models.dsa import attention as mla
from hisparse.models.dsa import index_keys, paged_select
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.kernels import deepgemm, flashmla
from hisparse.models.dsa.kernels import elementwise as ew
from hisparse.models.dsa.kernels import indexer as idx_kernel
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.models.dsa.kernels import rows as row_kernels
from hisparse.models.dsa.kernels import select as select_kernel
from hisparse.models.dsa.tokens import TokenBatch, token_rows  # noqa: F401 (the core's API)
from hisparse.models.rows import FORMATS, decode_rows, encode_rows

# Bound on one torch-path chunk (index scores [tokens, heads, context] or rows [tokens, K, kv_dim]).
CHUNK_ELEMS = 1 << 24
ATTENTION = ("auto", "bmm", "fused", "flashmla")
INDEXER = ("auto", "triton", "deepgemm")
# How a HiSparse step's misses reach the row read: copied into the hot buffer by the resolve
# op's gather first, or fetched by the row read itself (``kernels.misses``); "auto" takes the
# in-read from IN_READ_FROM requests up, where it measured faster (docs/results.md).
MISSES = ("auto", "gather", "in_read")
IN_READ_FROM = 16


class SparseMLACore:
    """The sparse attention of a DSA model with rows in ``row_format`` and index keys in
    ``key_format`` (default: fp8 beside fp8 rows, else f32) on ``device``."""

    def __init__(
        self,
        cfg: DSAConfig,
        row_format: str,
        device,
        *,
        key_format: str | None = None,
        backend: str = "auto",
        attention: str = "auto",
        misses: str = "auto",
        indexer: str = "auto",
    ) -> None:
        if row_format not in FORMATS:
            raise ValueError(f"row_format must be one of {list(FORMATS)}, got {row_format!r}")
        self.row_bytes = cfg.row_bytes(row_format)  # refuses fp8 rows of a partial tile
        key_format = key_format or index_keys.default_format(row_format)
        self.key_bytes = index_keys.key_bytes(key_format, cfg.index_head_dim)
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        if misses not in MISSES:
            raise ValueError(f"misses must be one of {MISSES}, got {misses!r}")
        if indexer not in INDEXER:
            raise ValueError(f"indexer must be one of {INDEXER}, got {indexer!r}")
        if attention in ("fused", "flashmla") and not cfg.standard_rows():
            raise ValueError(
                f"attention={attention!r} reads rows of 512 + 64 values; this model's are "
                f"{cfg.kv_lora_rank} + {cfg.qk_rope_head_dim}: pass attention='auto'"
            )
        can = row_kernels.available(device)
        if backend == "triton" and not can:
            raise ValueError(f"backend='triton' needs Triton and a CUDA device, not {device}")
        use = can and backend != "torch"
        self.cfg, self.row_format, self.key_format = cfg, row_format, key_format
        self.kernel_rows = use and row_format == "fp8" and cfg.standard_rows()
        self.kernel_index = (
            use and key_format == "fp8" and idx_kernel.fits(cfg.index_n_heads, cfg.index_head_dim)
        )
        d = cfg.index_head_dim
        self.kernel_keys = use and key_format == "fp8" and d & (d - 1) == 0
        self.misses = misses
        self._flash = flashmla.find() if self.kernel_rows and attention != "bmm" else None
        if attention == "flashmla":
            flashmla.require(self._flash, cfg.num_heads)
        if attention == "auto":  # measured once per device and shape (flashmla.choose)
            attention = "bmm"
            if self._flash is not None:
                attention = flashmla.choose(
                    device, cfg.num_heads, cfg.index_topk, mla_kernel.bmm_attention
                )
        self.attention = attention
        self.indexer, self._scores_fn = deepgemm.pick(  # "auto": measured (deepgemm.choose)
            indexer, self.kernel_index, cfg, device, idx_kernel.paged_scores
        )
        self._splits: dict = {}  # kv_b_proj weight -> (W_uk, W_uv), kernel path

    def encode_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Row values [T, kv_dim] -> [T, row_bytes] in the row format (``rows.encode_rows``;
        one launch, the same bytes, for fp8 rows on the kernel path)."""
        if self.kernel_rows and ew.supported(values):
            return ew.encode_fp8_rows(values)
        return encode_rows(values, self.row_format, self.cfg.kv_lora_rank)

    # ------------------------------------------------------------------ indexer
    def key_cache(self, blocks: int, block_size: int, device) -> torch.Tensor:
        """An empty paged index key cache (``hisparse.models.dsa.index_keys``)."""
        return torch.zeros(blocks, block_size * self.key_bytes, dtype=torch.uint8, device=device)

    def store_keys(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, bs: int):
        """This step's keys ``k`` [T, D] at their ``slots`` of the paged ``cache``."""
        if self.kernel_keys and bs % 4 == 0:
            idx_kernel.store_fp8_keys(cache, slots, k, bs)
        else:
            index_keys.store_keys(cache, slots, k, self.key_format, bs)

    def select(
        self, q: torch.Tensor, head_w: torch.Tensor, cache: torch.Tensor, batch: TokenBatch
    ) -> torch.Tensor:
        """Slots each token attends to, int64 [T, index_topk] in ascending position order, -1
        padding last: q [T, Hi, D] / head_w [T, Hi] of the tokens, ``cache`` the layer's index
        keys (paged, uint8 [blocks, block_size * key_bytes]), this step's keys already stored."""
        cfg = self.cfg
        if self.kernel_index:
            hw = head_w.float() * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
            b = batch
            q16 = q.to(torch.bfloat16)  # read once per tile of keys: half the bytes of float32
            scores_fn = self._scores_fn  # DeepGEMM's SM90 kernel reads blocks of 64 keys only
            if b.block_size != deepgemm.BLOCK:
                scores_fn = idx_kernel.paged_scores
            scores = scores_fn(q16, hw, cache, b.block_table, b.block_size, b.req, b.positions)
            return select_kernel.top_k_slots(
                scores, b.req, b.block_table, b.block_size, cfg.index_topk
            )
        pos = paged_select.positions(q, head_w, cache, batch, cfg, self.key_format, CHUNK_ELEMS)
        return batch.slots(pos)

    # ------------------------------------------------------------------ attention
    def attend(self, q_nope, q_pe, kv_b_weight, src, ids, misses=None) -> torch.Tensor:
        """Attention of each token over its rows ``ids`` [T, K] (-1 padding) of ``src`` (uint8
        [N, row_bytes]) -> per-head values [T, H * v_head_dim] (the input of ``o_proj``):
        ``attend_query`` of ``query(q_nope, q_pe, kv_b_weight)``."""
        self._check_misses(misses, ids)
        return self.attend_query(
            self.query(q_nope, q_pe, kv_b_weight), kv_b_weight, src, ids, misses
        )

    def query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor):
        """Each token's query in the latent, [T, H, kv_dim]: q_nope [T, H, nope] absorbed through
        kv_b_proj's W_uk, then the rotated q_pe [T, H, rope]. bf16 on the kernel path (what its
        attention reads). It needs no row: a HiSparse step computes it while the misses copy in."""
        if not self.kernel_rows:
            q_lat = mla.absorb_query(q_nope, kv_b_weight, self.cfg)
            return torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)
        w_uk, _ = self._split(kv_b_weight)
        t, h = q_nope.shape[:2]
        # The product writes the token-major buffer attention reads, through a transposed view:
        # no concatenation copies it again.
        c = self.cfg.kv_lora_rank
        q = q_nope.new_empty(t, h, self.cfg.kv_dim, dtype=torch.bfloat16)
        _bmm_into(q_nope.to(w_uk.dtype).transpose(0, 1), w_uk, q[..., :c].transpose(0, 1))
        q[..., c:] = q_pe
        return q

    def attend_query(self, q, kv_b_weight, src, ids, misses=None) -> torch.Tensor:
        """``attend`` from the tokens' ``query`` q [T, H, kv_dim]. ``misses``: a HiSparse step's
        miss plan (``hisparse.runtime.miss_plan.MissPlan``) when ``src`` is the hot buffer and
        ``reads_misses`` said so: the read fetches them."""
        cfg = self.cfg
        self._check_misses(misses, ids)
        if ids.shape[0] == 0:
            return kv_b_weight.new_zeros(0, cfg.num_heads * cfg.v_head_dim)
        if self.kernel_rows:
            _, w_uv = self._split(kv_b_weight)
            o = self.attend_latent(q, src, ids, misses).to(w_uv.dtype)
            # Written token-major through a transposed view: no reshape copies it again.
            v = o.new_empty(o.shape[0], o.shape[1], w_uv.shape[1])
            torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2), out=v.transpose(0, 1))
            return v.view(o.shape[0], -1)
        step = max(1, CHUNK_ELEMS // (ids.shape[1] * cfg.kv_dim))
        parts = [
            self._attend_torch(q[s : s + step], src, ids[s : s + step])
            for s in range(0, ids.shape[0], step)
        ]
        return mla.expand_values(torch.cat(parts), kv_b_weight, cfg)

    def _check_misses(self, misses, ids: torch.Tensor) -> None:
        if misses is not None and not self.reads_misses(ids.shape[0]):
            raise ValueError(
                f"misses= given, but this core reads them only where reads_misses() is true "
                f"(kernel rows, attention='bmm', misses={self.misses!r})"
            )

    def reads_misses(self, num_tokens: int) -> bool:
        """Whether ``attend`` over ``num_tokens`` tokens' hot rows should be handed the miss plan
        (``misses=``) instead of reading after the gather copied the misses in."""
        if not (self.kernel_rows and self.attention == "bmm") or self.misses == "gather":
            return False
        return self.misses == "in_read" or num_tokens >= IN_READ_FROM

    def _split(self, kv_b: torch.Tensor):
        """kv_b_proj's weight as contiguous W_uk [H, nope, 512] and W_uv [H, v, 512], split once
        per weight (the slices of the weight would be copied on every call otherwise)."""
        ref, version, *got = self._splits.get(id(kv_b), (None, None))
        if ref is None or ref() is not kv_b or version != kv_b._version:
            cfg = self.cfg
            w = kv_b.detach().view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
            got = [
                w[:, : cfg.qk_nope_head_dim].contiguous(),
                w[:, cfg.qk_nope_head_dim :].contiguous(),
            ]
            # A weak reference: a freed weight's id may come back with another tensor.
            self._splits[id(kv_b)] = (weakref.ref(kv_b), kv_b._version, *got)
        return got

    def _attend_torch(self, q, src, ids) -> torch.Tensor:
        valid = ids >= 0
        rows = src[ids.clamp(min=0)]
        # Padding entries read an arbitrary row: zero it so no NaN byte pattern reaches softmax.
        rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros_like(rows))
        cfg = self.cfg
        values = decode_rows(rows, self.row_format, q.dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        lat, pe = q[..., : cfg.kv_lora_rank], q[..., cfg.kv_lora_rank :]
        return mla.attend_rows(lat, pe, values, valid, self.cfg.softmax_scale)

    def attend_latent(self, q, src, ids, misses=None) -> torch.Tensor:
        """The kernels' attention in the latent: queries q [T, H, 576] bf16 (the absorbed
        query, then the rotated one) over rows ``ids`` [T, K] of the fp8 ``src`` -> latent mix
        [T, H, 512] bf16 (``misses``: see ``attend``)."""
        scale = self.cfg.softmax_scale
        if self.attention == "flashmla":
            return self._flash(q, src, ids, scale)
        if self.attention == "fused":
            splits = mla_kernel.splits_for(ids.shape[0], q.shape[1], src.device)
            return mla_kernel.sparse_mla(q, src, ids, scale, splits=splits)
        return mla_kernel.bmm_attention(q, src, ids, scale, misses)


def _bmm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[:] = a @ b`` (batched), written in place where the dtypes allow."""
    if out.dtype == a.dtype:
        torch.bmm(a, b, out=out)
    else:
        out.copy_(torch.bmm(a, b))
