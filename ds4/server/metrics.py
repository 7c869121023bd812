"""Prometheus metrics of one app, in a private registry (several apps may live in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Queue depth, busy slots, token counters, TTFT and inter-token histograms."""

    def __init__(self, queue_depth: Callable[[], float], busy_slots: Callable[[], float]):
        self.registry = CollectorRegistry()
        reg = self.registry
        Gauge("ds4_queue_depth", "Jobs waiting for a slot", registry=reg).set_function(queue_depth)
        Gauge("ds4_busy_slots", "Slots running a job", registry=reg).set_function(busy_slots)
        self.prompt_tokens = Counter("ds4_prompt_tokens", "Prompt tokens of finished jobs",
                                     registry=reg)
        self.cached_tokens = Counter("ds4_prompt_tokens_cached",
                                     "Prompt tokens reused from a slot's cache", registry=reg)
        self.generated_tokens = Counter("ds4_generated_tokens", "Tokens generated",
                                        registry=reg)
        self.requests = Counter("ds4_requests", "Finished generation requests",
                                ["endpoint", "outcome"], registry=reg)
        self.ttft = Histogram("ds4_time_to_first_token_seconds",
                              "Time from submission to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.inter_token = Histogram("ds4_inter_token_seconds",
                                     "Time between two generated tokens of one job",
                                     buckets=_LATENCY_BUCKETS, registry=reg)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)
