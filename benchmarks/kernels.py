"""Attention backends timed on the two shapes Sparrow runs, at 0.5k / 8k / 25k cached tokens.

    verify   nq = k + 1 tokens (chain) over the whole cached prefix: memory-bound, so each row
             also reports the bandwidth it achieved (bytes of K and V read / time) and that as a
             fraction of the device's measured copy bandwidth
    draft    1 or k queries over anchors + window + glimpse keys: the same at every context
             length; the "sdpa, all keys" rows show what a draft attending the full context pays

One attention layer with Qwen2.5-VL-7B's text shape (28 query heads, 4 kv heads, dim 128), batch 1.
CPU: fp32, Triton in its interpreter (correct, not fast: timed up to 1k cached tokens only),
FlexAttention eager unless --flex-compile (compiling costs ~18 s per shape on 2 cores).
GPU: bf16, compiled FlexAttention, Triton compiled, flash-attn if installed.

    python -m benchmarks.kernels [--tokens 512 8192 25000] [--repeat 5] [--threads N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")    # before anything imports triton (torch._dynamo does)

from benchmarks.report import write_section  # noqa: E402
from sparrow.kernels.packed import verify_attention_packed  # noqa: E402
from sparrow.kernels.reference import verify_attention_ref, window_attention_ref  # noqa: E402
from sparrow.kernels.split_kv import verify_attention_split  # noqa: E402
from sparrow.models.attention import available_backends, get_backend  # noqa: E402
from sparrow.anchored_window import window_mask  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128          # Qwen2.5-VL-7B text attention
DRAFT_TOKENS = 4
ANCHORS, WINDOW, GLIMPSE = 64, 32, 16
INTERPRETER_MAX_KEYS = 1024                     # the Triton interpreter takes ~25 s per call at 25k keys


# ----- inputs -------------------------------------------------------------------------------------

def verify_inputs(n_cached: int, dtype: torch.dtype, device: torch.device):
    """q (1, H, k+1, D); a cache of n_cached + k + 1 rows already holding the draft tokens."""
    nq = DRAFT_TOKENS + 1
    q = torch.randn(1, HEADS, nq, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, KV_HEADS, n_cached + nq, HEAD_DIM, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, torch.tensor([n_cached], device=device)


def window_inputs(nq: int, dtype: torch.dtype, device: torch.device):
    """Draft keys as the proposer keeps them: glimpse (pos -1), anchors, the window, nq new entries."""
    recent = torch.arange(1000 - WINDOW, 1000 + nq)
    pos = torch.cat([torch.full((GLIMPSE,), -1), torch.arange(ANCHORS), recent]).to(device)             # (nk,)
    pinned = torch.cat([torch.ones(GLIMPSE + ANCHORS, dtype=torch.bool),
                        torch.zeros(recent.shape[0], dtype=torch.bool)]).to(device)
    q = torch.randn(1, HEADS, nq, HEAD_DIM, device=device, dtype=dtype)
    k = torch.randn(1, KV_HEADS, pos.shape[0], HEAD_DIM, device=device, dtype=dtype)
    return q, k, torch.randn_like(k), pos[-nq:], pos, pinned


# ----- backends -------------------------------------------------------------------------------------

def verify_backends(device: torch.device, flex_compile: bool) -> dict:
    """name -> fn(q, k_cache, v_cache, prefix_lens). Optional ones only where importable."""
    fns = {"sdpa + dense mask": verify_attention_ref,
           "packed (prefix unmasked + own mask)": verify_attention_packed,
           "torch split-KV": lambda q, k, v, p: verify_attention_split(q, k, v, p, num_splits=8)}
    if "flex" in available_backends():
        from sparrow.kernels.flex import verify_attention_flex
        fns["flex" + (" (compiled)" if flex_compile else " (eager)")] = (
            lambda q, k, v, p: verify_attention_flex(q, k, v, p, compile=flex_compile))
    if "triton" in available_backends():
        from sparrow.kernels.triton_attention import verify_attention_triton
        fns["triton split-KV" + ("" if device.type == "cuda" else " (interpreter)")] = verify_attention_triton
    if "flash_attn" in available_backends() and device.type == "cuda":
        from sparrow.kernels.flash import verify_attention_flash
        fns["flash-attn kvcache"] = verify_attention_flash
    return fns


def window_backends(device: torch.device, flex_compile: bool) -> dict:
    """name -> fn(q, k, v, q_pos, k_pos, k_pinned): the registry backends get the dense (nq, nk) mask."""
    def registry(name):
        attn = get_backend(name)
        return lambda q, k, v, qp, kp, pin: attn(q, k, v, window_mask(qp, kp, pin, WINDOW))

    fns = {"sdpa + mask (today's default)": registry("sdpa"), "eager + mask": registry("eager"),
           "torch gather reference": lambda q, k, v, qp, kp, pin: window_attention_ref(q, k, v, qp, kp, pin, WINDOW)}
    if "flex" in available_backends():
        from sparrow.kernels.flex import window_attention_flex
        fns["flex" + (" (compiled)" if flex_compile else " (eager)")] = (
            lambda q, k, v, qp, kp, pin: window_attention_flex(q, k, v, qp, kp, pin, WINDOW, compile=flex_compile))
    if "triton" in available_backends():
        from sparrow.kernels.triton_attention import window_attention_triton
        fns["triton window" + ("" if device.type == "cuda" else " (interpreter)")] = (
            lambda q, k, v, qp, kp, pin: window_attention_triton(q, k, v, qp, kp, pin, WINDOW))
    return fns


# ----- timing -----------------------------------------------------------------------------------------

def timed(fn, repeat: int, device: torch.device) -> float:
    """Median seconds of `repeat` calls after two warm-up calls (compile, caches)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), the ceiling to compare with."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    src = torch.empty(n, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), 5, device)


def kv_bytes(k: torch.Tensor, n_keys: int) -> int:
    return 2 * k.shape[0] * k.shape[1] * n_keys * k.shape[-1] * k.element_size()


# ----- report ---------------------------------------------------------------------------------------------

def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    return (f"{model}, {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), load average "
            f"{os.getloadavg()[0]:.1f} at start, no GPU, torch {torch.__version__}")


def verify_table(args, device, dtype, bw) -> list[str]:
    rows = ["| cached tokens | backend | time (ms) | KV read (MB) | achieved GB/s | of copy BW |",
            "|---|---|---|---|---|---|"]
    for n in args.tokens:
        q, k, v, prefix = verify_inputs(n, dtype, device)
        ref = verify_attention_ref(q, k, v, prefix)
        nbytes = kv_bytes(k, n + q.shape[2])
        for name, fn in verify_backends(device, args.flex_compile).items():
            if "interpreter" in name and n > INTERPRETER_MAX_KEYS:
                rows.append(f"| {n} | {name} | skipped: interpreter, not a speed | | | |")
                continue
            torch.testing.assert_close(fn(q, k, v, prefix).float(), ref.float(), atol=2e-2, rtol=2e-2)
            t = timed(lambda: fn(q, k, v, prefix), args.repeat, device)
            gbs = nbytes / t / 1e9
            rows.append(f"| {n} | {name} | {t * 1e3:.2f} | {nbytes / 1e6:.1f} | {gbs:.1f} | {gbs * 1e9 / bw:.0%} |")
        print(rows[-1], file=sys.stderr)
    return rows


def draft_table(args, device, dtype) -> list[str]:
    rows = ["| queries | backend | keys | time (ms) |", "|---|---|---|---|"]
    for nq in (1, DRAFT_TOKENS):
        q, k, v, qp, kp, pin = window_inputs(nq, dtype, device)
        ref = window_attention_ref(q, k, v, qp, kp, pin, WINDOW)
        for name, fn in window_backends(device, args.flex_compile).items():
            torch.testing.assert_close(fn(q, k, v, qp, kp, pin).float(), ref.float(), atol=2e-2, rtol=2e-2)
            t = timed(lambda: fn(q, k, v, qp, kp, pin), args.repeat, device)
            rows.append(f"| {nq} | {name} | {k.shape[2]} | {t * 1e3:.2f} |")
        for n in args.tokens:      # a draft that attends to every cached token instead of the window
            q2, k2, v2, _ = verify_inputs(n, dtype, device)
            q2 = q2[:, :, :nq].contiguous()
            t = timed(lambda: F.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True), args.repeat, device)
            rows.append(f"| {nq} | sdpa, all {n} cached keys (full-attention draft) | {k2.shape[2]} | {t * 1e3:.2f} |")
        print(rows[-1], file=sys.stderr)
    return rows


def draft_step_table(args, device, dtype) -> list[str]:
    """k draft steps of the tiny test draft (launch-bound, like any 1-layer draft on a GPU):
    the current proposer path against the static step, eager and (CUDA only) graph-replayed."""
    from benchmarks.draft_graph import DraftDecodeStep
    from sparrow.tiny import tiny_draft, tiny_target

    target = tiny_target("qwen2_5_vl", seed=0)
    target.hf.to(device, dtype)
    draft = tiny_draft(target)
    _, _, _, _, pos, pinned = window_inputs(1, dtype, device)
    pos, pinned = pos[:-1], pinned[:-1]                               # the context before drafting
    kv = draft.new_kv(pos.shape[0] + DRAFT_TOKENS)                  # empty, on the device
    with torch.inference_mode():
        z = torch.randn(pos.shape[0], draft.config.hidden_size, device=device, dtype=dtype)
        hidden = draft.forward_entries(z, pos, pinned, kv, WINDOW)[-1:]                  # (1, hidden)
    token, first = torch.tensor([7], device=device), int(pos.max()) + 1
    no_pin = torch.zeros(1, dtype=torch.bool, device=device)

    def proposer_path():                     # what SparrowProposer.propose runs today, per step
        with torch.inference_mode():
            n = len(kv)
            for j in range(DRAFT_TOKENS):
                draft.forward_entries(draft.inputs_from_draft(token, hidden), torch.tensor([first + j], device=device),
                                      no_pin, kv, WINDOW)
            kv.truncate(n)

    rows = [f"| path | {DRAFT_TOKENS} draft steps (ms) |", "|---|---|",
            f"| forward_entries (today's proposer) | {timed(proposer_path, args.repeat, device) * 1e3:.2f} |"]
    for graph in ([False, True] if device.type == "cuda" else [False]):
        step = DraftDecodeStep(draft, capacity=len(kv) + DRAFT_TOKENS, window=WINDOW, use_graph=graph)

        def static_path():
            step.load(kv)
            for j in range(DRAFT_TOKENS):
                step.step(token, hidden, first + j)

        label = "static step, CUDA graph" if graph else "static step, eager"
        rows.append(f"| {label} (incl. load) | {timed(static_path, args.repeat, device) * 1e3:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 8192, 25000])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--flex-compile", action="store_true", default=torch.cuda.is_available())
    parser.add_argument("--threads", type=int, help="CPU threads for torch (on a shared, loaded machine use 1: "
                                                    "OpenMP threads spinning against other processes cost 100x)")
    parser.add_argument("--out", help="write the 'kernels' section of this report (BENCHMARKS.md)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    bw = copy_bandwidth(device)
    command = f"python -m benchmarks.kernels {' '.join(argv if argv is not None else sys.argv[1:])}"
    lines = [f"Machine: {machine(device)}; dtype {str(dtype).removeprefix('torch.')}; "
             f"copy bandwidth {bw / 1e9:.1f} GB/s (read + write).",
             "", f"Verify: {DRAFT_TOKENS + 1} tokens (chain) over the cache, one layer, "
             f"{HEADS} heads / {KV_HEADS} kv heads / dim {HEAD_DIM}.", ""]
    lines += verify_table(args, device, dtype, bw)
    lines += ["", f"Draft window: anchors {ANCHORS} + window {WINDOW} + glimpse {GLIMPSE} keys, same heads.", ""]
    lines += draft_table(args, device, dtype)
    lines += ["", f"Draft decode step, tiny test draft (hidden 64, 1 layer), {DRAFT_TOKENS} steps; "
              "the graph row exists only on CUDA.", ""]
    lines += draft_step_table(args, device, dtype)
    text = "\n".join(lines)
    print(text)
    if args.out:
        title = "Attention kernels" + ("" if device.type == "cuda" else " (CPU only: no GPU was available for this work)")
        write_section(args.out, "kernels", title, command, text)


if __name__ == "__main__":
    main()
