"""BENCHMARKS.md as the current report: each harness owns one marked section, so re-running a
benchmark replaces its own section (command, machine, load, date, table, plot) and leaves the
others in place; the index at the top is rebuilt from the sections on every write.

    python -m benchmarks.report --readme      # copy BENCHMARKS.md's headline table into README.md
    python -m benchmarks.report --index       # rebuild BENCHMARKS.md's index (write_section does it too)

The headline (decode speedup by method and video length) is written by the speculative harness
inside its own section, between `<!-- headline:begin -->` and `<!-- headline:end -->`; README.md
quotes it between the same markers, and tests/test_docs.py checks that the two are equal.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HEADER = ("# Benchmarks\n\nThe current report. Every section was written by the harness its command names; "
          "rerunning a benchmark with `--out BENCHMARKS.md` replaces its own section and this index. "
          "How to run each and what it measures: [docs/benchmarks.md](docs/benchmarks.md); earlier runs "
          "and the hand-written readings of them: [docs/benchmarks-history.md](docs/benchmarks-history.md).\n")
INDEX, HEADLINE = "index", "headline"          # marker keys that are not sections

# What each section measures, one line for the index (a section not listed gets its title alone).
ABOUT = {
    "core": "the engine's decode, verify and loop costs on a tiny random model",
    "video": "video decode + patchify against the prefill it feeds",
    "kernels": "verify and draft attention kernels against their references",
    "serving": "what gRPC and Ray Serve add over the in-process engine",
    "world": "the synthetic world pair's QA accuracy and tau by video length",
    "speculative": "plain, EAGLE-style, SpecVLM-style and Sparrow side by side on world v2: decode speedup and "
                   "tau by video length (the README's headline)",
    "speculative-v1": "the same on world v1's ~20-token captions, where tau is at its ceiling",
    "trees-batch": "every method at batch 1 and batch 8, five lengths, T = 0 and 1",
    "trees-batch-eagle": "EAGLE-style at batch 1 and 8 after the sliced draft begin",
    "verify-cost": "a target step's cost by tokens scored, chains and trees",
    "gpu-check": "a 7B-shaped target's step costs on a GPU",
    "faults": "injected faults (Redis, uploads, files, bad requests) and what came back",
    "concurrency": "1-16 concurrent streams, batched plain against batched Sparrow",
    "draft-wire": "bytes a remote draft sends a round at the 7B vocabulary",
    "live": "live sessions: TTFT over a stream's life, ingest rate, standing-question accuracy",
    "autoscale": "Ray Serve scaling target replicas up and down on a local 3-node cluster",
    "live-alerts": "alert rules' recall and precision on held-out live streams",
    "dead-requests": "CPU spent on requests that expire before their video is ready",
    "ttft-prefill": "short requests' TTFT and running streams' ITL while a 25k prefill runs",
    "live-cameras": "how many live cameras one server follows at real time",
    "uploads": "server memory under concurrent large uploads",
    "compiled-steps": "plain and Sparrow with eager and compiled target steps",
    "attention-paths": "each CPU verify attention path's time beside the one chosen",
    "serve-load": "plain and Sparrow under load: request rates, TTFT/ITL/E2E percentiles, goodput, sustained rate",
    "serve-load-v2": "the same on world v2: timed narrations of 40-170 tokens and short questions, the v2 probe pair",
    "tuning-stall": "a new pod's path tuner beside a 25k stream and an 8k arrival: gaps and TTFT, gated and ungated",
    "ragged-one-call": "a ragged batch's attention in one call against one call a request, 1 and 8 streams at 0.5k",
    "grpc-hand-over": "8 gRPC streams with a turn's events handed to the event loop at once against one by one",
    "kv-resident": "A/B: a cached video's KV rows kept in its freed slot for the next question, against a copy each question",
    "world-v2-probe": "world v2's probe pair on narrations: speedup and tau at batch 1, 1 and 8 streams",
    "world-v2-pair": "world v2's pair on the committed target: Sparrow, EAGLE-style, SpecVLM-style and the ablations trained alike, batch 1",
    "step-budget": "A/B under load (not kept): a step-time budget in the draft policy against none, plain beside them",
    "cpu-prefix-avx2": "the CPU prefix kernel rewritten for AVX2, in the engine: 8 streams of 25k questions with and without it",
    "policy-batch": "the draft policy's adaptive k against fixed k at batch 8, paired in process on one engine",
    "burst-pacing": "A/B in process (not kept): a burst of 8 questions about cached videos, prefill paced strictly against a balance",
}

_SECTION = re.compile(r"<!-- ([a-z0-9-]+):begin -->\n(.*?)<!-- \1:end -->", re.DOTALL)
_DATE = re.compile(r"\((\d{4}-\d{2}-\d{2})")


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    date: str          # of the run that wrote it ("" if the section does not say)
    text: str          # between the markers


def markers(key: str) -> tuple[str, str]:
    return f"<!-- {key}:begin -->", f"<!-- {key}:end -->"


def between(text: str, key: str) -> str | None:
    """The text between `key`'s markers, or None when they are not both there."""
    begin, end = markers(key)
    if begin not in text or end not in text.split(begin, 1)[1]:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0]


def replace_between(text: str, key: str, inner: str) -> str:
    """`text` with what lies between `key`'s markers replaced by `inner` (markers kept)."""
    begin, end = markers(key)
    head, rest = text.split(begin, 1)
    return head + begin + inner + end + rest.split(end, 1)[1]


def sections(text: str) -> list[Section]:
    """Every harness section of a report, in file order."""
    out = []
    for m in _SECTION.finditer(text):
        key, inner = m.group(1), m.group(2)
        if key in (INDEX, HEADLINE):
            continue
        title = next((line[3:].strip() for line in inner.splitlines() if line.startswith("## ")), key)
        date = _DATE.search(next((line for line in inner.splitlines() if line.startswith("Command:")), ""))
        out.append(Section(key, title, date.group(1) if date else "", inner))
    return out


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def index(text: str) -> str:
    lines = ["| section | what it measures | run on |", "|---|---|---|"]
    for s in sections(text):
        lines.append(f"| [{s.title}](#{anchor(s.title)}) | {ABOUT.get(s.key, '')} | {s.date or '-'} |")
    return "\n".join(lines)


def refresh_index(text: str) -> str:
    """The report with its index rebuilt (placed under the header when it has none)."""
    block = "\n" + index(text) + "\n"
    if between(text, INDEX) is not None:
        return replace_between(text, INDEX, block)
    begin, end = markers(INDEX)
    head, sep, rest = text.partition("\n<!-- ")
    return head.rstrip("\n") + f"\n\n{begin}{block}{end}\n" + (sep + rest if sep else "")


def write_section(path: str | Path, key: str, title: str, command: str, body: str) -> None:
    """Write one harness's section into the report at `path`: in place when the section is
    there, else at the end; then rebuild the index. `key`: lower-case letters, digits and '-'."""
    if not re.fullmatch(r"[a-z0-9-]+", key):
        raise ValueError(f"section key {key!r}: lower-case letters, digits and '-' only (the report reads no other)")
    path = Path(path)
    text = path.read_text() if path.exists() else HEADER
    begin, end = markers(key)
    stamp = datetime.date.today().isoformat()
    section = f"{begin}\n## {title}\n\nCommand: `{command}` ({stamp})\n\n{body}\n{end}"
    if between(text, key) is not None:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(refresh_index(text))


def copy_headline(benchmarks: str | Path, readme: str | Path) -> bool:
    """Copy the headline table from the report into the README (between the headline markers
    of each); True when the README changed."""
    table = between(Path(benchmarks).read_text(), HEADLINE)
    if table is None:
        raise SystemExit(f"{benchmarks}: no headline (run benchmarks.speculative with --out)")
    readme = Path(readme)
    text = readme.read_text()
    if between(text, HEADLINE) is None:
        raise SystemExit(f"{readme}: no headline markers")
    new = replace_between(text, HEADLINE, table)
    readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", default="BENCHMARKS.md")
    ap.add_argument("--readme", nargs="?", const="README.md", default=None,
                    help="copy the report's headline table into this README (default README.md)")
    ap.add_argument("--index", action="store_true", help="rebuild the report's index")
    args = ap.parse_args(argv)
    if args.index:
        report = Path(args.report)
        report.write_text(refresh_index(report.read_text()))
    if args.readme:
        changed = copy_headline(args.report, args.readme)
        print(f"{args.readme}: headline {'updated' if changed else 'already current'}")
    if not (args.index or args.readme):
        ap.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
