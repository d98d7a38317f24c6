"""The C++ extensions in csrc/, built on first use with torch.utils.cpp_extension (ninja and a C++
compiler; -O3 -march=native) and cached in torch's extension directory (TORCH_EXTENSIONS_DIR), so
a later process loads one in well under a second.

A build can never hang or hold up a process:

- It runs in a **process of its own** (`python -c ...build_main`), in a session of its own, never
  on a thread of the caller: the caller only waits on it, for at most `BUILD_TIMEOUT_S`, and then
  uses torch's path (one log line). Nothing joins the wait at exit: a script that used the engine
  ends when its last line does; the builder dies with it (Linux: the parent-death signal; and an
  exit hook), and takes its compiler processes with it (it kills its whole session).
- **The lock records its owner**: a builder holds an flock on `owner.lock` in the build directory
  (the pid written inside), which the kernel releases the moment its holder dies, however it died.
  Only the holder builds, so torch's own `lock` file, if present, was left by a dead builder and is
  removed at once (torch waits on such a file forever).
- **The build directory is named by everything that changes the binary**: the source, the flags,
  torch's version and headers, Python's, and this CPU's instruction set; two environments on one
  machine never rebuild (or load) each other's.

A failed build is logged once and never retried in the process: the torch path serves, no request
fails. `start_loading` (a server calls it at startup; the first call that could use an extension
does too) starts the build in the background; `load` waits for it, bounded.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# A build takes ~20-45 s on a 2-core machine (the sources include ATen's core and pybind, not
# torch/extension.h: draft_chain 39 -> 21 s, cpu_prefix 48 -> 44 s); one still running after
# this is killed and the torch path serves (a wait on another process's build counts too).
BUILD_TIMEOUT_S = float(os.environ.get("SPARROW_BUILD_TIMEOUT_S", "300"))
# Niceness of a builder and its compilers (0: the caller's): a server that builds while it serves
# can leave the CPU to its requests (10), which the torch path serves meanwhile.
BUILD_NICE = "SPARROW_BUILD_NICE"
OK_MARKER = "built.ok"         # written after the module is complete: its presence means "load it"
OWNER_LOCK = "owner.lock"      # flock held by the one live builder; holds its pid


def cpu_flags_line() -> str:
    """The flags line of /proc/cpuinfo as written ("flags" on x86, "Features" on Arm; "" where it
    cannot be read): the instruction set -march=native builds for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags (avx2, avx512f, amx_tile, asimd, ...); empty where unknown."""
    line = cpu_flags_line()
    return set(line.split(":", 1)[1].split()) if ":" in line else set()


def cpu_tag() -> str:
    """This CPU's instruction set (-march=native), hashed: a cache shared by machines of other CPUs
    never loads a binary built for another one."""
    return hashlib.sha1((platform.machine() + cpu_flags_line()).encode()).hexdigest()[:10]


def build_key(source: Path, cflags: list[str]) -> str:
    """A digest of everything that changes an extension's binary: its source, flags, the torch
    build (version, the path of its headers) and the Python (version, ABI, include directory), and
    this CPU's instruction set."""
    import torch
    from torch.utils import cpp_extension
    parts = [source.read_bytes(), repr(cflags).encode(), torch.__version__.encode(),
             repr(cpp_extension.include_paths()).encode(), sys.version.encode(),
             str(sysconfig.get_config_var("SOABI")).encode(), str(sysconfig.get_paths()["include"]).encode(),
             cpu_tag().encode()]
    digest = hashlib.sha1()
    for part in parts:
        digest.update(hashlib.sha1(part).digest())
    return digest.hexdigest()[:16]


def extensions_root() -> Path:
    """torch's extension directory (TORCH_EXTENSIONS_DIR, else its default under the cache)."""
    from torch.utils.cpp_extension import get_default_build_root
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def _import(name: str, build_dir: Path):
    """The built module `name` from build_dir (torch must be imported first: it links to libtorch)."""
    path = build_dir / f"{name}.so"
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# The builder process: until build_main takes over (after imports that take seconds), it dies with
# its parent by a plain SIGKILL (Linux), its signal mask cleared first (a child inherits its
# spawning thread's, and Ray's and gRPC's threads block SIGTERM).
_BUILDER = ("import ctypes, os, signal, sys\n"
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})\n"
            "try:\n    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)\nexcept (OSError, AttributeError):\n"
            "    pass\n"
            "if os.getppid() != int(sys.argv[1]):\n    os._exit(1)\n"
            "from sparrow.kernels.native import build_main\nsys.exit(build_main(sys.argv[1:]))\n")

_children: set[subprocess.Popen] = set()          # live builders of this process, killed at exit
_exiting = threading.Event()                      # set once they are being killed


def processes():
    """(pid, parent pid, session id) of every process (Linux: read from /proc; elsewhere none)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                yield int(entry), int(fields[1]), int(fields[3])
            except (OSError, IndexError, ValueError):
                pass


def kill_session(session: int) -> None:
    """SIGKILL every process of a session (a builder's: ninja puts each compiler in a process
    group of its own, so a group kill would miss them), the caller last if it is one of them."""
    me = os.getpid()
    found = [pid for pid, _, sid in processes() if sid == session]
    for pid in sorted(found, key=lambda p: p == me):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(session, signal.SIGKILL)   # where /proc cannot be read: the builder's own group
    except OSError:
        pass


def _kill(proc: subprocess.Popen) -> None:
    """Kill a builder and its session (ninja and the compilers it started)."""
    kill_session(proc.pid)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    _children.discard(proc)


@atexit.register
def kill_builders() -> None:
    """Kill every build this process started (at exit; a server's forced stop)."""
    _exiting.set()                   # the builds' waiters then end without a "not built" line
    for proc in list(_children):
        _kill(proc)


class NativeExtension:
    """One extension: `name` (the build's name, before the build key), `source` (a .cpp file),
    extra compiler flags; `what` names it in the log ("the CPU prefix attention kernel")."""

    def __init__(self, name: str, source: Path, cflags: list[str], what: str):
        self.name, self.source, self.cflags, self.what = name, source, cflags, what
        self.module = None               # the loaded extension, once built
        self.failed = False              # a build failed in this process: never tried again
        self.build_seconds: float | None = None     # how long the first load took (a build, or a cached load)
        self.background = threading.Event()          # a build (or a wait on one) is under way
        self._done = threading.Event()               # the module is loaded or failed
        self._lock = threading.Lock()
        self._builder: subprocess.Popen | None = None
        self._key: str | None = None

    @property
    def build_name(self) -> str:
        if self._key is None:
            self._key = build_key(self.source, self.cflags)
        return f"{self.name}_{self._key}"

    @property
    def build_dir(self) -> Path:
        return extensions_root() / self.build_name

    def load(self, timeout: float | None = None):
        """The extension (building it the first time, waiting at most `timeout`, default
        BUILD_TIMEOUT_S), or None where it cannot be built in time."""
        if self.module is None and not self.failed:
            self.start_loading()
            self.wait(BUILD_TIMEOUT_S + 10 if timeout is None else timeout)
        return self.module

    def start_loading(self) -> None:
        """Load it now if built, else start its build in a process of its own; callers use torch
        until it is ready. Never blocks for longer than an import."""
        with self._lock:
            if self.module is not None or self.failed or self.background.is_set():
                return
            self.background.set()
            t0 = time.perf_counter()
            # Resolved once: a build is spawned, awaited and loaded in one directory, whatever
            # TORCH_EXTENSIONS_DIR says by the time it ends.
            build_dir = self.build_dir
            try:
                if (build_dir / OK_MARKER).exists():
                    self._loaded(_import(self.build_name, build_dir), t0)
                    return
            except Exception as exc:  # noqa: BLE001 - anything here means the torch path
                self._failed(f"{type(exc).__name__}: {exc}")
                return
        # The builder is spawned by the thread that waits on it: Linux's parent-death signal follows
        # the spawning *thread*, so a caller's short-lived thread (a scheduler's, gone when idle)
        # would take the build down with it. A daemon: it only waits, nothing to join at exit.
        threading.Thread(target=self._await_build, args=(t0, build_dir), name=f"sparrow-await-{self.name}",
                         daemon=True).start()

    def wait(self, timeout: float = BUILD_TIMEOUT_S + 10) -> None:
        """Wait (bounded) for a build start_loading began (tests, benchmarks: before anything is timed)."""
        if self.background.is_set():
            self._done.wait(timeout)

    def stop(self) -> None:
        """Kill a build under way (the process ends; the next one builds again)."""
        proc = self._builder
        if proc is not None:
            _kill(proc)

    def _spawn(self, build_dir: Path) -> subprocess.Popen:
        build_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-c", _BUILDER, str(os.getpid()), self.build_name, str(self.source),
               str(build_dir), *self.cflags]
        with open(build_dir / f"build.{os.getpid()}.log", "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env=os.environ.copy())
        _children.add(proc)
        self._builder = proc
        log.info("building %s in %s (a process of its own, pid %d)", self.what, build_dir, proc.pid)
        return proc

    def _await_build(self, t0: float, build_dir: Path) -> None:
        logfile = build_dir / f"build.{os.getpid()}.log"
        try:
            proc = self._spawn(build_dir)
            try:
                code = proc.wait(timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill(proc)
                self._failed(f"still building after {BUILD_TIMEOUT_S:.0f} s (killed)")
                return
            _children.discard(proc)
            if _exiting.is_set():
                return                                    # killed by this process's own exit or stop
            if code != 0 or not (build_dir / OK_MARKER).exists():
                tail = ""
                try:
                    tail = (logfile.read_text(errors="replace").strip().splitlines() or [""])[-1]
                except OSError:
                    pass
                self._failed(f"builder exited {code}: {tail}")
                return
            self._loaded(_import(self.build_name, build_dir), t0)
        except Exception as exc:  # noqa: BLE001 - a broken build means the torch path, never a crash
            self._failed(f"{type(exc).__name__}: {exc}")
        finally:
            self._builder = None
            try:
                logfile.unlink()
            except OSError:
                pass

    def _loaded(self, module, t0: float) -> None:
        self.module = module
        self.build_seconds = time.perf_counter() - t0
        log.info("%s loaded in %.1f s", self.what, self.build_seconds)
        self._finish()

    def _failed(self, why: str) -> None:
        self.failed = True
        log.warning("%s not built (%s); torch computes it instead", self.what, why)
        self._finish()

    def _finish(self) -> None:
        self._done.set()
        self.background.clear()


def _die_with_parent(parent: int) -> None:
    """The builder's session goes when its parent does: a parent-death signal (Linux), unblocked
    here (a child inherits its spawning thread's signal mask, and Ray's and gRPC's threads block
    SIGTERM), whose handler kills the whole session; and, whatever the platform or the mask, a
    thread that sees the parent gone within half a second and does the same."""
    def end_session(*_):
        kill_session(os.getsid(0))
    signal.signal(signal.SIGTERM, end_session)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        end_session()
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    if os.getppid() != parent:                               # the parent died before any of this was set
        end_session()


def build_main(argv: list[str]) -> int:
    """The builder process: parent pid, build name, source, build directory, extra flags. Takes
    the owner lock (waiting while another live process builds), then builds unless that one did."""
    import fcntl
    parent, name, source, build_dir, cflags = int(argv[0]), argv[1], argv[2], Path(argv[3]), argv[4:]
    _die_with_parent(parent)
    nice = int(os.environ.get(BUILD_NICE) or 0)
    if nice > 0:
        os.nice(nice)                            # the compilers inherit it
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / OWNER_LOCK, "a+") as owner:
        fcntl.flock(owner, fcntl.LOCK_EX)        # released by the kernel when this process dies
        owner.seek(0)
        owner.truncate()
        owner.write(f"{os.getpid()}\n")
        owner.flush()
        if (build_dir / OK_MARKER).exists():
            return 0                             # another process built it while this one waited
        stale = build_dir / "lock"               # torch's lock: its builder is dead (this one holds ours)
        if stale.exists():
            stale.unlink()
            print(f"removed a build lock left by a dead builder in {build_dir}", flush=True)
        from torch.utils.cpp_extension import load
        load(name=name, sources=[source], extra_cflags=["-O3", "-march=native", *cflags],
             build_directory=str(build_dir), verbose=False)
        tmp = build_dir / f"{OK_MARKER}.{os.getpid()}"
        tmp.write_text(f"{name}\n")
        tmp.rename(build_dir / OK_MARKER)
    return 0
