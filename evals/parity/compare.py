"""Comparing two recorded runs bit for bit, and checking from the counters that a scenario
exercised what it claims."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from evals.parity.runs import Run
from evals.parity.scenarios import Scenario


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    if t.is_floating_point():
        int_for = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()]
        return t.view(int_for)
    return t


def bit_identical_rows(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """(identical rows, total rows) comparing the raw bits of each row; shape mismatch = 0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return 0, max(a.shape[0] if a.dim() else 1, b.shape[0] if b.dim() else 1)
    ea, eb = _bits(a), _bits(b)
    if ea.dim() == 0:
        return int(bool(ea == eb)), 1
    eq = (ea == eb).reshape(ea.shape[0], -1).all(dim=1)
    return int(eq.sum()), int(eq.numel())


def token_agreement(a: List[List[int]], b: List[List[int]]) -> tuple:
    """(identical tokens, total tokens): position-wise; extra or missing tokens count as
    different, and after a request's first difference its later tokens still count only if
    they happen to be equal (they usually diverge)."""
    same = total = 0
    for i in range(max(len(a), len(b))):
        ta = a[i] if i < len(a) else []
        tb = b[i] if i < len(b) else []
        total += max(len(ta), len(tb))
        same += sum(1 for x, y in zip(ta, tb) if x == y)
    return same, total


@dataclass
class PairResult:
    scenario: str
    seed: int
    kind: str  # "parity" or "negative-control"
    identical_tokens: int
    total_tokens: int
    attention_rows_identical: int = 0
    attention_rows_total: int = 0
    attention_layers_identical: int = 0
    attention_layers_total: int = 0
    hidden_identical: bool = False
    first_mismatch: Optional[tuple] = None
    parity_ok: bool = False  # tokens, final hidden states and attention all identical
    coverage: Dict[str, object] = field(default_factory=dict)
    coverage_problems: List[str] = field(default_factory=list)
    note: str = ""
    hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    host_to_device_bytes: int = 0
    wall_s: float = 0.0

    @property
    def token_pct(self) -> float:
        return 100.0 * self.identical_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def verdict(self) -> str:
        """For parity pairs PASS means identical; a negative control's pair 'FAIL's (the
        expected outcome) and ``ok`` says it was detected."""
        return "PASS" if self.parity_ok and not self.coverage_problems else "FAIL"

    @property
    def ok(self) -> bool:
        if self.kind == "negative-control":
            return not self.parity_ok  # the fault must be caught
        return self.verdict == "PASS"

    def to_dict(self) -> Dict[str, object]:
        d = asdict(self)
        d.update(token_pct=self.token_pct, verdict=self.verdict, ok=self.ok)
        return d


def coverage(sc: Scenario, other: Run, resident: Run) -> tuple:
    """(what the HiSparse / hybrid run exercised, which of the scenario's claims it failed)."""
    w, c = sc.workload, other.counters
    misses = int(c.get("misses", 0))
    # Every connector request starts from an empty state row: at most hot_size rows per index
    # group can land in empty slots; every further miss evicted a held row. Hybrid gives a
    # request a fresh state row each time it is spilled (admitted spilled included).
    admissions = w.requests if other.mode == "hisparse" else int(c.get("spilled_requests", 0))
    empty_fills = w.hot_size * w.groups * admissions
    evictions_lb = max(0, misses - empty_fills)
    cov: Dict[str, object] = {
        "context_over_hot": w.longest / w.hot_size,
        "hot_over_top_k": w.hot_size / w.top_k,
        "batch_rows": w.max_batch,
        "requests": w.requests,
        "index_group": w.group,
        "row_bytes": w.row_bytes,
        "evictions_lower_bound": evictions_lb,
        "misses": misses,
    }
    if other.mode == "hybrid":
        for k in ("spills", "spilled_requests", "returns", "peak_spilled"):
            cov[k] = int(c.get(k, 0))
    problems = []
    if sc.expect_spills and cov.get("spills", 0) <= 0:
        problems.append("no mid-request spill: every request stayed where it was admitted")
    if sc.expect_spills and cov.get("returns", 0) <= 0:
        problems.append("no return: no spilled request came back to device pages")
    if resident.device_kv_bytes and other.device_kv_bytes:
        ratio = other.device_kv_bytes / resident.device_kv_bytes
        cov["device_kv_ratio"] = ratio
        if ratio > sc.max_device_kv_ratio:
            problems.append(
                f"no memory pressure: device KV is {ratio:.2f}x the resident run's "
                f"(limit {sc.max_device_kv_ratio})"
            )
    else:
        problems.append("device KV bytes not recorded")
    if misses <= 0:
        problems.append("no misses: the host-pool path never ran")
    if sc.expect_eviction and evictions_lb <= 0:
        problems.append(f"no evictions proven ({misses} misses <= {empty_fills} empty-slot fills)")
    if sc.expect_reuse and w.requests <= w.max_batch:
        problems.append("no state-row reuse (requests <= batch rows)")
    if w.longest / w.hot_size < sc.min_context_over_hot:
        problems.append(f"context only {w.longest / w.hot_size:.1f}x the hot buffer")
    return cov, problems


def _attention(ra: Optional[dict], rb: Optional[dict]) -> tuple:
    """(rows identical, rows, layers identical, layers) over every recorded layer."""
    ra, rb = ra or {}, rb or {}
    rows_same = rows_total = layers_same = layers_total = 0
    for i in sorted(set(ra) | set(rb)):
        layers_total += 1
        if i in ra and i in rb:
            s, t = bit_identical_rows(ra[i], rb[i])
            rows_same, rows_total = rows_same + s, rows_total + t
            layers_same += int(s == t and t > 0)
        else:
            rows_total += ra.get(i, rb.get(i)).shape[0]
    return rows_same, rows_total, layers_same, layers_total


def first_mismatch(a: List[List[int]], b: List[List[int]]) -> Optional[tuple]:
    """(request, step) of the first token that differs, or None."""
    for i, (ta, tb) in enumerate(zip(a, b)):
        diff = [p for p, (x, y) in enumerate(zip(ta, tb)) if x != y]
        if diff or len(ta) != len(tb):
            return i, diff[0] if diff else min(len(ta), len(tb))
    return None


def compare_pair(sc: Scenario, seed: int, resident: Run, other: Run, kind: str) -> PairResult:
    same, total = token_agreement(resident.tokens, other.tokens)
    rows_same, rows_total, layers_same, layers_total = _attention(
        resident.attention, other.attention
    )
    hidden_ok = False
    if resident.final_hidden is not None and other.final_hidden is not None:
        hs, ht = bit_identical_rows(resident.final_hidden, other.final_hidden)
        hidden_ok = hs == ht > 0
    attention_ok = layers_total > 0 and layers_same == layers_total
    c = other.counters
    hits, misses = int(c.get("hits", 0)), int(c.get("misses", 0))
    cov, problems = coverage(sc, other, resident)
    return PairResult(
        scenario=sc.name,
        seed=seed,
        kind=kind,
        identical_tokens=same,
        total_tokens=total,
        attention_rows_identical=rows_same,
        attention_rows_total=rows_total,
        attention_layers_identical=layers_same,
        attention_layers_total=layers_total,
        hidden_identical=hidden_ok,
        first_mismatch=first_mismatch(resident.tokens, other.tokens),
        parity_ok=same == total > 0 and hidden_ok and attention_ok,
        coverage=cov,
        coverage_problems=problems if kind == "parity" else [],
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        host_to_device_bytes=int(c.get("host_to_device_bytes", 0)),
    )
