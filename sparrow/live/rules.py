"""A live session's alert rules (sparrow/live/alerts.py) run on its window.

    a frame pair prefilled -> the rules due at its end (their own cadence, in stream time)
      -> per rule: the session's `ask` with max_new_tokens 1 and the yes/no token ids: one
         prefill of the question on a copy of the window's cache, the target's first-position
         probabilities read, no decode step, no draft
      -> P(yes) -> AlertState.observe -> a "check" LiveEvent (its Check; .incident when the
         rule fired or cleared)

Rules are created, listed, replaced and removed at any time (thread-safe: the session's lock).
A rule whose previous check is still running skips a due check rather than queue behind it
(an engine busy with other work does not pile up checks); a check that ends after a later one
is not applied (the state machine sees checks in stream order).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from sparrow.live.alerts import AlertRule, AlertState, Check, yes_no_ids, yes_probability
from sparrow.config import SamplingParams
from sparrow.errors import InvalidRequest
from sparrow.output import GenerationOutput, TokenDelta

CHECK_SAMPLING = SamplingParams(max_new_tokens=1)


@dataclass(slots=True)
class _Entry:
    state: AlertState
    next_s: float
    running: bool = False
    last_end_s: float = -1.0          # the window end of the last check applied


class LiveAlerts:
    """The alert rules of one LiveSession (`session.alerts`). What it needs of the session:
    its lock, `ask` (a question on the window now), the window's end and open check, the
    target's tokenizer, and where checks and errors go."""

    def __init__(self, lock: threading.RLock, ask: Callable[..., Any], window_end: Callable[[], float],
                 check_open: Callable[[], None], tokenizer, on_check: Callable[[Check], None],
                 on_error: Callable[[str, BaseException], None]):
        self._lock, self._ask, self._window_end, self._check_open = lock, ask, window_end, check_open
        self._tokenizer, self._on_check, self._on_error = tokenizer, on_check, on_error
        self._rules: dict[str, _Entry] = {}
        self._ids: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    # ----- the rules (any thread) --------------------------------------------------------------------
    def add(self, rule: AlertRule) -> str:
        """A new rule, first checked when the window reaches `every_s` seconds past its newest pair."""
        self._token_ids()                     # a target without yes/no tokens refuses the rule now
        with self._lock:
            self._check_open()
            if rule.rule_id in self._rules:
                raise InvalidRequest(f"alert rule {rule.rule_id!r} exists already (replace it instead)")
            self._rules[rule.rule_id] = _Entry(AlertState(rule), self._window_end() + rule.every_s)
        return rule.rule_id

    def replace(self, rule: AlertRule) -> None:
        """A new definition for an existing rule (AlertState.replace: firing state and cooldown kept)."""
        with self._lock:
            self._check_open()
            entry = self._rules.get(rule.rule_id)
            if entry is None:
                raise InvalidRequest(f"no alert rule {rule.rule_id!r}")
            if rule.every_s != entry.state.rule.every_s:
                entry.next_s += rule.every_s - entry.state.rule.every_s
            entry.state.replace(rule)

    def remove(self, rule_id: str) -> bool:
        with self._lock:
            return self._rules.pop(rule_id, None) is not None

    def list(self) -> list[AlertRule]:
        with self._lock:
            return [entry.state.rule for entry in self._rules.values()]

    def active(self, rule_id: str) -> bool:
        """Whether the rule is firing now."""
        with self._lock:
            entry = self._rules.get(rule_id)
            if entry is None:
                raise InvalidRequest(f"no alert rule {rule_id!r}")
            return entry.state.active

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    # ----- checks (the scheduler thread) -------------------------------------------------------------
    def due(self, end_s: float) -> list[_Entry]:
        """The rules due at a pair ending at `end_s`, marked running. Lock held."""
        due = []
        for entry in self._rules.values():
            if entry.next_s > end_s + 1e-9:
                continue
            while entry.next_s <= end_s + 1e-9:
                entry.next_s += entry.state.rule.every_s
            if not entry.running:             # else skipped: its last check has not come back yet
                entry.running = True
                due.append(entry)
        return due

    def run(self, due: list[_Entry]) -> None:
        for entry in due:
            self._check(entry)

    def _check(self, entry: _Entry) -> None:
        yes, no = self._token_ids()
        rule = entry.state.rule
        rule_id = rule.rule_id
        box: dict[str, Any] = {"done": threading.Event()}

        def sink(item: Any) -> None:
            if isinstance(item, TokenDelta):
                return
            box["done"].wait()
            answer = box.get("answer")
            if isinstance(item, GenerationOutput) and item.first_token_probs is not None and answer is not None:
                self._apply(entry, answer, yes_probability(item.first_token_probs, len(yes)))
            else:
                self._finished(entry)
                if not isinstance(item, GenerationOutput):
                    self._on_error(rule_id, item)

        try:
            box["answer"] = self._ask(rule.question, CHECK_SAMPLING, question_id=rule_id, sink=sink,
                                      first_token_ids=yes + no)
        except Exception as exc:  # noqa: BLE001 - e.g. the engine is full: the event says so
            self._finished(entry)
            self._on_error(rule_id, exc)
        finally:
            box["done"].set()

    def _apply(self, entry: _Entry, answer, probability: float) -> None:
        with self._lock:
            entry.running = False
            if self._rules.get(entry.state.rule.rule_id) is not entry:   # removed while its check ran
                return
            if answer.end_s < entry.last_end_s:
                return
            entry.last_end_s = answer.end_s
            camera = answer.camera            # the window's newest frame: its source PTS and arrival
            check = entry.state.observe(probability, answer.start_s, answer.end_s,
                                        source_pts_s=camera.source_pts_s if camera is not None else 0.0,
                                        wall_time_s=camera.wall_time_s if camera is not None else 0.0)
        self._on_check(check)

    def _finished(self, entry: _Entry) -> None:
        with self._lock:
            entry.running = False

    def _token_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if self._ids is None:
            self._ids = yes_no_ids(self._tokenizer)
        return self._ids
