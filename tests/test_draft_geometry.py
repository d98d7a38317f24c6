"""The geometry a draft was trained with (window, anchors, glimpse, k, context) travels in its
checkpoint and is what an engine, a default server and a settings file run it with unless a
field is set explicitly."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import yaml

from sparrow import Engine, SpecConfig
from sparrow.models.draft import CONFIG_NAME, GEOMETRY_KEYS, SparrowDraft
from sparrow.services import ray_entry
from sparrow.cli.main import build_parser
from sparrow.cli.serve import app_settings, models_line
from sparrow.services.settings import AppSettings, build_engine
from sparrow.tiny import tiny_draft
from sparrow.world.pair_demo import DEFAULT_MODELS

TRAINED = {"window": 6, "anchors": 5, "glimpse": 2, "num_draft_tokens": 3, "draft_context": "text"}


@pytest.fixture(scope="module")
def trained_draft_dir(tmp_path_factory, qwen_target):
    draft = tiny_draft(qwen_target, seed=1)
    draft.trained_with = dict(TRAINED)
    path = tmp_path_factory.mktemp("draft")
    draft.save_pretrained(path)
    return path


def test_the_geometry_round_trips_through_the_checkpoint(trained_draft_dir, qwen_target):
    assert json.loads((trained_draft_dir / CONFIG_NAME).read_text())["trained_with"] == TRAINED
    loaded = SparrowDraft.from_pretrained(trained_draft_dir, qwen_target)
    assert loaded.trained_with == TRAINED
    spec = Engine(qwen_target, loaded).spec                         # no spec: the draft's geometry
    assert {k: getattr(spec, k) for k in GEOMETRY_KEYS} == TRAINED
    assert Engine(qwen_target, loaded, SpecConfig(window=9)).spec.window == 9    # a spec given wins whole
    assert SpecConfig(anchors=7).with_geometry(TRAINED, {"anchors"}).anchors == 7
    untrained = tiny_draft(qwen_target, seed=2)
    assert untrained.trained_with == {} and Engine(qwen_target, untrained).spec == SpecConfig()


def test_a_server_runs_the_drafts_geometry_unless_a_field_is_set(trained_draft_dir, tmp_path):
    settings = AppSettings(target="tiny:qwen2_5_vl", draft=str(trained_draft_dir))
    engine, _ = build_engine(settings)
    assert (engine.spec.window, engine.spec.anchors, engine.spec.glimpse, engine.spec.num_draft_tokens) == (6, 5, 2, 3)
    assert engine.proposer.spec == engine.spec                        # the proposer drafts with it too
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({"target": "tiny:qwen2_5_vl", "draft": str(trained_draft_dir),
                                    "spec": {"window": 12}}))
    from_file = ray_entry.settings_from_args({"settings_file": str(path)})
    assert from_file.spec_given == {"window"}
    spec = build_engine(from_file)[0].spec
    assert (spec.window, spec.anchors, spec.num_draft_tokens) == (12, 5, 3)


def test_a_default_server_runs_the_world_draft_as_trained():
    if not (DEFAULT_MODELS / "draft" / CONFIG_NAME).is_file():
        pytest.skip("no committed world pair")
    trained = json.loads((DEFAULT_MODELS / "draft" / CONFIG_NAME).read_text())["trained_with"]
    assert (trained["window"], trained["anchors"]) == (16, 32)          # world/draft_data.py
    settings = app_settings(build_parser().parse_args(["serve"]))
    assert settings.spec_given == frozenset() and "as the draft was trained" in models_line(settings)
    spec = build_engine(settings)[0].spec
    assert {k: getattr(spec, k) for k in GEOMETRY_KEYS} == trained
    with_k = app_settings(build_parser().parse_args(["serve", "--k", "2"]))
    assert with_k.spec_given == {"num_draft_tokens"} and "k=2" in models_line(with_k)
    assert build_engine(with_k)[0].spec.num_draft_tokens == 2


def test_the_tools_that_measure_a_draft_at_a_fixed_k_run_its_geometry(monkeypatch):
    """`world eval` / `benchmarks.world_accuracy` (tau_rows), `world compare-drafts`, `make demo` and the long
    demo build their spec with SpecConfig.as_trained: the draft's window, anchors and glimpse at
    the k asked for (tau_rows once ran the world draft without the glimpse it was trained with)."""
    from sparrow.world import draft_data as world_data

    trained = {"window": 12, "anchors": 5, "glimpse": 8, "num_draft_tokens": 3}
    spec = SpecConfig.as_trained(trained, 4, adaptive_k=False)
    assert (spec.window, spec.anchors, spec.glimpse, spec.num_draft_tokens, spec.adaptive_k) == (12, 5, 8, 4, False)
    seen = []

    def held_out_tau(target, draft, samples, spec, *args, **kwargs):     # what tau_rows runs, recorded
        seen.append(spec)
        return SimpleNamespace(mean_acceptance_length=1.0, accepted_per_step=0.0, acceptance_rate_per_position=[])

    monkeypatch.setattr(world_data, "held_out_tau", held_out_tau)
    monkeypatch.setattr(world_data, "caption_samples", lambda world, seeds: [])
    monkeypatch.setattr(world_data, "untrained_like", lambda draft, target: draft)
    world_data.tau_rows(None, SimpleNamespace(trained_with=trained), SimpleNamespace(options=lambda: None), [], k=4)
    assert [(s.glimpse, s.window, s.anchors, s.num_draft_tokens) for s in seen] == [(8, 12, 5, 4)] * 2
