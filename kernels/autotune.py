"""Attention paths chosen by measuring them on the machine they run on.

A kernel tuned on one CPU is a guess on another (the C++ prefix kernel, tuned on an AMD EPYC, is
1.5-2.9x slower than torch's flash op on an Intel Xeon with AMX). So every path that can serve a
shape is timed once, off the serving path, per

    (device, dtype, head dim, kv heads, group, query-rows bucket, keys bucket)

and the fastest serves from then on. A shape first seen is served by the caller's default (what
it would do without measurements) while a worker thread times the candidates on tensors of that
shape (one worker for every tuner: one measurement at a time); the choice is kept for the process
and in a file beside the extension builds, named by the CPU, torch and the kernels' build keys,
so the next process starts with it. cuBLAS, oneDNN and Triton's autotuner all work this way.
Each timed call goes between two of the schedulers' turns, never beside one, and a busy engine
gives the tuner at most a quarter of its time (sparrow/tuning_gate.py): timing beside serving
slowed both and made the timings noisy.

    SPARROW_ATTENTION_PATH=kernel|flash|dense   force one attention path wherever it can serve (no timing)
    SPARROW_AUTOTUNE=0                          no timing: the callers' defaults serve

The draft's levels are chosen the same way (kernels/draft_chain.py: torch's levels or the C++
kernel, per draft geometry, window, key slots and batch-rows bucket), by a tuner of their own
with its own override (SPARROW_DRAFT_NATIVE) and its own file here.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import queue
import statistics
import threading
import time
from pathlib import Path
from typing import Callable, Hashable

import torch

from sparrow.tuning_gate import GATE

log = logging.getLogger(__name__)

FORCED = os.environ.get("SPARROW_ATTENTION_PATH", "").strip().lower() or None
ENABLED = os.environ.get("SPARROW_AUTOTUNE", "1").strip() != "0"
# At least MIN_REPS rounds (each candidate once, interleaved) after one warm-up, more while under
# BUDGET_S a candidate.
MIN_REPS, MAX_REPS, BUDGET_S = 5, 40, 0.25
# Where the two fastest are within CLOSE of each other, up to CLOSE_FACTOR times the rounds.
CLOSE, CLOSE_FACTOR = 0.08, 4


@functools.lru_cache(maxsize=4096)
def rows_bucket(n: int) -> int:
    """Query rows (tokens a step scores) by bucket: every count to 4, then steps of about 1.5x."""
    if n <= 4:
        return n
    return int(round(1.5 ** math.ceil(math.log(n, 1.5))))


def keys_bucket(p: int) -> int:
    """Cached keys by bucket: half powers of two (512, 724, 1024, 1448, ...), read off the bit
    length (a call a layer: no logarithms)."""
    if p <= 64:
        return 64
    low = 1 << (p - 1).bit_length() - 1            # the power of two below p (p itself excluded)
    mid = int(round(low * 1.4142135623730951))
    return mid if p <= mid else 2 * low


Key = tuple[Hashable, ...]
# A measurement: the candidates' names, and a function that makes inputs of the shape and returns,
# for a candidate's name, a zero-argument callable running that path once on them.
Bench = Callable[[], Callable[[str], Callable[[], object]]]


class PathTuner:
    """Chooses among named paths per key by timing them; `choice` never waits on a measurement."""

    def __init__(self, name: str, store: Callable[[], Path | None],
                 forced: Callable[[], str | None] | None = None, clock: Callable[[], float] = time.perf_counter):
        # forced: the path an override names (None: none), by default SPARROW_ATTENTION_PATH's;
        # clock: what a run costs (wall time; time.thread_time for paths that run on the calling
        # thread alone, so a busy serving thread's hold on the GIL is not charged to them)
        self.name, self._store, self._forced, self._clock = name, store, forced, clock
        self._chosen: dict[Key, str] = {}
        self._times: dict[Key, dict[str, float]] = {}
        self._pending: set[Key] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loaded = False

    def choice(self, key: Key, candidates: tuple[str, ...], bench: Bench,
               snapshot: Callable[[], object] | None = None) -> str | None:
        """The fastest of `candidates` for `key`, if measured; else None (the caller's default
        serves) and the measurement is queued. A forced path wins where it is a candidate.
        snapshot: called on this thread only when the measurement is queued (copies of live
        inputs the bench times on); its value is then bench's one argument."""
        forced = FORCED if self._forced is None else self._forced()
        if forced is not None:
            return forced if forced in candidates else None
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        full = (*key, candidates)
        chosen = self._chosen.get(full)
        if chosen is not None or not ENABLED:
            return chosen
        if not self._loaded:
            self._load()
            chosen = self._chosen.get(full)
            if chosen is not None:
                return chosen
        with self._lock:
            if full in self._pending or self._stop.is_set():
                return None
            self._pending.add(full)
            if snapshot is not None:
                try:
                    bench = functools.partial(bench, snapshot())
                except Exception as exc:  # noqa: BLE001 - nothing to time on: the default serves
                    log.warning("%s: could not copy the inputs of %s (%s: %s); the default serves", self.name,
                                full, type(exc).__name__, exc)
                    self._pending.discard(full)
                    self._chosen[full] = candidates[0]
                    return None
        WORKER.put((self, full, candidates, bench))
        return None

    def times(self, key: Key, candidates: tuple[str, ...]) -> dict[str, float] | None:
        """The measured ms of each candidate for key (None: not measured in this process)."""
        return self._times.get((*key, candidates))

    def measured(self) -> dict[Key, tuple[str, dict[str, float]]]:
        """What this process measured: per key (the candidates last) the choice and each one's ms."""
        return {full: (self._chosen[full], dict(ms)) for full, ms in list(self._times.items())}

    def measure(self, key: Key, candidates: tuple[str, ...], bench: Bench) -> str:
        """Time the candidates now, on this thread; the choice is kept and returned."""
        full = (*key, candidates)
        make = bench()
        ms = _time({name: make(name) for name in candidates}, self._clock, self._stop.is_set)
        best = min(ms, key=ms.get)
        self._chosen[full], self._times[full] = best, ms
        log.info("%s %s: %s (%s)", self.name, key, best, ", ".join(f"{n} {t:.3f} ms" for n, t in ms.items()))
        self._save()
        return best

    def wait(self, timeout: float = 60.0) -> bool:
        """Wait until every queued measurement is done (tests, benchmarks); True if it was."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def forget(self) -> None:
        """Drop every choice (tests)."""
        with self._lock:
            self._chosen.clear()
            self._times.clear()
            self._loaded = True

    def stop(self) -> None:
        """No more measurements for this tuner (one under way finishes); its choices stay."""
        self._stop.set()

    def _run_queued(self, full: Key, candidates: tuple[str, ...], bench: Bench) -> None:
        try:
            if not self._stop.is_set():
                self.measure(full[:-1], candidates, bench)
        except Abandoned:
            pass                          # stopped (the process is ending): nothing chosen, nothing kept
        except Exception as exc:  # noqa: BLE001 - a failed measurement leaves the default serving
            log.warning("%s: could not time %s (%s: %s); the default serves", self.name, full,
                        type(exc).__name__, exc)
            self._chosen[full] = candidates[0]
        finally:
            with self._lock:
                self._pending.discard(full)

    def _load(self) -> None:
        self._loaded = True
        path = self._store()
        if path is None or not path.exists():
            return
        try:
            for entry in json.loads(path.read_text()):
                self._chosen.setdefault(_untuple(entry["key"]), entry["choice"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring %s (%s)", path, exc)

    def _save(self) -> None:
        path = self._store()
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = {}                   # what another process (or tuner) kept there meanwhile stays
            if path.exists():
                try:
                    kept = {_untuple(e["key"]): e["choice"] for e in json.loads(path.read_text())}
                except (ValueError, KeyError, TypeError):
                    kept = {}
            kept.update(self._chosen)
            entries = [{"key": list(_listed(k)), "choice": c} for k, c in list(kept.items())]
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_text(json.dumps(entries))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not keep the measured choices in %s (%s)", path, exc)


def _listed(key):
    return [list(k) if isinstance(k, tuple) else k for k in key]


def _untuple(key):
    return tuple(tuple(k) if isinstance(k, list) else k for k in key)


class Abandoned(Exception):
    """A measurement given up between two timed calls because its tuner was stopped."""


def _time(runs: dict[str, Callable[[], object]], clock: Callable[[], float] = time.perf_counter,
          stopped: Callable[[], bool] = lambda: False) -> dict[str, float]:
    """Median ms of each run() by `clock` after a warm-up, the candidates interleaved in every
    round (a load that comes and goes moves them alike), MIN_REPS..MAX_REPS rounds within about
    BUDGET_S (wall) a candidate; CLOSE_FACTOR times that where the two fastest came within CLOSE
    of each other. Raises Abandoned before any call once `stopped()`: a measurement of a long
    shape runs for seconds, and the process must not end with a call under way (torch's
    teardown under a running op aborts it)."""
    for run in runs.values():
        if stopped():
            raise Abandoned
        with GATE.tuning():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    rounds, budget, extended = MAX_REPS, BUDGET_S * len(runs), False
    start = time.perf_counter()
    while True:
        for name, run in runs.items():
            if stopped():
                raise Abandoned
            with GATE.tuning():          # between serving turns, never beside one (sparrow/tuning_gate.py)
                t0 = clock()
                run()
                times[name].append(clock() - t0)
        done = len(times[next(iter(runs))])
        if done < MIN_REPS or (done < rounds and time.perf_counter() - start < budget):
            continue
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        first, second = (sorted(ms.values()) + [float("inf")])[:2]
        if extended or second > first * (1 + CLOSE):
            return ms
        rounds, budget, extended = rounds * CLOSE_FACTOR, budget * CLOSE_FACTOR, True


def store_path(*parts: str, kind: str = "attention") -> Path | None:
    """A file beside the extension builds, named by `kind`, the CPU, torch and `parts` (build keys)."""
    try:
        from .native import cpu_tag, extensions_root
        tag = "_".join([cpu_tag(), torch.__version__.replace("+", "-"), *parts])
        return extensions_root() / "sparrow_tuned" / f"{kind}_{tag}.json"
    except Exception:  # noqa: BLE001 - no place to keep them: measured again next process
        return None


class _Worker:
    """The one thread that times every tuner's queued measurements, one at a time (two measured at
    once would each be timed under the other's load). A daemon that only waits and times small
    ops: it holds no file or lock, ends when idle for a second, and the exit hook stops it between
    two measurements."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def put(self, item: tuple) -> None:
        with self._lock:
            self._queue.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sparrow-tune", daemon=True)
                self._thread.start()

    def join(self, timeout: float) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                tuner, full, candidates, bench = self._queue.get(timeout=1.0)
            except queue.Empty:
                with self._lock:                  # idle: ends; the next queued shape starts another
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            tuner._run_queued(full, candidates, bench)


WORKER = _Worker()


# How long the exit hook waits for the call under way (a measurement stops before its next one).
EXIT_JOIN_S = 30.0


def _stop_all() -> None:
    for tuner in list(TUNERS):
        tuner.stop()
    WORKER.join(timeout=EXIT_JOIN_S)


TUNERS: list[PathTuner] = []
atexit.register(_stop_all)


def tuner(name: str, store: Callable[[], Path | None], forced: Callable[[], str | None] | None = None,
          clock: Callable[[], float] = time.perf_counter) -> PathTuner:
    """A registered PathTuner (stopped at exit)."""
    made = PathTuner(name, store, forced, clock)
    TUNERS.append(made)
    return made
