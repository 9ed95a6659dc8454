"""Prometheus metrics of one server (its own CollectorRegistry), named like vLLM's with `kimiserve:`;
the ones vLLM also has are exported a second time under vLLM's own name (`vllm:...`, same value,
same labels), so dashboards and autoscalers written for vLLM work unchanged.

Request metrics are recorded in the engine thread as outputs come out of each step
(`ServerMetrics` is the AsyncLLMEngine's observer), so they count what the engine generated,
whether or not the client stayed to read it. Engine gauges (running/waiting, cache pages, prefix
cache) are read from the engine's latest stats snapshot at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kimiserve.engine.async_engine import RequestRecord
from kimiserve.engine.outputs import RequestOutput, RequestTimes

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
REQUEST_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
PREFIXES = ("kimiserve", "vllm")
VLLM_NAMES = frozenset((
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_prompt_tokens", "request_generation_tokens", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos"))
"""The metrics vLLM exports under the same name and meaning (also exported as `vllm:NAME`)."""


def prefixes(name: str) -> tuple[str, ...]:
    return PREFIXES if name in VLLM_NAMES else PREFIXES[:1]


class _Both:
    """One labelled metric child per prefix, updated together."""

    def __init__(self, children: list):
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)


class _EngineCollector:
    """Gauges and counters read from `AsyncLLMEngine.stats()` when /metrics is scraped."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats()
        used_by_requests = s["pages_used"] - s["pages_cached"]

        def family(kind, name: str, doc: str, value: float):
            out = []
            for prefix in prefixes(name):
                f = kind(f"{prefix}:{name}", doc, labels=["model_name"])
                f.add_metric([self.model_name], value)
                out.append(f)
            return out

        def gauge(name: str, doc: str, value: float):
            return family(GaugeMetricFamily, name, doc, value)

        def counter(name: str, doc: str, value: float):
            return family(CounterMetricFamily, name, doc, value)

        for metric in self._families(s, used_by_requests, gauge, counter):
            yield from metric

    def _families(self, s, used_by_requests, gauge, counter):
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
        if "spec_decode_num_drafts" in s:  # speculative decoding is on
            yield counter("spec_decode_num_drafts", "Verify rounds (chunks that carried drafts).",
                          s["spec_decode_num_drafts"])
            yield counter("spec_decode_num_draft_tokens", "Drafted tokens verified.", s["spec_decode_num_draft_tokens"])
            yield counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                          s["spec_decode_num_accepted_tokens"])
            yield self._per_position(s["spec_decode_num_accepted_tokens_per_pos"])

    def _per_position(self, counts: list[int]):
        name = "spec_decode_num_accepted_tokens_per_pos"
        out = []
        for prefix in prefixes(name):
            f = CounterMetricFamily(f"{prefix}:{name}", "Rounds whose draft at this position (0-based) was accepted.",
                                    labels=["model_name", "position"])
            for position, count in enumerate(counts):
                f.add_metric([self.model_name, str(position)], count)
            out.append(f)
        return out


class ServerMetrics:
    """The server's registry; also the AsyncLLMEngine observer that records request metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def metric(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kw):
            made = [kind(f"{prefix}:{name}", doc, ["model_name", *labels], registry=self.registry, **kw)
                    for prefix in prefixes(name)]
            if labels:
                return lambda *values: _Both([m.labels(model_name, *values) for m in made])
            return _Both([m.labels(model_name) for m in made])

        def histogram(name: str, doc: str, buckets) -> _Both:
            return metric(Histogram, name, doc, buckets=buckets)

        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of requests (counted once each, at "
                                    "their first output).")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens (all samples, aborted "
                                        "requests included).")
        success = metric(Counter, "request_success", "Finished requests by finish reason (abort: the client left "
                         "or the request was cancelled; error: it failed inside the engine).", ("finished_reason",))
        self.success = {reason: success(reason) for reason in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's steps that generated "
                             "tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of finished requests.", E2E_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per finished "
                                                   "request.", TOKEN_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Engine arrival to the first step that scheduled "
                                    "the request (finished requests).", REQUEST_TIME_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first generated token "
                                      "(finished requests).", REQUEST_TIME_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First generated token to finish (finished "
                                     "requests).", REQUEST_TIME_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finish (finished "
                                        "requests).", REQUEST_TIME_BUCKETS)

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
            self._observe_phases(output.times, now)

    def _observe_phases(self, times: RequestTimes | None, now: float) -> None:
        if times is None or times.first_scheduled is None:
            return
        finished = times.finished if times.finished is not None else now
        self.queue_time.observe(times.first_scheduled - times.arrival)
        self.inference_time.observe(finished - times.first_scheduled)
        if times.first_token is not None:
            self.prefill_time.observe(times.first_token - times.first_scheduled)
            self.decode_time.observe(finished - times.first_token)

    def on_abort(self, record: RequestRecord) -> None:
        self.success["abort"].inc()
