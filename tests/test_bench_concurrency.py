"""The concurrent-streams benchmark harness (benchmarks/concurrency/harness.py) on tiny random models:
result structure (every configuration, both paths, the prefill scenario), that its T=0
identity check passes on real outputs and fails when one concurrent output is corrupted, and
the CLI's exit status. Timings are the benchmark's business, never asserted here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/ is a repo folder, not installed
from benchmarks.concurrency import harness as cb, results as cr, streams as cs  # noqa: E402
from benchmarks.concurrency import stream_videos as cv  # noqa: E402
from benchmarks.concurrency.plan import PATHS, ConcurrencyConfig  # noqa: E402
from benchmarks.tiny_models import save_tiny_models  # noqa: E402

TOKENS = 6


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    return save_tiny_models(tmp_path_factory.mktemp("bench-models"))


def _config(models_dir, **kw) -> ConcurrencyConfig:
    base = dict(models=str(models_dir), lengths=((84, 8),), streams=(1, 2), tokens=TOKENS, reps=1, warmup_tokens=2,
                prefill_video=(112, 16), prefill_streams=2, prefill_reps=1, prefill_stream_tokens=400, before_s=0.1,
                prefill_shorts=2, short_gap_s=0.0)
    return ConcurrencyConfig(**{**base, **kw})


def test_result_structure_and_identity(models_dir):
    lines: list[str] = []
    result = cb.run_benchmark(_config(models_dir), log=lines.append)

    assert result["identical"] and result["mismatches"] == []
    # 84 px x 8 frames: 4 frame pairs of 3x3 visual tokens
    cells = {(r["path"], r["method"], r["streams"]): r for r in result["summary"]}
    assert set(cells) == {(p, m, n) for p in PATHS for m in ("plain", "sparrow") for n in (1, 2)}
    assert len(result["runs"]) == len(cells)
    for r in result["runs"]:
        assert r["visual_tokens"] == 36 and r["rep"] == 0
        assert r["tokens"] == TOKENS * r["streams"]               # EOS ignored: every stream its full length
        assert r["tok_s"] > 0 and r["one_at_a_time_tok_s"] > 0
        assert r["x_one_at_a_time"] == pytest.approx(r["tok_s"] / r["one_at_a_time_tok_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p95_ms"] and 0 < r["itl_p50_ms"] <= r["itl_p95_ms"]
    for (path, method, n), row in cells.items():
        assert row["reps"] == 1 and row["tok_s"]["min"] == row["tok_s"]["median"] == row["tok_s"]["max"]
        assert row["tau"]["median"] >= 1.0
        assert (row["x_plain"] == 1.0) if method == "plain" else row["x_plain"] > 0
    assert cells[("in-process", "plain", 1)]["tau"]["median"] == 1.0

    [plain, sparrow] = result["prefill_summary"]
    assert (plain["method"], sparrow["method"]) == ("plain", "sparrow")
    for row in result["prefill_scenario"]:
        assert row["streams"] == 2 and row["prefill_visual_tokens"] == 128 and row["covered"]
        assert row["before_gaps"] > 0 and not math.isnan(row["before_p95_ms"])
        assert row["long_ttft_s"] >= row["long_prefill_s"] > 0
        assert row["shorts_asked"] == 2 and 0 <= row["shorts_in_prefill"] <= 2     # short requests during it
        assert row["shorts_in_prefill"] == 0 or row["short_ttft_p95_s"] >= row["short_ttft_p50_s"] > 0
    json.dumps(result)                                            # --json writes it as is

    text = cr.report(result)
    assert "Output identity: every output" in text and "prefill arrives" in text and "short TTFT p95 s" in text
    assert "| 0 | 36 | gRPC | Sparrow | 2 |" in text and "load average (1/5/15 min) before" in text
    assert "**T = 0, gRPC.**" in text                            # the methods side by side
    assert any("prefill scenario, sparrow" in line for line in lines)
    # the length's shapes met once, untimed, before its first rep (not among the runs above)
    assert sum("warm round at 36 visual tokens" in line for line in lines) == 1
    assert "the whole configuration once, untimed" in text


def _corrupt_concurrent(monkeypatch):
    """The last concurrent stream emits a wrong last token (one at a time stays right)."""
    real = cs.run_concurrent

    def corrupted(calls):
        traces = real(calls)
        last = traces[-1].chunks[-1]
        last[-1] = (last[-1] + 1) % 512                # the tiny target's vocabulary
        return traces

    monkeypatch.setattr(cs, "run_concurrent", corrupted)


def test_world_v2_streams_ask_narrations_about_v2_videos(models_dir):
    """--world v2: each stream a fresh v2 video (lengths in seconds: 112 px x 4 s is 64 visual
    tokens) asking a narration wording; the same identity check and report."""
    from sparrow.world.v2.questions_v2 import QUESTIONS_V2

    asked = []
    make_videos = cb.make_videos
    cfg = _config(models_dir, lengths=((112, 4),), paths=("in-process",), prefill_video=None, world="v2")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(cb, "make_videos", lambda *a: (lambda got: (asked.extend(v.prompt for v in got), got)[1])(make_videos(*a)))
        result = cb.run_benchmark(cfg, log=lambda _: None)
    assert result["identical"] and {r["visual_tokens"] for r in result["runs"]} == {64}
    assert asked and set(asked) <= set(QUESTIONS_V2["narrate"])
    assert "narration prompts" in cb.report(result) and "videos of world v2" in cb.report(result)


def test_corrupted_concurrent_output_fails_identity(models_dir, monkeypatch):
    _corrupt_concurrent(monkeypatch)
    cfg = _config(models_dir, methods=("plain",), paths=("in-process",), prefill_video=None)
    result = cb.run_benchmark(cfg, log=lambda _: None)
    assert not result["identical"]
    assert [(b["streams"], b["request"], b["index"]) for b in result["mismatches"]] == [(1, 0, TOKENS - 1),
                                                                                         (2, 1, TOKENS - 1)]
    assert {b["reference"] for b in result["mismatches"]} == {"plain/in-process"}
    assert "MISMATCHES" in cr.report(result)
    assert cb.mismatch_lines(result["mismatches"])[0].startswith("MISMATCH at T=0: plain in-process (1 streams")


def test_cli_exit_status(models_dir, monkeypatch, tmp_path, capsys):
    out = tmp_path / "BENCH.md"
    args = ["--models", str(models_dir), "--lengths", "84x8", "--streams", "1,2", "--tokens", "4", "--reps", "1",
            "--paths", "in-process", "--no-prefill", "--out", str(out), "--json", str(tmp_path / "r.json")]
    assert cb.main(args) == 0
    assert "<!-- concurrency:begin -->" in out.read_text() and "--streams 1,2" in out.read_text()
    assert json.loads((tmp_path / "r.json").read_text())["identical"] is True

    _corrupt_concurrent(monkeypatch)
    out.unlink()
    assert cb.main(args) == 1                                     # a mismatch fails the run, nothing written
    assert "FAILED" in capsys.readouterr().err and not out.exists()

    assert cb.main(["--models", str(tmp_path / "nowhere")]) == 2
    assert "no target model at" in capsys.readouterr().err


def test_baselines_at_two_temperatures_from_one_shared_prefill(models_dir, monkeypatch):
    """Issue 17's batch table: EAGLE-style and SpecVLM-style beside plain and Sparrow's tree, T=0
    and T=1 (seeded), the in-process engines answering from one prefill per video (SpecVLM, whose
    small VLM reads the pixels, from its own); every output checked against its reference."""
    shared = []
    real_share = cv.share_prefix

    def counting(target, processed, prompt, engines, cache, tag):
        shared.append(sorted(engines))
        return real_share(target, processed, prompt, engines, cache, tag)

    monkeypatch.setattr(cv, "share_prefix", counting)
    methods = ("plain", "eagle", "specvlm", "sparrow-tree")
    cfg = _config(models_dir, methods=methods, paths=("in-process",), prefill_video=None, temperatures=(0.0, 1.0),
                  share_prefill=True)
    result = cb.run_benchmark(cfg, log=lambda _: None)

    assert result["identical"], cb.mismatch_lines(result["mismatches"])
    # one prefill a video, SpecVLM apart: the rep's videos and the warm round's (one a stream)
    assert shared == [["eagle", "plain", "sparrow-tree"]] * (cfg.streams[-1] + cfg.videos_per_rep)
    cells = {(r["temperature"], r["method"], r["streams"]): r for r in result["summary"]}
    assert set(cells) == {(t, m, n) for t in (0.0, 1.0) for m in methods for n in (1, 2)}
    for (t, m, n), row in cells.items():
        assert row["tau"]["median"] >= 1.0 and (m != "plain" or row["tau"]["median"] == 1.0)   # random drafts
        assert (row["x_plain"] == 1.0) if m == "plain" else row["x_plain"] > 0
    text = cr.report(result)
    for t in ("0", "1"):
        assert f"**T = {t}, in-process.**" in text
    assert "| visual tokens | streams | plain | EAGLE-style (all tokens) | SpecVLM-style | Sparrow tree |" in text
    assert "| 36 | 2 | " in text and "one shared prefill per video" in text


def test_seeded_outputs_are_checked_against_their_own_method(models_dir, monkeypatch):
    """At T > 0 a concurrent output must equal the same method's one-at-a-time output with the
    same seed: a corrupted one fails, named with its temperature and reference."""
    _corrupt_concurrent(monkeypatch)
    cfg = _config(models_dir, methods=("sparrow",), paths=("in-process",), prefill_video=None, temperatures=(1.0,),
                  streams=(2,))
    result = cb.run_benchmark(cfg, log=lambda _: None)
    assert [(b["temperature"], b["streams"], b["request"], b["reference"]) for b in result["mismatches"]] == \
        [(1.0, 2, 1, "sparrow/in-process")]
    assert cb.mismatch_lines(result["mismatches"])[0].startswith("MISMATCH at T=1: sparrow in-process (2 streams")
    with pytest.raises(ValueError, match="temperatures"):
        _config(models_dir, temperatures=(-1.0,))


def test_runs_a_length_each_merge_into_one_report(models_dir, tmp_path):
    files = []
    for lengths in ("84x8", "112x8"):
        files.append(tmp_path / f"{lengths}.json")
        assert cb.main(["--models", str(models_dir), "--lengths", lengths, "--streams", "1", "--tokens", "3",
                        "--reps", "1", "--paths", "in-process", "--no-prefill", "--methods", "plain,sparrow",
                        "--json", str(files[-1])]) == 0
    out = tmp_path / "BENCH.md"
    assert cb.main(["--from-json", ",".join(map(str, files)), "--out", str(out), "--section", "merged",
                    "--title", "Two lengths"]) == 0
    text = out.read_text()
    assert "<!-- merged:begin -->\n## Two lengths" in text
    assert "| 36 | one at a time | " in text                                  # batch 1 over every video of a rep
    assert "lengths 84x8: load average" in text and "lengths 112x8: load average" in text
    assert "--lengths 84x8" in text and "--lengths 112x8" in text           # each part's command
    assert "| 36 | 1 | " in text and "| 64 | 1 | " in text

    parts = [json.loads(f.read_text()) for f in files]
    merged = cr.merge(parts)
    assert [r["visual_tokens"] for r in merged["summary"] if r["method"] == "plain"] == [36, 64]
    assert merged["config"]["lengths"] == [[84, 8], [112, 8]] and merged["identical"]
    parts[1]["config"]["reps"] = 2                       # the longest length may run fewer (or more) reps
    assert "2 reps (84x8: 1)" in cr.report(cr.merge(parts))
    parts[1]["config"]["tokens"] = 4
    with pytest.raises(ValueError, match="tokens"):
        cr.merge(parts)


def test_streams_run_past_the_answer_unless_told_to_stop_at_it(monkeypatch):
    """--stop-at-eos: each stream ends at its answer's end (EOS honoured) on both paths; by
    default every stream runs its tokens (EOS ignored), so each does the same work."""
    got = []
    monkeypatch.setattr(cb, "engine_call", lambda engine, key, prompt, sampling: got.append(sampling.ignore_eos))
    monkeypatch.setattr(cb, "grpc_call", lambda *a: got.append(a[-1]))
    video = cv.Video(None, 36, b"", 2.0, "p", {"sparrow": "k"}, "v")
    assert ConcurrencyConfig().stop_at_eos is False
    for stop in (False, True):
        got.clear()
        for path in PATHS:
            cb._calls(path, None, None, [video], 8, "sparrow", 0.0, 1, not stop)
        assert got == [not stop] * len(PATHS)


def test_the_warm_round_leaves_the_reps_prefills_in_a_shared_cache(models_dir):
    """Eight streams from one shared prefix cache (room for a rep's videos and 8 more): the warm
    round's eight prefills come before the rep's, so none of the rep's is evicted before it runs."""
    cfg = _config(models_dir, streams=(8,), paths=("in-process",), prefill_video=None, share_prefill=True)
    result = cb.run_benchmark(cfg, log=lambda _: None)
    assert result["identical"] and {r["streams"] for r in result["runs"]} == {8}
