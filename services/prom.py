"""Prometheus metrics for both hosts: one recording interface, two sinks.

    Recorder.record_request(SpecMetrics, ttft_s, ...)   one finished request -> every metric
    Recorder.running()                                  a request in flight (the running gauge)
    Recorder.record_error(method, reason)               a call refused, cancelled or past its deadline
    observe_stream(service.generate(...))               both, around a host's response stream
    Recorder.live_session() -> update(LiveStats), end   a live session's share of the live_* metrics
        -> PrometheusSink   prometheus_client on a registry of its own; `/metrics` over HTTP
                            (start_metrics_server) for the embedded server
        -> RaySink          ray.serve.metrics, exported by each Ray node's metrics agent
                            (Serve adds the deployment / replica / application tags)

Names follow vLLM's, prefix `sparrow:` for `vllm:`, so dashboards built for vLLM carry over
with a search-and-replace: `sparrow:spec_decode_num_accepted_tokens_total` beside
`vllm:spec_decode_num_accepted_tokens_total`, the same `position` label on the per-position
counter, the same `model_name` label on everything. Ray Serve's exporter refuses ':' in
names (Ray 2.60 warns that it will become an error), so the Ray sink writes
`sparrow_<name>` and Ray's exporter adds its `ray_` prefix: `ray_sparrow_spec_decode_num_drafts`
- what Ray Serve LLM does with vLLM's names (`ray_vllm_...`).

Definitions, in DESIGN.md's words (see sparrow.metrics.SpecMetrics):
  spec_decode_num_drafts          verify steps of speculative requests, so that
                                  1 + num_accepted_tokens / num_drafts = mean acceptance length
                                  tau, as the request's own metric computes it
  spec_decode_num_draft_tokens    draft tokens proposed
  spec_decode_num_accepted_tokens draft tokens accepted (the bonus token is not a draft token)
  ..._accepted_tokens_per_pos     accepted draft tokens by draft position (0 = first draft)
  time_per_output_token_seconds   one observation per request: decode time / (tokens - 1).
                                  Speculative decoding emits tokens in bursts, so per-token
                                  gaps would be mostly zero; the per-request mean is the
                                  number a latency SLO is written against.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from sparrow.metrics import SpecMetrics

PREFIX = "sparrow:"

# Buckets (seconds) as vLLM's, extended downwards where tiny models answer in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LAG_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str                      # without the prefix
    kind: str                      # "counter" | "histogram" | "gauge"
    doc: str
    labels: tuple[str, ...] = ("model_name",)
    buckets: tuple[float, ...] = ()


METRICS: tuple[MetricSpec, ...] = (
    # speculative decoding (vLLM: vllm:spec_decode_*)
    MetricSpec("spec_decode_num_drafts", "counter", "Verify steps of speculative requests (one draft each)."),
    MetricSpec("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed."),
    MetricSpec("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by the target."),
    MetricSpec("spec_decode_num_accepted_tokens_per_pos", "counter",
               "Accepted draft tokens by draft position (0 = the first draft token of a step).",
               labels=("model_name", "position")),
    # requests and tokens
    MetricSpec("request_success", "counter", "Finished requests by finish reason.",
               labels=("model_name", "finished_reason")),
    MetricSpec("request_errors", "counter",
               "Calls that ended without their answer, by method and reason: refused (invalid_argument, "
               "permission_denied, not_found, overloaded, upload_limit, resource_exhausted, unavailable, ...), "
               "cancelled by the client, or past their deadline (deadline).",
               labels=("model_name", "method", "reason")),
    MetricSpec("http_requests", "counter",
               "HTTP requests to the OpenAI-compatible API, by route and status (its chat completions are also "
               "counted in request_success / request_errors, beside the gRPC calls).",
               labels=("model_name", "route", "status")),
    MetricSpec("prompt_tokens", "counter", "Prompt tokens prefilled or reused, visual tokens included."),
    MetricSpec("generation_tokens", "counter", "Tokens generated."),
    # latencies
    MetricSpec("time_to_first_token_seconds", "histogram", "Request arrival to its first token.",
               buckets=TTFT_BUCKETS),
    MetricSpec("time_per_output_token_seconds", "histogram",
               "Mean time per output token of a request after its first (decode time / (tokens - 1)).",
               buckets=TPOT_BUCKETS),
    MetricSpec("e2e_request_latency_seconds", "histogram", "Request arrival to its last message.",
               buckets=PHASE_BUCKETS),
    MetricSpec("request_prefill_time_seconds", "histogram", "Prefill: the target's forward over the prompt.",
               buckets=PHASE_BUCKETS),
    MetricSpec("request_decode_time_seconds", "histogram", "Decode: first token to last token.",
               buckets=PHASE_BUCKETS),
    MetricSpec("request_video_decode_time_seconds", "histogram",
               "Video decode + frame sampling + patchify (zero-cost on a prefix-cache hit).",
               buckets=PHASE_BUCKETS),
    # state
    MetricSpec("num_requests_running", "gauge", "Requests running on this server or replica."),
    MetricSpec("prefix_cache_queries", "counter", "Prompt tokens looked up in the video prefix cache."),
    MetricSpec("prefix_cache_hits", "counter", "Prompt tokens whose prefill was reused from the prefix cache."),
    MetricSpec("prefix_cache_hit_rate", "gauge",
               "Fraction of prompt tokens reused from the prefix cache since this process started."),
    # live sessions (the Live RPC)
    MetricSpec("live_sessions_active", "gauge", "Live sessions open on this server or replica."),
    MetricSpec("live_sessions_ended", "counter",
               "Live sessions ended, by how: ok (half-closed), cancelled, or the status code that ended them.",
               labels=("model_name", "reason")),
    MetricSpec("live_frames_ingested", "counter",
               "Frames live sessions received (decoded from their media or sent raw), before sampling at their fps."),
    MetricSpec("live_frames_dropped", "counter",
               "Frames sampled by live sessions but never prefilled: ingest fell behind real time."),
    MetricSpec("live_pairs_prefilled", "counter", "Frame pairs prefilled into live sessions' windows."),
    MetricSpec("live_ingest_lag_seconds", "histogram",
               "How far a live session's window trails its newest frame (observed about once a second per session).",
               buckets=LAG_BUCKETS),
    MetricSpec("live_kv_bytes", "gauge", "KV cache bytes held by the live sessions of this server or replica."),
    # per open session, by its slot: a small number a new session reuses once its holder ended
    # (bounded labels); a free slot reads 0
    MetricSpec("live_session_lag_seconds", "gauge", "How far an open live session's window trails its newest frame.",
               labels=("model_name", "slot")),
    MetricSpec("live_session_frames_dropped", "gauge", "Frames an open live session dropped so far (ingest behind).",
               labels=("model_name", "slot")),
    MetricSpec("live_questions_refused", "counter",
               "Live questions refused: the session's answers in flight and queued were at their limits."),
)
SPECS = {spec.name: spec for spec in METRICS}


class MetricsSink(Protocol):
    """Where recorded values go. Names are METRICS names, without the prefix."""

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None: ...


class PrometheusSink:
    """prometheus_client metrics on a registry of their own (not the global one), so two
    sinks in one process (tests, a library user's own metrics) never collide."""

    def __init__(self, registry=None):
        import prometheus_client as pc

        self.registry = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)
        self._metrics = {}
        for spec in METRICS:
            full = PREFIX + spec.name
            if spec.kind == "counter":
                metric = pc.Counter(full, spec.doc, spec.labels, registry=self.registry)
            elif spec.kind == "histogram":
                metric = pc.Histogram(full, spec.doc, spec.labels, buckets=spec.buckets, registry=self.registry)
            else:
                metric = pc.Gauge(full, spec.doc, spec.labels, registry=self.registry)
            self._metrics[spec.name] = metric

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].labels(**labels).inc(value)

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].labels(**labels).observe(value)

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].labels(**labels).set(value)


def ray_metric_name(name: str) -> str:
    """The name the Ray sink registers (Ray's exporter then prepends `ray_`)."""
    return (PREFIX + name).replace(":", "_")


class RaySink:
    """ray.serve.metrics (inside a replica Serve adds deployment, replica and application
    tags; elsewhere they behave as ray.util.metrics). `metrics_module` is for tests."""

    def __init__(self, metrics_module=None):
        if metrics_module is None:
            from ray.serve import metrics as metrics_module
        self._metrics = {}
        for spec in METRICS:
            name = ray_metric_name(spec.name)
            if spec.kind == "counter":
                metric = metrics_module.Counter(name, description=spec.doc, tag_keys=spec.labels)
            elif spec.kind == "histogram":
                metric = metrics_module.Histogram(name, description=spec.doc, boundaries=list(spec.buckets),
                                                  tag_keys=spec.labels)
            else:
                metric = metrics_module.Gauge(name, description=spec.doc, tag_keys=spec.labels)
            self._metrics[spec.name] = metric

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:          # Ray's Counter refuses 0; an absent increment is the same count
            self._metrics[name].inc(value, tags=dict(labels))

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].observe(value, tags=dict(labels))

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._metrics[name].set(value, tags=dict(labels))


class Recorder:
    """Turns finished requests into metric updates on one sink. Thread-safe: hosts record
    from their event loop, engine threads may too."""

    def __init__(self, sink: MetricsSink, model_name: str = ""):
        self.sink = sink
        self.labels = {"model_name": model_name}
        self._lock = threading.Lock()
        self._running = 0
        self._cache_queries = 0
        self._cache_hits = 0
        self._live_kv: dict[int, int] = {}          # session -> its KV bytes (the gauge is their sum)
        self._live_ids = 0
        self._live_slots: set[int] = set()          # slots of the open sessions (per-session gauges)

    def record_request(self, metrics: SpecMetrics, ttft_s: float | None, *, finish_reason: str = "stop",
                       e2e_s: float | None = None) -> None:
        """One finished request. ttft_s: arrival to first token as the host saw it (None when
        no token was sent); e2e_s: arrival to the last message, when the host knows it."""
        sink, labels = self.sink, self.labels
        if metrics.num_draft_tokens > 0:       # a speculative request (k = 0 is plain decoding)
            sink.inc("spec_decode_num_drafts", metrics.steps, labels)
            sink.inc("spec_decode_num_draft_tokens", metrics.draft_tokens, labels)
            sink.inc("spec_decode_num_accepted_tokens", metrics.accepted_tokens, labels)
            for position, count in enumerate(metrics.accepted_per_position):
                sink.inc("spec_decode_num_accepted_tokens_per_pos", count, {**labels, "position": str(position)})
        sink.inc("request_success", 1, {**labels, "finished_reason": finish_reason})
        sink.inc("prompt_tokens", metrics.prompt_tokens, labels)
        sink.inc("generation_tokens", metrics.completion_tokens, labels)
        if ttft_s is not None:
            sink.observe("time_to_first_token_seconds", ttft_s, labels)
        if metrics.completion_tokens > 1:
            sink.observe("time_per_output_token_seconds",
                         metrics.decode_seconds / (metrics.completion_tokens - 1), labels)
        if e2e_s is not None:
            sink.observe("e2e_request_latency_seconds", e2e_s, labels)
        sink.observe("request_prefill_time_seconds", metrics.prefill_seconds, labels)
        sink.observe("request_decode_time_seconds", metrics.decode_seconds, labels)
        sink.observe("request_video_decode_time_seconds", metrics.video_seconds, labels)
        sink.inc("prefix_cache_queries", metrics.prompt_tokens, labels)
        sink.inc("prefix_cache_hits", metrics.cached_prompt_tokens, labels)
        with self._lock:       # set under the lock: concurrent requests must not leave a stale rate
            self._cache_queries += metrics.prompt_tokens
            self._cache_hits += metrics.cached_prompt_tokens
            sink.set("prefix_cache_hit_rate", self._cache_hits / self._cache_queries if self._cache_queries else 0.0,
                     labels)

    def record_error(self, method: str, reason: str) -> None:
        """One call (Generate, UploadVideo, Live, ...) that ended without its answer; reason
        as services.errors.error_reason says, or cancelled / deadline."""
        self.sink.inc("request_errors", 1, {**self.labels, "method": method, "reason": reason})

    def record_http(self, route: str, status: int) -> None:
        """One HTTP request (services.openai_api) answered with `status`."""
        self.sink.inc("http_requests", 1, {**self.labels, "route": route, "status": str(status)})

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Count a request as running for the duration of the block. The count lives here,
        not in the sink: Ray's Gauge can only be set, not incremented."""
        self._add_running(1)
        try:
            yield
        finally:
            self._add_running(-1)

    def _add_running(self, delta: int) -> None:
        with self._lock:       # set under the lock, or two requests ending together may leave 1
            self._running += delta
            self.sink.set("num_requests_running", self._running, self.labels)

    def live_session(self) -> "LiveSessionMetrics":
        """A live session opened: counted active until its `end`."""
        with self._lock:
            self._live_ids += 1
            key = self._live_ids
            self._live_kv[key] = 0
            slot = min(set(range(len(self._live_slots) + 1)) - self._live_slots)
            self._live_slots.add(slot)
            self._set_live_gauges()
        return LiveSessionMetrics(self, key, slot)

    def _set_live_gauges(self) -> None:
        """Lock held. Gauges are set, not incremented (Ray's Gauge can only be set)."""
        self.sink.set("live_sessions_active", len(self._live_kv), self.labels)
        self.sink.set("live_kv_bytes", sum(self._live_kv.values()), self.labels)


class LiveSessionMetrics:
    """One live session's share of the live metrics: `update` with its sparrow.live.session.LiveStats
    (counters advance by what changed since the last update), `end` once."""

    def __init__(self, recorder: Recorder, key: int, slot: int = 0):
        self.recorder, self.key, self.slot = recorder, key, slot
        self._seen = {"frames_received": 0, "frames_dropped": 0, "pairs_prefilled": 0, "questions_refused": 0}
        self._ended = False

    def update(self, stats) -> None:
        r, labels = self.recorder, self.recorder.labels
        for field, metric in (("frames_received", "live_frames_ingested"), ("frames_dropped", "live_frames_dropped"),
                              ("pairs_prefilled", "live_pairs_prefilled"), ("questions_refused", "live_questions_refused")):
            value = getattr(stats, field)
            r.sink.inc(metric, value - self._seen[field], labels)
            self._seen[field] = value
        if stats.window_pairs:
            r.sink.observe("live_ingest_lag_seconds", stats.lag_s, labels)
        with r._lock:
            if not self._ended:
                self._set_session(stats.lag_s, stats.frames_dropped)
                r._live_kv[self.key] = stats.kv_bytes
                r._set_live_gauges()

    def end(self, reason: str) -> None:
        r = self.recorder
        with r._lock:
            if self._ended:
                return
            self._ended = True
            self._set_session(0.0, 0)
            r._live_slots.discard(self.slot)
            r._live_kv.pop(self.key, None)
            r._set_live_gauges()
        r.sink.inc("live_sessions_ended", 1, {**r.labels, "reason": reason})

    def _set_session(self, lag_s: float, dropped: int) -> None:
        """This session's gauges (recorder lock held)."""
        r = self.recorder
        labels = {**r.labels, "slot": str(self.slot)}
        r.sink.set("live_session_lag_seconds", lag_s, labels)
        r.sink.set("live_session_frames_dropped", dropped, labels)


# ----- the process-wide recorder ------------------------------------------------------------------
_recorder: Recorder | None = None
_recorder_lock = threading.Lock()


def configure(sink: MetricsSink | None = None, model_name: str = "") -> Recorder:
    """Install the process's recorder: a host calls this once at start-up (the embedded
    server with a PrometheusSink, a Ray replica with a RaySink)."""
    global _recorder
    with _recorder_lock:
        _recorder = Recorder(sink if sink is not None else PrometheusSink(), model_name)
        return _recorder


def get_recorder() -> Recorder:
    """The process's recorder; a PrometheusSink one if no host configured one."""
    global _recorder
    with _recorder_lock:
        if _recorder is None:
            _recorder = Recorder(PrometheusSink())
        return _recorder


def record_request(metrics: SpecMetrics, ttft_s: float | None, *, finish_reason: str = "stop",
                   e2e_s: float | None = None, recorder: Recorder | None = None) -> None:
    """Record one finished request on the process's recorder (or the one given)."""
    (recorder or get_recorder()).record_request(metrics, ttft_s, finish_reason=finish_reason, e2e_s=e2e_s)


def spec_metrics_from_completion(completion) -> SpecMetrics:
    """The request's SpecMetrics back from its sparrow.v1.Completion (what a host sees).
    Per-position counts come back exactly: the message carries count / steps."""
    m, u = completion.metrics, completion.usage
    return SpecMetrics(
        num_draft_tokens=m.num_draft_tokens, steps=m.steps, draft_tokens=m.draft_tokens,
        accepted_tokens=m.accepted_tokens,
        accepted_per_position=[round(rate * m.steps) for rate in m.acceptance_rate_per_position],
        prompt_tokens=u.prompt_tokens, visual_tokens=u.visual_tokens, completion_tokens=u.completion_tokens,
        cached_prompt_tokens=u.cached_prompt_tokens, video_seconds=m.video_seconds,
        prefill_seconds=m.prefill_seconds, decode_seconds=m.decode_seconds, draft_seconds=m.draft_seconds,
        verify_seconds=m.verify_seconds, policy_seconds=m.policy_seconds)


def finish_reason_name(completion) -> str:
    """FINISH_REASON_LENGTH -> "length" (the label value vLLM uses)."""
    enum = completion.DESCRIPTOR.fields_by_name["finish_reason"].enum_type
    return enum.values_by_number[completion.finish_reason].name.removeprefix("FINISH_REASON_").lower()


async def observe_stream(responses: AsyncIterator, recorder: Recorder | None = None) -> AsyncIterator:
    """Pass a Generate response stream through, measuring it as the host sees it: running
    while it lasts, time to the first chunk, and on the Completion the request's metrics.
    Closing this stream closes `responses` (so the generation is aborted as before)."""
    recorder = recorder or get_recorder()
    start, ttft = time.monotonic(), None
    with recorder.running():
        async with contextlib.aclosing(responses) as inner:
            async for response in inner:
                kind = response.WhichOneof("kind")
                if kind == "chunk" and ttft is None:
                    ttft = time.monotonic() - start
                elif kind == "completion":
                    completion = response.completion
                    recorder.record_request(spec_metrics_from_completion(completion), ttft,
                                            finish_reason=finish_reason_name(completion),
                                            e2e_s=time.monotonic() - start)
                yield response


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: object
    _thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str = "127.0.0.1", port: int = 0, recorder: Recorder | None = None) -> MetricsServer:
    """Serve `/metrics` for the embedded server on a daemon thread; port 0 picks a free one.
    Needs a recorder with a PrometheusSink (the default)."""
    import prometheus_client as pc

    sink = (recorder or get_recorder()).sink
    if not isinstance(sink, PrometheusSink):
        raise TypeError(f"a /metrics endpoint needs a PrometheusSink, not {type(sink).__name__}")
    server, thread = pc.start_http_server(port, addr=host, registry=sink.registry)
    return MetricsServer(host, server.server_port, server, thread)
