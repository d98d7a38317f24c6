"""The side-by-side benchmark's report: the headline table (the README quotes it), the
acceptance bars, the markdown tables (methods, ablation, bars, GPU projection) and the plot of
decode speedup and tau vs visual tokens.

    python -m benchmarks.speculative_report --headline BENCHMARKS.md   # rebuild the section's headline from its tables
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from pathlib import Path

from benchmarks.engines import ABLATIONS, FIXED, method_keys, method_label, method_of
from benchmarks.report import HEADLINE, between, markers, replace_between
from benchmarks.step_cost_projection import gpu_lines
from benchmarks.world_videos import DEFAULT_WORLD

PAPER_ABLATION_TAU = {"none": (3.95, 2.95), "window": (3.95, 3.86), "mtp": (4.44, 3.51),
                      "bridge": (4.53, 1.21), "all three": (4.51, 4.37)}   # DESIGN.md, 0.5k / 25k


def _find(summary: list[dict], method: str, temp: float, n_vis: int) -> dict | None:
    return next((r for r in summary if r["method"] == method and r["temperature"] == temp
                 and r["visual_tokens"] == n_vis), None)


def bars(result: dict) -> list[dict]:
    """The acceptance bars of issue 6, at T=0, smallest vs largest video of the run."""
    summary = result["summary"]
    sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == 0.0})
    if not sizes:
        return []
    lo, hi = sizes[0], sizes[-1]
    s_lo, s_hi = _find(summary, "sparrow", 0.0, lo), _find(summary, "sparrow", 0.0, hi)

    def bar(name, measured, need, ok_if_ge=True, unit=""):
        if measured is None or need is None:
            return {"bar": name, "measured": None, "needed": need, "margin": None, "pass": None}
        margin = measured - need if ok_if_ge else need - measured
        return {"bar": name, "measured": measured, "needed": need, "margin": margin, "pass": margin >= 0, "unit": unit}

    get = lambda r, k: r[k] if r is not None else None   # noqa: E731
    out = [
        bar(f"Sparrow tau @{_k(hi)} >= 95% of tau @{_k(lo)}", get(s_hi, "tau"),
            0.95 * s_lo["tau"] if s_lo else None),
        bar(f"Sparrow draft ms/step @{_k(hi)} <= 1.1x @{_k(lo)}", get(s_hi, "draft_ms_per_step"),
            1.1 * s_lo["draft_ms_per_step"] if s_lo else None, ok_if_ge=False, unit=" ms"),
        bar(f"Sparrow decode speedup @{_k(hi)} >= 2.5x", get(s_hi, "decode_speedup"), 2.5, unit="x"),
    ]
    for other in ("eagle", "specvlm"):
        o = _find(summary, other, 0.0, hi)
        out.append(bar(f"Sparrow speedup @{_k(hi)} >= 1.3x {other}'s", get(s_hi, "decode_speedup"),
                       1.3 * o["decode_speedup"] if o else None, unit="x"))
    return out


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _step_ms(row: dict) -> str:
    """A summary row's verify / draft / policy ms a step (medians; a run from before the policy
    was timed has no policy figure)."""
    policy = row.get("policy_ms_per_step")
    return (f"{row['verify_ms_per_step']:.2f} / {row['draft_ms_per_step']:.2f} / "
            + (f"{policy:.2f}" if policy is not None else "-"))


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


# ----- the headline ----------------------------------------------------------------------------------
HEADLINE_METHODS = ("sparrow", "sparrow-tree", "specvlm", "eagle")


def headline_table(speedups: dict[tuple[float, int, str], float], machine: str, date: str, world: str) -> str:
    """The README's headline: decode speedup over plain decoding by method (rows) and video
    length (columns), "T = 0 / T = 1" in each cell; `speedups` maps (temperature, visual tokens,
    method) to the speedup. Between the headline markers, so README.md can quote it whole."""
    temps = sorted({t for t, _, _ in speedups if t in (0.0, 1.0)})
    sizes = sorted({n for t, n, _ in speedups if t in temps})
    methods = [key for m in HEADLINE_METHODS for key in (m, m + FIXED) if any(k[2] == key for k in speedups)]
    both = " / ".join(f"T = {t:g}" for t in temps)
    lines = [f"Decode speedup over plain decoding (prefill excluded), {both}, by video length in visual tokens; "
             f"the synthetic world {world} pair, every method's tokens equal to plain decoding's; a method under the engine's "
             f"adaptive policy (k chosen per step) unless its row says fixed k. {machine}; {date}.", "",
             "| method | " + " | ".join(f"{n:,}" for n in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for m in methods:
        cells = [" / ".join(_x(speedups.get((t, n, m))) for t in temps) for n in sizes]
        lines.append(f"| {method_label(m)} | " + " | ".join(cells) + " |")
    begin, end = markers(HEADLINE)
    return f"{begin}\n" + "\n".join(lines) + f"\n{end}"


def headline(result: dict, date: str | None = None) -> str:
    """The headline of a run, from its summary."""
    speedups = {(r["temperature"], r["visual_tokens"], r["method"]): r["decode_speedup"]
                for r in result["summary"] if r["decode_speedup"] is not None}
    return headline_table(speedups, result["machine"], date or datetime.date.today().isoformat(),
                          result["config"].get("world", "v1"))


_T_BLOCK = re.compile(r"^\*\*T = ([0-9.]+)\.\*\*", re.MULTILINE)
_ROW = re.compile(r"^\| (\d+) \| ([a-z0-9@-]+) \| [0-9.]+ \| ([0-9.]+)x \|", re.MULTILINE)


def speedups_from_section(section: str) -> dict[tuple[float, int, str], float]:
    """(temperature, visual tokens, method) -> decode speedup, read back from the per-method
    tables of a written 'speculative' section (one `**T = t.**` block per temperature)."""
    out = {}
    starts = list(_T_BLOCK.finditer(section))
    for i, m in enumerate(starts):
        block = section[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(section)]
        for row in _ROW.finditer(block):
            out[(float(m.group(1)), int(row.group(1)), row.group(2))] = float(row.group(3))
    return out


def headline_from_section(section: str) -> str:
    """The headline a written 'speculative' section implies: its figures, machine and date."""
    machine = re.search(r"^Machine: (.*?)\.?$", section, re.MULTILINE)
    date = re.search(r"^Command: `.*` \((\d{4}-\d{2}-\d{2})", section, re.MULTILINE)
    if machine is None or date is None:
        raise ValueError("not a written 'speculative' section: no Machine or dated Command line")
    world = re.search(r"videos of world (v\d)", section)
    return headline_table(speedups_from_section(section), machine.group(1), date.group(1),
                          world.group(1) if world else "v1")


def refresh_headline(path: str | Path) -> None:
    """Write (or rewrite) the headline of the report's 'speculative' section from its tables,
    just below its Command line."""
    path = Path(path)
    text = path.read_text()
    section = between(text, "speculative")
    if section is None:
        raise SystemExit(f"{path}: no 'speculative' section")
    table = headline_from_section(section)
    if between(section, HEADLINE) is not None:
        new = replace_between(section, HEADLINE, between(table, HEADLINE))
    else:
        head, command, rest = re.split(r"^(Command: .*\n)", section, maxsplit=1, flags=re.MULTILINE)
        new = head + command + "\n" + table + "\n" + rest
    path.write_text(replace_between(text, "speculative", new))


# ----- report -----------------------------------------------------------------------------------------
def report(result: dict, plot_path: str | None = None) -> str:
    cfg, summary = result["config"], result["summary"]
    keys = method_keys(tuple(cfg["methods"]), tuple(cfg.get("policies", ("adaptive",))))
    shown = [m for m in keys if m in {r["method"] for r in summary} and not method_of(m).ablation]
    table = headline(result)          # the default world's run carries the README's headline; others a plain table
    if cfg.get("world", "v1") != DEFAULT_WORLD:
        table = between(table, HEADLINE).strip("\n")
    lines = [table, "", f"Machine: {result['machine']}.", f"Target: {result['target']}. k = {cfg['k']}, window {cfg['window']}, "
             f"anchors {cfg['anchors']}, glimpse: the draft's own (sparrow-glimpse {cfg['glimpse']}, sparrow-text 0); "
             f"{cfg['max_new_tokens']} new "
             f"tokens (answers end at the end of turn), {cfg['reps']} reps, methods interleaved per rep, medians (a speedup: the median of each rep's ratio to plain); fresh "
             f"videos of world {cfg.get('world', 'v1')} (seeds from {cfg['seed']}), "
             f"{'narration' if cfg.get('world') == 'v2' else 'caption'} prompts. Policies: every drafting method under "
             f"{' and '.join(cfg.get('policies', ('adaptive',)))} ('adaptive': k in [0, {cfg['k']}] chosen per step from the "
             f"measured acceptance and costs, the engine's default; 'fixed': {cfg['k']} drafts every step). Tau's ceiling: "
             f"the most tau a step of {cfg['k']} drafts allows for the answers' lengths (k + 1 tokens a step, the "
             f"answer's last step cut short), so a tau near it is the answers' limit, not the method's.", ""]
    if result["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in result["skipped"].items()) + ".", ""]
    ident = "all methods' tokens equal plain decoding's" if result["identical"] else \
        f"**{len(result['mismatches'])} MISMATCHES**"
    temps = "/".join(f"{t:g}" for t in cfg["temperatures"])
    lines += [f"Output identity at T = {temps} (T > 0: the same seed): {ident}.", ""]
    for temp in cfg["temperatures"]:
        sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == temp})
        lines += [f"**T = {temp:g}.** Cell: decode speedup / tau / draft ms per step / verify ms per step "
                  f"(plain: its decode step) / draft KV per request.", "",
                  "| visual tokens | tau ceiling | " + " | ".join(method_label(m) for m in shown) + " |",
                  "|---|---|" + "---|" * len(shown)]
        for n in sizes:
            ref = _find(summary, "plain", temp, n)
            cells = [f"{ref['tau_ceiling']:.2f}" if ref and "tau_ceiling" in ref else "-"]
            for m in shown:
                r = _find(summary, m, temp, n)
                draft_ms = "-" if m == "plain" else f"{r['draft_ms_per_step']:.2f}" if r else ""
                cells.append("-" if r is None else f"{_x(r['decode_speedup'])} / {r['tau']:.2f} / {draft_ms} / "
                             f"{r['verify_ms_per_step']:.2f} / {_bytes(r['draft_kv_bytes'])}")
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines += ["", "| visual tokens | method | decode ms/token | decode speedup | end-to-end s | end-to-end speedup "
                  "| tau | accepted/step | acceptance per position | draft keys | ms a step: verify / draft / policy |",
                  "|---" * 11 + "|"]
        for n in sizes:
            for m in shown:
                r = _find(summary, m, temp, n)
                if r is not None:
                    pos = " ".join(f"{p:.2f}" for p in r["acceptance_per_position"]) or "-"
                    lines.append(f"| {n} | {m} | {r['decode_ms_per_token']:.2f} | {_x(r['decode_speedup'])} | "
                                 f"{r['e2e_seconds']:.2f} | {_x(r['e2e_speedup'])} | {r['tau']:.2f} | "
                                 f"{r['accepted_per_step']:.2f} | {pos} | {r['draft_max_keys'] or '-'} | {_step_ms(r)} |")
        lines.append("")
    lines += ablation_table(result) + bars_table(result)
    if result.get("gpu"):
        lines += gpu_lines(result["gpu"])
    if plot_path:
        lines += [f"![decode speedup and tau vs visual tokens]({plot_path})", ""]
    return "\n".join(lines).rstrip("\n")


def ablation_table(result: dict) -> list[str]:
    summary = result["summary"]
    sizes = sorted({r["visual_tokens"] for r in summary if r["temperature"] == 0.0})
    rows = [(kind, f"ablation-{kind}") for kind in ABLATIONS] + [("all three", "sparrow")]
    if not sizes or not any(_find(summary, m, 0.0, sizes[0]) for _, m in rows[:-1]):
        return ["Ablation: no ablation draft ran (models under bench/ablation/ missing or not selected).", ""]
    lo, hi = sizes[0], sizes[-1]
    lines = [f"Ablation (T = 0): tau at {lo} and {hi} visual tokens. none: full attention, no MTP, no bridging; "
             "window: text-anchored window only; mtp: window + multi-token unrolling; bridge: bridging without "
             "window; all three: the world draft. Paper column: DESIGN.md's secondary-source figures (0.5k / 25k).",
             "", f"| draft | tau @{_k(lo)} | tau @{_k(hi)} | @{_k(hi)} / @{_k(lo)} | paper 0.5k / 25k |",
             "|---|---|---|---|---|"]
    for kind, m in rows:
        a, b = _find(summary, m, 0.0, lo), _find(summary, m, 0.0, hi)
        ratio = f"{b['tau'] / a['tau']:.2f}" if a and b and a["tau"] else "-"
        paper = PAPER_ABLATION_TAU[kind]
        lines.append(f"| {kind} | {a['tau'] if a else float('nan'):.2f} | {b['tau'] if b else float('nan'):.2f} | "
                     f"{ratio} | {paper[0]} / {paper[1]} |")
    return lines + [""]


def bars_table(result: dict) -> list[str]:
    lines = ["Bars (T = 0, smallest vs largest video of this run):", "",
             "| bar | measured | needed | margin | result |", "|---|---|---|---|---|"]
    for b in bars(result):
        if b["pass"] is None:
            measured = "-" if b["measured"] is None else f"{b['measured']:.2f}"
            needed = "-" if b["needed"] is None else f"{b['needed']:.2f}"
            lines.append(f"| {b['bar']} | {measured} | {needed} | - | n/a (not measured) |")
        else:
            u = b["unit"]
            lines.append(f"| {b['bar']} | {b['measured']:.2f}{u} | {b['needed']:.2f}{u} | {b['margin']:+.2f}{u} | "
                         f"{'pass' if b['pass'] else 'miss'} |")
    return lines + [""]


def plot(result: dict, path: str | Path) -> None:
    """Decode speedup and tau vs visual tokens (log x), one line per method; T=0 solid, others dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    cfg = result["config"]
    methods = [m for m in method_keys(tuple(cfg["methods"]), tuple(cfg.get("policies", ("adaptive",))))
               if not method_of(m).ablation]
    for temp in result["config"]["temperatures"]:
        for i, m in enumerate(methods):
            rows = sorted((r for r in summary if r["method"] == m and r["temperature"] == temp),
                          key=lambda r: r["visual_tokens"])
            if not rows:
                continue
            x = [r["visual_tokens"] for r in rows]
            style = dict(color=f"C{i}", marker="o", linestyle="-" if temp == 0.0 else "--",
                         label=f"{method_label(m)} (T={temp:g})")
            ax1.plot(x, [r["decode_speedup"] for r in rows], **style)
            ax2.plot(x, [r["tau"] for r in rows], **style)
    for ax, title in ((ax1, "decode speedup vs plain"), (ax2, "mean acceptance length tau")):
        ax.set_xscale("log")
        ax.set_xlabel("visual tokens")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax1.axhline(1.0, color="grey", linewidth=0.8)
    ax2.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Rebuild the headline of a report's 'speculative' section from its tables.")
    ap.add_argument("--headline", metavar="REPORT", required=True, help="the report (BENCHMARKS.md)")
    refresh_headline(ap.parse_args(argv).headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
