import os

os.environ.setdefault("SPARROW_AUTOTUNE", "0")     # tests choose attention paths by rule; autotune tests switch it on

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU; the flag must precede triton's first import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Tiny models: one intra-op thread avoids OpenMP spin-waiting against the test's other
# processes (Ray workers, redis, gRPC servers) on a 2-core machine.
torch.set_num_threads(1)

from sparrow.tiny import synthetic_frames, tiny_target  # noqa: E402


@pytest.fixture(scope="session")
def qwen_target():
    return tiny_target("qwen2_5_vl", seed=0)


@pytest.fixture(scope="session")
def llava_target():
    return tiny_target("llava_onevision", seed=0)


@pytest.fixture(scope="session", params=["qwen2_5_vl", "llava_onevision"])
def any_target(request, qwen_target, llava_target):
    return qwen_target if request.param == "qwen2_5_vl" else llava_target


@pytest.fixture(scope="session")
def small_video():
    return synthetic_frames(4, 56, 56, seed=1)


@pytest.fixture(scope="session")
def large_video():
    return synthetic_frames(8, 84, 112, seed=2)


# Serving fixtures (redis-server, saved tiny models, Ray) live in their own module.
pytest_plugins = ["conftest_services"]


# `make test-fast` (pytest -m "not slow") leaves these out: whole modules that start Ray clusters,
# servers in subprocesses, C++ builds or 7B-wide models, and the engine-level sampling statistics.
SLOW_MODULES = {"test_ray_serve", "test_ray_autoscale", "test_ray_bind", "test_smoke_7b", "test_native_build",
                "test_clean_stop", "test_host_faults", "test_train_draft", "test_packaging", "test_openai_api_ray"}
SLOW_NAMES = ("distribution_end_to_end", "bf16_speculative_sampling", "ray_sink", "through_a_real_ray")


# `make test` runs in two phases. First every test not marked serial, on two pytest-xdist workers
# (--dist loadgroup): a module with module-scoped fixtures (a server) runs whole on one worker, any
# other module's tests spread over both. Then the serial tests, in one process as before: tests
# that bound a wall time (a stop within 5 s, a failover within its budget, a deadline) or run Ray
# clusters and servers, whose timing another worker's load beside them would decide.
SERIAL_MODULES = {
    "test_alerts", "test_autotune", "test_clean_stop", "test_cpu_prefix_kernel", "test_draft_failover",
    "test_edges", "test_faults", "test_host_faults", "test_live_sources",
    "test_native_build", "test_openai_api", "test_openai_api_ray", "test_prom",
    "test_ray_bind", "test_ray_proxy", "test_ray_serve", "test_rtsp", "test_scheduler",
    "test_service", "test_service_limits", "test_service_live", "test_video_fuzz", "test_video_sources",
}
# The serial tests run in two processes side by side: the tests of the session's Ray node (its
# Serve applications), which wait mostly on Ray's own processes, and the rest. Each process has
# about one of the 2 cores, as each serial test had before beside its own servers.
RAY_SERIAL_MODULES = {"test_host_faults", "test_openai_api_ray", "test_prom", "test_ray_serve"}
assert RAY_SERIAL_MODULES <= SERIAL_MODULES
# Not serial, though heavy: what they wait for is an event with a generous bound, never a wall
# time another worker could break (training steps to a kill, background compiles, the scheduler's
# order held by a gate task, a 2-node Ray cluster in its own process scaling on request counts).
# test_ray_autoscale, test_train_draft, test_step_graph, test_step_graph_safety,
# test_prefill_together, test_live_fairness


def _shares_one_worker(path: str) -> bool:
    """Whether a test module's tests must share one worker: it has module-scoped fixtures."""
    with open(path) as f:
        return 'scope="module"' in f.read()


@pytest.hookimpl(optionalhook=True)     # the serial phase runs without xdist (-p no:xdist)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, done here: xdist 3.8 marks a group (an xdist_group marker) by editing an
    item's `_nodeid`, which pytest 9 no longer reads, so no group ever formed and every
    module-scoped fixture (a server, a load run) was built once per worker. This scheduler groups by the module file instead: a module
    with module-scoped fixtures goes whole to one worker, any other test goes wherever is free."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootdir = config.rootpath
    shared: dict[str, bool] = {}

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module not in shared:
                shared[module] = _shares_one_worker(str(rootdir / module))
            return module if shared[module] else nodeid

    return ModuleGroups(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1]
        if name in SLOW_MODULES or any(n in item.name for n in SLOW_NAMES):
            item.add_marker(pytest.mark.slow)
        if name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)
        if name in RAY_SERIAL_MODULES:
            item.add_marker(pytest.mark.ray_serial)
