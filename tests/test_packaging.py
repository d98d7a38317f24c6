"""services/, kernels/, training/ install as sparrow.services / .kernels / .training: checked
from outside the repo root, where `import services` cannot work by accident (cwd on sys.path)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_subpackages_import_from_outside_the_repo(tmp_path):
    code = (
        "import importlib.util, sparrow.services, sparrow.kernels, sparrow.training, sparrow.v1.sparrow_pb2;"
        "print(sparrow.services.__file__); print(sparrow.kernels.__file__); print(sparrow.training.__file__);"
        "print(importlib.util.find_spec('services'), importlib.util.find_spec('training'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    services, kernels, training, generic = out.stdout.strip().splitlines()
    assert Path(services) == REPO / "services" / "__init__.py"
    assert Path(kernels) == REPO / "kernels" / "__init__.py"
    assert Path(training) == REPO / "training" / "__init__.py"
    assert generic == "None None"          # nothing generic lands on sys.path


def test_console_script_runs(tmp_path):
    exe = Path(sys.executable).parent / "sparrow"
    out = subprocess.run([str(exe), "--help"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "serve" in out.stdout
