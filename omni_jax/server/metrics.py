"""Prometheus metrics of the server: per-stage queues and KV usage, latency histograms, errors.

Per-stage gauges come from the engine's `stage_stats()` at scrape time; histograms are
observed when a request finishes, from its `RequestMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0)
_RTF = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0, 50.0)
# HTTP status -> the error type label.
ERROR_TYPES = {400: "bad_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed",
               413: "too_large", 429: "rate_limited", 500: "internal", 503: "unavailable"}
# stage_stats key -> (metric name, help)
_STAGE_GAUGES = {
    "num_running": ("omni_jax_stage_requests_running", "Requests running in the stage's scheduler"),
    "num_waiting": ("omni_jax_stage_requests_waiting", "Requests waiting in the stage's scheduler"),
    "kv_cache_usage": ("omni_jax_stage_kv_cache_usage", "Fraction of the stage's KV blocks in use (0-1)"),
    "prefix_cache_hit_rate": ("omni_jax_stage_prefix_cache_hit_rate", "Prefix cache hit rate of the stage"),
    "num_compilations": ("omni_jax_stage_compilations", "Jitted step compilations in the stage"),
    "num_restarts": ("omni_jax_stage_restarts", "Times the stage process was started again after it failed"),
}


class _StageCollector:
    """Exposes the last stage-stats snapshot as labelled gauges."""

    def __init__(self):
        self.snapshot: dict[str, dict] = {}

    def collect(self):
        for key, (name, doc) in _STAGE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["stage"])
            for stage, stats in self.snapshot.items():
                if key in stats:
                    g.add_metric([stage], float(stats[key]))
            yield g


class Metrics:
    """The server's metrics in a registry of their own (so several apps can live in one process)."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("omni_jax_requests", "Finished generation requests", ["endpoint", "finish_reason"],
                                registry=r)
        self.errors = Counter("omni_jax_errors", "Error responses and failed requests, by type", ["type"], registry=r)
        self.in_flight = Gauge("omni_jax_requests_in_flight", "Generation requests being served", registry=r)
        self.ttft = Histogram("omni_jax_time_to_first_token_seconds", "Time to first text token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("omni_jax_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_PER_TOKEN, registry=r)
        self.ttfa = Histogram("omni_jax_time_to_first_audio_seconds", "Time to the first audio samples",
                              buckets=_LATENCY, registry=r)
        self.rtf = Histogram("omni_jax_real_time_factor", "Request time / seconds of speech produced", buckets=_RTF,
                             registry=r)
        self.e2e = Histogram("omni_jax_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY,
                             registry=r)
        self.prompt_tokens = Counter("omni_jax_prompt_tokens", "Prompt tokens of finished requests: computed, or "
                                     "found in the first stage's prefix cache", ["source"], registry=r)
        self.realtime_sessions = Gauge("omni_jax_realtime_sessions", "Open /v1/realtime sessions", registry=r)
        self.stages = _StageCollector()
        r.register(self.stages)

    def error(self, status: int) -> None:
        self.errors.labels(ERROR_TYPES.get(status, str(status))).inc()

    def aborted(self, endpoint: str) -> None:
        """Record a request its client left before it finished (it is aborted in every stage)."""
        self.requests.labels(endpoint, "abort").inc()

    def finished(self, endpoint: str, out, counted: bool = True) -> None:
        """Record a finished OmniRequestOutput; `counted`: it ends a client's request (a long
        transcription's pieces other than its last do not), so it counts in `requests`."""
        if counted:
            self.requests.labels(endpoint, out.finish_reason or "unknown").inc()
        if out.error:
            self.errors.labels("request_failed").inc()
        cached = out.num_cached_tokens
        self.prompt_tokens.labels("cached").inc(cached)
        self.prompt_tokens.labels("computed").inc(max(len(out.prompt_token_ids) - cached, 0))
        m = out.metrics
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.ttfa, m.time_to_first_audio),
                            (self.rtf, m.rtf), (self.e2e, m.e2e_latency)):
            if value is not None:
                hist.observe(value)

    def render(self, stage_stats: dict[str, dict] | None) -> bytes:
        """The Prometheus text exposition, with the given stage stats."""
        if stage_stats is not None:
            self.stages.snapshot = stage_stats
        return generate_latest(self.registry)
