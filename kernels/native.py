"""The C++ extensions in csrc/, built on first use with torch.utils.cpp_extension (ninja and a C++
compiler; -O3 -march=native) and cached in torch's extension directory (TORCH_EXTENSIONS_DIR)
under a name keyed by this CPU's features, so a later process loads one in well under a second.

A build is never paid on a serving step: `start_loading` builds on a thread of its own (a server
calls it at startup; the first call that could use an extension calls it too) and, until it is
ready, callers compute the same thing in torch. A failed build is logged once and never retried
in the process: the torch path serves, and no request fails.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")


def cpu_tag() -> str:
    """Names a build by this CPU's instruction set (-march=native): a cache directory shared by
    machines of other CPUs never loads a binary built for another one."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


# A build takes ~30-60 s; a build directory's lock older than this was left by a process killed
# mid-build (a server stopped during its startup build). torch waits on such a lock forever: every
# later process would never get the extension, and hang at exit on its build thread.
STALE_LOCK_S = 600.0


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove `build_dir`'s build lock if it is older than max_age_s (logged). True if removed."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age <= max_age_s:
        return False
    try:
        lock.unlink()
    except OSError:
        return False
    log.warning("removed a build lock %.0f s old in %s (a build killed midway)", age, build_dir)
    return True


def _clear_stale_build_lock(name: str) -> None:
    """clear_stale_lock in torch's build directory for `name`. Best effort: where torch is found
    through a private helper that a torch release no longer has, the build goes on without it."""
    try:
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return
    clear_stale_lock(Path(_get_build_directory(name, False)))


class NativeExtension:
    """One extension: `name` (the build's name, before the CPU tag), `source` (a .cpp file),
    extra compiler flags; `what` names it in the log ("the CPU prefix attention kernel")."""

    def __init__(self, name: str, source: Path, cflags: list[str], what: str):
        self.name, self.source, self.cflags, self.what = name, source, cflags, what
        self.module = None               # the loaded extension, once built
        self.failed = False              # a build failed in this process: never tried again
        self.build_seconds: float | None = None     # how long the first load took (a build, or a cached load)
        self.background = threading.Event()          # start_loading's build is running
        self._lock = threading.Lock()

    def load(self):
        """The extension (building it the first time), or None where it cannot be built."""
        if self.module is not None or self.failed:
            return self.module
        with self._lock:
            if self.module is None and not self.failed:
                t0 = time.perf_counter()
                try:
                    from torch.utils.cpp_extension import load as load_ext
                    _clear_stale_build_lock(f"{self.name}_{cpu_tag()}")
                    self.module = load_ext(name=f"{self.name}_{cpu_tag()}", sources=[str(self.source)],
                                           extra_cflags=["-O3", "-march=native", *self.cflags], verbose=False)
                    self.build_seconds = time.perf_counter() - t0
                    log.info("%s loaded in %.1f s", self.what, self.build_seconds)
                except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a build error: all mean the fallback
                    self.failed = True
                    last = (str(exc).strip().splitlines() or [""])[-1]
                    log.warning("%s not built (%s: %s); torch computes it instead", self.what,
                                type(exc).__name__, last)
        return self.module

    def start_loading(self) -> None:
        """Build (or load) on a thread of its own, now; callers use torch until it is ready. Not a
        daemon: interpreter exit waits for a build in progress rather than kill it holding the
        build directory's lock."""
        if self.module is not None or self.failed or self.background.is_set():
            return
        self.background.set()

        def build() -> None:
            try:
                self.load()
            finally:
                self.background.clear()
        threading.Thread(target=build, name=f"sparrow-build-{self.name}").start()

    def wait(self, timeout: float = 600.0) -> None:
        """Wait for a build start_loading began (tests, benchmarks: before anything is timed)."""
        deadline = time.monotonic() + timeout
        while self.background.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
