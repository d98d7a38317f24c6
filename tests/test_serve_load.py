"""The load benchmark (benchmarks/serve_load) in its smoke mode on tiny random models, through
real embedded gRPC servers: the report has every column for every (rate, method), and its numbers
agree with each other (percentiles ordered, tokens counted equal to the answers' tokens and to the
server's count, goodput within throughput). Timings are the benchmark's business, never asserted;
the pure parts (workload, goodput, sustained rate) are checked on hand-made values."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/ is a repo folder, not installed
from benchmarks.concurrency.streams import Trace  # noqa: E402
from benchmarks.serve_load.__main__ import main  # noqa: E402
from benchmarks.serve_load.load_config import Ask, Objective, asks, poisson  # noqa: E402
from benchmarks.serve_load.load_driver import Record  # noqa: E402
from benchmarks.serve_load.load_stats import COLUMNS, LATENCIES, PCTS, request_row, summarize_run, sustained  # noqa: E402
from benchmarks.serve_load.load_table import HEAD  # noqa: E402
from sparrow.world.scenes import CAPTION_PROMPTS  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-load")
    out, raw, figure = tmp / "BENCH.md", tmp / "load.json", tmp / "load.png"
    status = main(["--smoke", "--threads", "1", "--seed", "123", "--json", str(raw), "--out", str(out),
                   "--plot", str(figure)])
    again = tmp / "AGAIN.md"                 # the same run reported from its JSON
    assert main(["--from-json", str(raw), "--out", str(again), "--plot", str(figure)]) == 0
    assert again.read_text().split("| load |")[1] == out.read_text().split("| load |")[1]
    return status, json.loads(raw.read_text()), out.read_text(), figure


def test_smoke_report_has_every_column(smoke):
    status, result, markdown, figure = smoke
    assert status == 0
    runs = result["runs"]
    assert {(r["load"], r["method"]) for r in runs} == {(load, m) for load in (2.0, 8.0) for m in ("plain", "sparrow")}
    for r in runs:
        assert set(COLUMNS) <= set(r), set(COLUMNS) - set(r)
        assert r["requests"] == 4 and r["failed"] == 0           # 2 videos x 2 questions
    assert "<!-- serve-load:begin -->" in markdown and "| " + " | ".join(HEAD) + " |" in markdown
    for load in ("2 req/s", "8 req/s"):
        for method in ("plain", "sparrow"):
            assert f"| {load} | {method} |" in markdown
    assert "Highest rate sustained" in markdown and "Objective: TTFT <= 2 s" in markdown
    assert figure.is_file() and figure.stat().st_size > 1000
    assert set(result["sustained"]) == {"plain", "sparrow"}


def test_smoke_numbers_are_consistent(smoke):
    _, result, _, _ = smoke
    for r in result["runs"]:
        for name in LATENCIES:
            values = [r[f"{name}_p{q}"] for q in PCTS]
            assert values[0] > 0 and values == sorted(values), (name, values)
        done = r["per_request"]
        # tokens counted = the answers' tokens = the server's own count of each answer
        assert r["output_tokens"] == sum(x["tokens"] for x in done)
        assert all(x["tokens"] == x["server_tokens"] and 1 <= x["tokens"] <= 12 for x in done)
        assert r["out_tok_s"] == pytest.approx(r["output_tokens"] / r["duration_s"])
        assert r["good"] == sum(x["good"] for x in done) and r["goodput_req_s"] <= r["req_s"] + 1e-9
        assert r["good_share"] == pytest.approx(r["good"] / r["requests"])
        # each video's first question is cold (caches emptied per run): at most the repeats hit
        assert 0 <= r["prefix_hits"] <= r["requests"] - 2
        assert all(x["uncached_prompt_tokens"] > 0 for x in done if not x["cached"])
        assert r["tau"] >= 1.0
        assert all(x["ttft_ms"] <= x["e2e_ms"] for x in done)


def test_workload_keeps_each_videos_questions():
    got = asks(3, 4, seed=7)
    assert len(got) == 12 and sorted(a.video for a in got) == [0] * 4 + [1] * 4 + [2] * 4
    firsts = {}
    for a in got:
        firsts.setdefault(a.video, a.prompt)
    assert all(p in CAPTION_PROMPTS for p in firsts.values())      # a caption first, repeats after
    timed = poisson(got, rate=4.0, seed=1)
    assert timed[0].at == 0.0 and all(b.at > a.at for a, b in zip(timed, timed[1:]))
    assert [(a.video, a.prompt) for a in timed] == [(a.video, a.prompt) for a in got]
    assert 1.0 < timed[-1].at < 6.0        # 11 gaps of mean 0.25 s (a loose bound: able to fail)


def test_v2_workload_asks_a_narration_first_and_no_template(tmp_path):
    from sparrow.world.v2.questions_v2 import QUESTIONS_V2
    got = asks(4, 3, seed=11, world="v2")
    firsts = {}
    for a in got:
        firsts.setdefault(a.video, a.prompt)
    assert all(p in QUESTIONS_V2["narrate"] for p in firsts.values()) and len(firsts) == 4
    assert all("{" not in a.prompt for a in got) and not any(a.prompt in CAPTION_PROMPTS for a in got)
    only_long = asks(4, 3, seed=11, world="v2", long_share=1.0)
    assert all(a.prompt in QUESTIONS_V2["narrate"] for a in only_long)
    narrations = [a.video for a in asks(4, 3, seed=11, world="v2", long_share=0.0) if a.prompt in QUESTIONS_V2["narrate"]]
    assert sorted(narrations) == [0, 1, 2, 3]              # each video's first question only
    out, raw = tmp_path / "BENCH.md", tmp_path / "load.json"
    assert main(["--smoke", "--world", "v2", "--rates", "4", "--threads", "1", "--seed", "321", "--json", str(raw),
                 "--out", str(out), "--plot", str(tmp_path / "load.png")]) == 0
    result, markdown = json.loads(raw.read_text()), out.read_text()
    assert "<!-- serve-load-v2:begin -->" in markdown and "<!-- serve-load:begin -->" not in markdown
    assert "world v2 videos" in markdown and "of 1 x 72, 1 x 128 visual tokens" in markdown
    asked = [x["prompt"] for r in result["runs"] for x in r["per_request"]]
    assert asked and any(p in QUESTIONS_V2["narrate"] for p in asked)


def _trace(ttft: float, gap: float, tokens: int, prompt: int = 1000, cached: int = 0) -> Trace:
    times = [ttft + i * gap for i in range(tokens)]
    return Trace(0.0, times, [[1]] * tokens, times[-1], tokens, 0, cached, prompt, tokens)


def test_objective_and_sustained_rate():
    obj = Objective(ttft_s=1.0, prefill_s_per_1k=1.0, tpot_ms=50.0, attain=0.5)
    assert request_row(Record(Ask(0, "q"), 0, _trace(1.9, 0.04, 5, prompt=1000)), obj)["good"]      # 1 s + 1 s allowed
    assert not request_row(Record(Ask(0, "q"), 0, _trace(1.9, 0.04, 5, prompt=1000, cached=900)), obj)["good"]
    assert not request_row(Record(Ask(0, "q"), 0, _trace(0.1, 0.06, 5)), obj)["good"]               # TPOT 60 ms
    failed = request_row(Record(Ask(0, "q"), 0, None, "boom"), obj)
    assert not failed["ok"] and not failed["good"]
    row = summarize_run([Record(Ask(0, "q"), 0, _trace(0.1, 0.01, 3)), Record(Ask(0, "q"), 0, None, "x")], 0.0, 2.0, obj)
    assert row["requests"] == 2 and row["failed"] == 1 and row["good"] == 1 and row["goodput_req_s"] == 0.5
    assert math.isclose(row["itl_ms_p50"], 10.0)
    runs = [{"method": "m", "mode": "rate", "load": load, "good_share": share}
            for load, share in ((1.0, 0.9), (2.0, 0.6), (4.0, 0.4), (8.0, 0.7))]
    assert sustained(runs, "m", obj) == 2.0         # 8 req/s passes but 4 does not: not sustained
    assert sustained([dict(runs[2], load=0.5)], "m", obj) is None
