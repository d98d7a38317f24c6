"""Autoscaling exercised: on a local 2-node Ray cluster (loopback, 1 CPU a node), load makes
Serve add a target replica on the second node and idleness removes it; every request is
answered, and answered right (token for token the in-process engine's), while replicas are
added and while they drain and stop; video-affine routing finds a video's prefill after the
scale-up (a second question reuses the first one's).

The scenario is benchmarks.autoscale (its own Ray cluster, so a subprocess: the session's
Ray instance stays untouched); this reads the run it writes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_serve_scales_target_replicas_up_under_load_and_down_when_idle(tmp_path):
    out = tmp_path / "run.json"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "benchmarks.autoscale", "--nodes", "2", "--streams", "6",
                           "--tokens", "100", "--videos", "4", "--settle", "3", "--timeout", "120",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=420,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())
    replicas = [r for _, _, r, _ in run["timeline"]]
    assert run["max_replicas"] == 2, run["timeline"]                  # one replica a node under load
    assert run["final_replicas"] == 1 and run["down_s"] is not None     # back to min_replicas when idle
    assert 1 in replicas[replicas.index(2):]                            # ... removed after it, while requests came
    assert run["answered"]["up"] > 0 and run["answered"]["down"] >= 3
    assert run["wrong"] == [] and run["errors"] == []                   # no request lost or wrong
    assert run["reused"] >= run["videos"] - 1 and run["videos"] == 4    # affinity holds after the scale event
    assert done.returncode == 0, done.stderr[-3000:]
