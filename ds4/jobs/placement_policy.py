"""When the scheduler re-places routed experts: every `every_tokens` generated tokens it asks
the engine to fold the routing counts (decayed by those tokens, half-life `half_life_tokens`)
and to move the hot experts onto the GPU if that cuts the expected host reads by more than
the rule's `min_cut` (a swap needs the host expert hotter than the resident one by `margin` and
by `evidence` standard deviations of count noise, so uniform routing's spread moves nothing;
at most `max_swaps` experts cross PCIe per look, bounding the pause).
It runs between turns, so never inside an engine step."""

from __future__ import annotations

from ds4.engine import Engine, ReplacementRule
from ds4.jobs.stats import SchedulerStats


class ReplacementPolicy:
    """The scheduler's clock for expert re-placement, and its figures for /metrics."""

    def __init__(self, engine: Engine, every_tokens: int = 256, half_life_tokens: float = 4096,
                 rule: ReplacementRule | None = None):
        self.engine = engine
        self.every_tokens, self.half_life_tokens = every_tokens, half_life_tokens
        self.rule = rule or ReplacementRule(min_cut=0.1, margin=0.25, evidence=4.0,
                                            max_swaps=32)
        stats = getattr(engine, "expert_placement_stats", lambda: None)
        self.enabled = stats() is not None  # no experts in host memory: nothing to move
        self.seen = 0  # generated tokens at the last look

    def after_turn(self, stats: SchedulerStats) -> int:
        """Re-place when due (experts moved, else 0); the placement's figures go to stats."""
        done = stats.generated_tokens - self.seen
        if not self.enabled or done < self.every_tokens:
            return 0
        self.seen = stats.generated_tokens
        moved = self.engine.replace_experts(self.rule, 0.5 ** (done / self.half_life_tokens))
        figures = self.engine.expert_placement_stats()
        stats.expert_replacements = figures["replacements"]
        stats.experts_moved = figures["moved"]
        stats.expert_host_read_share = figures["host_read_share"]
        return moved
