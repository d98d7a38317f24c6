"""What the command lines say while they work: progress lines for long work (a 25k-token
prefill, an evaluation over many videos), and the switch that keeps third-party progress
bars and notices (transformers' "Loading weights" bar) off the terminal unless asked for.

A progress line is rewritten in place on a terminal and printed once per update elsewhere
(logs, pipes), with the rate and the time left measured from the work done so far.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from typing import Callable, TextIO


def quiet_third_party(verbose: bool = False) -> None:
    """Unless verbose: no transformers progress bars or info/warning lines, no deprecation
    notices from the libraries underneath (they speak of their internals, not of the
    user's request). Errors still show."""
    from transformers.utils import logging as hf_logging

    if verbose:
        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity_warning()
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    for category in (FutureWarning, DeprecationWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(transformers|torch|av)(\.|$)")


def verbose_option() -> argparse.ArgumentParser:
    """The --verbose option, as an argparse parent every subcommand takes (see quiet_third_party)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--verbose", action="store_true",
                        help="show third-party progress bars and notices (model loading), hidden otherwise")
    return common


def eta_text(done: float, total: float, elapsed_s: float) -> str:
    """'12.3 s left' from the rate so far; '' before anything is done."""
    if done <= 0 or total <= done:
        return ""
    return f"{elapsed_s * (total - done) / done:.1f} s left"


class ProgressLine:
    """One line of progress: `update(done)` rewrites it (on a terminal; elsewhere at most
    every `min_interval_s`), `finish(text)` ends it."""

    def __init__(self, label: str, total: float, unit: str = "", stream: TextIO | None = None,
                 min_interval_s: float = 2.0):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.min_interval_s = 0.0 if self.tty else min_interval_s
        self._last = -1e9
        self._shown: tuple[float, str] | None = None
        # The rate is measured from the first update that reports work done, so a slow first
        # phase with nothing to count (a vision tower before the first prefill chunk) does not
        # skew the time left.
        self._first: tuple[float, float] | None = None      # (time, done)

    def update(self, done: float, note: str = "") -> None:
        now = time.perf_counter()
        if self._first is None and done > 0:
            self._first = (now, done)
        if now - self._last < self.min_interval_s or (not self.tty and (done, note) == self._shown):
            return
        self._last, self._shown = now, (done, note)
        pct = 100.0 * done / self.total if self.total else 100.0
        eta = ""
        if self._first is not None and done > self._first[1]:
            t0, d0 = self._first
            eta = eta_text(done - d0, self.total - d0, now - t0)
        parts = [f"{self.label}: {done:,.0f}/{self.total:,.0f}{self.unit} ({pct:.0f}%)", note, eta]
        self._write(", ".join(p for p in parts if p))

    def finish(self, text: str) -> None:
        self._write(f"{self.label}: {text}", end="\n")

    def _write(self, text: str, end: str = "") -> None:
        if self.tty:
            self.stream.write("\r\033[K" + text + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def watch_prefill(generation, line: ProgressLine, poll_s: float = 0.25) -> Callable[[], None]:
    """Report a running request's prefill from outside the engine: a thread polls its
    PrefillJob (positions start .. end of the prompt, `cursor` the next one to run) until
    `stop()` is called, which the caller does at the first delta (or the request's end).
    `line.total` is set to the positions to prefill once the job exists."""
    stopped = threading.Event()

    def poll() -> None:
        while not stopped.wait(poll_s):
            request = generation.request
            job = getattr(request, "job", None) if request is not None else None
            if job is None:
                continue
            line.total = job.end - job.start
            if job.cursor == job.start:
                line.update(0, "vision tower over the whole video")
            elif job.cursor >= job.end:     # prefilled; the draft builds its context before the first token
                line.update(line.total, "starting the draft")
            else:
                line.update(job.cursor - job.start)

    thread = threading.Thread(target=poll, name="prefill-progress", daemon=True)
    thread.start()

    def stop() -> None:
        stopped.set()
        thread.join()

    return stop
