"""Prometheus metrics of one app, in a private registry (several apps may live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ds4.jobs.stats import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a whole request: a long stream runs for minutes
_REQUEST_BUCKETS = _LATENCY_BUCKETS + (120.0, 300.0, 600.0, 1800.0)
_BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 32)  # sessions in one engine decode step


class Metrics:
    """Queue depth, busy slots, token counters, TTFT, inter-token and decode batch-size
    histograms, and every HTTP request by route and status class with its end-to-end time."""

    def __init__(self, queue_depth: Callable[[], float], busy_slots: Callable[[], float],
                 stats: Callable[[], SchedulerStats | None] = lambda: None):
        self.registry = CollectorRegistry()
        reg = self.registry
        Gauge("ds4_queue_depth", "Jobs waiting for a slot", registry=reg).set_function(queue_depth)
        Gauge("ds4_busy_slots", "Slots running a job", registry=reg).set_function(busy_slots)
        reg.register(TokenCounters(stats))
        ProcessCollector(registry=reg)  # process_resident_memory_bytes and friends
        self.requests = Counter("ds4_requests", "Finished generation requests",
                                ["endpoint", "outcome"], registry=reg)
        self.ttft = Histogram("ds4_time_to_first_token_seconds",
                              "Time from submission to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.inter_token = Histogram("ds4_inter_token_seconds",
                                     "Time between two generated tokens of one job",
                                     buckets=_LATENCY_BUCKETS, registry=reg)
        self.decode_batch = Histogram("ds4_decode_batch_size",
                                      "Sessions decoded together in one engine step",
                                      buckets=_BATCH_BUCKETS, registry=reg)

        self.http_requests = Counter("ds4_http_requests", "HTTP requests answered",
                                     ["route", "status"], registry=reg)
        self.http_seconds = Histogram("ds4_http_request_seconds",
                                      "Time from a request's arrival to its response's last byte",
                                      ["route"], buckets=_REQUEST_BUCKETS, registry=reg)

    def exposition(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class TokenCounters:
    """The scheduler's own token counts at scrape time: the engine's work, cancelled jobs too."""

    def __init__(self, stats: Callable[[], SchedulerStats | None]):
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """ds4_prompt_tokens, _cached, ds4_generated_tokens, ds4_expert_replacements and
        ds4_experts_moved (as _total), the gauge ds4_expert_host_read_share, and the ds4_mtp_*
        figures."""
        s = self.stats() or SchedulerStats()
        yield CounterMetricFamily("ds4_prompt_tokens", "Prompt tokens evaluated or reused",
                                  value=s.prompt_tokens_computed + s.prompt_tokens_reused)
        yield CounterMetricFamily("ds4_prompt_tokens_cached",
                                  "Prompt tokens reused from a slot's cache",
                                  value=s.prompt_tokens_reused)
        yield CounterMetricFamily("ds4_generated_tokens", "Tokens generated",
                                  value=s.generated_tokens)
        yield CounterMetricFamily("ds4_expert_replacements",
                                  "Re-placements of routed experts between GPU and host memory",
                                  value=s.expert_replacements)
        yield CounterMetricFamily("ds4_experts_moved", "Routed experts moved by re-placements",
                                  value=s.experts_moved)
        yield GaugeMetricFamily("ds4_expert_host_read_share",
                                "Share of counted routed-expert picks read from host memory",
                                value=s.expert_host_read_share)
        yield from speculation_metrics(s.speculation)


def speculation_metrics(spec) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """MTP draft/verify counters (as _total), acceptance rate and tokens per verify round."""
    yield CounterMetricFamily("ds4_mtp_verify_rounds", "MTP rounds that verified drafts",
                              value=spec.verify_rounds)
    yield CounterMetricFamily("ds4_mtp_draft_tokens", "MTP drafts verified",
                              value=spec.drafted)
    yield CounterMetricFamily("ds4_mtp_accepted_tokens", "MTP drafts accepted",
                              value=spec.accepted)
    yield GaugeMetricFamily("ds4_mtp_acceptance_rate", "Accepted over verified MTP drafts",
                            value=spec.acceptance_rate)
    yield GaugeMetricFamily("ds4_mtp_tokens_per_round",
                            "Tokens emitted per MTP verify round (1 + accepted drafts)",
                            value=spec.tokens_per_round)


class KVDiskCounters:
    """The disk KV store's counters at scrape time (ds4_kv_disk_*)."""

    COUNTERS = (("hits", "Prompts that restored a prefix from disk"),
                ("misses", "Prompts that found no usable prefix on disk"),
                ("restored_tokens", "Prompt tokens restored from disk"),
                ("stores", "Checkpoints written"),
                ("evictions", "Checkpoints deleted to stay within the disk budget"),
                ("removed_invalid", "Corrupt, truncated or foreign checkpoints removed"))

    def __init__(self, store: Callable[[], object | None]):
        self.store = store

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """Counters (as _total) plus the bytes and files stored now."""
        store = self.store()
        if store is None:
            return
        s = store.stats
        for name, doc in self.COUNTERS:
            yield CounterMetricFamily(f"ds4_kv_disk_{name}", doc, value=getattr(s, name))
        yield GaugeMetricFamily("ds4_kv_disk_bytes", "Bytes of checkpoints on disk", value=s.bytes)
        yield GaugeMetricFamily("ds4_kv_disk_files", "Checkpoint files on disk", value=s.files)
