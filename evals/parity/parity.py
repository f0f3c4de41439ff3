"""HiSparse vs all-resident parity on the reference engine, under memory pressure.

Each scenario is one engine workload; each (scenario, seed) runs twice — every KV row resident
on the device, and HiSparse with the full KV in the host pool and small hot buffers — with
per-layer attention outputs recorded. The pair passes only if every generated token is equal
and every recorded attention output and final hidden state is bit-identical (compared as raw
bits, so -0.0 vs 0.0 or NaN payloads count as differences).

Each scenario also states what it exercises (hot buffer == top-k, eviction, state-row reuse,
context much longer than the hot buffer), and the HiSparse run's counters must show it did: a
scenario whose workload stopped exercising the spill path fails instead of passing vacuously.

Negative control: the HiSparse run with the per-layer binding broken (every layer bound at the
allocation's base offset, the upstream bug) must fail parity. If it "passes", the eval itself is
broken and the overall verdict is FAIL.

Hybrid profiles (``hybrid``, ``hybrid-ci``): the HiSparse run uses hybrid residency with a device
page budget well under what the requests need, so running requests spill to the host pool
mid-request and come back once others finish; every pair must show both (the counters say so).
Their second negative control spills one row too few to the host pool (``spill_fault``) and must
fail parity too.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    engine: Dict[str, object]  # EngineConfig keyword arguments (seed added per run)
    expect_eviction: bool = True  # misses must exceed what empty slots can absorb
    expect_reuse: bool = True  # more requests than state rows
    min_context_over_hot: float = 2.0  # longest context / hot_size
    max_device_kv_ratio: float = 0.5  # HiSparse device KV bytes / resident device KV bytes
    expect_spills: bool = False  # hybrid: mid-request spills and returns must both happen


# Two profiles of the same scenarios: "full" (the CLI default, minutes) and "ci" (seconds).
# Sizes are chosen so that, at every profile, contexts are several times the hot buffer and the
# indexer drifts enough to evict every step.
# The small model every CI profile runs (the scenario fields below vary the cache and workload).
_CI_MODEL = dict(hidden=32, vocab=128, indexer_dim=16)

_SCENARIOS: Dict[str, Dict[str, Dict[str, object]]] = {
    "hot-eq-topk-g1": {
        "description": "hot buffer == top-k, index groups of 1, fast-drifting indexer: every "
        "miss evicts",
        "full": dict(
            num_layers=4,
            index_share=1,
            top_k=64,
            hot_size=64,
            drift=0.5,
            recent_window=8,
            prompt_len=512,
            output_len=48,
            num_requests=12,
            max_running=4,
        ),
        "ci": dict(
            **_CI_MODEL,
            num_layers=2,
            index_share=1,
            top_k=16,
            hot_size=16,
            drift=0.5,
            recent_window=4,
            prompt_len=160,
            output_len=20,
            num_requests=6,
            max_running=2,
        ),
    },
    "hot-eq-topk-g4": {
        "description": "hot buffer == top-k, index groups of 4 (leader resolves, 3 followers "
        "gather the same plan), fast drift",
        "full": dict(
            num_layers=8,
            index_share=4,
            top_k=64,
            hot_size=64,
            drift=0.5,
            recent_window=8,
            prompt_len=512,
            output_len=48,
            num_requests=12,
            max_running=4,
        ),
        "ci": dict(
            **_CI_MODEL,
            num_layers=4,
            index_share=4,
            top_k=16,
            hot_size=16,
            drift=0.5,
            recent_window=4,
            prompt_len=160,
            output_len=20,
            num_requests=6,
            max_running=2,
        ),
    },
    "long-context-bf16-g4": {
        "description": "long contexts (16x the hot buffer), BF16 1152-byte rows, groups of 4, "
        "realistic locality",
        "full": dict(
            num_layers=8,
            index_share=4,
            row_format="bf16",
            top_k=64,
            hot_size=128,
            drift=0.05,
            recent_window=8,
            prompt_len=2048,
            output_len=64,
            num_requests=6,
            max_running=3,
        ),
        "ci": dict(
            **_CI_MODEL,
            num_layers=4,
            index_share=4,
            row_format="bf16",
            top_k=16,
            hot_size=24,
            drift=0.2,
            recent_window=4,
            prompt_len=384,
            output_len=24,
            num_requests=4,
            max_running=2,
        ),
    },
    "state-row-reuse": {
        "description": "many short requests through few state rows: requests finish and their "
        "state rows (and hot buffers) are handed to new requests",
        "full": dict(
            num_layers=4,
            index_share=2,
            top_k=32,
            hot_size=32,
            drift=0.5,
            recent_window=4,
            prompt_len=192,
            output_len=24,
            length_jitter=0.75,
            num_requests=32,
            max_running=3,
        ),
        "ci": dict(
            **_CI_MODEL,
            num_layers=2,
            index_share=2,
            top_k=16,
            hot_size=16,
            drift=0.5,
            recent_window=4,
            prompt_len=96,
            output_len=16,
            length_jitter=0.75,
            num_requests=12,
            max_running=2,
        ),
    },
}

# Hybrid residency under a device page budget about half of what the requests need at max
# context: outputs longer than prompts (resident requests outgrow their pages mid-request) and
# jittered lengths (early finishers free pages, spilled requests come back).
_HYBRID = dict(residency="hybrid", length_jitter=0.75)
_SCENARIOS.update(
    {
        "hybrid-spill-return-g1": {
            "description": "hybrid residency, groups of 1, fast drift, hot buffer == top-k: "
            "requests spill mid-request, are served from hot buffers, and come back",
            "hybrid": dict(
                _HYBRID,
                num_layers=4,
                index_share=1,
                top_k=64,
                hot_size=64,
                drift=0.5,
                recent_window=8,
                prompt_len=160,
                output_len=256,
                num_requests=12,
                max_running=4,
                block_size=16,
                device_pages=48,
            ),
            "hybrid-ci": dict(
                _HYBRID,
                **_CI_MODEL,
                num_layers=2,
                index_share=1,
                top_k=16,
                hot_size=16,
                drift=0.5,
                recent_window=4,
                prompt_len=40,
                output_len=64,
                num_requests=10,
                max_running=4,
                block_size=8,
                device_pages=18,
            ),
        },
        "hybrid-g4-bf16-nowindow": {
            "description": "hybrid residency, groups of 4, BF16 rows, no forced recent tokens (a "
            "one-row device window: host writes land the very next step)",
            "hybrid": dict(
                _HYBRID,
                num_layers=8,
                index_share=4,
                row_format="bf16",
                top_k=64,
                hot_size=96,
                drift=0.1,
                recent_window=0,
                prompt_len=192,
                output_len=288,
                num_requests=10,
                max_running=3,
                block_size=16,
                device_pages=40,
            ),
            "hybrid-ci": dict(
                _HYBRID,
                **_CI_MODEL,
                num_layers=4,
                index_share=4,
                row_format="bf16",
                top_k=16,
                hot_size=24,
                drift=0.2,
                recent_window=0,
                prompt_len=48,
                output_len=72,
                num_requests=8,
                max_running=3,
                block_size=8,
                device_pages=20,
            ),
        },
    }
)
_SCENARIO_CHECKS = {
    # hybrid: the device holds pages + small hot buffers, so the ratio is looser; evictions are
    # not the point (few requests are spilled at once), spills and returns are
    "hybrid-spill-return-g1": dict(
        expect_spills=True, expect_eviction=False, max_device_kv_ratio=0.75
    ),
    "hybrid-g4-bf16-nowindow": dict(
        expect_spills=True, expect_eviction=False, max_device_kv_ratio=0.75
    ),
}

# The negative control runs on the scenario where the bug is subtlest to see (groups of 4:
# followers share the leader's plan, so only the row bytes differ between layers).
NEGATIVE_CONTROL = {
    "full": "hot-eq-topk-g4",
    "ci": "hot-eq-topk-g4",
    "hybrid": "hybrid-g4-bf16-nowindow",
    "hybrid-ci": "hybrid-g4-bf16-nowindow",
}
NEGATIVE_CONTROL_SCENARIO = NEGATIVE_CONTROL["full"]
# The spill-path control needs a scenario whose spilled rows are read back from the pool often
# (a 4-row window, fast drift): there the missing row is always selected after it left the window.
SPILL_CONTROL_SCENARIO = "hybrid-spill-return-g1"
HYBRID_PROFILES = ("hybrid", "hybrid-ci")
PROFILES = ("full", "ci") + HYBRID_PROFILES
DEFAULT_SEEDS = {"full": (0, 1, 2), "ci": (0, 1, 2), "hybrid": (0, 1, 2), "hybrid-ci": (0, 1, 2)}


def scenarios(profile: str = "full", names: Optional[Sequence[str]] = None) -> List[Scenario]:
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    in_profile = [n for n, s in _SCENARIOS.items() if profile in s]
    chosen = in_profile if not names else list(names)
    out = []
    for n in chosen:
        if n not in _SCENARIOS:
            raise ValueError(f"unknown scenario {n!r}; known: {', '.join(_SCENARIOS)}")
        s = _SCENARIOS[n]
        if profile not in s:
            raise ValueError(
                f"scenario {n!r} is not in profile {profile!r} (its scenarios: "
                f"{', '.join(in_profile)})"
            )
        out.append(
            Scenario(
                name=n,
                description=str(s["description"]),
                engine=dict(s[profile]),
                **_SCENARIO_CHECKS.get(n, {}),
            )
        )
    return out


# ----------------------------------------------------------------------------- comparison


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
    attention_rows_identical: int
    attention_rows_total: int
    attention_layers_identical: int
    attention_layers_total: int
    hidden_identical: bool
    first_mismatch: Optional[tuple]
    parity_ok: bool  # tokens, hidden states and attention all identical
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
        """For parity pairs PASS means identical; for the negative control the pair itself
        'FAIL's (that is the expected outcome) and `detected` says so."""
        return "PASS" if self.parity_ok and not self.coverage_problems else "FAIL"

    @property
    def ok(self) -> bool:
        if self.kind == "negative-control":
            return not self.parity_ok  # the broken binding must be caught
        return self.verdict == "PASS"

    def to_dict(self) -> Dict[str, object]:
        d = asdict(self)
        d.update(token_pct=self.token_pct, verdict=self.verdict, ok=self.ok)
        return d


def _coverage(sc: Scenario, cfg, stats, resident_stats=None) -> tuple:
    """What the HiSparse run exercised, and which of the scenario's claims it failed to."""
    longest = cfg.prompt_len + cfg.output_len
    groups = cfg.num_groups
    # every admission starts from an empty state row: at most hot_size * requests * groups
    # misses can land in empty slots; every further miss evicted a held row.
    empty_fills = cfg.hot_size * cfg.num_requests * groups
    evictions_lb = max(0, int(stats.misses) - empty_fills)
    cov = {
        "context_over_hot": longest / cfg.hot_size,
        "hot_over_top_k": cfg.hot_size / cfg.top_k,
        "state_rows": cfg.max_running,
        "requests": cfg.num_requests,
        "index_share": cfg.index_share,
        "row_bytes": cfg.row_bytes,
        "evictions_lower_bound": evictions_lb,
        "misses": int(stats.misses),
    }
    if getattr(cfg, "residency", "host") == "hybrid":
        cov.update(
            spilled_requests=int(stats.spilled_requests),
            mid_request_spills=int(stats.mid_request_spills),
            returned_requests=int(stats.returned_requests),
        )
    problems = []
    if sc.expect_spills and int(getattr(stats, "mid_request_spills", 0)) <= 0:
        problems.append("no mid-request spill: every request stayed where it was admitted")
    if sc.expect_spills and int(getattr(stats, "returned_requests", 0)) <= 0:
        problems.append("no return: no spilled request came back to device pages")
    if resident_stats is not None and getattr(resident_stats, "device_kv_bytes", 0):
        ratio = int(stats.device_kv_bytes) / int(resident_stats.device_kv_bytes)
        cov["device_kv_ratio"] = ratio
        if ratio > sc.max_device_kv_ratio:
            problems.append(
                f"no memory pressure: HiSparse device KV is {ratio:.2f}x the "
                f"resident run's (limit {sc.max_device_kv_ratio})"
            )
    if int(stats.misses) <= 0:
        problems.append("no misses: the host-pool path never ran")
    if sc.expect_eviction and evictions_lb <= 0:
        problems.append(
            f"no evictions proven ({int(stats.misses)} misses <= {empty_fills} empty-slot fills)"
        )
    if sc.expect_reuse and cfg.num_requests <= cfg.max_running:
        problems.append("no state-row reuse (requests <= state rows)")
    if longest / cfg.hot_size < sc.min_context_over_hot:
        problems.append(f"context only {longest / cfg.hot_size:.1f}x the hot buffer")
    return cov, problems


def compare_pair(sc: Scenario, cfg, resident, hisparse, kind: str) -> PairResult:
    same, total = token_agreement(resident.tokens, hisparse.tokens)
    rows_same = rows_total = layers_same = layers_total = 0
    ra, ha = resident.attention or {}, hisparse.attention or {}
    for name in sorted(set(ra) | set(ha)):
        layers_total += 1
        if name in ra and name in ha:
            s, t = bit_identical_rows(ra[name], ha[name])
            rows_same += s
            rows_total += t
            layers_same += int(s == t and t > 0)
        else:
            rows_total += (ra.get(name, ha.get(name))).shape[0]
    hs, ht = bit_identical_rows(resident.final_hidden, hisparse.final_hidden)
    hidden_ok = hs == ht and ht > 0
    first = None
    for i, (ta, tb) in enumerate(zip(resident.tokens, hisparse.tokens)):
        diff = [p for p, (x, y) in enumerate(zip(ta, tb)) if x != y]
        if diff or len(ta) != len(tb):
            first = (i, diff[0] if diff else min(len(ta), len(tb)))
            break
    attention_ok = layers_total > 0 and layers_same == layers_total
    parity_ok = same == total and total > 0 and hidden_ok and attention_ok
    st = hisparse.stats
    cov, problems = _coverage(sc, cfg, st, resident.stats)
    return PairResult(
        scenario=sc.name,
        seed=cfg.seed,
        kind=kind,
        identical_tokens=same,
        total_tokens=total,
        attention_rows_identical=rows_same,
        attention_rows_total=rows_total,
        attention_layers_identical=layers_same,
        attention_layers_total=layers_total,
        hidden_identical=hidden_ok,
        first_mismatch=first,
        parity_ok=parity_ok,
        coverage=cov,
        coverage_problems=problems if kind == "parity" else [],
        hits=int(st.hits),
        misses=int(st.misses),
        hit_rate=float(st.hit_rate),
        host_to_device_bytes=int(st.host_to_device_bytes),
    )


# ----------------------------------------------------------------------------- driver


def _git_commit() -> Optional[str]:
    import os
    import subprocess

    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@dataclass
class ParityReport:
    profile: str
    device: str
    seeds: List[int]
    pairs: List[PairResult]
    wall_s: float

    @property
    def parity_pairs(self) -> List[PairResult]:
        return [p for p in self.pairs if p.kind == "parity"]

    @property
    def controls(self) -> List[PairResult]:
        return [p for p in self.pairs if p.kind == "negative-control"]

    @property
    def negative_control_detected(self) -> Optional[bool]:
        c = self.controls
        return None if not c else all(p.ok for p in c)

    @property
    def passed(self) -> bool:
        if not self.parity_pairs or not all(p.ok for p in self.parity_pairs):
            return False
        return self.negative_control_detected is not False

    def identical_token_pct(self) -> float:
        same = sum(p.identical_tokens for p in self.parity_pairs)
        total = sum(p.total_tokens for p in self.parity_pairs)
        return 100.0 * same / total if total else 0.0

    def to_dict(self) -> Dict[str, object]:
        return {
            "passed": self.passed,
            "profile": self.profile,
            "device": self.device,
            "git_commit": _git_commit(),
            "torch": torch.__version__,
            "seeds": self.seeds,
            "wall_s": self.wall_s,
            "identical_token_pct": self.identical_token_pct(),
            "negative_control_detected": self.negative_control_detected,
            "pairs": [p.to_dict() for p in self.pairs],
        }

    def table(self) -> str:
        head = (
            f"{'kind':<17} {'scenario':<22} {'seed':>4} {'tokens identical':>20} "
            f"{'attn rows identical':>22} {'hidden':>6} {'hit rate':>8} {'evict>=':>8} "
            f"{'devKV':>6} {'verdict':>7}"
        )
        lines = [head, "-" * len(head)]
        for p in self.pairs:
            tok = f"{p.identical_tokens}/{p.total_tokens} ({p.token_pct:.1f}%)"
            att = f"{p.attention_rows_identical}/{p.attention_rows_total}"
            verdict = p.verdict
            if p.kind == "negative-control":
                verdict += " (detected)" if p.ok else " (MISSED)"
            lines.append(
                f"{p.kind:<17} {p.scenario:<22} {p.seed:>4} {tok:>20} {att:>22} "
                f"{'same' if p.hidden_identical else 'DIFF':>6} {p.hit_rate:>8.3f} "
                f"{p.coverage.get('evictions_lower_bound', 0):>8} "
                f"{p.coverage.get('device_kv_ratio', float('nan')):>6.3f} {verdict}"
            )
            for prob in p.coverage_problems:
                lines.append(f"{'':<17} coverage: {prob}")
        det = self.negative_control_detected
        lines.append("")
        lines.append(
            f"identical tokens: {self.identical_token_pct():.2f}% over "
            f"{len(self.parity_pairs)} pairs; negative control (base-offset binding"
            f"{', hybrid spill off by one' if self.profile in HYBRID_PROFILES else ''}): "
            f"{'not run' if det is None else ('detected' if det else 'NOT DETECTED')}; "
            f"overall {'PASS' if self.passed else 'FAIL'} ({self.wall_s:.1f} s)"
        )
        return "\n".join(lines)


def _negative_control(run_workload, sc: Scenario, cfg, resident, device) -> PairResult:
    """Every layer bound at the base offset (the upstream bug), compared with the correct
    resident run. The connector refuses overlapping layer views, so the HiSparse run is stopped
    at bind time; the same fault is then applied to a resident run, which has no such check,
    to show that the parity comparison itself catches the corrupted outputs. A faulty run that
    raises anything else also counts as detected."""
    from hisparse.runtime.views import BindingError

    t = time.monotonic()
    note = None
    try:
        bad = run_workload(
            cfg, mode="hisparse", device=device, record_attention=True, binding_fault="base_offset"
        )
    except BindingError as e:
        note = f"HiSparse run refused at bind time ({e}); faulty resident run compared instead"
        bad = run_workload(
            cfg, mode="resident", device=device, record_attention=True, binding_fault="base_offset"
        )
    except Exception as e:  # noqa: BLE001 - any failure of the faulty run is a detection
        return PairResult(
            scenario=sc.name,
            seed=cfg.seed,
            kind="negative-control",
            identical_tokens=0,
            total_tokens=sum(len(t) for t in resident.tokens),
            attention_rows_identical=0,
            attention_rows_total=0,
            attention_layers_identical=0,
            attention_layers_total=0,
            hidden_identical=False,
            first_mismatch=None,
            parity_ok=False,
            note=f"faulty run raised {type(e).__name__}: {e}",
            wall_s=time.monotonic() - t,
        )
    nc = compare_pair(sc, cfg, resident, bad, "negative-control")
    if note is not None:
        nc.note = note if not nc.note else f"{note}; {nc.note}"
    nc.wall_s = time.monotonic() - t
    return nc


def _spill_control(run_workload, sc: Scenario, cfg, resident, device) -> PairResult:
    """Hybrid profiles: a spill that copies one row too few to the host pool must be caught."""
    t = time.monotonic()
    bad = run_workload(
        cfg, mode="hisparse", device=device, record_attention=True, spill_fault="off_by_one"
    )
    nc = compare_pair(sc, cfg, resident, bad, "negative-control")
    nc.note = "hybrid spill copies one row too few to the host pool"
    nc.wall_s = time.monotonic() - t
    return nc


def _control_scenarios(profile: str) -> List[str]:
    names = [NEGATIVE_CONTROL[profile]]
    if profile in HYBRID_PROFILES:
        names.append(SPILL_CONTROL_SCENARIO)
    return names


def _controls(run_workload, profile: str, sc: Scenario, cfg, resident, device) -> List[PairResult]:
    out = []
    if sc.name == NEGATIVE_CONTROL[profile]:
        out.append(_negative_control(run_workload, sc, cfg, resident, device))
    if profile in HYBRID_PROFILES and sc.name == SPILL_CONTROL_SCENARIO:
        out.append(_spill_control(run_workload, sc, cfg, resident, device))
    return out


def run_parity(
    profile: str = "full",
    seeds: Optional[Sequence[int]] = None,
    names: Optional[Sequence[str]] = None,
    device: str = "cpu",
    negative_control: bool = True,
    threads: Optional[int] = 1,
    log: Optional[Callable[[str], None]] = None,
) -> ParityReport:
    """Run every (scenario, seed) pair and the negative control. `threads` caps torch's CPU
    threads for the duration (default 1: the engine's ops are tiny, and on a loaded 2-core
    machine extra threads make them 10-30x slower; None leaves torch's setting alone)."""
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_parity(profile, seeds, names, device, negative_control, log)
    finally:
        torch.set_num_threads(prev)


def _run_parity(profile, seeds, names, device, negative_control, log) -> ParityReport:
    from hisparse.engine import EngineConfig, run_workload  # the engine is imported lazily

    seeds = list(DEFAULT_SEEDS[profile] if seeds is None else seeds)
    if not seeds:
        raise ValueError("at least one seed is needed")
    t0 = time.monotonic()
    pairs: List[PairResult] = []
    chosen = scenarios(profile, names)
    for sc in chosen:
        for seed in seeds:
            cfg = EngineConfig(**{**sc.engine, "seed": seed})
            t = time.monotonic()
            res = run_workload(cfg, mode="resident", device=device, record_attention=True)
            hs = run_workload(cfg, mode="hisparse", device=device, record_attention=True)
            pr = compare_pair(sc, cfg, res, hs, "parity")
            pr.wall_s = time.monotonic() - t
            pairs.append(pr)
            if log:
                log(
                    f"{sc.name} seed {seed}: {pr.verdict} ({pr.token_pct:.1f}% tokens, "
                    f"{pr.wall_s:.1f} s)"
                )
            if negative_control:
                for nc in _controls(run_workload, profile, sc, cfg, res, device):
                    pairs.append(nc)
                    if log:
                        log(
                            f"{sc.name} seed {seed} negative control: "
                            f"{'detected' if nc.ok else 'NOT DETECTED'}"
                        )
    missing = [n for n in _control_scenarios(profile) if n not in [s.name for s in chosen]]
    for name in missing if negative_control else []:
        # the controls always run, even when the scenario filter left their scenario out
        sc = scenarios(profile, [name])[0]
        cfg = EngineConfig(**{**sc.engine, "seed": seeds[0]})
        res = run_workload(cfg, mode="resident", device=device, record_attention=True)
        for nc in _controls(run_workload, profile, sc, cfg, res, device):
            pairs.append(nc)
            if log:
                log(f"negative control: {'detected' if nc.ok else 'NOT DETECTED'}")
    return ParityReport(
        profile=profile, device=str(device), seeds=seeds, pairs=pairs, wall_s=time.monotonic() - t0
    )
