"""The load benchmark's configuration and its workload: which videos, which questions, and when
each request arrives (Poisson at a rate) or which client sends it (closed loop)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.world_videos import WORLDS, world_prompts, world_short_questions
from sparrow.world.scenes import LADDER

METHODS = ("plain", "sparrow")
# (side px, frames, videos): 504, 8,064 and 25,056 visual tokens with the world target
MIX = ((LADDER[0][0], LADDER[0][1], 4), (LADDER[2][0], LADDER[2][1], 2), (LADDER[-1][0], LADDER[-1][1], 1))
SMOKE_MIX = ((84, 8, 1), (112, 8, 1))          # tiny models: 36 and 64 visual tokens (v2: 72 and 128)


@dataclass(frozen=True, slots=True)
class Objective:
    """A request meets the objective iff its time to first token is within `ttft_s` plus
    `prefill_s_per_1k` for every 1,000 prompt tokens it had to prefill (a cold video pays its
    prefill; a repeat question about a cached video does not), and its time per output token
    after the first ((end - first token) / (tokens - 1)) is within `tpot_ms`."""

    ttft_s: float = 2.0
    prefill_s_per_1k: float = 1.0
    tpot_ms: float = 50.0
    attain: float = 0.9        # a rate is sustained when at least this share of its requests meet it

    def describe(self) -> str:
        return (f"TTFT <= {self.ttft_s:g} s + {self.prefill_s_per_1k:g} s per 1k uncached prompt tokens and "
                f"TPOT <= {self.tpot_ms:g} ms; a rate is sustained when >= {100 * self.attain:g}% of its requests "
                f"meet it (and every lower rate is sustained)")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    models: str = "models"                               # DIR with world/{target,draft}
    mix: tuple[tuple[int, int, int], ...] = MIX          # (side px, frames (v2: seconds), videos of that size)
    world: str = "v1"                                    # the videos' and questions' world (benchmarks.world_videos)
    questions: int = 3                                   # asked about each video (the first is cold)
    long_share: float | None = None                      # a repeat question's chance of a long answer; None: drawn
                                                         # from every prompt alike
    rates: tuple[float, ...] = (0.25, 0.5, 1.0)          # requests/s, Poisson arrivals
    concurrency: tuple[int, ...] = ()                    # closed loop: N clients, each sends its next when done
    methods: tuple[str, ...] = METHODS
    max_new_tokens: int = 256                            # a cap: answers end at their own end of turn
    temperature: float = 0.0
    seed: int | None = None                              # None: fresh videos and arrivals every run
    objective: Objective = Objective()
    request_timeout_s: float = 600.0                     # each call's gRPC deadline
    warmup_tokens: int = 8                               # one untimed request per method first

    def __post_init__(self) -> None:
        if self.long_share is not None and not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        if self.world not in WORLDS:
            raise ValueError(f"unknown world {self.world!r}; choose from {WORLDS}")
        if not self.mix or any(n < 1 for _, _, n in self.mix) or self.questions < 1:
            raise ValueError("need a non-empty mix of videos (>= 1 each) and questions >= 1")
        if not (self.rates or self.concurrency):
            raise ValueError("give request rates, closed-loop concurrencies, or both")
        if any(r <= 0 for r in self.rates) or any(c < 1 for c in self.concurrency):
            raise ValueError("rates must be > 0 and concurrencies >= 1")
        if list(self.rates) != sorted(set(self.rates)):
            raise ValueError(f"rates must be increasing, got {self.rates}")
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise ValueError(f"methods must be a non-empty subset of {METHODS}")
        if self.max_new_tokens < 2 or self.request_timeout_s <= 0:
            raise ValueError("need max_new_tokens >= 2 and a positive request timeout")


@dataclass(frozen=True, slots=True)
class Ask:
    """One request of the workload: a question about video `video` at `at` seconds (open loop)."""

    video: int
    prompt: str
    at: float = 0.0


def fresh_seed() -> int:
    """World video seeds clear of training (< 1e9) and the other benchmarks (2e9, 3e9, 4e9)."""
    return 5 * 10**9 + random.SystemRandom().randrange(10**9)


def asks(num_videos: int, questions: int, seed: int, world: str = "v1", long_share: float | None = None) -> list[Ask]:
    """Every video asked `questions` questions (a caption, in v2 a timed narration, first; then
    short ones, or further captions: a long one with chance `long_share`, or with None drawn from
    every prompt alike), in a shuffled order in which each video's questions keep their order:
    repeats arrive while the video is cached."""
    rng = random.Random(seed)
    long, short = world_prompts(world), world_short_questions(world)
    rest = (*long, *short)

    def repeat() -> str:
        if long_share is None:
            return rest[rng.randrange(len(rest))]
        pool = long if rng.random() < long_share else short
        return pool[rng.randrange(len(pool))]

    per_video = [[long[rng.randrange(len(long))]] + [repeat() for _ in range(questions - 1)] for _ in range(num_videos)]
    order = [v for v in range(num_videos) for _ in range(questions)]
    rng.shuffle(order)
    taken = [0] * num_videos
    out = []
    for v in order:
        out.append(Ask(v, per_video[v][taken[v]]))
        taken[v] += 1
    return out


def poisson(requests: list[Ask], rate: float, seed: int) -> list[Ask]:
    """The requests with Poisson arrival times at `rate` per second (the first at 0)."""
    rng, t, out = random.Random(seed), 0.0, []
    for i, a in enumerate(requests):
        if i:
            t += rng.expovariate(rate)
        out.append(Ask(a.video, a.prompt, t))
    return out
