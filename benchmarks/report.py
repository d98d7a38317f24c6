"""Writing benchmark results into BENCHMARKS.md: each harness owns one marked section, so
re-running one benchmark replaces its own table and leaves the others in place."""

from __future__ import annotations

import datetime
from pathlib import Path

HEADER = "# Benchmarks\n\nEvery table here was written by the harness named above it, with the command that made it.\n"


def write_section(path: str | Path, key: str, title: str, command: str, body: str) -> None:
    path = Path(path)
    text = path.read_text() if path.exists() else HEADER
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    stamp = datetime.date.today().isoformat()
    section = f"{begin}\n## {title}\n\nCommand: `{command}` ({stamp})\n\n{body}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)
