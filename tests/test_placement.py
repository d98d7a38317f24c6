"""dtype / device / device_map: from settings files and CLI flags down to the loaded models."""

import importlib.util

import pytest
import torch
import yaml

from sparrow.errors import InvalidRequest
from sparrow.models.placement import check_placement, parse_device, parse_dtype
from sparrow.services import ray_entry
from sparrow.cli.main import build_parser
from sparrow.cli.serve import app_settings, models_line
from sparrow.services.models import load_draft, load_heads, load_target
from sparrow.services.settings import AppSettings, build_engine
from sparrow.tiny import tiny_draft


def test_settings_file_round_trips_and_reaches_the_models(tmp_path):
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump({"target": "tiny:qwen2_5_vl", "draft": "tiny", "dtype": "bfloat16",
                                    "device": "cpu", "spec": {"num_draft_tokens": 3}}))
    settings = ray_entry.settings_from_args({"settings_file": str(path)})
    assert (settings.dtype, settings.device, settings.device_map) == ("bfloat16", "cpu", None)
    engine, _ = build_engine(settings)
    assert engine.target.hf.dtype == torch.bfloat16
    assert {p.dtype for p in engine.proposer.draft.parameters()} == {torch.bfloat16}
    assert {p.device for p in engine.proposer.draft.parameters()} == {engine.target.device}
    inline = ray_entry.settings_from_args({"settings_file": str(path), "dtype": "float32"})   # inline args win
    assert build_engine(inline)[0].target.hf.dtype == torch.float32
    assert engine.target.verify_attention == "auto"                                       # CPU: packed
    assert engine.target.step_kernel().__name__ == "verify_attention_packed"
    split = build_engine(ray_entry.settings_from_args({"settings_file": str(path), "verify_attention": "split"}))[0]
    assert split.target.verify_attention == "split"
    assert split.target.step_kernel().__name__ == "verify_attention_split"


def test_verify_attention_auto_follows_the_device(qwen_target):
    """"auto": the packed kernel on CPU; the Triton kernel once the model is on CUDA (where triton is)."""
    before = qwen_target.verify_attention
    qwen_target.verify_attention = "auto"
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        import copy
        target = copy.deepcopy(qwen_target)
        target.hf.to("cuda")
        assert target.step_kernel().__name__ == "verify_attention_triton"
        target.hf.to("cpu")
        assert target.step_kernel().__name__ == "verify_attention_packed"
    else:
        assert qwen_target.step_kernel().__name__ == "verify_attention_packed"
    qwen_target.verify_attention = "split"
    try:
        assert qwen_target.step_kernel().__name__ == "verify_attention_split"
    finally:
        qwen_target.verify_attention = before


def test_serve_flags_become_settings():
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "--device", "auto", "--device-map", "auto"])
    settings = app_settings(args)
    assert (settings.dtype, settings.device, settings.device_map) == ("bfloat16", "auto", "auto")
    defaults = app_settings(build_parser().parse_args(["serve"]))
    assert (defaults.dtype, defaults.device, defaults.device_map) == ("float32", "cpu", None)
    assert defaults.verify_attention == "auto"
    assert app_settings(build_parser().parse_args(["serve", "--verify-attention", "triton"])).verify_attention == "triton"
    assert defaults.spec.draft_step == "static"
    compiled = app_settings(build_parser().parse_args(["serve", "--draft-step", "compiled", "--k", "3"]))
    assert (compiled.spec.draft_step, compiled.spec.num_draft_tokens) == ("compiled", 3)
    assert "compiled draft steps" in models_line(compiled)
    assert defaults.target_step == "compiled"            # a server compiles its steps; --target-step eager does not
    assert app_settings(build_parser().parse_args(["serve", "--target-step", "eager"])).target_step == "eager"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--target-step", "fast"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--verify-attention", "flash"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dtype", "float8"])
    for command in (["train-draft", "--target", "t", "--data", "d", "--out", "o"], ["world", "eval", "--target", "t"],
                    ["world", "demo"], ["demo"]):
        assert build_parser().parse_args([*command, "--dtype", "bfloat16"]).dtype == "bfloat16"


@pytest.mark.parametrize("bad", [dict(dtype="float8"), dict(device="gpu0"), dict(device_map="everywhere"),
                                 dict(verify_attention="flash"), dict(target_step="fast")])
def test_bad_placement_settings_are_refused(bad):
    with pytest.raises((InvalidRequest, ValueError)):
        AppSettings(target="tiny:qwen2_5_vl", **bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a CPU-only machine gives")
def test_cuda_on_a_machine_without_one_is_a_clear_error():
    check_placement("bfloat16", "cuda")              # a Ray head without GPUs may check a GPU replica's settings
    assert parse_device("auto") == torch.device("cpu")
    with pytest.raises(InvalidRequest, match="no CUDA device"):
        load_target("tiny:qwen2_5_vl", "bfloat16", "cuda")


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is not None, reason="accelerate installed")
def test_device_map_without_accelerate_is_a_clear_error(tmp_path, qwen_target):
    qwen_target.save_pretrained(tmp_path)
    with pytest.raises(InvalidRequest, match="accelerate"):
        load_target(str(tmp_path), "bfloat16", device_map="auto")


def test_saved_sharded_checkpoint_loads_in_bf16_with_draft_and_heads(tmp_path, qwen_target):
    qwen_target.save_pretrained(tmp_path / "target", max_shard_size="200KB")
    assert len(list((tmp_path / "target").glob("model-*.safetensors"))) > 1        # really sharded
    tiny_draft(qwen_target).save_pretrained(tmp_path / "draft")
    target = load_target(str(tmp_path / "target"), "bfloat16", "cpu")
    assert target.hf.dtype == torch.bfloat16 and parse_dtype("auto") == "auto"
    draft = load_draft(str(tmp_path / "draft"), target)
    assert {p.dtype for p in draft.parameters()} == {torch.bfloat16}
    heads = load_heads(str(tmp_path / "target"), "bfloat16", "cpu")     # a draft replica's view: no target
    assert heads.embed.weight.dtype == heads.head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(heads.embed.weight, target.embed_tokens().weight, atol=0, rtol=0)
    torch.testing.assert_close(heads.head.weight, target.lm_head().weight, atol=0, rtol=0)
    remote = load_draft(str(tmp_path / "draft"), heads)
    assert {p.dtype for p in remote.parameters()} == {torch.bfloat16}
    kept = load_target(str(tmp_path / "target"), "auto")                # the checkpoint's own dtype
    assert kept.hf.dtype == torch.float32


def test_gpu_settings_of_the_k8s_base_load_on_a_cpu_machine_as_cpu():
    """The gpu overlay's settings (k8s/base/settings.yaml): bfloat16, device auto, so a replica
    Ray gives no GPU (the draft's) loads on the CPU instead of failing."""
    data = yaml.safe_load(open("k8s/base/settings.yaml"))
    settings = ray_entry.settings_from_args(data)
    assert (settings.dtype, settings.device) == ("bfloat16", "auto")
    if not torch.cuda.is_available():
        assert parse_device(settings.device) == torch.device("cpu")


def test_remote_placement_cuts_the_drafts_q_unless_told():
    """A remote draft's sampled rounds carry q: the remote placement draws from a cut q
    (REMOTE_DRAFT_CUT), one spec for replicas and fallback; a spec that sets its own cut, and
    the colocated placement, keep theirs."""
    from sparrow import SpecConfig
    from sparrow.services.settings import REMOTE_DRAFT_CUT

    remote = AppSettings(target="tiny:qwen2_5_vl", draft="tiny", draft_placement="remote")
    assert (remote.spec.draft_mass, remote.spec.draft_max_candidates) == tuple(REMOTE_DRAFT_CUT.values())
    colocated = AppSettings(target="tiny:qwen2_5_vl", draft="tiny")
    assert (colocated.spec.draft_mass, colocated.spec.draft_max_candidates) == (1.0, 0)
    own = AppSettings(target="tiny:qwen2_5_vl", draft="tiny", draft_placement="remote",
                      spec=SpecConfig(adaptive_k=False, draft_mass=0.9))
    assert (own.spec.draft_mass, own.spec.draft_max_candidates) == (0.9, 0)


def test_every_draft_process_warms_its_compiled_steps_before_it_serves(qwen_target, monkeypatch):
    """A colocated draft (build_engine) and a remote draft replica (DraftDeployment) both get
    their proposer from warmed_proposer, which compiles the greedy chains of the batch sizes the
    server runs (up to max_concurrent) when the draft steps are compiled."""
    import dataclasses
    import inspect

    from sparrow.config import SpecConfig
    from sparrow.services import ray_app, settings as settings_module
    from sparrow.speculative.sparrow_proposer import SparrowProposer

    warmed = []
    monkeypatch.setattr(SparrowProposer, "warm_up", lambda self, sizes: (warmed.append((self.spec.draft_step, sizes)), 1.0)[1])
    settings = app_settings(build_parser().parse_args(["serve", "--target", "tiny:qwen2_5_vl", "--draft", "tiny",
                                                       "--draft-step", "compiled"]))
    settings = dataclasses.replace(settings, service=dataclasses.replace(settings.service, max_concurrent=4))
    engine, _ = build_engine(settings)
    assert warmed == [("compiled", (1, 2, 4))]
    settings_module.warmed_proposer(tiny_draft(qwen_target), SpecConfig(draft_step="static"), settings)
    assert warmed[-1] == ("static", (1, 2, 4))             # (warm_up itself does nothing for eager steps)
    assert "warmed_proposer(" in inspect.getsource(ray_app.DraftDeployment.func_or_class.__init__)
