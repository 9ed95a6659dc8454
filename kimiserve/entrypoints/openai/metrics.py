"""Prometheus metrics of one server (its own CollectorRegistry), named like vLLM's with `kimiserve:`.

Request metrics are recorded in the engine thread as outputs come out of each step
(`ServerMetrics` is the AsyncLLMEngine's observer), so they count what the engine generated,
whether or not the client stayed to read it. Engine gauges (running/waiting, cache pages, prefix
cache) are read from the engine's latest stats snapshot at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kimiserve.engine.async_engine import RequestRecord
from kimiserve.engine.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "abort", "error")


class _EngineCollector:
    """Gauges and counters read from `AsyncLLMEngine.stats()` when /metrics is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats()
        used_by_requests = s["pages_used"] - s["pages_cached"]

        def gauge(name: str, doc: str, value: float):
            g = GaugeMetricFamily(f"kimiserve:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            return g

        def counter(name: str, doc: str, value: float):
            c = CounterMetricFamily(f"kimiserve:{name}", doc, labels=["model_name"])
            c.add_metric([self.model_name], value)
            return c

        yield gauge("num_requests_running", "Sequences running (one per sample of n).", s["running"])
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s["waiting"])
        yield gauge("kv_cache_usage_perc", "Fraction of cache pages held by requests (1 = 100%); pages "
                    "held only by the prefix cache are reusable and not counted.",
                    used_by_requests / s["pages_total"] if s["pages_total"] else 0.0)
        yield gauge("cache_pages_total", "Pages in the cache pool.", s["pages_total"])
        yield gauge("cache_pages_used", "Pages with a holder (requests or prefix-cache snapshots).", s["pages_used"])
        yield gauge("cache_pages_cached", "Pages held only by prefix-cache snapshots.", s["pages_cached"])
        yield gauge("cache_pages_used_by_requests", "Pages held by requests (0 when the engine is idle).",
                    used_by_requests)
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hit tokens / queried tokens since start.", s["hit_rate"])
        yield gauge("engine_dead", "1 once the engine thread has died.", float(self.engine.errored))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s["prefix_query_tokens"])
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s["prefix_hit_tokens"])
        yield counter("num_preemptions", "Sequences preempted (freed and recomputed later).", s["preemptions"])


class ServerMetrics:
    """The server's registry; also the AsyncLLMEngine observer that records request metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("kimiserve:prompt_tokens", "Prompt tokens of requests (counted once "
                                     "each, at their first output).", labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("kimiserve:generation_tokens", "Generated tokens (all samples, aborted "
                                         "requests included).", labels, registry=r).labels(model_name)
        success = Counter("kimiserve:request_success", "Finished requests by finish reason (abort: the client "
                          "left or the request was cancelled; error: it failed inside the engine).",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = Histogram("kimiserve:time_to_first_token_seconds", "Arrival to first generated token.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("kimiserve:inter_token_latency_seconds", "Time between a request's steps that "
                             "generated tokens.", labels, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("kimiserve:e2e_request_latency_seconds", "Arrival to finish of finished requests.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.request_prompt_tokens = Histogram("kimiserve:request_prompt_tokens", "Prompt tokens per request.",
                                               labels, buckets=TOKEN_BUCKETS, registry=r).labels(model_name)
        self.request_generation_tokens = Histogram("kimiserve:request_generation_tokens", "Generated tokens per "
                                                   "finished request.", labels, buckets=TOKEN_BUCKETS,
                                                   registry=r).labels(model_name)

    def attach(self, engine) -> None:
        """Add the engine's gauges (engine: an AsyncLLMEngine)."""
        self.registry.register(_EngineCollector(engine, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # EngineObserver (engine thread) --------------------------------------------------------------
    def on_output(self, record: RequestRecord, output: RequestOutput, now: float) -> None:
        new = sum(len(c.delta_token_ids) for c in output.outputs)
        if new:
            if record.first_token_time is None:
                record.first_token_time = now
                self.prompt_tokens.inc(record.num_prompt_tokens)
                self.request_prompt_tokens.observe(record.num_prompt_tokens)
                self.ttft.observe(now - record.arrival)
            else:
                self.itl.observe(now - record.last_token_time)
            record.last_token_time = now
            record.num_generation_tokens += new
            self.generation_tokens.inc(new)
        if output.finished:
            self.success[output.outputs[0].finish_reason or "stop"].inc()  # one count per request: sample 0's
            self.e2e.observe(now - record.arrival)
            self.request_generation_tokens.observe(record.num_generation_tokens)

    def on_abort(self, record: RequestRecord) -> None:
        self.success["abort"].inc()
