"""The geometry a draft was trained with (window, anchors, glimpse, k, context) travels in its
checkpoint and is what an engine, a default server and a settings file run it with unless a
field is set explicitly."""

from __future__ import annotations

import json

import pytest
import yaml

from sparrow import Engine, SpecConfig
from sparrow.models.draft import CONFIG_NAME, GEOMETRY_KEYS, SparrowDraft
from sparrow.services import ray_entry
from sparrow.services.cli import build_parser
from sparrow.services.cli_serve import app_settings, models_line
from sparrow.services.settings import AppSettings, build_engine
from sparrow.tiny import tiny_draft
from sparrow.training.world_demo import DEFAULT_MODELS

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
    assert (trained["window"], trained["anchors"]) == (16, 32)          # training/world_data.py
    settings = app_settings(build_parser().parse_args(["serve"]))
    assert settings.spec_given == frozenset() and "as the draft was trained" in models_line(settings)
    spec = build_engine(settings)[0].spec
    assert {k: getattr(spec, k) for k in GEOMETRY_KEYS} == trained
    with_k = app_settings(build_parser().parse_args(["serve", "--k", "2"]))
    assert with_k.spec_given == {"num_draft_tokens"} and "k=2" in models_line(with_k)
    assert build_engine(with_k)[0].spec.num_draft_tokens == 2
