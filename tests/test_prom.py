"""Prometheus metrics: real tiny-model requests recorded, the `/metrics` endpoint scraped over
HTTP, the counters compared with the requests' own SpecMetrics; the Ray sink receives the
same updates under Ray-legal names; JSON logs carry the request id."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import time
import urllib.request
import warnings

import pytest
from helpers import OracleProposer

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.metrics import SpecMetrics
from sparrow.services import prom
from sparrow.tiny import tiny_draft

SPEC = SpecConfig(adaptive_k=False, method="sparrow", num_draft_tokens=4, window=8, anchors=16)
PROMPT = "What happens in the video?"


def timed_generate(engine: Engine, video, sampling: SamplingParams):
    """(output, ttft_s, e2e_s) as a host measures them around the engine's stream."""
    start = time.perf_counter()
    gen = engine.stream(video, PROMPT, sampling)
    ttft = None
    for _ in gen:
        if ttft is None:
            ttft = time.perf_counter() - start
    return gen.output, ttft, time.perf_counter() - start


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} from a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def requests_done(qwen_target, small_video):
    """Two real requests on the tiny target: a random Sparrow draft (little accepted) and
    the target's own continuation as the draft (everything accepted, every position)."""
    sampling = SamplingParams(max_new_tokens=24, ignore_eos=True)
    random_draft = Engine(qwen_target, tiny_draft(qwen_target, seed=0), SPEC)
    first = timed_generate(random_draft, small_video, sampling)
    oracle = Engine(qwen_target, spec=SPEC, proposer=OracleProposer(first[0].token_ids))
    second = timed_generate(oracle, small_video, sampling)
    return [first, second]


@pytest.fixture
def endpoint():
    recorder = prom.Recorder(prom.PrometheusSink(), model_name="tiny-qwen")
    server = prom.start_metrics_server("127.0.0.1", 0, recorder=recorder)
    try:
        yield recorder, server
    finally:
        server.close()


def test_scraped_counters_equal_the_requests_own_metrics(requests_done, endpoint):
    recorder, server = endpoint
    for output, ttft, e2e in requests_done:
        prom.record_request(output.metrics, ttft, finish_reason=output.finish_reason, e2e_s=e2e, recorder=recorder)
    got = scrape(server.url)
    model = ("model_name", "tiny-qwen")

    def value(name, **labels):
        return got[(f"sparrow:{name}", frozenset({model, *labels.items()}))]

    metrics = [out.metrics for out, _, _ in requests_done]
    assert metrics[1].accepted_tokens > 0 and metrics[1].accepted_per_position[-1] > 0, "the oracle run accepts"
    assert value("spec_decode_num_drafts_total") == sum(m.steps for m in metrics)
    assert value("spec_decode_num_draft_tokens_total") == sum(m.draft_tokens for m in metrics)
    assert value("spec_decode_num_accepted_tokens_total") == sum(m.accepted_tokens for m in metrics)
    for position in range(SPEC.num_draft_tokens):
        expected = sum(m.accepted_per_position[position] for m in metrics if position < len(m.accepted_per_position))
        assert value("spec_decode_num_accepted_tokens_per_pos_total", position=str(position)) == expected
    # The dashboard formula gives each request's tau back (here: the pooled one).
    drafts, accepted = value("spec_decode_num_drafts_total"), value("spec_decode_num_accepted_tokens_total")
    pooled = SpecMetrics(steps=int(drafts), accepted_tokens=int(accepted))
    assert 1 + accepted / drafts == pytest.approx(pooled.mean_acceptance_length)

    assert value("request_success_total", finished_reason="length") == 2
    assert value("generation_tokens_total") == sum(m.completion_tokens for m in metrics) == 48
    assert value("prompt_tokens_total") == sum(m.prompt_tokens for m in metrics)
    assert value("time_to_first_token_seconds_count") == 2
    assert value("time_to_first_token_seconds_sum") == pytest.approx(sum(t for _, t, _ in requests_done))
    assert value("request_prefill_time_seconds_sum") == pytest.approx(sum(m.prefill_seconds for m in metrics))
    assert value("request_video_decode_time_seconds_count") == 2
    tpot = sum(m.decode_seconds / (m.completion_tokens - 1) for m in metrics)
    assert value("time_per_output_token_seconds_sum") == pytest.approx(tpot)
    assert value("e2e_request_latency_seconds_sum") == pytest.approx(sum(e for _, _, e in requests_done))
    assert value("prefix_cache_hits_total") == 0 and value("prefix_cache_hit_rate") == 0.0


def test_running_gauge_and_cache_hits(endpoint):
    recorder, server = endpoint
    key = ("sparrow:num_requests_running", frozenset({("model_name", "tiny-qwen")}))
    with recorder.running(), recorder.running():
        assert scrape(server.url)[key] == 2
    assert scrape(server.url)[key] == 0
    # a second question on the same video: 90 of 100 prompt tokens reused
    recorder.record_request(SpecMetrics(prompt_tokens=100), 0.5)
    recorder.record_request(SpecMetrics(prompt_tokens=100, cached_prompt_tokens=90), 0.1)
    got = scrape(server.url)
    labels = frozenset({("model_name", "tiny-qwen")})
    assert got[("sparrow:prefix_cache_hits_total", labels)] == 90
    assert got[("sparrow:prefix_cache_queries_total", labels)] == 200
    assert got[("sparrow:prefix_cache_hit_rate", labels)] == pytest.approx(0.45)
    # plain decoding (k = 0) drafts nothing: no spec-decode sample for this model yet
    assert got.get(("sparrow:spec_decode_num_drafts_total", labels), 0) == 0
    assert got[("sparrow:generation_tokens_total", labels)] == 0


class FakeRayMetrics:
    """Stands in for ray.serve.metrics: records what the sink sends (the real classes need a
    running Ray node to record)."""

    def __init__(self):
        self.calls: list[tuple[str, str, float, dict]] = []
        outer = self

        class _Metric:
            def __init__(self, name, description="", tag_keys=(), boundaries=None):
                assert ":" not in name and tag_keys
                self.name, self.tag_keys = name, tag_keys

            def _call(self, op, value, tags):
                assert set(tags) == set(self.tag_keys), (self.name, tags)
                outer.calls.append((op, self.name, value, tags))

        class Counter(_Metric):
            def inc(self, value=1.0, tags=None):
                assert value > 0, "Ray's Counter.inc raises on 0"
                self._call("inc", value, tags)

        class Histogram(_Metric):
            def observe(self, value, tags=None):
                self._call("observe", value, tags)

        class Gauge(_Metric):
            def set(self, value, tags=None):
                self._call("set", value, tags)

        self.Counter, self.Histogram, self.Gauge = Counter, Histogram, Gauge

    def totals(self) -> dict:
        out: dict = {}
        for op, name, value, tags in self.calls:
            key = (name, frozenset(tags.items()))
            out[key] = out.get(key, 0) + value if op == "inc" else value
        return out


def test_ray_sink_receives_the_same_updates(requests_done, endpoint):
    recorder, server = endpoint
    fake = FakeRayMetrics()
    ray_recorder = prom.Recorder(prom.RaySink(fake), model_name="tiny-qwen")
    for output, ttft, e2e in requests_done:
        for r in (recorder, ray_recorder):
            r.record_request(output.metrics, ttft, finish_reason=output.finish_reason, e2e_s=e2e)
    prometheus, ray_totals = scrape(server.url), fake.totals()
    counters = [s.name for s in prom.METRICS if s.kind == "counter"]
    compared = 0
    for (name, labels), value in prometheus.items():
        base = name.removeprefix("sparrow:").removesuffix("_total")
        if name.endswith("_total") and base in counters and value > 0:
            assert ray_totals[(prom.ray_metric_name(base), labels)] == value, name
            compared += 1
    assert compared >= 8
    observed = [v for op, n, v, _ in fake.calls if op == "observe" and n == "sparrow_time_to_first_token_seconds"]
    assert observed == [ttft for _, ttft, _ in requests_done]


def test_ray_sink_names_are_accepted_by_ray():
    pytest.importorskip("ray")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)     # Ray warns (future error) on ':' in names
        warnings.simplefilter("error", UserWarning)       # ...and discards invalid names with a warning
        prom.RaySink()
    assert prom.ray_metric_name("spec_decode_num_drafts") == "sparrow_spec_decode_num_drafts"


def test_metrics_server_needs_a_prometheus_sink():
    with pytest.raises(TypeError, match="PrometheusSink"):
        prom.start_metrics_server(recorder=prom.Recorder(prom.RaySink(FakeRayMetrics())))


def test_json_logs_carry_the_request_id():
    from sparrow.services.logs import JsonFormatter, RequestIdFilter, request_context

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("sparrow.test.logs")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    try:
        with request_context("req-42"):
            log.info("prefill done in %.1f s", 1.5, extra={"visual_tokens": 4096})
        log.warning("outside")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        log.removeHandler(handler)
    inside, outside, failed = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["request_id"] == "req-42" and inside["msg"] == "prefill done in 1.5 s"
    assert inside["visual_tokens"] == 4096 and inside["level"] == "INFO" and inside["ts"].endswith("Z")
    assert "request_id" not in outside
    assert "ValueError: boom" in failed["exc_info"]


def ray_node_exports(port: int, model_name: str, within: float = 60.0) -> dict[str, dict[str, float]]:
    """{ray_sparrow_* sample: {position label: value}} for `model_name`, from the Ray node's
    metrics agent, once the per-position counter (recorded last) has been exported."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline, found = time.monotonic() + within, {}
    while "ray_sparrow_spec_decode_num_accepted_tokens_per_pos_total" not in found:
        assert time.monotonic() < deadline, f"not exported within {within:.0f} s: {sorted(found)}"
        time.sleep(0.5)
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            continue
        found = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_sparrow_") and s.labels.get("model_name") == model_name:
                    found.setdefault(s.name, {})[s.labels.get("position", "")] = s.value
    return found


def test_ray_sink_exports_through_a_real_ray_node(requests_done, ray_instance, ray_metrics_port):
    """The Ray sink end to end: the session's real (local) Ray node's metrics agent exports what
    the sink recorded in this driver, under ray_sparrow_* names, equal to the request's own
    metrics (a model name of its own: the node's counters are the session's)."""
    import uuid

    metrics = requests_done[1][0].metrics          # the oracle run: every position accepted
    name = f"prom-test-{uuid.uuid4().hex[:8]}"
    prom.Recorder(prom.RaySink(), model_name=name).record_request(metrics, 0.25, finish_reason="length")
    found = ray_node_exports(ray_metrics_port, name)
    assert found["ray_sparrow_spec_decode_num_drafts_total"][""] == metrics.steps
    assert found["ray_sparrow_spec_decode_num_draft_tokens_total"][""] == metrics.draft_tokens
    assert found["ray_sparrow_spec_decode_num_accepted_tokens_total"][""] == metrics.accepted_tokens
    per_position = found["ray_sparrow_spec_decode_num_accepted_tokens_per_pos_total"]
    assert {int(p): v for p, v in per_position.items()} == {
        i: c for i, c in enumerate(metrics.accepted_per_position) if c > 0}
    assert found["ray_sparrow_time_to_first_token_seconds_count"][""] == 1


def test_observe_stream_records_what_the_host_streams(requests_done, endpoint):
    """The host-side wrapper: the Completion message carries the request's metrics back
    exactly (per-position counts too), the running gauge covers the stream, and closing the
    stream early closes the service's generator."""
    import asyncio

    from sparrow.services.protos import pb
    from sparrow.services.completion import completion

    recorder, server = endpoint
    output = requests_done[1][0]
    closed = []

    async def service_stream():
        try:
            for delta in ([1, 2], [3]):
                await asyncio.sleep(0.01)
                yield pb.GenerateResponse(request_id="r", chunk=pb.Chunk(token_ids=delta, text="x"))
            yield pb.GenerateResponse(request_id="r", completion=completion(output))
        finally:
            closed.append(True)

    async def consume(limit=None):
        seen = 0
        async with contextlib.aclosing(prom.observe_stream(service_stream(), recorder)) as responses:
            async for _ in responses:
                seen += 1
                if seen == 1:
                    assert scrape(server.url)[("sparrow:num_requests_running", labels)] == 1
                if seen == limit:
                    break

    labels = frozenset({("model_name", "tiny-qwen")})
    asyncio.run(consume())
    got = scrape(server.url)
    m = output.metrics
    back = prom.spec_metrics_from_completion(completion(output))
    assert back.accepted_per_position == m.accepted_per_position
    assert (back.draft_seconds, back.verify_seconds, back.policy_seconds) == (m.draft_seconds, m.verify_seconds,
                                                                             m.policy_seconds)
    assert got[("sparrow:spec_decode_num_accepted_tokens_total", labels)] == m.accepted_tokens
    for i, count in enumerate(m.accepted_per_position):
        assert got[("sparrow:spec_decode_num_accepted_tokens_per_pos_total", labels | {("position", str(i))})] == count
    assert got[("sparrow:request_success_total", labels | {("finished_reason", "length")})] == 1
    assert 0.01 <= got[("sparrow:time_to_first_token_seconds_sum", labels)] < got[
        ("sparrow:e2e_request_latency_seconds_sum", labels)]
    assert got[("sparrow:num_requests_running", labels)] == 0 and closed == [True]

    asyncio.run(consume(limit=1))          # a client that goes away after the first chunk
    got = scrape(server.url)
    assert closed == [True, True] and got[("sparrow:num_requests_running", labels)] == 0
    assert got[("sparrow:request_success_total", labels | {("finished_reason", "length")})] == 1
