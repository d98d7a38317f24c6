"""Dependencies point one way (DESIGN.md, Layout): services -> sparrow <- training, and the
kernels are leaves the core reaches only by name, through the attention-backend registry.

Two checks: importing the core loads neither training nor services (what a process pays for
`import sparrow`), and no import statement anywhere in the core or the kernels, including
the ones inside functions that run only when called, points the wrong way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import sparrow
import sparrow.kernels

CORE = Path(sparrow.__file__).parent          # sparrow/ (services, kernels, training live elsewhere)
KERNELS = Path(sparrow.kernels.__file__).parent


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module an import statement in `path` names, relative imports resolved against
    `package` (the module's own package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)   # `from pkg import module`
    return names


def modules_under(root: Path, package: str) -> dict[str, tuple[Path, str]]:
    """module name -> (file, the package its relative imports resolve against)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        pkg = ".".join([package] + parts[:-1])
        name = pkg if parts[-1] == "__init__" else f"{pkg}.{parts[-1]}"
        out[name] = (path, pkg)
    return out


def test_importing_the_core_loads_neither_training_nor_services():
    core = sorted(modules_under(CORE, "sparrow"))
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith(('sparrow.training', 'sparrow.services'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "sparrow.engine" in core and "sparrow.scheduler" in core and "sparrow.tiny" in core
    assert out.stdout.strip() == "[]", f"the core pulled in {out.stdout.strip()}"


def test_a_client_command_starts_without_torch(tmp_path):
    """`sparrow generate` / `sparrow live` talk to a server: their parser, the gRPC client and the
    stubs import neither torch nor transformers (they took ~7 s to start when the package's
    names and the training commands' configs loaded the engine); `--help` exits 0."""
    code = (
        "import sys\n"
        "from sparrow.cli.main import main\n"
        "import sparrow.services.client, sparrow.services.player, sparrow.video.policy\n"
        "import sparrow.cli.generate, sparrow.cli.live\n"
        "for command in ('generate', 'live'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "print('LOADED', sorted(m for m in ('torch', 'transformers', 'sparrow.engine') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "usage: sparrow generate" in out.stdout and "usage: sparrow live" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "LOADED []"
    # the package's names still load on use
    names = "import sparrow; print(sparrow.Engine.__module__, sparrow.SpecConfig.__name__)"
    out = subprocess.run([sys.executable, "-c", names], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.stdout.split() == ["sparrow.engine", "SpecConfig"], out.stderr
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        sparrow.Engin


def test_core_imports_no_training_services_kernels_or_test_helpers():
    wrong = ("sparrow.training", "sparrow.services", "sparrow.kernels", "helpers")
    bad = {name: sorted(m for m in imported_modules(path, pkg) if m.startswith(wrong))
           for name, (path, pkg) in modules_under(CORE, "sparrow").items()}
    assert {name: mods for name, mods in bad.items() if mods} == {}


def test_kernels_are_leaves():
    """Kernels import torch, triton, flash-attn, each other and two leaf modules of the core (the
    window rule, and the gate by which serving and the path tuner take turns): nothing of the
    core that loads them (sparrow.models.attention imports them by name)."""
    allowed = ("sparrow.kernels", "sparrow.anchored_window", "sparrow.tuning_gate")
    bad = {name: sorted(m for m in imported_modules(path, pkg)
                        if m.startswith("sparrow") and not m.startswith(allowed))
           for name, (path, pkg) in modules_under(KERNELS, "sparrow.kernels").items()}
    assert {name: mods for name, mods in bad.items() if mods} == {}


def test_the_import_scan_sees_imports_inside_functions(tmp_path):
    """The scans above would pass vacuously if they missed a lazy import: they must not."""
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ..training.unroll import unroll\n    import sparrow.cli.main\n")
    assert {"sparrow.training.unroll", "sparrow.cli.main"} <= imported_modules(src, "sparrow.speculative")
