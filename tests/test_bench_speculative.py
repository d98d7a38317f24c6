"""The side-by-side speculative benchmark harness (benchmarks/speculative.py) on tiny random
models saved in the --models layout: result structure, the T=0 output-identity check, and
that a corrupted method output fails the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/ is a repo folder, not installed
from benchmarks import speculative as sb, speculative_report as sr  # noqa: E402
from benchmarks.engines import BenchConfig  # noqa: E402
from benchmarks.step_cost_projection import step_costs  # noqa: E402
from benchmarks.tiny_models import save_tiny_models  # noqa: E402

# 84 px x 24 frames = 12 frame pairs x 3x3 tokens = 108 visual tokens; 112 px x 8 frames = 64.
VIDEOS = ((84, 24), (112, 8))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """world/{target,draft}, bench/draft-eagle, bench/small-target; no bench/ablation/: those
    methods must be skipped, not crash."""
    return save_tiny_models(tmp_path_factory.mktemp("bench-models"))


def _config(models_dir, methods, videos=VIDEOS, **kw) -> BenchConfig:
    return BenchConfig(models=str(models_dir), videos=videos, temperatures=(0.0,), reps=1, max_new_tokens=12,
                          methods=methods, warmup_tokens=0, **kw)


def test_result_structure_identity_and_report(models_dir, tmp_path):
    """Every drafting method runs under both policies (adaptive and fixed k), each its own row."""
    methods = ("plain", "eagle", "specvlm", "specvlm-eagle", "sparrow", "ablation-none")
    lines: list[str] = []
    result = sb.run_benchmark(_config(models_dir, methods), log=lines.append)

    assert result["identical"] and result["mismatches"] == []
    assert set(result["skipped"]) == {"ablation-none", "ablation-none@fixed"}
    assert "bench/ablation/none" in result["skipped"]["ablation-none"]
    ran = ["plain"] + [m + policy for m in methods[1:-1] for policy in ("", "@fixed")]
    assert [v["visual_tokens"] for v in result["videos"]] == [108, 64]
    assert len(result["runs"]) == len(VIDEOS) * len(ran)
    plain = {r["visual_tokens"]: r["token_ids"] for r in result["runs"] if r["method"] == "plain"}
    for r in result["runs"]:
        assert len(r["token_ids"]) == 12                       # EOS ignored: equal lengths
        assert r["token_ids"] == plain[r["visual_tokens"]]     # what the identity check asserted
        assert r["e2e_seconds"] > r["metrics"]["decode_seconds"] > 0
    assert all(r["draft_kv_bytes"] > 0 for r in result["runs"] if r["method"] != "plain")

    cells = {(r["method"], r["visual_tokens"]): r for r in result["summary"]}
    assert set(cells) == {(m, n) for m in ran for n in (64, 108)}
    for (method, n), row in cells.items():
        assert row["reps"] == 1 and row["temperature"] == 0.0
        assert row["decode_speedup"] > 0 and row["e2e_speedup"] > 0 and row["tau"] >= 1.0
        # tau: the answer's tokens a step (11 after the prefill's), never over its ceiling; the
        # engine's acceptance (past the 12th token too) is accepted_per_step
        steps = [r["metrics"]["steps"] for r in result["runs"] if (r["method"], r["visual_tokens"]) == (method, n)]
        assert row["tau"] == pytest.approx(11 / sum(steps)) and row["accepted_per_step"] >= row["tau"] - 1 - 1e-9
        assert all(0.0 <= p <= 1.0 for p in row["acceptance_per_position"])
        assert row["draft_ms_per_step"] >= 0 and row["verify_ms_per_step"] > 0
        # 12 tokens, EOS ignored: the prefill's first, then 11 at most 5 a step, so 3 steps at least
        assert row["tau_ceiling"] == pytest.approx(11 / 3) and row["tau"] <= row["tau_ceiling"]
    assert cells[("plain", 64)]["decode_speedup"] == 1.0 and cells[("plain", 64)]["tau"] == 1.0
    # adaptive: k <= 4, chosen per step from measured costs (with this random draft, k = 0
    # throughout is a right choice too; the policy is tested in test_draft_policy.py); fixed: k = 4
    # every step, for every drafting method
    for m in methods[1:-1]:
        assert len(cells[(m, 64)]["acceptance_per_position"]) <= 4
        assert len(cells[(m + "@fixed", 64)]["acceptance_per_position"]) == 4
    # the draft that sees every token holds more keys than the text-anchored window draft
    assert cells[("eagle", 108)]["draft_max_keys"] > 108 > cells[("sparrow", 108)]["draft_max_keys"]
    json.dumps(result)                                           # --json writes it as is

    text = sr.report(result, "speculative.png")
    assert "Output identity at T = 0 (T > 0: the same seed): all methods' tokens equal plain decoding's" in text
    assert "| 108 |" in text and "SpecVLM" in text and "Bars" in text and "ablation-none" in text
    assert "| visual tokens | tau ceiling | plain | EAGLE (all tokens) | EAGLE (all tokens), fixed k |" in text
    assert "| 108 | 3.67 |" in text and "| 108 | specvlm@fixed |" in text
    # the headline read back from the written tables keeps both policies' rows
    assert sr.speedups_from_section(text)[(0.0, 108, "eagle@fixed")] == pytest.approx(cells[("eagle@fixed", 108)]["decode_speedup"], abs=0.01)
    assert {b["bar"].split(" ")[0] for b in sr.bars(result)} == {"Sparrow"} and len(sr.bars(result)) == 5
    sr.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_world_v2_videos_and_narration_prompts(models_dir, monkeypatch):
    """--world v2: v2 videos (lengths in seconds: 16 visual tokens a second at 112 px, 4 at 56 px),
    v2's narration prompts, the same identity check; its default ladder reaches 25k tokens."""
    from benchmarks.world_videos import world_ladder, world_prompts
    from sparrow.world.v2.questions_v2 import QUESTIONS_V2
    from sparrow.world.v2.render_v2 import visual_tokens

    asked = []
    run_one = sb.run_one
    monkeypatch.setattr(sb, "run_one", lambda engine, prompt, *a: (asked.append(prompt), run_one(engine, prompt, *a))[1])
    result = sb.run_benchmark(_config(models_dir, ("plain", "sparrow"), videos=((112, 4), (56, 8)), world="v2"))
    assert result["identical"] and [v["visual_tokens"] for v in result["videos"]] == [64, 32]
    assert asked and set(asked) <= set(QUESTIONS_V2["narrate"]) == set(world_prompts("v2"))
    assert "videos of world v2" in sr.report(result) and "narration prompts" in sr.report(result)
    assert [visual_tokens(s, side) for side, s in world_ladder("v2")] == [512, 1536, 8000, 25024]
    with pytest.raises(ValueError, match="unknown world"):
        sb.make_video(None, 112, 4, 0, "v3")


def test_tau_ceiling_is_what_k_drafts_a_step_allow():
    assert sb.tau_ceiling([12], 4) == pytest.approx(11 / 3)       # 11 tokens after the first: 5 + 5 + 1
    assert sb.tau_ceiling([11], 4) == 5.0                         # 10: two full steps
    assert sb.tau_ceiling([12, 11], 4) == pytest.approx(21 / 5)   # pooled as tau is: tokens over steps
    assert sb.tau_ceiling([2], 4) == 1.0 and sb.tau_ceiling([1], 4) == 0.0
    assert sb.tau_ceiling([101], 2) == pytest.approx(100 / 34)
    with pytest.raises(ValueError, match="policies"):
        _config(".", ("plain",), policies=("greedy",))


def _corrupt_speculative(monkeypatch):
    """Make every speculative method emit a wrong last token (plain stays right)."""
    real = sb.run_one

    def corrupted(engine, *args, **kw):
        out = real(engine, *args, **kw)
        if engine.spec.speculative:
            out.token_ids = out.token_ids[:-1] + [(out.token_ids[-1] + 1) % engine.target.vocab_size]
        return out

    monkeypatch.setattr(sb, "run_one", corrupted)


def test_each_two_reps_run_every_pair_of_methods_in_both_orders():
    keys = ["plain", "sparrow", "sparrow@fixed", "eagle", "eagle@fixed"]
    for start in (0, 2, 4, 6):
        first, second = sb.rep_order(keys, start), sb.rep_order(keys, start + 1)
        assert sorted(first) == sorted(keys) and second == first[::-1]
    assert sb.rep_order(keys, 0)[0] != sb.rep_order(keys, 2)[0]          # and the first place moves


def test_corrupted_output_fails_identity(models_dir, monkeypatch):
    _corrupt_speculative(monkeypatch)
    result = sb.run_benchmark(_config(models_dir, ("plain", "sparrow"), videos=VIDEOS[1:]), log=lambda _: None)
    assert not result["identical"]
    assert [bad["method"] for bad in result["mismatches"]] == ["sparrow", "sparrow@fixed"]
    assert all(bad["index"] == 11 and bad["visual_tokens"] == 64 for bad in result["mismatches"])
    assert "MISMATCHES" in sr.report(result)


def test_cli_exit_status(models_dir, monkeypatch, tmp_path, capsys):
    out = tmp_path / "BENCH.md"
    args = ["--models", str(models_dir), "--videos", "112x8", "--reps", "1", "--temperatures", "0",
            "--max-new-tokens", "6", "--methods", "plain,sparrow", "--out", str(out),
            "--plot", str(tmp_path / "p.png"), "--json", str(tmp_path / "r.json")]
    assert sb.main(args) == 0
    assert "<!-- speculative:begin -->" in out.read_text() and (tmp_path / "p.png").exists()
    assert json.loads((tmp_path / "r.json").read_text())["identical"] is True
    # world v2 is the default; a v1 run writes a section of its own, and only the default's holds the headline
    assert sb.main(args + ["--world", "v1"]) == 0
    text = out.read_text()
    assert "<!-- speculative-v1:begin -->" in text and text.count("<!-- headline:begin -->") == 1
    from benchmarks.report import between
    assert "synthetic world v2 pair" in between(between(text, "speculative"), "headline")
    assert "synthetic world v1 pair" in between(text, "speculative-v1")
    assert "| 128 |" in between(text, "speculative") and "| 64 |" in between(text, "speculative-v1")

    # the raw results (the v1 run's, the last written) report again without a run, into their world's section
    again = tmp_path / "AGAIN.md"
    assert sb.main(["--from-json", str(tmp_path / "r.json"), "--out", str(again), "--plot", str(tmp_path / "q.png")]) == 0
    assert "| 64 |" in between(again.read_text(), "speculative-v1") and "--from-json" in again.read_text()
    command = next(line for line in again.read_text().splitlines() if line.startswith("Command:"))
    assert "--max-new-tokens 6" in command and "--world v1" in command    # the run's own command is kept

    _corrupt_speculative(monkeypatch)
    out.unlink()
    assert sb.main(args) == 1                                    # a mismatch fails the run
    assert "MISMATCH at T=0: sparrow" in capsys.readouterr().err and not out.exists()

    assert sb.main(["--models", str(tmp_path / "nowhere")]) == 2
    assert "no target model at" in capsys.readouterr().err


def test_step_costs_smoke_on_cpu():
    """The --gpu timing code, on a tiny shape on CPU (the 7B shape needs CUDA)."""
    shape = dict(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=256)
    c = step_costs(torch.device("cpu"), torch.float32, shape, context=300, k=3, reps=2)
    assert c["decode_ms"] > 0 and c["verify_ms"] > 0 and c["draft_step_ms"] > 0 and c["draft_commit_ms"] > 0
    assert c["draft_step_ms"] == pytest.approx(c["draft_propose_ms"] / 3)


def test_speedups_pair_each_rep_with_its_own_plain_run():
    """A rep's methods ran on one video, interleaved: the speedup is the median of each rep's ratio
    (here 2.0 and 0.5 -> 1.25), not a ratio of medians across reps (15 / 22.5 ms)."""
    def run(method, rep, ms):
        return {"temperature": 0.0, "visual_tokens": 64, "method": method, "rep": rep, "e2e_seconds": ms / 10,
                "metrics": {"decode_seconds": ms * 10 / 1e3, "completion_tokens": 11, "steps": 10, "accepted_tokens": 0,
                            "accepted_per_position": [], "draft_seconds": 0.0, "verify_seconds": ms * 10 / 1e3,
                            "draft_max_keys": 0}, "draft_kv_bytes": None}
    rows = sb.summarize([run("plain", 0, 10.0), run("sparrow", 0, 5.0), run("plain", 1, 20.0), run("sparrow", 1, 40.0)], 4)
    row = next(r for r in rows if r["method"] == "sparrow")
    assert row["decode_speedup"] == pytest.approx(1.25) and row["e2e_speedup"] == pytest.approx(1.25)
    assert next(r for r in rows if r["method"] == "plain")["decode_speedup"] == 1.0
