"""How much of the scheduler thread prefill slices (and call_soon tasks) may take while streams
decode: a balance of seconds, earned at `share` of the wall time and spent by each slice's own
time; a slice may start while the balance is not negative, and the balance never holds more
than `burst_s`.

With `burst_s` 0 this is strict alternation: after a slice of s seconds the next waits
s x (1 - share) / share (the scheduler's rule before the balance). With a burst, prefill that
has not used its share lately may run up to `burst_s / (1 - share)` seconds (plus the last
slice) back to back: a burst of questions arriving a few ms apart (8 gRPC streams at once) is
prefilled in consecutive slices, so its streams start decoding in one batch rather than a
staircase of groups each behind a decode step. Sustained, prefill still gets at most `share`.

Slices run while nothing decodes are not charged: they delay no one. Times are the caller's
clock (the scheduler's time.perf_counter), passed in.
"""

from __future__ import annotations


class PrefillPacer:
    def __init__(self, share: float, burst_s: float):
        if not 0 < share <= 1 or burst_s < 0:
            raise ValueError(f"need 0 < share <= 1 and burst_s >= 0, got {share}, {burst_s}")
        self.share, self.burst_s = share, burst_s
        self.balance = burst_s           # seconds of prefill that may run now
        self.at = None                   # when the balance was last brought up to date

    def _update(self, now: float) -> None:
        if self.at is not None:
            self.balance = min(self.burst_s, self.balance + self.share * (now - self.at))
        self.at = now

    def may_run(self, now: float, decoding: bool) -> bool:
        """Whether a slice may start now (always, while no stream decodes)."""
        self._update(now)
        return not decoding or self.balance >= 0

    def ran(self, started: float, now: float, decoding: bool) -> None:
        """A slice ran from `started` to `now`. Streams decoding, it cost them its time, less
        the share earned meanwhile; otherwise it is free and the balance keeps earning."""
        self._update(max(started, self.at if self.at is not None else started))
        if decoding:
            self.balance -= (1 - self.share) * (now - self.at)
            self.at = now
        else:
            self._update(now)
