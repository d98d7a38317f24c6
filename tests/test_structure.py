"""The package's structure holds: no import circles (function-level imports and importlib strings
included), the core (`sparrow/`) never reaches the transports, the trainer, the synthetic world or the benchmarks, no
`hasattr`/`getattr` dispatch on a proposer or its state, no source file over 500 lines, no two
modules with one basename (each file name says one thing), and the live code reaches the engine
through its public seams only (no private names, no scheduler or arena of its own).

Each rule is checked on the tree as it is and on a mutant that breaks it, so none can pass by
reading nothing."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# source folder -> the module prefix it installs as (pyproject's package-dir mapping)
ROOTS = {"sparrow": "sparrow", "services": "sparrow.services", "training": "sparrow.training",
         "kernels": "sparrow.kernels", "world": "sparrow.world", "cli": "sparrow.cli",
         "benchmarks": "benchmarks"}
GENERATED = ("sparrow.v1",)                # protoc output, not ours to structure
CORE_MAY_NOT_IMPORT = ("sparrow.services", "sparrow.training", "sparrow.world", "sparrow.cli", "benchmarks")
MAX_LINES = 500
# a basename more than one package may hold, because the package says which (sparrow.config,
# sparrow.services.config, sparrow.training.config: each package's settings)
SHARED_BASENAMES = {"__init__.py", "__main__.py", "config.py"}
# what live code (the session and its RPC) may not touch of the engine: its private names and its
# parts (Engine.call_soon, claim_kv, kv_tokens and Generation.sink are the seams)
LIVE_CODE = ("sparrow.live", "sparrow.services.live")
REACH_IN = re.compile(r"\._events\b|\.arena\b|\.scheduler\b|\.runner\b")
# the first argument of a hasattr/getattr that probes a proposer or a draft's per-request state
PROPOSER_PROBE = re.compile(r"proposer|draft", re.IGNORECASE)


def module_sources() -> dict[str, tuple[Path, str]]:
    """module name -> (its file, its source) for every module of the installed packages."""
    out: dict[str, tuple[Path, str]] = {}
    for folder, prefix in ROOTS.items():
        base = REPO / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if not name.startswith(GENERATED):
                out[name] = (path, path.read_text())
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(module: str, path: Path, level: int, target: str | None) -> str:
    """The absolute name a (possibly relative) import in `module` (at `path`) refers to."""
    if level == 0:
        return target or ""
    package = module if _is_package(path) else module.rpartition(".")[0]
    for _ in range(level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{target}" if target else package


def _known(name: str, modules: set[str]) -> str | None:
    """The longest known module `name` starts with (an attribute import names its module)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


@functools.lru_cache(maxsize=None)
def parsed(source: str) -> ast.Module:
    """A source's tree, parsed once: the checks and their mutants walk the same files many
    times (a mutant re-parses only the file it changed). Read-only: nothing edits a tree."""
    return ast.parse(source)


def imports_of(module: str, path: Path, source: str, modules: set[str]) -> set[str]:
    """Every module of ours `module` imports, wherever the import sits (module level, inside a
    function, or as a string given to importlib: a literal naming one of our modules, alone or
    as "module:function", in a file that calls importlib; "namespace::op" names a torch op)."""
    tree = parsed(source)
    names: set[str] = set()
    dynamic = "importlib" in source
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node.level, node.module)
            for alias in node.names:         # `from . import gqa` imports gqa, not the package again
                sub = f"{base}.{alias.name}"
                names.add(sub if sub in modules else base)
        elif dynamic and isinstance(node, ast.Constant) and isinstance(node.value, str) and "::" not in node.value:
            text = node.value.split(":")[0]
            if re.fullmatch(r"[A-Za-z_][\w.]*", text) and text in modules:
                names.add(text)
    found = {_known(n, modules) for n in names}
    return {m for m in found if m is not None and m != module}


def import_graph(sources: dict[str, tuple[Path, str]]) -> dict[str, set[str]]:
    modules = set(sources)
    return {m: imports_of(m, path, text, modules) for m, (path, text) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        # iterative DFS: (node, iterator over its edges)
        work = [(v, iter(sorted(graph.get(v, ()))))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        scc.append(w)
                        if w == node:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def core_violations(graph: dict[str, set[str]], sources: dict[str, tuple[Path, str]]) -> list[str]:
    """Imports from the core library (files under sparrow/) of services, training or benchmarks."""
    core = REPO / "sparrow"
    return [f"{m} -> {t}" for m, targets in graph.items() if sources[m][0].is_relative_to(core)
            for t in sorted(targets) if t.startswith(CORE_MAY_NOT_IMPORT)]


def proposer_probes(sources: dict[str, tuple[Path, str]]) -> list[str]:
    """hasattr/getattr calls whose object is a proposer or a draft state (a typed contract
    says what every proposer and state has; probing for it is dispatch by accident)."""
    out = []
    for module, (path, text) in sources.items():
        for node in ast.walk(parsed(text)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args
                    and PROPOSER_PROBE.search(ast.unparse(node.args[0]))):
                out.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.fixture(scope="module")
def sources():
    return module_sources()


def _mutant(sources, module: str, extra: str):
    path, text = sources[module]
    return {**sources, module: (path, text + "\n" + extra + "\n")}


def test_walks_every_package(sources):
    for prefix in ROOTS.values():
        assert any(m == prefix or m.startswith(prefix + ".") for m in sources), prefix
    graph = import_graph(sources)
    assert "sparrow.config" in graph["sparrow.engine"]
    assert sum(len(t) for t in graph.values()) > 200          # the walk sees the real imports


def test_no_import_circles(sources):
    assert circles(import_graph(sources)) == []


def test_a_circle_is_found_wherever_its_import_sits(sources):
    lazy = "def _late():\n    from .engine import Engine\n    return Engine"
    found = circles(import_graph(_mutant(sources, "sparrow.config", lazy)))
    assert any({"sparrow.config", "sparrow.engine"} <= set(c) for c in found)
    by_string = "import importlib\n_BACKEND = 'sparrow.scheduler:Scheduler'\nimportlib.import_module"
    found = circles(import_graph(_mutant(sources, "sparrow.config", by_string)))
    assert any({"sparrow.config", "sparrow.scheduler"} <= set(c) for c in found)


def test_core_imports_no_service_training_or_benchmark(sources):
    graph = import_graph(sources)
    assert core_violations(graph, sources) == []
    for extra in ("def f():\n    from sparrow.cli import main", "from ..training import trainer",
                  "import importlib\nimportlib.import_module('benchmarks.speculative')"):
        mutant = _mutant(sources, "sparrow.models.target", extra)
        assert core_violations(import_graph(mutant), mutant) != [], extra


def test_no_hasattr_or_getattr_dispatch_on_proposers(sources):
    assert proposer_probes(sources) == []
    for extra in ("def f(engine):\n    return hasattr(engine.proposer, 'begin_request')",
                  "def g(request):\n    return getattr(request.draft_state, 'kv', None)"):
        assert proposer_probes(_mutant(sources, "sparrow.engine", extra)) != [], extra


def test_no_source_file_over_the_limit(sources):
    long = {m: len(text.splitlines()) for m, (_, text) in sources.items() if len(text.splitlines()) > MAX_LINES}
    assert long == {}


def repeated_basenames(sources: dict[str, tuple[Path, str]]) -> dict[str, list[str]]:
    """basename -> the modules that share it, for names outside SHARED_BASENAMES."""
    by_name: dict[str, list[str]] = {}
    for module, (path, _) in sources.items():
        by_name.setdefault(path.name, []).append(module)
    return {n: sorted(ms) for n, ms in by_name.items() if len(ms) > 1 and n not in SHARED_BASENAMES}


def live_reach_ins(sources: dict[str, tuple[Path, str]]) -> list[str]:
    """Lines of live code that touch the engine's insides (comments and docstrings aside)."""
    out = []
    for module, (_, text) in sources.items():
        if not module.startswith(LIVE_CODE):
            continue
        for node in ast.walk(parsed(text)):
            if isinstance(node, ast.Attribute) and REACH_IN.search("." + node.attr):
                out.append(f"{module}:{node.lineno}: .{node.attr}")
    return out


def test_no_two_modules_share_a_basename(sources):
    assert repeated_basenames(sources) == {}
    twin = {**sources, "sparrow.services.engine": (REPO / "services" / "engine.py", "")}
    assert repeated_basenames(twin) == {"engine.py": ["sparrow.engine", "sparrow.services.engine"]}


def test_live_code_uses_the_engines_public_seams(sources):
    assert live_reach_ins(sources) == []
    for extra in ("def f(engine):\n    return engine.runner.arena.free_tokens",
                  "def g(gen):\n    gen._events.put(None)", "def h(engine):\n    engine.scheduler.call_soon(print)"):
        assert live_reach_ins(_mutant(sources, "sparrow.live.session", extra)) != [], extra
