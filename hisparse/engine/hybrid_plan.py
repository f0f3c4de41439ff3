"""Where a hybrid step's new rows go, decided once per step on the host and uploaded in one
copy: each row to its request's device page or (spilled requests) device window, spilled
requests' decode rows also to the staging buffer, spilled prompts to the host pool."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class StepPlan:
    dev_dst: torch.Tensor  # device rows every new row (or ``dev_src``'s) goes to
    dev_src: Optional[torch.Tensor]  # which new rows, None = all of them in batch order
    stage_src: torch.Tensor  # spilled decode rows (batch index) to stage
    stage_keys: torch.Tensor  # their keys (CPU), where the pool takes them later
    resident_idx: torch.Tensor  # batch index of resident decode requests
    spilled_idx: torch.Tensor  # batch index of spilled decode requests
    spilled_hot: torch.Tensor  # their hot slots
    all_spilled: bool  # every decode request is spilled
    # spilled prompts' rows (batch index) and the host rows (keys) they are written to, int32
    prefill_src: Optional[torch.Tensor]
    prefill_keys: Optional[torch.Tensor]
    stage: Optional[torch.Tensor]  # [layers, staged rows, row_bytes] on the device
    num_staged: int = 0
    num_resident: int = 0
    num_spilled: int = 0


@dataclass
class _Routes:
    dev_dst: List[int] = field(default_factory=list)
    dev_src: List[int] = field(default_factory=list)
    stage_src: List[int] = field(default_factory=list)
    stage_keys: List[int] = field(default_factory=list)
    resident_idx: List[int] = field(default_factory=list)
    spilled_idx: List[int] = field(default_factory=list)
    spilled_hot: List[int] = field(default_factory=list)
    prefill_host: List[Tuple[int, int, int]] = field(default_factory=list)
    all_dev: bool = True  # every new row goes to the device, in batch order


def _route(kv, dec: Sequence, new: Sequence) -> _Routes:
    bs, rt = kv.cfg.block_size, _Routes()
    for i, r in enumerate(dec):
        s, p = r.slot, r.pos
        rt.dev_src.append(i)
        if s in kv.pages:
            rt.dev_dst.append(kv.pages[s][p // bs] * bs + p % bs)
            rt.resident_idx.append(i)
        else:
            h = kv.hot[s]
            rt.dev_dst.append(kv._window_row(h, p))
            rt.stage_src.append(i)
            rt.stage_keys.append(kv._key0(s) + p)
            rt.spilled_idx.append(i)
            rt.spilled_hot.append(h)
    off = len(dec)
    for r in new:
        s, P = r.slot, r.prompt_len
        if s in kv.pages:
            rt.dev_dst.extend(kv._rows_of(kv.pages[s], 0, P))
            rt.dev_src.extend(range(off, off + P))
        else:
            # only the newest rows stay on the device, in the window; the rest go to the pool
            lo = max(0, P - kv.window)
            rt.dev_dst.extend(kv._window_row(kv.hot[s], q) for q in range(lo, P))
            rt.dev_src.extend(range(off + lo, off + P))
            rt.all_dev = False
            rt.prefill_host.append((kv._key0(s), off, P))
        off += P
    return rt


def build_plan(kv, dec: Sequence, new: Sequence, pt_updates: Sequence[tuple]) -> StepPlan:
    """The step's plan; also applies the step's page-table updates ``(slot, index, page)``."""
    cfg, rt = kv.cfg, _route(kv, dec, new)
    pt_s = [u[0] for u in pt_updates]
    pt_i = [u[1] for u in pt_updates]
    pt_v = [u[2] for u in pt_updates]
    (t_dst, t_src, t_stage, t_rs, t_sp, t_hot, t_ps, t_pi, t_pv) = kv._upload(
        [
            rt.dev_dst,
            rt.dev_src if not rt.all_dev else [],
            rt.stage_src,
            rt.resident_idx,
            rt.spilled_idx,
            rt.spilled_hot,
            pt_s,
            pt_i,
            pt_v,
        ]
    )
    if pt_s:
        kv.pt[t_ps, t_pi] = t_pv
    num_staged = len(rt.stage_src)
    stage = (
        torch.empty(cfg.num_layers, num_staged, cfg.row_bytes, dtype=torch.uint8, device=kv.device)
        if num_staged
        else None
    )
    prefill_src = prefill_keys = None
    if rt.prefill_host:
        idx = torch.cat(
            [
                torch.stack([torch.arange(off, off + P), torch.arange(k0, k0 + P)])
                for k0, off, P in rt.prefill_host
            ],
            dim=1,
        ).to(torch.int32)
        if kv.on_cuda:
            idx = idx.pin_memory().to(kv.device, non_blocking=True)
        prefill_src, prefill_keys = idx[0], idx[1]
    return StepPlan(
        dev_dst=t_dst,
        dev_src=None if rt.all_dev else t_src,
        stage_src=t_stage,
        stage_keys=torch.tensor(rt.stage_keys, dtype=torch.int64),
        resident_idx=t_rs,
        spilled_idx=t_sp,
        spilled_hot=t_hot,
        all_spilled=len(rt.spilled_idx) == len(dec),
        prefill_src=prefill_src,
        prefill_keys=prefill_keys,
        stage=stage,
        num_staged=num_staged,
        num_resident=len(rt.resident_idx),
        num_spilled=len(rt.spilled_idx),
    )


def page_rows(
    pl: StepPlan, pt: torch.Tensor, bs: int, sel_pos: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """Device rows of the resident decode requests' selections, through the page table ``pt``
    (slot, page index) -> page."""
    if pl.num_spilled:
        rs = pl.resident_idx
        sp, sl = sel_pos.index_select(0, rs), slots.index_select(0, rs)
    else:
        sp, sl = sel_pos, slots
    spc = sp.clamp(min=0)
    return pt[sl.unsqueeze(1), spc // bs] * bs + spc % bs


def connector_query(
    pl: StepPlan,
    win_base: int,
    window: int,
    sel_keys: torch.Tensor,
    sel_pos: torch.Tensor,
    cur_pos: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(top_k, resident_rows)`` for resolve: the spilled decode requests' top-k keys and, for
    the ones still in their device window, the window rows (the op's resident tier)."""
    if pl.all_spilled:
        keys, sp, cp = sel_keys, sel_pos, cur_pos
    else:
        idx = pl.spilled_idx
        keys, sp, cp = (
            sel_keys.index_select(0, idx),
            sel_pos.index_select(0, idx),
            cur_pos.index_select(0, idx),
        )
    in_win = (sp >= 0) & (sp > (cp - window).unsqueeze(1))
    win_row = win_base + pl.spilled_hot.unsqueeze(1) * window + sp.remainder(window)
    resident = torch.where(in_win, win_row, torch.full_like(win_row, -1))
    return keys.to(torch.int32), resident.to(torch.int32)
