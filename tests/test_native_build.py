"""C++ extension builds never hang a process (kernels/native.py): a build is a process of its own,
its lock names its owner and goes with it, every wait is bounded, and the build directory is named
by everything that changes the binary."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sparrow.kernels import cpu_prefix, native

REPO = Path(__file__).resolve().parents[1]

# A process that wants the CPU prefix kernel: it starts the build, and computes a verify step's
# attention (the kernel where it is built, torch's op until then), checked against the reference.
WANTS_THE_KERNEL = textwrap.dedent("""
    import sys, time
    import torch
    from sparrow.kernels import cpu_prefix, packed
    from sparrow.kernels.packed import verify_attention_packed
    from sparrow.kernels.reference import verify_attention_ref
    cpu_prefix.IMPL = "torch" if sys.argv[1] == "torch" else "kernel"
    packed.DENSE_PREFIX = -1
    if sys.argv[1] == "hold":      # started as a server's thread would: SIGTERM blocked (Ray's, gRPC's)
        import signal, threading
        def start():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            cpu_prefix.start_loading()
            print("started", flush=True)
            time.sleep(600)
        threading.Thread(target=start, daemon=True).start()
        time.sleep(600)
    cpu_prefix.start_loading()
    print("started", flush=True)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 3, 16, generator=g)
    k, v = torch.randn(1, 2, 203, 16, generator=g), torch.randn(1, 2, 203, 16, generator=g)
    prefix = torch.tensor([200])
    torch.testing.assert_close(verify_attention_packed(q, k, v, prefix), verify_attention_ref(q, k, v, prefix),
                               rtol=1e-4, atol=1e-5)
    print("right", "kernel" if cpu_prefix.EXTENSION.module is not None else "torch", flush=True)
    print(f"last line at {time.time()}", flush=True)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:                          # a zombie is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _session(leader: int) -> list[int]:
    """The live processes of a builder's session (the builder, ninja, the compilers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == leader and fields[0] != "Z":
                found.append(int(entry))
    return found


def _owner(build_dir: Path, within: float) -> int:
    """The pid the builder wrote into the owner lock (waits for it, bounded)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            text = (build_dir / native.OWNER_LOCK).read_text().strip()
            if text:
                return int(text)
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"no builder took the owner lock in {within} s")


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    return tmp_path / "ext"


def test_a_process_killed_mid_build_costs_the_next_one_nothing_but_the_build(ext_dir, tmp_path):
    """SIGKILL a process while its build runs: the builder (and its compilers) go with it, its lock
    with them; a second process that wants the kernel answers right within 60 s (the kernel or
    torch's op) and exits within 2 s of its last line though a build is under way."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir), "PYTHONPATH": str(REPO)}
    build_dir = ext_dir / cpu_prefix.EXTENSION.build_name
    # The first process's compiler: the real one for torch's checks, and for the compile a process
    # that says it started (its pid, in a file) and runs until killed. "Mid-build" is then an
    # event, not a guess at how long a compile takes on a loaded machine.
    compiling = tmp_path / "compiling"
    wrapper = tmp_path / "bin" / "c++"
    wrapper.parent.mkdir()
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for arg in "$@"; do
          if [ "$arg" = "-c" ]; then
            echo $$ > {compiling}.tmp && mv {compiling}.tmp {compiling}
            exec sleep 600
          fi
        done
        exec {shutil.which("c++")} "$@"
        """))
    wrapper.chmod(0o755)
    first = subprocess.Popen([sys.executable, "-c", WANTS_THE_KERNEL, "hold"], env={**env, "CXX": str(wrapper)},
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "started"
        builder = _owner(build_dir, 60)
        assert _alive(builder)
        deadline = time.monotonic() + 120          # bounds a broken build only: the event ends the wait
        while not compiling.exists():
            assert time.monotonic() < deadline, "the build never started its compiler"
            assert _alive(builder), "the builder ended before it compiled"
            time.sleep(0.05)
        compiler = int(compiling.read_text())
        assert compiler in _session(builder)
    finally:
        first.kill()
        first.wait(10)
    deadline = time.monotonic() + 5
    while _session(builder) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _session(builder)
    for pid in left:                               # a failed run leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the build outlived the process that started it: {left}"
    assert not _alive(compiler)
    (build_dir / "lock").touch()                   # torch's lock, as a build killed midway leaves it

    def run(how: str) -> tuple[list[str], float]:
        """The script's lines, and how long it took to exit after its last line."""
        done = subprocess.run([sys.executable, "-c", WANTS_THE_KERNEL, how], env=env, capture_output=True,
                              text=True, timeout=60)
        ended = time.time()
        assert done.returncode == 0, done.stderr[-2000:]
        lines = done.stdout.strip().splitlines()
        return lines, ended - float(lines[-1].rsplit(" ", 1)[1])

    t0 = time.monotonic()
    lines, exit_s = run("go")
    assert time.monotonic() - t0 < 60
    assert lines[1].startswith("right"), lines
    # The interpreter's own exit (torch, transformers) takes 0.5-2 s on a loaded 2-core machine: the
    # build may add at most 1 s to what the same script takes with no build at all.
    _, plain_exit_s = run("torch")
    assert exit_s < max(2.0, plain_exit_s + 1.0), f"exited {exit_s:.1f} s after its last line ({plain_exit_s:.1f} without a build)"


def test_a_build_waits_bounded_then_torch_serves(ext_dir, monkeypatch, caplog):
    """A builder that cannot finish (here: another live process holds the owner lock for good) is
    killed after BUILD_TIMEOUT_S; the wait ends there, with one log line, and torch's path serves."""
    import fcntl
    import logging
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 3.0)
    ext = native.NativeExtension(cpu_prefix.EXTENSION.name, cpu_prefix.EXTENSION.source,
                                 cpu_prefix.EXTENSION.cflags, "CPU prefix attention kernel (a wait that cannot end)")
    ext.build_dir.mkdir(parents=True)
    with open(ext.build_dir / native.OWNER_LOCK, "a+") as owner, \
            caplog.at_level(logging.WARNING, logger=native.__name__):
        fcntl.flock(owner, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert ext.load(timeout=30) is None
        assert time.monotonic() - t0 < 15
    assert ext.failed
    assert len([r for r in caplog.records if "not built" in r.getMessage() and ext.what in r.getMessage()]) == 1


def test_a_builder_runs_at_the_niceness_asked_for(ext_dir, monkeypatch):
    """SPARROW_BUILD_NICE: the builder (and so its compilers) runs that much nicer than its caller."""
    import fcntl
    monkeypatch.setenv(native.BUILD_NICE, "7")
    ext = native.NativeExtension(cpu_prefix.EXTENSION.name, cpu_prefix.EXTENSION.source,
                                 cpu_prefix.EXTENSION.cflags, "CPU prefix attention kernel (a nice build)")
    ext.build_dir.mkdir(parents=True)
    with open(ext.build_dir / native.OWNER_LOCK, "a+") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)            # the builder waits here, after it took its niceness
        ext.start_loading()
        mine, seen = os.getpriority(os.PRIO_PROCESS, 0), None
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and seen != mine + 7:
                builder = ext._builder
                if builder is not None:
                    try:
                        seen = os.getpriority(os.PRIO_PROCESS, builder.pid)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
        finally:
            ext.stop()
    assert seen == min(19, mine + 7)


def test_the_build_directory_is_named_by_what_changes_the_binary(monkeypatch, tmp_path):
    """Source, flags, torch's headers and the CPU each change the build's name; nothing else does."""
    from torch.utils import cpp_extension
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 1; }\n")
    base = native.build_key(source, ["-DX"])
    assert native.build_key(source, ["-DX"]) == base
    assert native.build_key(source, ["-DY"]) != base
    source.write_text("int f() { return 2; }\n")
    assert native.build_key(source, ["-DX"]) != base
    source.write_text("int f() { return 1; }\n")
    real = cpp_extension.include_paths
    monkeypatch.setattr(cpp_extension, "include_paths", lambda *a, **k: [*real(*a, **k), "/another/venv"])
    assert native.build_key(source, ["-DX"]) != base
    monkeypatch.setattr(cpp_extension, "include_paths", real)
    monkeypatch.setattr(native, "cpu_tag", lambda: "another-cpu")
    assert native.build_key(source, ["-DX"]) != base
