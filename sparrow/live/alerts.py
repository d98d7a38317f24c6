"""Alert rules: a standing yes/no question about a live stream, decided on the target's
probability of "yes", with hysteresis and a cooldown.

    every `every_s` seconds of stream: ask `question` about the window (one prefill, no decode)
      -> p = P(yes) / (P(yes) + P(no)) from the target's next-token distribution
      -> AlertState.observe(p): "fired" when p >= fire_at for fire_after checks in a row (and
         the cooldown since the last firing has passed); "cleared" when p < clear_at for
         clear_after checks in a row
      -> an Incident (rule id, fired/cleared, p, the window [start_s, end_s) the check saw)

The decision reads the probability, not the sampled word: a target that puts 0.4 on "yes"
still answers "no" greedily, and a threshold below 0.5 can still catch it. Everything here is
pure logic; sparrow/live/session.py runs the checks and services/ carries the incidents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparrow.errors import InvalidRequest

YES_WORDS = ("yes", "Yes", " yes", " Yes", "YES")
NO_WORDS = ("no", "No", " no", " No", "NO")
MAX_RULE_ID_CHARS = 128


@dataclass(frozen=True, slots=True)
class AlertRule:
    """rule_id      names the rule and its incidents
    question        a yes/no question about the window ("is a red shape in view ?")
    every_s         checked every this many seconds of stream (first when the window reaches it)
    fire_at         P(yes) at or above this counts towards firing
    clear_at        P(yes) below this counts towards clearing (default fire_at; lower: a band
                    where a firing rule stays firing and a clear one stays clear)
    fire_after      checks in a row at or above fire_at before it fires
    clear_after     checks in a row below clear_at before it clears
    cooldown_s      stream seconds after a firing before the rule may fire again
    """

    rule_id: str
    question: str
    every_s: float = 1.0
    fire_at: float = 0.5
    clear_at: float | None = None
    fire_after: int = 1
    clear_after: int = 1
    cooldown_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rule_id, str) or not self.rule_id or len(self.rule_id) > MAX_RULE_ID_CHARS:
            raise InvalidRequest(f"rule_id must be a non-empty string of at most {MAX_RULE_ID_CHARS} characters")
        if not isinstance(self.question, str) or not self.question.strip():
            raise InvalidRequest("an alert rule's question must be a non-empty string")
        if not (isinstance(self.every_s, (int, float)) and math.isfinite(self.every_s) and self.every_s > 0):
            raise InvalidRequest(f"every_s must be > 0, got {self.every_s!r}")
        if not (isinstance(self.fire_at, (int, float)) and 0.0 < self.fire_at <= 1.0):
            raise InvalidRequest(f"fire_at must be in (0, 1], got {self.fire_at!r}")
        if not (isinstance(self.clear_at_value, (int, float)) and 0.0 < self.clear_at_value <= self.fire_at):
            raise InvalidRequest(f"clear_at must be in (0, fire_at], got {self.clear_at!r}")
        for name in ("fire_after", "clear_after"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise InvalidRequest(f"{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.cooldown_s, (int, float)) and math.isfinite(self.cooldown_s) and self.cooldown_s >= 0):
            raise InvalidRequest(f"cooldown_s must be >= 0, got {self.cooldown_s!r}")

    @property
    def clear_at_value(self) -> float:
        return self.fire_at if self.clear_at is None else self.clear_at


@dataclass(frozen=True, slots=True)
class Incident:
    """A rule's state changed: kind "fired" or "cleared", at the check whose window was
    [start_s, end_s) of stream time and whose P(yes) was `probability`. Camera time of the
    window's newest frame (source PTS, wall clock) when the session knows it, else 0."""

    rule_id: str
    kind: str
    probability: float
    start_s: float
    end_s: float
    question: str = ""
    source_pts_s: float = 0.0
    wall_time_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Check:
    """One evaluation of a rule: its P(yes), the window it saw, whether the rule is firing
    after it, and the incident it caused (if any)."""

    rule_id: str
    probability: float
    start_s: float
    end_s: float
    active: bool
    incident: Incident | None


class AlertState:
    """A rule's state machine. `observe` takes each check's P(yes) in stream order."""

    def __init__(self, rule: AlertRule):
        self.rule = rule
        self.active = False                  # firing
        self._run = 0                        # checks in a row pointing away from the current state
        self._last_fired: float | None = None   # stream time (end_s) of the last firing

    def replace(self, rule: AlertRule) -> None:
        """A new definition under the same id: whether it is firing and its cooldown stay (its
        next incident is the clear of this firing); the run of checks starts again."""
        self.rule, self._run = rule, 0

    def observe(self, probability: float, start_s: float, end_s: float, *,
                source_pts_s: float = 0.0, wall_time_s: float = 0.0) -> Check:
        if not (isinstance(probability, (int, float)) and 0.0 <= probability <= 1.0):
            raise InvalidRequest(f"a probability must be in [0, 1], got {probability!r}")
        rule, incident = self.rule, None
        if not self.active:
            self._run = self._run + 1 if probability >= rule.fire_at else 0
            cooled = self._last_fired is None or end_s - self._last_fired >= rule.cooldown_s - 1e-9
            if self._run >= rule.fire_after and cooled:
                self.active, self._run, self._last_fired = True, 0, end_s
                incident = "fired"
        else:
            self._run = self._run + 1 if probability < rule.clear_at_value else 0
            if self._run >= rule.clear_after:
                self.active, self._run = False, 0
                incident = "cleared"
        made = None if incident is None else Incident(rule.rule_id, incident, float(probability), start_s, end_s,
                                                      rule.question, source_pts_s, wall_time_s)
        return Check(rule.rule_id, float(probability), start_s, end_s, self.active, made)


def yes_no_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The single-token spellings of "yes" and of "no" in this tokenizer (with and without a
    leading space, lower and upper case, where they are one token)."""
    def ids(words) -> tuple[int, ...]:
        found: list[int] = []
        for word in words:
            encoded = tokenizer.encode(word, add_special_tokens=False)
            if len(encoded) == 1 and encoded[0] not in found and tokenizer.decode(encoded).strip().lower() == word.strip().lower():
                found.append(encoded[0])
        return tuple(found)

    yes, no = ids(YES_WORDS), ids(NO_WORDS)
    if not yes or not no:
        raise InvalidRequest("this target's tokenizer has no single token for 'yes' and 'no': it cannot run alert rules")
    return yes, no


def yes_probability(probs: tuple[float, ...], num_yes: int) -> float:
    """P(yes) among the yes/no answers: probs holds the yes tokens' then the no tokens' probabilities."""
    yes, no = sum(probs[:num_yes]), sum(probs[num_yes:])
    total = yes + no
    return yes / total if total > 0 else 0.0


__all__ = ["AlertRule", "AlertState", "Check", "Incident", "yes_no_ids", "yes_probability"]
