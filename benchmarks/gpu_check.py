"""The GPU runbook's figures (`make gpu-check`): a Qwen2.5-VL-7B-shaped text decoder (random
weights, bf16) on CUDA, timed at the two ends of the visual-token ladder:

    plain decode step, verify step of k+1 tokens, Sparrow draft step and commit,
    at 0.5k and 25k cached tokens -> verify(k)/AR step and draft/target step ratios

and, for draft trees (issue 17, item 4: the node budget by measured verify cost, per device):

    the target step scoring N tokens (N = --sizes) at each context, batch 1 and --batch;
    one layer's verify attention alone through each kernel (ragged SDPA as the engine runs it,
    the split-KV Triton kernel, FlexAttention compiled, flash-attn for chains when installed);
    the draft growing a --tree; and from these and the CPU runs' measured tau
    (benchmarks/speculative.json) the decode speedup projected for this GPU (a projection).

Written into BENCHMARKS.md (section "gpu-check") with the card's name. Without CUDA it says
so and writes nothing, so a CPU run never replaces a GPU's figures.

    python -m benchmarks.gpu_check [--out BENCHMARKS.md] [--k 4] [--contexts 512,25000]
        [--sizes 1,2,4,5,8,13,16,32,64] [--tree 2,2,12] [--batch 8] [--taus benchmarks/speculative.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.report import write_section
from benchmarks.step_cost_projection import QWEN7B, kernel_ms, step_costs

SECTION = "gpu-check"


def measure(contexts: list[int], k: int, reps: int, sizes: tuple[int, ...] = (),
            tree: tuple[int, int, int] | None = None) -> list[dict]:
    rows = step_costs(torch.device("cuda"), torch.bfloat16, QWEN7B, contexts, k, reps=reps, sizes=sizes, tree=tree)
    for c in rows:
        c["verify_over_ar"] = c["verify_ms"] / c["decode_ms"]
        c["draft_over_target"] = c["draft_step_ms"] / c["decode_ms"]
        print(f"{c['context']:>6} tokens: AR step {c['decode_ms']:.2f} ms, verify(k+1) {c['verify_ms']:.2f} ms, "
              f"draft step {c['draft_step_ms']:.3f} ms, curve {c['verify_curve']}", flush=True)
    return rows


def table(rows: list[dict], device: str, k: int) -> str:
    lines = [f"{device}, torch {torch.__version__}: random Qwen2.5-VL-7B-shaped text decoder (hidden 3584, 28 "
             f"layers, 28/4 heads, vocab 152064), bf16, static KV cache; Sparrow draft of that width, 1 layer; k = {k}.",
             "", "| cached tokens | AR step ms | verify (k+1) ms | verify / AR | draft step ms | draft commit ms "
                 "| draft / target step |", "|---|---|---|---|---|---|---|"]
    for c in rows:
        lines.append(f"| {c['context']} | {c['decode_ms']:.2f} | {c['verify_ms']:.2f} | {c['verify_over_ar']:.2f} "
                     f"| {c['draft_step_ms']:.3f} | {c['draft_commit_ms']:.3f} | {c['draft_over_target']:.3f} |")
    return "\n".join(lines) + "\n"


def curve_table(rows: list[dict], title: str) -> str:
    """ms of a target step scoring N tokens, and its ratio to a decode step (N = 1)."""
    sizes = sorted(rows[0]["verify_curve"])
    lines = [title, "", "| cached tokens | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for c in rows:
        base = c["verify_curve"].get(1, c["decode_ms"])
        lines.append(f"| {c['context']} | " + " | ".join(
            f"{c['verify_curve'][n]:.2f} ms ({c['verify_curve'][n] / base:.2f}x)" for n in sizes) + " |")
    return "\n".join(lines) + "\n"


def busy_table(rows: list[dict]) -> str:
    """The same steps' GPU kernel time (the host's launches excluded)."""
    sizes = sorted(n for n in rows[0]["kernel_ms"] if isinstance(n, int))
    lines = ["GPU kernel time of the same target steps (torch.profiler, CUDA kernels summed; eager HF steps "
             "above are bound by host launches, this is what a captured or compiled step approaches), ms and x "
             "a decode step:", "", "| cached tokens | " + " | ".join(f"N = {n}" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for c in rows:
        base = c["kernel_ms"][1]
        lines.append(f"| {c['context']} | " + " | ".join(
            f"{c['kernel_ms'][n]:.2f} ({c['kernel_ms'][n] / base:.2f}x)" for n in sizes) + " |")
    return "\n".join(lines) + "\n"


def budget(curve: dict[int, float], within: float = 1.10) -> int:
    """The most tokens a step scores for at most `within` x a decode step's cost: the node
    budget a tree can take for about the price of a chain's verify on this device."""
    curve = {n: ms for n, ms in curve.items() if isinstance(n, int)}        # kernel_ms also holds the draft's
    base = curve[min(curve)]
    return max(n for n, ms in curve.items() if ms <= within * base)


def attention_costs(contexts: list[int], sizes: tuple[int, ...], batches: tuple[int, ...], reps: int,
                    device: str = "cuda") -> list[dict]:
    """One layer of the 7B shape (28 query heads, 4 KV heads, head dim 128, bf16): verify
    attention of N tree tokens over each row's cache through each kernel. A random tree (each
    node's parent earlier), the same for every row; rows of a batch have the same length."""
    from benchmarks.kernels import timed
    from sparrow.kernels.triton_attention import verify_attention_triton
    from sparrow.models.ragged import ragged_attention

    kernels = {"ragged SDPA": None, "triton split-KV": verify_attention_triton}
    # FlexAttention compiles per shape (tens of seconds each): tests/test_gpu.py checks it, not timed here
    dev, gen = torch.device(device), torch.Generator().manual_seed(0)
    rows = []
    for bsz in batches:
        for context in contexts:
            for n in sizes:
                parents = [torch.randint(0, i, (1,), generator=gen).item() if i else -1 for i in range(n)]
                tree = torch.eye(n, dtype=torch.bool)
                for i, p in enumerate(parents):
                    if p >= 0:
                        tree[i] |= tree[p]
                tree = tree.to(dev)
                q = torch.randn(bsz, 28, n, 128, generator=gen).to(dev, torch.bfloat16)
                k, v = (torch.randn(bsz, 4, context + n, 128, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
                prefix = torch.full((bsz,), context, dtype=torch.int64, device=dev)

                def sdpa():
                    for b in range(bsz):                   # the engine's ragged path: one request at a time
                        ragged_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], 128 ** -0.5, tree)
                row = {"batch": bsz, "context": context, "n": n}
                for name, fn in kernels.items():
                    call = sdpa if fn is None else (lambda fn=fn: fn(q, k, v, prefix, tree))
                    try:
                        row[name] = (kernel_ms(call, max(2, reps // 2)) * 1e3 if dev.type == "cuda"
                                     else timed(call, reps, dev) * 1e6)
                    except Exception as e:                 # noqa: BLE001 - a kernel that cannot run here is reported
                        row[name] = f"failed: {type(e).__name__}"
                rows.append(row)
                print(row, flush=True)
    return rows


def attention_table(rows: list[dict]) -> str:
    names = [key for key in rows[0] if key not in ("batch", "context", "n")]
    lines = ["One layer's verify attention alone (28/4 heads, head dim 128, bf16; a random tree of N nodes "
             "per row), microseconds of GPU kernel time per call (torch.profiler; on CPU: wall time):", "",
             "| batch | cached tokens | N | " + " | ".join(names) + " |", "|---|---|---|" + "---|" * len(names)]
    for r in rows:
        cells = [f"{r[m]:.0f}" if isinstance(r[m], float) else r[m] for m in names]
        lines.append(f"| {r['batch']} | {r['context']} | {r['n']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def projection(rows: list[dict], taus_path: str, k: int, tree: tuple[int, int, int]) -> str:
    """Decode speedup projected for this GPU from the CPU runs' measured tau: tau x AR step /
    (draft + verify of the verified tokens + commit), each cost measured here at the nearest
    context. A projection, not a measurement: the 7B target's own tau is unknown."""
    path = Path(taus_path)
    if not path.exists():
        return f"Projection skipped: {taus_path} not found (it holds the CPU runs' tau).\n"
    result = json.loads(path.read_text())
    config = result["config"]
    chain_k = config.get("k", k)
    tree_nodes = (config.get("tree") or tree)[2]
    lines = [f"**Projection, not a measurement**: decode speedup on this GPU if the 7B pair reached the tau the "
             f"world pair measured on the CPU ({taus_path}, {config.get('reps')} reps a length). Chain: k = "
             f"{chain_k}, {chain_k + 1} tokens verified; tree: {tree_nodes} nodes, {tree_nodes + 1} tokens; "
             "round = draft + verify + commit, each measured here: wall time of eager steps (host-launch bound) "
             "and GPU kernel time (launches excluded).", "",
             "| visual tokens | T | method | tau (CPU) | verified tokens | round ms (wall) | projected (wall) "
             "| round ms (kernels) | projected (kernels) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(result["summary"], key=lambda r: (r["temperature"], r["visual_tokens"], r["method"])):
        if r["method"] not in ("sparrow", "sparrow-tree"):
            continue
        c = min(rows, key=lambda c: abs(c["context"] - r["visual_tokens"]))
        chain = r["method"] == "sparrow"
        n = chain_k + 1 if chain else tree_nodes + 1
        draft = c["draft_propose_ms"] if chain else (c["draft_tree_ms"] or c["draft_propose_ms"])
        wall = draft + _interpolate(c["verify_curve"], n) + c["draft_commit_ms"]
        cells = [f"{wall:.2f}", f"{r['tau'] * c['decode_ms'] / wall:.2f}x"]
        busy = c.get("kernel_ms") or {}
        if busy:
            draft = busy["draft_chain"] if chain else busy.get("draft_tree", busy["draft_chain"])
            steps = {m: v for m, v in busy.items() if isinstance(m, int)}
            kern = draft + _interpolate(steps, n) + busy["draft_commit"]
            cells += [f"{kern:.2f}", f"{r['tau'] * steps[1] / kern:.2f}x"]
        else:
            cells += ["-", "-"]
        lines.append(f"| {r['visual_tokens']} | {r['temperature']:g} | {r['method']} | {r['tau']:.2f} | {n} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _interpolate(curve: dict[int, float], n: int) -> float:
    sizes = sorted(curve)
    if n in curve:
        return curve[n]
    lo = max((s for s in sizes if s < n), default=sizes[0])
    hi = min((s for s in sizes if s > n), default=sizes[-1])
    if lo == hi:
        return curve[lo]
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,25000", help="cached tokens, comma list")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sizes", default="", help="tokens per target step for the verify curve, comma list")
    ap.add_argument("--tree", default="2,2,12", help="WIDTH,BRANCH,BUDGET of the draft tree timed")
    ap.add_argument("--batch", type=int, default=0, help="also the verify curve at this batch size (0: no)")
    ap.add_argument("--attention", action="store_true", help="also time one layer's verify attention per kernel")
    ap.add_argument("--attention-only", action="store_true", help="only that (no 7B model)")
    ap.add_argument("--taus", default="benchmarks/speculative.json", help="the CPU runs' results (tau) to project")
    ap.add_argument("--out", help="write the gpu-check section of this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check figures: SKIPPED (no CUDA device); nothing written. On a GPU machine: make gpu-check")
        return 0
    device = torch.cuda.get_device_name(0)
    contexts = [int(x) for x in args.contexts.split(",")]
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    tree = tuple(int(x) for x in args.tree.split(","))
    if args.attention_only:
        print(attention_table(attention_costs([contexts[0], contexts[-1]], tuple(sizes) or (1, 13, 64),
                                              (1, args.batch) if args.batch > 1 else (1,), args.reps)))
        return 0
    rows = measure(contexts, args.k, args.reps, sizes, tree)
    parts = [table(rows, device, args.k)]
    if sizes:
        parts.append(curve_table(rows, "Target step scoring N tokens (batch 1), ms and x a decode step; "
                                       f"tree {args.tree} drafted in " + ", ".join(
                                           f"{c['draft_tree_ms']:.2f} ms at {c['context']}" for c in rows)
                                 + " (the chain's k steps: " + ", ".join(
                                           f"{c['draft_propose_ms']:.2f} ms" for c in rows) + "):"))
        parts.append(busy_table(rows))
        parts.append("Node budget for <= 1.10x a decode step, by GPU kernel time: " + ", ".join(
            f"{budget(c['kernel_ms'])} tokens at {c['context']}" for c in rows) + ".\n")
        if args.batch > 1:
            batched = step_costs(torch.device("cuda"), torch.bfloat16, QWEN7B, [contexts[0], contexts[-1]], args.k,
                                 reps=args.reps, sizes=sizes, batch=args.batch)
            parts.append(busy_table(batched).replace("GPU kernel time of the same target steps",
                                                     f"At batch {args.batch} (every row that long): GPU kernel time"))
            parts.append(f"Node budget per request at batch {args.batch}, <= 1.10x its decode step: " + ", ".join(
                f"{budget(c['kernel_ms'])} tokens at {c['context']}" for c in batched) + ".\n")
        parts.append(projection(rows, args.taus, args.k, tree))
    if args.attention:
        parts.append(attention_table(attention_costs([contexts[0], contexts[-1]], (1, 13, 64),
                                                     (1, args.batch) if args.batch > 1 else (1,), args.reps)))
    body = "\n".join(parts)
    print(body)
    if args.out:
        command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(args.out, SECTION, f"GPU check: 7B-shaped step costs ({device})", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
