"""The concurrent-streams benchmark's results: summaries over reps, runs of one configuration
over different lengths merged into one (--from-json), and the markdown report."""

from __future__ import annotations

import statistics

from benchmarks.concurrency.plan import METHODS, PATHS

# ----- summaries and report ------------------------------------------------------------------------------------
SUMMARY_KEYS = ("tok_s", "one_at_a_time_tok_s", "x_one_at_a_time", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms",
                "itl_p95_ms", "tau")


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (temperature, visual tokens, path, method, streams): min/median/max over reps of each
    measure, and the method's median tokens/s over plain's of the same cell."""
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r.get("temperature", 0.0), r["visual_tokens"], r["path"], r["method"], r["streams"]),
                         []).append(r)
    rows = [{"temperature": t, "visual_tokens": n, "path": p, "method": m, "streams": s, "reps": len(rs),
             **{k: _spread([r[k] for r in rs]) for k in SUMMARY_KEYS}}
            for (t, n, p, m, s), rs in sorted(cells.items(), key=lambda kv: (
                kv[0][0], kv[0][1], list(PATHS).index(kv[0][2]), list(METHODS).index(kv[0][3]), kv[0][4]))]
    plain = {(r["temperature"], r["visual_tokens"], r["path"], r["streams"]): r for r in rows if r["method"] == "plain"}
    for r in rows:
        p = plain.get((r["temperature"], r["visual_tokens"], r["path"], r["streams"]))
        r["x_plain"] = r["tok_s"]["median"] / p["tok_s"]["median"] if p else None
    return rows


def summarize_scenario(rows: list[dict]) -> list[dict]:
    keys = ("before_p50_ms", "before_p95_ms", "during_p50_ms", "during_p95_ms", "during_max_ms", "long_ttft_s",
            "long_prefill_s", "short_ttft_p50_s", "short_ttft_p95_s", "short_ttft_max_s")
    out = []
    for method in METHODS:
        rs = [r for r in rows if r["method"] == method]
        if rs:
            # a window without a gap (a prefill shorter than one step) is nan: spread over the others
            out.append({"method": method, "streams": rs[0]["streams"], "reps": len(rs),
                        "prefill_visual_tokens": rs[0]["prefill_visual_tokens"],
                        "covered": all(r["covered"] for r in rs),
                        "shorts": sum(r.get("shorts_in_prefill", 0) for r in rs),
                        **{k: _spread([r[k] for r in rs if r.get(k, float("nan")) == r.get(k, float("nan"))]
                                      or [float("nan")]) for k in keys}})
    return out


def _cell(s: dict, fmt: str = ".1f") -> str:
    return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"


def _loads(result: dict) -> str:
    parts = result.get("parts") or [result]
    return "; ".join(f"{'lengths ' + ', '.join(f'{a}x{b}' for a, b in p['lengths']) + ': ' if 'parts' in result else ''}"
                     f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in p['load_before'])}, "
                     f"after {'/'.join(f'{x:.2f}' for x in p['load_after'])}" for p in parts)


def _reps(result: dict) -> str:
    parts = result.get("parts") or [{"lengths": result["config"]["lengths"], "reps": result["config"]["reps"]}]
    counts = sorted({p["reps"] for p in parts}, reverse=True)
    if len(counts) == 1:
        return f"{counts[0]} reps"
    fewer = [f"{a}x{b}: {p['reps']}" for p in parts if p["reps"] != counts[0] for a, b in p["lengths"]]
    return f"{counts[0]} reps ({', '.join(fewer)})"


def report(result: dict) -> str:
    cfg = result["config"]
    temps = ", ".join(f"{t:g}" for t in cfg.get("temperatures", (0.0,)))
    per_stream = (f"up to {cfg['tokens']} new tokens a stream (each ends at its answer's end)" if cfg.get("stop_at_eos")
                  else f"{cfg['tokens']} new tokens a stream (EOS ignored)")
    lines = [f"Machine: {result['machine']}; {_loads(result)}.",
             f"Target: {result['target']}; Sparrow draft k = {cfg['k']}, window 16, anchors 32, the glimpse it was trained with; trees "
             f"{'x'.join(map(str, cfg['tree'][:2]))}, at most {cfg['tree'][2]} nodes. "
             f"{per_stream}, T = {temps} (T > 0: request i seeded), "
             f"{'narration' if cfg.get('world') == 'v2' else 'caption'} prompts; {_reps(result)}, each with fresh "
             f"videos of world {cfg.get('world', 'v1')}, one per stream (seeds from {cfg['seed']}); "
             f"prefills cached before timing{' (one shared prefill per video in-process)' if cfg.get('share_prefill') else ''}"
             f"{'; before each length, the whole configuration once, untimed, on videos of its own' if cfg.get('warm_lengths') else ''}. "
             "Cells: median (min-max) over reps. One at a time: the same requests one after another. ITL: the gap "
             "between two chunks of a stream (a speculative chunk holds tau tokens on average).", ""]
    ident = ("every output (every method and path, one at a time and concurrent) equals plain decoding's "
             "one-at-a-time output at T=0, and its own method's one-at-a-time output with the same seed at T > 0"
             if result["identical"] else f"**{len(result['mismatches'])} MISMATCHES**")
    lines += [f"Output identity: {ident}.", ""]
    lines += goal_lines(result)
    lines += method_table_lines(result)
    lines += ["| T | visual tokens | path | method | streams | tok/s | one at a time tok/s | x one at a time | "
              "x plain | TTFT p50 ms | TTFT p95 ms | ITL p50 ms | ITL p95 ms | tau |", "|---" * 14 + "|"]
    for r in result["summary"]:
        vs = f"{r['x_plain']:.2f}x" if r["method"] != "plain" and r["x_plain"] is not None else "-"
        lines.append(f"| {r['temperature']:g} | {r['visual_tokens']} | {PATHS[r['path']]} | {METHODS[r['method']]} | "
                     f"{r['streams']} | "
                     f"{_cell(r['tok_s'])} | {r['one_at_a_time_tok_s']['median']:.1f} | "
                     f"{_cell(r['x_one_at_a_time'], '.2f')} | {vs} | {_cell(r['ttft_p50_ms'])} | "
                     f"{_cell(r['ttft_p95_ms'])} | {_cell(r['itl_p50_ms'])} | {_cell(r['itl_p95_ms'])} | "
                     f"{r['tau']['median']:.2f} |")
    lines += [""] + scenario_lines(result)
    return "\n".join(lines).rstrip("\n")


def goal_lines(result: dict) -> list[str]:
    """Issue 15's goal: 8 streams >= 3x the tokens/s of one at a time on the shortest videos."""
    rows = [r for r in result["summary"] if r["streams"] == 8 and r["temperature"] == 0]
    if not rows:
        return []
    n = min(r["visual_tokens"] for r in rows)
    got = ", ".join(f"{PATHS[r['path']]} {METHODS[r['method']]} {r['x_one_at_a_time']['median']:.2f}x"
                    for r in rows if r["visual_tokens"] == n)
    return [f"Goal (issue 15): 8 streams >= 3x the tokens/s of one at a time on {n}-token videos. Measured: {got}.",
            ""]


def method_table_lines(result: dict) -> list[str]:
    """The methods side by side, one table per temperature and path: rows (visual tokens, streams),
    a column per method: aggregate tokens/s median (min-max), tau, x plain at the same batch."""
    summary = result["summary"]
    methods = [m for m in METHODS if any(r["method"] == m for r in summary)]
    if len(methods) < 2:
        return []
    lines = []
    for temp in sorted({r["temperature"] for r in summary}):
        for path in [p for p in PATHS if any(r["path"] == p for r in summary)]:
            cells = {(r["visual_tokens"], r["streams"], r["method"]): r for r in summary
                     if r["temperature"] == temp and r["path"] == path}
            most = max(s for _, s, _ in cells)
            lines += [f"**T = {temp:g}, {PATHS[path]}.** Cell: aggregate tokens/s, median (min-max) over reps; tau; "
                      f"x plain at the same batch. Row \"one at a time\": the {most} requests of each rep one after "
                      "another (tokens over the sum of their times; tau not recorded for it).", "",
                      "| visual tokens | streams | " + " | ".join(METHODS[m] for m in methods) + " |",
                      "|---" * (2 + len(methods)) + "|"]
            for n in sorted({n for n, _, _ in cells}):
                plain = cells.get((n, most, "plain"))
                row = []
                for m in methods:
                    r = cells.get((n, most, m))
                    x = f"; {r['one_at_a_time_tok_s']['median'] / plain['one_at_a_time_tok_s']['median']:.2f}x" \
                        if r is not None and plain is not None else ""
                    row.append("-" if r is None else _cell(r["one_at_a_time_tok_s"], ".0f") + x)
                lines.append(f"| {n:,} | one at a time | " + " | ".join(row) + " |")
                for streams in sorted({s for k, s, _ in cells if k == n}):
                    row = []
                    for m in methods:
                        r = cells.get((n, streams, m))
                        row.append("-" if r is None else f"{_cell(r['tok_s'], '.0f')}"
                                   + ("" if m == "plain" else f", tau {r['tau']['median']:.2f}")
                                   + (f"; {r['x_plain']:.2f}x" if r["x_plain"] is not None else ""))
                    lines.append(f"| {n:,} | {streams} | " + " | ".join(row) + " |")
            lines.append("")
    return lines


def merge(results: list[dict]) -> dict:
    """Runs of the same configuration over different lengths (one command per length, so a
    long benchmark keeps what it measured; the longest may run fewer reps) as one result: runs
    concatenated, summaries redone, each part's lengths, reps, load and command kept."""
    first = results[0]
    free = ("lengths", "reps", "prefill_reps")
    for r in results[1:]:
        a = {k: v for k, v in first["config"].items() if k not in free}
        b = {k: v for k, v in r["config"].items() if k not in free}
        if a != b:
            diff = sorted(k for k in a if a[k] != b.get(k))
            raise ValueError(f"cannot merge runs whose configurations differ beyond their lengths: {diff}")
    merged = {"config": {**first["config"], "lengths": [x for r in results for x in r["config"]["lengths"]]},
              "machine": first["machine"], "target": first["target"],
              "load_before": first["load_before"], "load_after": results[-1]["load_after"],
              "parts": [{"lengths": r["config"]["lengths"], "reps": r["config"]["reps"], "load_before": r["load_before"],
                         "load_after": r["load_after"], "command": r.get("command", ""),
                         "wall_seconds": r.get("wall_seconds", 0.0)} for r in results],
              "wall_seconds": sum(r.get("wall_seconds", 0.0) for r in results)}
    for key in ("runs", "prefill_scenario", "mismatches"):
        merged[key] = [x for r in results for x in r[key]]
    merged.update(summary=summarize(merged["runs"]), prefill_summary=summarize_scenario(merged["prefill_scenario"]),
                  identical=not merged["mismatches"])
    return merged


def scenario_lines(result: dict) -> list[str]:
    rows = result["prefill_summary"]
    if not rows:
        return ["Prefill scenario: not run.", ""]
    lines = [f"Streams decoding while a {rows[0]['prefill_visual_tokens']}-token prefill arrives (in-process; the "
             f"long video decoded beforehand, its prefill uncached; streams on the shortest videos): inter-token "
             f"latency in the {result['config']['before_s']:g} s before it arrives vs until its first token; and "
             "the time to first token of short requests on uncached short videos asked one after another while "
             "it prefills (shorts: how many were asked before its first token, over all reps). "
             "Median (min-max) over reps.", "",
             "| method | streams | ITL p50 before ms | ITL p95 before ms | ITL p50 during ms | ITL p95 during ms | "
             "ITL max during ms | long request TTFT s | its prefill s | short TTFT p50 s | short TTFT p95 s | "
             "shorts | reps |", "|---" * 13 + "|"]
    for r in rows:
        flag = "" if r["covered"] else " (streams ended before the prefill: raise --prefill-stream-tokens)"
        lines.append(f"| {METHODS[r['method']]} | {r['streams']} | {_cell(r['before_p50_ms'])} | "
                     f"{_cell(r['before_p95_ms'])} | {_cell(r['during_p50_ms'])} | {_cell(r['during_p95_ms'])} | "
                     f"{_cell(r['during_max_ms'])} | {_cell(r['long_ttft_s'], '.2f')} | "
                     f"{_cell(r['long_prefill_s'], '.2f')} | {_cell(r['short_ttft_p50_s'], '.2f')} | "
                     f"{_cell(r['short_ttft_p95_s'], '.2f')} | {r.get('shorts', 0)} | {r['reps']}{flag} |")
    return lines + [""]
