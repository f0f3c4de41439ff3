"""HiSparse vs all-resident parity on the DSA engine (``hisparse.engine.dsa``), under memory
pressure.

Each (scenario, seed) runs a tiny seeded DeepSeek-V3.2 or GLM-5 checkpoint twice: every KV row
resident on the device, and HiSparse (every row in the connector's host pool, small hot buffers
on the device; hybrid residency in the hybrid profiles), with every layer's attention output
and the final hidden states recorded. The pair passes only if every generated token is equal
and every recorded row is bit-identical (compared as raw bits, so -0.0 vs 0.0 or NaN payloads
count as differences), and the HiSparse run's counters show that it exercised what the
scenario claims (misses, evictions, state-row reuse, contexts several times the hot buffer,
device rows at most a fraction of resident's; hybrid: spills mid-request and returns): a
scenario whose workload stopped exercising the spill path fails instead of passing vacuously.

Negative controls: the per-layer binding broken (every layer's buffer at the allocation's base
offset, the upstream bug) must be refused at bind time or fail parity; in the hybrid profiles a
spill that copies one row too few to the host pool must fail parity. A control that "passes"
means the eval cannot see the fault, and the overall verdict is FAIL.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from evals.parity.compare import (  # noqa: F401 - the eval's API, one import away
    PairResult,
    bit_identical_rows,
    compare_pair,
    token_agreement,
)
from evals.parity.runs import Checkpoints, Run, run
from evals.parity.scenarios import (  # noqa: F401
    DEFAULT_SEEDS,
    HYBRID_PROFILES,
    NEGATIVE_CONTROL,
    NEGATIVE_CONTROL_SCENARIO,
    PROFILES,
    SCENARIO_NAMES,
    SPILL_CONTROL_SCENARIO,
    Scenario,
    Workload,
    control_scenarios,
    scenarios,
)


def _git_commit() -> Optional[str]:
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
            "engine": "hisparse.engine.dsa",
            "profile": self.profile,
            "device": self.device,
            "git_commit": _git_commit(),
            "torch": torch.__version__,
            "seeds": self.seeds,
            "wall_s": self.wall_s,
            "identical_token_pct": self.identical_token_pct(),
            "negative_control_detected": self.negative_control_detected,
            "scenarios": {s.name: asdict(s.workload) for s in scenarios(self.profile)},
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
            if "spills" in p.coverage:
                cv = p.coverage
                lines.append(
                    f"{'':<17} hybrid: {cv['spills']} mid-request spills, "
                    f"{cv['spilled_requests']} requests spilled, {cv['returns']} returns"
                )
            for prob in p.coverage_problems:
                lines.append(f"{'':<17} coverage: {prob}")
            if p.note:
                lines.append(f"{'':<17} note: {p.note}")
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


def _failed_run(sc: Scenario, seed: int, resident: Run, note: str) -> PairResult:
    """A faulty run that raised: detected, nothing to compare."""
    total = sum(len(t) for t in resident.tokens)
    return PairResult(sc.name, seed, "negative-control", 0, total, note=note)


def _binding_control(cks, sc: Scenario, seed: int, resident: Run) -> PairResult:
    """Every layer's buffer at the base offset of one allocation (the upstream bug), compared
    with the correct resident run. The connector refuses overlapping layer buffers, so the
    HiSparse run stops at bind time; the same fault is then applied to a resident run, which
    has no such check, to show that the comparison itself catches the corrupted outputs. A
    faulty run that raises anything else also counts as detected."""
    from hisparse.runtime.views import BindingError

    w, note = sc.workload, ""
    try:
        bad = run(cks, w, seed, w.mode, binding_fault="base_offset")
    except BindingError as e:
        note = f"{w.mode} run refused at bind time ({e}); faulty resident run compared instead"
        bad = run(cks, w, seed, "resident", binding_fault="base_offset")
    except Exception as e:  # noqa: BLE001 - any failure of the faulty run is a detection
        return _failed_run(sc, seed, resident, f"faulty run raised {type(e).__name__}: {e}")
    nc = compare_pair(sc, seed, resident, bad, "negative-control")
    nc.note = note
    return nc


def _spill_control(cks, sc: Scenario, seed: int, resident: Run) -> PairResult:
    """Hybrid profiles: a spill that copies one row too few to the host pool must be caught."""
    bad = run(cks, sc.workload, seed, "hybrid", spill_fault="off_by_one")
    nc = compare_pair(sc, seed, resident, bad, "negative-control")
    nc.note = "hybrid spill copies one row too few to the host pool"
    if not bad.counters.get("spills"):
        nc.note += " (no spill happened: the fault never ran)"
    return nc


def _controls(cks, profile: str, sc: Scenario, seed: int, resident: Run) -> List[PairResult]:
    kinds = [_binding_control] if sc.name == NEGATIVE_CONTROL[profile] else []
    if profile in HYBRID_PROFILES and sc.name == SPILL_CONTROL_SCENARIO:
        kinds.append(_spill_control)
    out = []
    for control in kinds:
        t = time.monotonic()
        out.append(control(cks, sc, seed, resident))
        out[-1].wall_s = time.monotonic() - t
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
    """Run every (scenario, seed) pair and the negative controls. ``threads`` caps torch's CPU
    threads for the duration (default 1: the engine's ops are tiny, and on a loaded 2-core
    machine extra threads make them many times slower; None leaves torch's setting alone)."""
    chosen = scenarios(profile, names)
    seeds = list(DEFAULT_SEEDS[profile] if seeds is None else seeds)
    if not seeds:
        raise ValueError("at least one seed is needed")
    prev = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    cks = Checkpoints(torch.device(device))
    try:
        t0 = time.monotonic()
        pairs = _run_pairs(cks, profile, chosen, seeds, negative_control, log or (lambda m: None))
        return ParityReport(profile, str(device), seeds, pairs, time.monotonic() - t0)
    finally:
        cks.close()
        torch.set_num_threads(prev)


def _run_pairs(cks, profile, chosen, seeds, negative_control, log) -> List[PairResult]:
    pairs: List[PairResult] = []
    for sc in chosen:
        for seed in seeds:
            t = time.monotonic()
            res = run(cks, sc.workload, seed, "resident")
            other = run(cks, sc.workload, seed, sc.workload.mode)
            pr = compare_pair(sc, seed, res, other, "parity")
            pr.wall_s = time.monotonic() - t
            pairs.append(pr)
            took = f"{pr.token_pct:.1f}% tokens, {pr.wall_s:.1f} s"
            log(f"{sc.name} seed {seed}: {pr.verdict} ({took})")
            for nc in _controls(cks, profile, sc, seed, res) if negative_control else []:
                pairs.append(nc)
                log(f"{sc.name} seed {seed} control: {'detected' if nc.ok else 'NOT DETECTED'}")
    ran = {s.name for s in chosen}
    for name in [n for n in control_scenarios(profile) if n not in ran] if negative_control else []:
        # the controls always run, even when the scenario filter left their scenario out
        sc = scenarios(profile, [name])[0]
        res = run(cks, sc.workload, seeds[0], "resident")
        for nc in _controls(cks, profile, sc, seeds[0], res):
            pairs.append(nc)
            log(f"negative control ({name}): {'detected' if nc.ok else 'NOT DETECTED'}")
    return pairs
