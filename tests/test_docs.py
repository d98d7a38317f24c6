"""The documents hold together: README.md's headline is BENCHMARKS.md's, BENCHMARKS.md is only
harness-written sections under an index that is current, the README stays a map (at most 200
lines), and every relative link in README.md, CONTRIBUTING.md and docs/ reaches a file.

Each rule is checked on the files as they are and on a mutant that breaks it, so none can pass
by reading nothing."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from benchmarks.report import HEADER, HEADLINE, INDEX, between, index, sections, write_section
from benchmarks.speculative_report import headline, headline_from_section, report

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _read(name: str) -> str:
    return (REPO / name).read_text()


# ----- the headline ---------------------------------------------------------------------------------
def headline_rows(text: str) -> list[str]:
    """The method rows of the headline table in `text` (empty when there is none)."""
    block = between(text, HEADLINE) or ""
    return [line for line in block.splitlines() if re.match(r"^\| [A-Z].* \| \d+\.\d\dx", line)]


def headline_agrees(readme: str, benchmarks: str) -> bool:
    """The README quotes the report's headline whole: the same table, machine and date."""
    ours, theirs = between(readme, HEADLINE), between(benchmarks, HEADLINE)
    return ours is not None and ours == theirs and len(headline_rows(readme)) >= 4


def test_readme_headline_equals_benchmarks():
    readme, bench = _read("README.md"), _read("BENCHMARKS.md")
    assert headline_agrees(readme, bench), "README's headline differs: python -m benchmarks.report --readme"
    rows = headline_rows(readme)
    mutant = readme.replace(rows[0], rows[0].replace("x", "0x", 1))
    assert mutant != readme and not headline_agrees(mutant, bench)
    assert not headline_agrees(readme.replace("<!-- headline:begin -->", ""), bench)


def test_benchmarks_headline_is_its_sections_own_figures():
    bench = _read("BENCHMARKS.md")
    section = between(bench, "speculative")
    assert section is not None and len(headline_rows(bench)) >= 4
    assert headline_from_section(section) in section          # not edited by hand
    first = headline_rows(bench)[0]
    mutant = section.replace(first, re.sub(r"\d\.\d\dx", "9.99x", first, count=1))
    assert mutant != section and headline_from_section(mutant) not in mutant


def _result() -> dict:
    """A small side-by-side result, as benchmarks.speculative returns it."""
    def row(method, temp, n, speedup, tau):
        return {"method": method, "temperature": temp, "visual_tokens": n, "reps": 1,
                "decode_ms_per_token": 4.0 / speedup, "e2e_seconds": 1.0, "tau": tau, "accepted_per_step": tau - 1,
                "acceptance_per_position": [0.9], "draft_ms_per_step": 0.3, "verify_ms_per_step": 2.0,
                "draft_kv_bytes": None if method == "plain" else 1 << 16, "draft_max_keys": 53,
                "decode_speedup": speedup, "e2e_speedup": 1.0}
    methods = ("plain", "sparrow", "sparrow-tree", "specvlm", "eagle")
    summary = [row(m, t, n, 1.0 if m == "plain" else 1.0 + i / 3 + n / 1e5 + t / 7, 1.0 + i / 2)
               for t in (0.0, 1.0) for n in (504, 25056) for i, m in enumerate(methods)]
    return {"config": {"methods": list(methods), "k": 4, "window": 16, "anchors": 32, "glimpse": 16,
                       "max_new_tokens": 64, "reps": 1, "seed": 1, "temperatures": [0.0, 1.0], "world": "v2"},
            "machine": "a test box, 2 cores", "target": "tiny", "skipped": {}, "identical": True,
            "mismatches": [], "summary": summary}


def test_speculative_report_writes_the_headline_its_tables_give(tmp_path):
    result = _result()
    out = tmp_path / "BENCHMARKS.md"
    write_section(out, "speculative", "Speculative decoding side by side (world models)", "python -m x",
                  report(result))
    section = between(out.read_text(), "speculative")
    today = datetime.date.today().isoformat()
    assert headline(result, today) in section
    assert headline_from_section(section) == headline(result, today)
    assert "| Sparrow | 1.34x / 1.48x | 1.58x / 1.73x |" in section
    result["summary"][1]["decode_speedup"] = 7.0                # plain's cell unchanged, Sparrow's at T=0, 504
    assert headline(result, today) not in section


# ----- BENCHMARKS.md: harness sections under a current index ------------------------------------------
def stray_text(text: str) -> str:
    """What a report holds outside its index and sections, besides the header."""
    rest = re.sub(r"<!-- ([a-z0-9-]+):begin -->\n.*?<!-- \1:end -->", "", text, flags=re.DOTALL)
    return rest.replace(HEADER.strip(), "").strip()


def index_current(text: str) -> bool:
    return between(text, INDEX) == "\n" + index(text) + "\n"


def test_benchmarks_is_only_harness_sections_with_a_current_index():
    bench = _read("BENCHMARKS.md")
    assert stray_text(bench) == ""
    assert index_current(bench)
    found = sections(bench)
    assert len(found) >= 20 and len({s.key for s in found}) == len(found)
    assert all(s.date for s in found), [s.key for s in found if not s.date]      # each says when it ran
    assert all("-notes" not in s.key for s in found)
    assert stray_text(bench.replace("<!-- core:end -->", "<!-- core:end -->\n\nRead by hand.")) == "Read by hand."
    assert not index_current(bench.replace("<!-- video:begin -->\n## Video", "<!-- video:begin -->\n## Film"))


def test_write_section_replaces_in_place_and_keeps_the_index(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    write_section(path, "alpha", "Alpha", "python -m a", "| a |\n|---|\n| 1 |")
    write_section(path, "beta", "Beta", "python -m b", "| b |\n|---|\n| 2 |")
    write_section(path, "alpha", "Alpha again", "python -m a --more", "| a |\n|---|\n| 3 |")
    text = path.read_text()
    assert [s.key for s in sections(text)] == ["alpha", "beta"]              # rewritten where it was
    assert text.count("<!-- alpha:begin -->") == 1 and "| 1 |" not in text and "| 3 |" in text
    assert "Command: `python -m a --more`" in text and stray_text(text) == ""
    assert index_current(text)
    rows = between(text, INDEX).strip().splitlines()[2:]
    today = datetime.date.today().isoformat()
    assert rows[0].startswith("| [Alpha again](#alpha-again) |") and rows[0].endswith(f"| {today} |")
    assert rows[1].startswith("| [Beta](#beta) |") and len(rows) == 2
    assert text.index(INDEX) < text.index("<!-- alpha:begin -->")


# ----- the README is a map; links reach files ---------------------------------------------------------
def too_long(text: str) -> bool:
    return len(text.splitlines()) > README_MAX_LINES


def test_readme_is_at_most_200_lines():
    readme = _read("README.md")
    assert not too_long(readme), len(readme.splitlines())
    assert too_long(readme + "\n" * (README_MAX_LINES + 1 - len(readme.splitlines())) + "x\n")


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file (outside code blocks) whose file does not exist."""
    text = _FENCE.sub("", path.read_text())
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue                                      # a URL, or an anchor in the same page
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(target)
    return bad


def documents() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").rglob("*.md"))]


def test_every_relative_link_resolves(tmp_path):
    docs = documents()
    assert (REPO / "CONTRIBUTING.md").exists() and len(docs) >= 12
    assert {str(p.relative_to(REPO)): broken_links(p) for p in docs if broken_links(p)} == {}
    links = sum(len(_LINK.findall(p.read_text())) for p in docs)
    assert links >= 30                                    # the check read real links
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "README.md").write_text("x")
    page.write_text("[up](../README.md) [web](https://x.org) [here](#a) ![p](missing.png) "
                    "[gone](serving.md#x)\n```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == ["missing.png", "serving.md#x"]
