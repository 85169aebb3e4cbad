"""Prometheus metrics of one router replica, in a registry of its own.

Owns: `RouterMetrics` (latency histograms, token and success counters, attainment of the objectives
per class and path, the path decisions by reason) and `LoadReportCollector`,
which turns the replicas' latest load reports (`router.loadboard`) into per-replica gauges at
scrape time (requests running / waiting, KV blocks used / free, and a prefill replica's outbox:
handles waiting to be pulled).

Definitions (as the common benchmark tools use them): TTFT = request received by the router →
first token sent; ITL = gap between successive streamed token events; TPOT = (e2e − TTFT) /
(output tokens − 1); queue / prefill / KV transfer times are what the workers report for the
request. Names parallel vLLM's (``vllm:`` → ``pdserve:``) so dashboards port.

Invariants: never the global registry (two apps in one process must not collide); a label set of
a replica that disappeared is dropped at the next scrape (gauges are rebuilt from the board).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router import loadboard
from router.migration import MIGRATION_REASONS
from router.objectives import SLOClass, attained
from router.path_policy import Path, PathDecision

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5, 5.0)


class LoadReportCollector(Collector):
    """Per-replica gauges from the load board of the given deployments."""

    def __init__(self, deployments: Sequence[str]) -> None:
        self._deployments = tuple(deployments)

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("pdserve:num_requests_running", "Requests running on a replica.",
                                    labels=["replica", "role"])
        waiting = GaugeMetricFamily("pdserve:num_requests_waiting", "Requests waiting on a replica.",
                                    labels=["replica", "role"])
        used = GaugeMetricFamily("pdserve:kv_blocks_used", "KV blocks in use on a replica.",
                                 labels=["replica", "role"])
        free = GaugeMetricFamily("pdserve:kv_blocks_free", "Free KV blocks on a replica.",
                                 labels=["replica", "role"])
        outbox = GaugeMetricFamily("pdserve:kv_outbox_pending", "KV handles a prefill replica holds for a pull "
                                   "(not yet pulled, released or expired).", labels=["replica", "role"])
        steps = CounterMetricFamily("pdserve:engine_steps", "Engine steps a decode replica ran.",
                                    labels=["replica", "role"])
        step_s = CounterMetricFamily("pdserve:engine_step_seconds", "Seconds a decode replica spent in its "
                                     "steps' forwards (per step: divide by engine_steps).", labels=["replica", "role"])
        step_cpu = CounterMetricFamily("pdserve:engine_step_cpu_seconds", "CPU seconds of a decode replica's "
                                       "model thread in those forwards (below engine_step_seconds by its waits: "
                                       "the GIL, a busy core).", labels=["replica", "role"])
        step_seqs = CounterMetricFamily("pdserve:engine_step_sequences", "Sequences decoded in a decode replica's "
                                        "steps (mean batch: divide by engine_steps).", labels=["replica", "role"])
        pairs = GaugeMetricFamily("pdserve:kv_pairs", "Prefill KV sources a decode replica is paired with now.",
                                  labels=["replica", "role"])
        unpaired = CounterMetricFamily("pdserve:kv_pulls_unpaired", "Pulls on a decode replica that found no pair "
                                       "with their source and waited for a meeting inside the request.",
                                       labels=["replica", "role"])
        for deployment in self._deployments:
            for rid, r in sorted(loadboard.snapshot(deployment).items()):
                labels = [rid, r.role or deployment]
                running.add_metric(labels, r.num_running)
                waiting.add_metric(labels, r.num_waiting)
                used.add_metric(labels, max(0, r.kv_blocks_total - r.kv_blocks_free))
                free.add_metric(labels, r.kv_blocks_free)
                if r.role == "prefill":
                    outbox.add_metric(labels, r.outbox_pending)
                else:
                    steps.add_metric(labels, r.steps)
                    step_s.add_metric(labels, r.step_seconds)
                    step_seqs.add_metric(labels, r.step_sequences)
                    step_cpu.add_metric(labels, r.step_cpu_seconds)
                    if r.role == "decode":
                        pairs.add_metric(labels, r.kv_pairs)
                        unpaired.add_metric(labels, r.kv_pulls_unpaired)
        yield from (running, waiting, used, free, outbox, steps, step_s, step_cpu, step_seqs, pairs, unpaired)


class RouterMetrics:
    def __init__(self, load_deployments: Sequence[str] = ()) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time to first token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve:inter_token_latency_seconds", "Gap between streamed tokens.",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.tpot = Histogram("pdserve:time_per_output_token_seconds", "Mean time per token after the first.",
                              buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Request received to last token sent.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("pdserve:request_queue_time_seconds", "Time waiting in a worker queue.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram("pdserve:request_prefill_time_seconds", "Prefill compute time.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_transfer = Histogram("pdserve:kv_transfer_time_seconds", "KV pull time on the decode side.",
                                     buckets=_TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter("pdserve:request_success", "Requests finished, by finish reason.",
                               ["finish_reason"], registry=r)
        self.migrations = Counter("pdserve:router_migrations", "Decode streams moved to another decode replica "
                                  "mid-request (router.migration), by reason.", ["reason"], registry=r)
        for reason in MIGRATION_REASONS:
            self.migrations.labels(reason=reason)  # every reason reads 0 before its first
        self.migrated_tokens = Counter("pdserve:router_migration_recomputed_tokens", "Tokens whose KV a "
                                       "migration built again (prompt and tokens sent but the last).", registry=r)
        self.slo = Counter("pdserve:slo_requests", "Finished requests judged against their class's TTFT and TPOT "
                           "objectives (router.objectives), by class, path and whether both were met.",
                           ["slo_class", "path", "attained"], registry=r)
        self.path_decisions = Counter("pdserve:path_decisions", "Path decisions (router.path_policy), by path "
                                      "and reason.", ["path", "reason"], registry=r)
        self.in_flight = Gauge("pdserve:router_requests_in_flight",
                               "Generations this router replica has admitted and not yet finished.", registry=r)
        r.register(LoadReportCollector(load_deployments))

    def record_decision(self, decision: PathDecision) -> None:
        self.path_decisions.labels(decision.path.value, decision.reason.value).inc()

    def record_slo(self, cls: SLOClass, path: Path, ttft_s: float, tpot_s: float | None) -> None:
        """One finished request against its class's objectives (``tpot_s`` None: one output token)."""
        self.slo.labels(cls.name, path.value, "true" if attained(ttft_s, tpot_s, cls) else "false").inc()

    def track_in_flight(self, count: Callable[[], int]) -> None:
        """Read ``pdserve:router_requests_in_flight`` from ``count`` at each scrape."""
        self.in_flight.set_function(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
