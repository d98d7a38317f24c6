"""The command lines a new user meets first: every option explains itself, the demo does what
its options say or refuses them, and `sparrow serve` with no model flags serves the trained
world pair and says so."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparrow.cli.main import build_parser, main
from sparrow.cli.serve import app_settings, models_line
from sparrow.world.pair_demo import DEFAULT_MODELS

WORLD = DEFAULT_MODELS / "target" / "config.json"
needs_world = pytest.mark.skipif(not WORLD.is_file(), reason="the committed world pair is not in this checkout")


def _parsers(parser: argparse.ArgumentParser, name: str = "sparrow"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_option_of_every_subcommand_says_what_it_does():
    missing = []
    for name, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = (action.help or "").strip()
            # "default 300" alone names a value, not what the option does
            if not text or text == argparse.SUPPRESS or re.fullmatch(r"\(?default[^)]*\)?", text):
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, "options without help: " + ", ".join(missing)
    assert len(list(_parsers(build_parser()))) >= 12          # the walk reached the nested world commands


# ----- the demo's options -----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--random", "--long"], "exclude each other"),
    (["--random", "--models", "models/world"], "takes no --models"),
    (["--reps", "2"], "add --long"),
    (["--plot", "x.png"], "add --long"),
    (["--long", "--frames", "1393"], "even number"),
    (["--long", "--size", "100"], "multiple of 28"),
    (["--frames", "9"], "even number"),
    (["--long", "--frames", "1500", "--size", "168"], "over the world videos' budget"),
    (["--k", "0"], "--k must be"),
    (["--threads", "0"], "--threads must be"),
    (["--long", "--max-new-tokens", "1"], "--max-new-tokens must be"),
    (["--models", "/nonexistent/models"], "no trained world pair"),
    (["--long", "--eagle-draft", "/nonexistent/eagle"], "no EAGLE-style draft"),
])
def test_demo_refuses_what_it_cannot_honour(argv, says, capsys):
    if not WORLD.is_file() and "--random" not in argv:
        pytest.skip("the committed world pair is not in this checkout")
    assert main(["demo", *argv]) == 2
    assert says in capsys.readouterr().err


@needs_world
def test_long_demo_short_run_honours_its_options(tmp_path, capsys):
    plot = tmp_path / "demo.png"
    code = main(["demo", "--long", "--frames", "12", "--size", "56", "--seed", "3", "--reps", "1", "--k", "3",
                 "--max-new-tokens", "12", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "12 frames 56x56" in out and "decoded 12 frames -> 24 visual tokens" in out     # 6 pairs x 2x2 tokens
    assert "k=3" in out and "median of 1" in out
    rows = {name: line for line in out.splitlines() for name in ("plain (no draft)", "EAGLE-style", "Sparrow")
            if line.startswith(name)}
    assert len(rows) == 3
    eagle_keys, sparrow_keys = (int(rows[n].split()[-2].replace(",", "")) for n in ("EAGLE-style", "Sparrow"))
    assert eagle_keys > 24 > 0 < sparrow_keys       # the EAGLE-style draft read the visual tokens too
    assert "identical answers from all three (lossless): True" in out
    tokens = int(re.search(r"\n   (\d+) tokens; prompt", out).group(1))
    assert 1 <= tokens <= 12
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out and not plot.exists()
    else:
        assert plot.stat().st_size > 0 and f"plot: {plot}" in out


@needs_world
def test_short_world_demo_honours_frames_size_and_length(capsys):
    assert main(["demo", "--frames", "12", "--size", "56", "--seed", "5", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "12 frames 56x56" in out


def test_random_demo_honours_frames_and_size(capsys):
    assert main(["demo", "--random", "--frames", "6", "--size", "56", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "video: 6 frames 56x56" in out and "4 tokens" in out


# ----- serve's default models ----------------------------------------------------------------------------
def _serve_settings(*argv: str):
    return app_settings(build_parser().parse_args(["serve", *argv]))


@needs_world
def test_serve_without_model_flags_serves_the_world_pair():
    s = _serve_settings()
    assert (s.target, s.draft) == (str(DEFAULT_MODELS / "target"), str(DEFAULT_MODELS / "draft"))
    line = models_line(s)
    assert str(DEFAULT_MODELS / "target") in line and str(DEFAULT_MODELS / "draft") in line and "RANDOM" not in line


def test_serve_writes_its_kv_memory_at_start_unless_told_not_to():
    s = _serve_settings("--target", "tiny:qwen2_5_vl", "--draft", "none")
    assert s.engine.kv_prefault and s.engine.kv_cache_bytes == 2048 << 20
    s = _serve_settings("--target", "tiny:qwen2_5_vl", "--draft", "none", "--kv-cache-mb", "64", "--no-kv-prefault")
    assert not s.engine.kv_prefault and s.engine.kv_cache_bytes == 64 << 20


def test_random_models_only_when_named(tiny_model_dirs):
    tiny = _serve_settings("--target", "tiny:qwen2_5_vl")
    assert tiny.draft == "tiny" and "RANDOM WEIGHTS" in models_line(tiny)
    given = _serve_settings("--target", str(tiny_model_dirs[0]))
    assert given.draft is None and "no draft" in models_line(given)


@needs_world
def test_serve_out_of_the_box_answers_with_the_world_pair(tmp_path):
    """`sparrow serve` as a user starts it (no model flags): it names the world pair and its
    answer to a world question is the world pair's own."""
    from sparrow import Engine, SamplingParams, SpecConfig
    from sparrow.models import SparrowDraft, TargetModel
    from sparrow.services.client import SparrowClient
    from sparrow.services.protos import pb
    from sparrow.world.scenes import WorldVideo, caption

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "sparrow.cli", "serve", "--port", "0",
                             "--log-format", "text", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        while not (lines and "serving sparrow.v1.Sparrow on" in lines[-1]):
            line = proc.stdout.readline()
            assert line, "server exited: " + "".join(lines)
            lines.append(line)
        startup = "".join(lines)
        assert f"target {DEFAULT_MODELS / 'target'}" in startup and f"draft {DEFAULT_MODELS / 'draft'}" in startup
        assert "Loading weights" not in startup                    # no third-party progress bar
        address = lines[-1].split(" on ")[1].split(" ")[0]
        world = WorldVideo(num_frames=8)
        video = world.make(12)              # a video whose caption the world target gets right
        with SparrowClient(address) as client:
            got = client.generate("describe the video .", data=video.data, max_new_tokens=48,
                                  video_options=pb.VideoOptions(num_frames=8))
    finally:
        proc.terminate()
        proc.wait(30)
    assert proc.returncode == 0                 # SIGTERM (Kubernetes stopping the pod) shuts the server down cleanly
    target = TargetModel.from_pretrained(DEFAULT_MODELS / "target")
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4)
    engine = Engine(target, SparrowDraft.from_pretrained(DEFAULT_MODELS / "draft", target), spec)
    want = engine.generate(video.data, "describe the video .", SamplingParams(max_new_tokens=48), world.options())
    assert got.token_ids == want.token_ids
    assert got.text.strip() == caption(video.events)                  # a right answer, not noise
    engine.close()


def test_help_of_the_world_commands_is_printed_without_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["world", "tune-target", "--help"])
    assert exit_.value.code == 0 and "M-RoPE sections" in capsys.readouterr().out


def test_every_command_runs_by_its_own_name():
    """The parser built for one command (main builds only the one about to run) knows every
    command the whole parser lists, with the same options: `sparrow build-features` once failed
    as an unknown command though `sparrow --help` listed it."""
    whole = dict(_parsers(build_parser()))
    for name in (n.split()[1] for n in whole if n.count(" ") == 1):
        own = dict(_parsers(build_parser(name)))
        assert f"sparrow {name}" in own, f"sparrow {name}: unknown when it is the command to run"
        assert sorted(own[f"sparrow {name}"]._option_string_actions) == sorted(
            whole[f"sparrow {name}"]._option_string_actions), name


def test_heldout_text_never_prints_an_unmeasured_tau():
    from sparrow.training.commands import heldout_text

    assert heldout_text(None) == "held-out tau not measured"
    assert "not measured" in heldout_text({"tau": None, "samples": 0, "skipped": 2})
    assert heldout_text({"tau": 3.25, "samples": 4, "skipped": 0}) == "held-out tau 3.250 (4 samples)"


def test_readme_first_screen_shows_the_long_demo_and_the_ray_deployments():
    repo = Path(__file__).resolve().parents[1]
    readme = (repo / "README.md").read_text()
    first = readme[:readme.index("## Quick start")]
    assert "make demo" in first and "make test" in first and "sparrow demo --long" in first
    assert "identical answers from all three (lossless): True" in first     # a pasted run, not a promise
    assert "identical answers from all three (lossless): True" in (repo / "docs" / "world.md").read_text()
    assert "a DraftDeployment only with `--draft-placement remote`" in (repo / "docs" / "serving.md").read_text()
