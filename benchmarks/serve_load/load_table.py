"""A load run as markdown (the BENCHMARKS.md section) and as a plot."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.serve_load.load_stats import PCTS
from benchmarks.world_videos import visual_tokens

HEAD = ("load", "method", "requests (failed)", "prefix hits", "out tok/s", "x plain", "TTFT p50/p95/p99 ms",
        "ITL p50/p95/p99 ms", "TPOT p50/p95/p99 ms", "E2E p50/p95/p99 s", "goodput req/s (share)", "tau")


def _three(row: dict, name: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    return "/".join(fmt.format(row[f"{name}_p{q}"] * scale) for q in PCTS)


def _load(row: dict) -> str:
    return f"{row['load']:g} req/s" if row["mode"] == "rate" else f"{row['load']} clients"


def table(runs: list[dict], methods: list[str]) -> str:
    """A row per (load, method): rates first, then concurrencies, each method in `methods` order."""
    plain = {(r["mode"], r["load"]): r for r in runs if r["method"] == "plain"}
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in sorted(runs, key=lambda r: (r["mode"] != "rate", r["load"], methods.index(r["method"]))):
        base = plain.get((r["mode"], r["load"]))
        ratio = f"{r['out_tok_s'] / base['out_tok_s']:.2f}" if base and base["out_tok_s"] else "-"
        tau = "-" if math.isnan(r["tau"]) or r["method"] == "plain" else f"{r['tau']:.2f}"
        lines.append(
            f"| {_load(r)} | {r['method']} | {r['requests']} ({r['failed']}) | {r['prefix_hits']} | "
            f"{r['out_tok_s']:.1f} | {ratio} | {_three(r, 'ttft_ms')} | {_three(r, 'itl_ms', fmt='{:.1f}')} | "
            f"{_three(r, 'tpot_ms', fmt='{:.1f}')} | {_three(r, 'e2e_ms', 1e-3, '{:.2f}')} | "
            f"{r['goodput_req_s']:.2f} ({100 * r['good_share']:.0f}%) | {tau} |")
    return "\n".join(lines)


def report(result: dict, plot: str | None = None) -> str:
    cfg = result["config"]
    world = cfg.get("world", "v1")
    mix = ", ".join(f"{n} x {visual_tokens(s, f, world)}" for s, f, n in cfg["mix"])
    long = "narration" if world == "v2" else "caption"
    share = cfg.get("long_share")
    then = (f"then a {long} with chance {share:g}, else a short question" if share is not None
            else f"then any prompt alike, short questions or {long}s")
    first = f"a {'timed narration' if world == 'v2' else 'caption'} first, {then}"
    sustained = ", ".join(f"{m} {'none' if r is None else f'{r:g} req/s'}" for m, r in result["sustained"].items())
    parts = [
        f"Machine: {result['machine']}; load average {result['load_before'][0]:.1f} before, "
        f"{result['load_after'][0]:.1f} after (2 cores shared with other engineers' runs).",
        f"Target: {result['target']}. Methods: {', '.join(cfg['methods'])} (Sparrow: the default engine, k chosen "
        f"per step), each behind its own embedded gRPC server, the same requests in the same order at each load, "
        f"prefix caches emptied before each.",
        f"Workload: fresh world {world} videos (seed {result['seed']}) of {mix} visual tokens, {cfg['questions']} "
        f"questions each ({first}; a repeat question reuses the video's prefill: 'prefix hits'), "
        f"answers to their own end (at most {cfg['max_new_tokens']} tokens), T={cfg['temperature']:g}. Open loop: "
        f"Poisson arrivals at each rate; closed loop: N clients each sending its next request when the last ends.",
        f"Objective: {result['objective']}. Highest rate sustained: {sustained}.",
        "ITL is the gap between two chunks of a stream that carry tokens (a speculative chunk holds several); "
        "TPOT is a request's (end - first token) / (tokens - 1); E2E from the request's send to its last token.",
        table(result["runs"], list(cfg["methods"])),
    ]
    if plot:
        parts.append(f"![load]({plot})")
    return "\n\n".join(parts)


def plot(result: dict, path: str | Path) -> None:
    """Per method against the request rate: output tokens/s, goodput, TTFT p95 and ITL p95."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("out_tok_s", "output tokens/s"), ("goodput_req_s", "goodput req/s"), ("ttft_ms_p95", "TTFT p95 ms"),
              ("itl_ms_p95", "ITL p95 ms"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        for method in result["config"]["methods"]:
            rows = [r for r in result["runs"] if r["method"] == method and r["mode"] == "rate"]
            ax.plot([r["load"] for r in rows], [r[key] for r in rows], marker="o", label=method)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
