"""Scheduler counters for /metrics: queue, slots, tokens, TTFT and inter-token gaps."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ds4.jobs.speculative import SpeculationStats

Observer = Callable[[float], None]


@dataclass
class SchedulerStats:
    """Counters written by the scheduler thread, read by the server (plain ints: no torn reads).

    TTFT and gap observations go to the observers (e.g. prometheus histograms' `observe`)
    and to bounded recent-value windows.
    """

    queue_depth: int = 0
    busy_slots: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_reused: int = 0
    generated_tokens: int = 0
    jobs_finished: int = 0
    jobs_failed: int = 0
    jobs_cancelled: int = 0
    expert_replacements: int = 0  # re-placements of routed experts (ds4/jobs/placement_policy)
    experts_moved: int = 0
    expert_host_read_share: float = 0.0  # share of counted expert picks read from host memory
    ttft: deque = field(default_factory=lambda: deque(maxlen=1024))
    inter_token: deque = field(default_factory=lambda: deque(maxlen=4096))
    ttft_observers: list[Observer] = field(default_factory=list)
    inter_token_observers: list[Observer] = field(default_factory=list)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)  # MTP rounds

    def observe_ttft(self, seconds: float) -> None:
        """Time from arrival to a job's first token."""
        self.ttft.append(seconds)
        for observe in self.ttft_observers:
            observe(seconds)

    def observe_gap(self, seconds: float) -> None:
        """Time between two consecutive tokens of one job."""
        self.inter_token.append(seconds)
        for observe in self.inter_token_observers:
            observe(seconds)

    def count_end(self, state: str) -> None:
        """Count a job that reached a terminal state."""
        if state == "done":
            self.jobs_finished += 1
        elif state == "failed":
            self.jobs_failed += 1
        else:
            self.jobs_cancelled += 1
