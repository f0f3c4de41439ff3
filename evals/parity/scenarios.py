"""The parity eval's scenarios: one DSA engine workload each (a tiny seeded DeepSeek-V3.2 or
GLM-5 checkpoint, its cache sizes and a batch of requests), in four profiles: ``full`` and
``ci`` (HiSparse: every row in the host pool, hot buffers on the device), ``hybrid`` and
``hybrid-ci`` (hybrid residency under a device page budget that forces spills).

Sizes are chosen so that at every profile contexts are several times the hot buffer, the
indexer's top-k moves from step to step (random weights: most lookups miss and evict), more
requests run than the batch has rows, and HiSparse's device rows are a small part of resident's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from hisparse.engine.dsa.stores import BLOCK
from hisparse.models.rows import ROW_FORMATS


@dataclass(frozen=True)
class Workload:
    """One DSA engine run: checkpoint shape, cache sizes, requests."""

    arch: str  # "deepseek_v32" (every layer its own indexer) or "glm_moe_dsa"
    layers: int
    top_k: int  # the checkpoint's index_topk
    hot_size: int  # hot-buffer rows per request per layer
    prompt_len: int  # longest prompt; request i's is shorter by up to jitter x prompt_len
    max_new: int  # every request generates this many tokens
    requests: int
    max_batch: int  # batch rows: requests decoding together (connector state rows)
    group: int = 1  # layers per index group (GLM-5: a full indexer layer and shared ones)
    row_format: str = "fp8"
    jitter: float = 0.0
    device_blocks: Optional[int] = None  # hybrid residency's device pages (BLOCK rows each)

    @property
    def mode(self) -> str:
        """The run compared with resident: hybrid under a budget, else HiSparse."""
        return "hisparse" if self.device_blocks is None else "hybrid"

    @property
    def longest(self) -> int:
        return self.prompt_len + self.max_new

    @property
    def groups(self) -> int:
        """Index groups: the full indexer layers."""
        return -(-self.layers // self.group)

    @property
    def row_bytes(self) -> int:
        return ROW_FORMATS[self.row_format].row_bytes

    def checkpoint_overrides(self) -> dict:
        """config.json fields of the tiny checkpoint (``write_random_checkpoint``)."""
        out = dict(
            num_hidden_layers=self.layers,
            index_topk=self.top_k,
            max_position_embeddings=max(512, -(-self.longest // BLOCK) * BLOCK),
        )
        if self.arch == "glm_moe_dsa":
            out["indexer_types"] = [
                "full" if i % self.group == 0 else "shared" for i in range(self.layers)
            ]
        elif self.group != 1:
            raise ValueError("deepseek_v32 runs every layer's indexer: group must be 1")
        return out


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: Workload
    expect_eviction: bool = True  # misses must exceed what empty hot-buffer slots absorb
    expect_reuse: bool = True  # more requests than batch rows
    min_context_over_hot: float = 2.0  # longest context / hot_size
    max_device_kv_ratio: float = 0.5  # device latent-row bytes, HiSparse run / resident run
    expect_spills: bool = False  # hybrid: mid-request spills and returns must both happen


DSV32, GLM5 = "deepseek_v32", "glm_moe_dsa"
W = Workload
_G4_BF16 = dict(group=4, row_format="bf16", jitter=0.25)
_SCENARIOS: Dict[str, Dict[str, object]] = {
    "hot-eq-topk-g1": {
        "description": "DeepSeek-V3.2, FP8 656-byte rows, hot buffer == top-k, every layer its "
        "own indexer (groups of 1): nearly every miss evicts",
        "full": W(DSV32, 4, 64, 64, 320, 64, 12, 4, jitter=0.25),
        "ci": W(DSV32, 2, 16, 16, 96, 24, 6, 2, jitter=0.25),
    },
    "hot-eq-topk-g4": {
        "description": "GLM-5, groups of 4 (the leader resolves, 3 shared layers gather the same "
        "plan), FP8 rows, hot buffer == top-k",
        "full": W(GLM5, 8, 64, 64, 320, 64, 12, 4, group=4, jitter=0.25),
        "ci": W(GLM5, 4, 16, 16, 96, 24, 6, 2, group=4, jitter=0.25),
    },
    "long-context-bf16-g4": {
        "description": "GLM-5, groups of 4, BF16 1152-byte rows, contexts 16x the hot buffer, "
        "hot buffer 2x top-k",
        "full": W(GLM5, 8, 32, 64, 960, 64, 4, 2, group=4, row_format="bf16", jitter=0.1),
        "ci": W(GLM5, 4, 16, 24, 352, 32, 4, 2, group=4, row_format="bf16", jitter=0.1),
    },
    "state-row-reuse": {
        "description": "GLM-5, groups of 2, many short requests through few batch rows: "
        "requests finish and their state rows (and hot buffers) go to new ones",
        "full": W(GLM5, 4, 32, 32, 192, 24, 32, 3, group=2, jitter=0.5),
        "ci": W(GLM5, 2, 16, 16, 80, 16, 12, 2, group=2, jitter=0.5),
    },
    # Hybrid: a device page budget about half of what the batch needs at its longest; outputs
    # longer than prompts (resident requests outgrow their pages mid-request) and staggered
    # admissions (early finishers free pages, spilled requests come back).
    "hybrid-spill-return-g1": {
        "description": "hybrid residency, DeepSeek-V3.2, FP8, hot buffer == top-k: requests "
        "spill mid-request, decode from hot buffers, and come back",
        "hybrid": W(DSV32, 4, 64, 64, 160, 256, 12, 4, jitter=0.25, device_blocks=48),
        "hybrid-ci": W(DSV32, 2, 16, 16, 48, 64, 10, 4, jitter=0.25, device_blocks=12),
    },
    "hybrid-g4-bf16": {
        "description": "hybrid residency, GLM-5, groups of 4, BF16 rows, hot buffer 1.5x top-k",
        "hybrid": W(GLM5, 8, 64, 96, 192, 288, 10, 3, **_G4_BF16, device_blocks=40),
        "hybrid-ci": W(GLM5, 4, 16, 24, 48, 72, 8, 3, **_G4_BF16, device_blocks=10),
    },
}
# Hybrid: the device holds pages and hot buffers, so the ratio is looser; evictions are not the
# point (few requests are spilled at once), spills and returns are.
_CHECKS = {
    "hybrid-spill-return-g1": dict(
        expect_spills=True, expect_eviction=False, max_device_kv_ratio=0.75
    ),
    "hybrid-g4-bf16": dict(expect_spills=True, expect_eviction=False, max_device_kv_ratio=0.75),
}

# The binding control runs where the bug is subtlest (groups of 4: shared layers gather the
# leader's plan, so only the rows' bytes differ between layers).
NEGATIVE_CONTROL = {
    "full": "hot-eq-topk-g4",
    "ci": "hot-eq-topk-g4",
    "hybrid": "hybrid-g4-bf16",
    "hybrid-ci": "hybrid-g4-bf16",
}
NEGATIVE_CONTROL_SCENARIO = NEGATIVE_CONTROL["full"]
# The spill control needs spilled rows read back often: groups of 1 (every layer selects its own
# top-k) and hot == top-k, so the missing row is soon selected after its request spilled.
SPILL_CONTROL_SCENARIO = "hybrid-spill-return-g1"
HYBRID_PROFILES = ("hybrid", "hybrid-ci")
PROFILES = ("full", "ci") + HYBRID_PROFILES
DEFAULT_SEEDS = {p: (0, 1, 2) for p in PROFILES}
SCENARIO_NAMES = tuple(_SCENARIOS)


def scenarios(profile: str = "full", names: Optional[Sequence[str]] = None) -> List[Scenario]:
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    in_profile = [n for n, s in _SCENARIOS.items() if profile in s]
    out = []
    for n in names or in_profile:
        if n not in _SCENARIOS:
            raise ValueError(f"unknown scenario {n!r}; known: {', '.join(_SCENARIOS)}")
        s = _SCENARIOS[n]
        if profile not in s:
            raise ValueError(
                f"scenario {n!r} is not in profile {profile!r} (its scenarios: "
                f"{', '.join(in_profile)})"
            )
        out.append(Scenario(n, str(s["description"]), s[profile], **_CHECKS.get(n, {})))
    return out


def control_scenarios(profile: str) -> List[str]:
    """The scenarios whose runs carry this profile's negative controls."""
    names = [NEGATIVE_CONTROL[profile]]
    if profile in HYBRID_PROFILES:
        names.append(SPILL_CONTROL_SCENARIO)
    return names
