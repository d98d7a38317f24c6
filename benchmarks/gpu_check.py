"""The GPU runbook's figures (`make gpu-check`): a Qwen2.5-VL-7B-shaped text decoder (random
weights, bf16) on CUDA, timed at the two ends of the visual-token ladder:

    plain decode step, verify step of k+1 tokens, Sparrow draft step and commit,
    at 0.5k and 25k cached tokens -> verify(k)/AR step and draft/target step ratios

Written into BENCHMARKS.md (section "gpu-check") with the card's name. Without CUDA it says
so and writes nothing, so a CPU run never replaces a GPU's figures.

    python -m benchmarks.gpu_check [--out BENCHMARKS.md] [--k 4] [--contexts 512,25000]
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.report import write_section
from benchmarks.speculative import QWEN7B, step_costs

SECTION = "gpu-check"


def measure(contexts: list[int], k: int, reps: int) -> list[dict]:
    rows = []
    for context in contexts:
        c = step_costs(torch.device("cuda"), torch.bfloat16, QWEN7B, context, k, reps=reps)
        c["verify_over_ar"] = c["verify_ms"] / c["decode_ms"]
        c["draft_over_target"] = c["draft_step_ms"] / c["decode_ms"]
        rows.append(c)
        print(f"{context:>6} tokens: AR step {c['decode_ms']:.2f} ms, verify(k+1) {c['verify_ms']:.2f} ms, "
              f"draft step {c['draft_step_ms']:.3f} ms", flush=True)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="512,25000", help="cached tokens, comma list")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", help="write the gpu-check section of this markdown file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check figures: SKIPPED (no CUDA device); nothing written. On a GPU machine: make gpu-check")
        return 0
    device = torch.cuda.get_device_name(0)
    rows = measure([int(x) for x in args.contexts.split(",")], args.k, args.reps)
    body = table(rows, device, args.k)
    print(body)
    if args.out:
        command = "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:])
        write_section(args.out, SECTION, f"GPU check: 7B-shaped step costs ({device})", command, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
