"""Step costs of a 7B-shaped target, and the projection they give (--gpu, gpu_check): a random
text decoder's plain decode and verify steps and a Sparrow draft of its hidden size, timed as
wall time and as GPU kernel time, and the decode speedup a measured tau would give."""

from __future__ import annotations

import statistics
import time

import torch

from sparrow import SamplingParams, SpecConfig
from sparrow.models.draft import SparrowDraft

QWEN7B = dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064)


def step_costs(device: torch.device, dtype: torch.dtype, shape: dict, context: int | list[int], k: int,
               reps: int = 20, sizes: tuple[int, ...] = (), tree: tuple[int, int, int] | None = None,
               batch: int = 1) -> dict | list[dict]:
    """Random text decoder of `shape` with `context` tokens cached: ms of a plain decode step,
    a verify step of k+1 tokens, and Sparrow's k draft steps + commit (a draft of that hidden size);
    `sizes`: also the target step scoring that many tokens at once ("verify_curve", ms by size:
    a tree of N nodes is verified as N + 1 tokens; its mask costs what a causal one does);
    `tree` (width, branch, budget): also the draft growing such a tree of depth k ("draft_tree_ms").
    `batch` > 1: the target steps score that many rows at once (each with `context` cached);
    the draft is timed for one request. A list of contexts builds the models once and returns one dict per context."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sparrow.models.draft import DraftConfig

    contexts = context if isinstance(context, list) else [context]
    h = shape["hidden"]
    config = Qwen2Config(hidden_size=h, num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                         num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
                         vocab_size=shape["vocab"], max_position_embeddings=max(contexts) + 1024,
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config).eval()
            draft = SparrowDraft(DraftConfig(
                hidden_size=h, intermediate_size=shape["intermediate"], num_layers=1, num_heads=shape["heads"],
                num_kv_heads=shape["kv_heads"], head_dim=h // shape["heads"], vocab_size=shape["vocab"],
                feature_layers=(2, shape["layers"] // 2, shape["layers"] - 3),
                bridge_layer=shape["layers"] // 2)).eval()
    finally:
        torch.set_default_dtype(old)

    class _Shim:          # what SparrowDraft.bind reads from a target
        num_layers = shape["layers"]
        embed_tokens = staticmethod(lambda: model.model.embed_tokens)
        lm_head = staticmethod(lambda: model.lm_head)
    draft.bind(_Shim())

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    out = [_costs_at(model, draft, device, dtype, shape, n, k, reps, sizes, tree, batch, sync, gen) for n in contexts]
    return out if isinstance(context, list) else out[0]


def _costs_at(model, draft, device, dtype, shape, context, k, reps, sizes, tree, batch, sync, gen) -> dict:
    from sparrow.models.kv_cache import new_kv_cache
    from sparrow.speculative.sparrow_proposer import SparrowProposer
    from sparrow.speculative.draft_context import DraftContext

    h = shape["hidden"]
    kv = new_kv_cache("static", shape["layers"], context + max((k + 1, *sizes)) + 8)
    with torch.inference_mode():
        for start in range(0, context, 2048):
            ids = torch.randint(0, shape["vocab"], (batch, min(2048, context - start)), generator=gen).to(device)
            model(input_ids=ids, cache=kv, use_cache=True, logits_to_keep=1)

        def timed(fn) -> float:
            fn()                                      # warm-up
            times = []
            for _ in range(reps):
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)

        def target_step(n):
            def run():
                model(input_ids=torch.randint(0, shape["vocab"], (batch, n), generator=gen).to(device),
                      cache=kv, use_cache=True)
                kv.crop(-n)
            return run

        decode_ms, verify_ms = timed(target_step(1)), timed(target_step(k + 1))
        curve = {n: timed(target_step(n)) for n in sizes}
        # Eager HF steps on a GPU are bound by kernel launches from the host: the GPU's own busy
        # time per step (kernels summed, what CUDA graphs / a compiled step would approach).
        profiled = max(2, reps // 4)       # the profiler's own cost per step is large; kernel times are steady
        busy = ({n: kernel_ms(target_step(n), profiled) for n in sorted({1, k + 1, *sizes})}
                if device.type == "cuda" else {})
        nf = len(draft.config.feature_layers) * h
        ctx = DraftContext(torch.randint(0, shape["vocab"], (96,), generator=gen).to(device),   # 64 prompt + 32 more
                           torch.randn(96, nf, generator=gen).to(device, dtype), 64,
                           torch.zeros(0, h, device=device, dtype=dtype))
        proposer = SparrowProposer(draft, SpecConfig(num_draft_tokens=k))
        state = proposer.begin_context(ctx)
        sampling = SamplingParams()
        propose_ms = timed(lambda: proposer.propose_one(state, k, sampling, gen))
        tree_ms = None
        if tree is not None:
            width, branch, budget = tree
            grower = SparrowProposer(draft, SpecConfig(num_draft_tokens=k, tree_width=width, tree_branch=branch,
                                                       tree_budget=budget))
            grown = grower.begin_context(ctx)
            def grow():
                grower.propose_one(grown, k, sampling, gen)
                grown.kv.truncate(grown.committed)          # what the commit would drop first
            tree_ms = timed(grow)
        feats = torch.randn(2, nf, generator=gen).to(device, dtype)
        commit_ms = timed(lambda: proposer.commit_one(state, [1, 2], feats))
        if device.type == "cuda":
            busy["draft_chain"] = kernel_ms(lambda: proposer.propose_one(state, k, sampling, gen), profiled)
            busy["draft_commit"] = kernel_ms(lambda: proposer.commit_one(state, [1, 2], feats), profiled)
            if tree is not None:
                busy["draft_tree"] = kernel_ms(grow, profiled)
    print(f"  {context} cached tokens x {batch}: decode {decode_ms:.2f} ms, kernels {busy}", flush=True)
    return {"decode_ms": decode_ms, "verify_ms": verify_ms, "draft_propose_ms": propose_ms,
            "draft_step_ms": propose_ms / k, "draft_commit_ms": commit_ms, "context": context, "k": k,
            "verify_curve": curve, "draft_tree_ms": tree_ms, "batch": batch, "kernel_ms": busy}


def kernel_ms(fn, reps: int) -> float:
    """ms of GPU kernel time per call of fn (CUDA kernels summed over reps calls, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(getattr(e, "device_time", 0.0) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    return total_us / 1e3 / reps


def gpu_mode(k: int, taus: list[float], context: int = 25_000) -> dict:
    if not torch.cuda.is_available():
        print("--gpu: skipped (torch.cuda.is_available() is False)")
        return {"skipped": "torch.cuda.is_available() is False"}
    costs = step_costs(torch.device("cuda"), torch.bfloat16, QWEN7B, context, k)
    costs["device"] = torch.cuda.get_device_name(0)
    costs["ratio"] = costs["draft_step_ms"] / costs["decode_ms"]
    round_ms = costs["draft_propose_ms"] + costs["verify_ms"] + costs["draft_commit_ms"]
    costs["projection"] = {f"{t:.2f}": t * costs["decode_ms"] / round_ms for t in taus}
    return costs


def gpu_lines(g: dict) -> list[str]:
    if "skipped" in g:
        return [f"GPU mode: skipped ({g['skipped']}).", ""]
    lines = [f"GPU ({g['device']}): random Qwen2.5-VL-7B-shaped text decoder, bf16, {g['context']} tokens in the KV "
             f"cache; Sparrow draft of that hidden size, 1 layer, k = {g['k']}.", "",
             "| plain decode step ms | verify (k+1) ms | draft step ms | draft commit ms | draft / target step |",
             "|---|---|---|---|---|",
             f"| {g['decode_ms']:.2f} | {g['verify_ms']:.2f} | {g['draft_step_ms']:.2f} | {g['draft_commit_ms']:.2f} "
             f"| {g['ratio']:.3f} |", "",
             "Projection (not a measurement): decode speedup = tau x decode step / (k draft steps + verify + commit): "
             + ", ".join(f"tau {t}: {s:.2f}x" for t, s in g["projection"].items()) + ".", ""]
    return lines
