"""The concurrent-streams benchmark's configuration: its methods, paths, seeds and options."""

from __future__ import annotations

from dataclasses import dataclass

from sparrow.world.scenes import LADDER

# Method keys as benchmarks/engines.py reads them: every drafting method under the adaptive policy
# (k chosen per step, the engine's default), "@fixed" under fixed k.
METHODS = {"plain": "plain", "eagle": "EAGLE-style (all tokens)", "specvlm": "SpecVLM-style", "sparrow": "Sparrow",
           "sparrow@fixed": "Sparrow, fixed k", "sparrow-tree": "Sparrow tree",
           "sparrow-tree-auto": "Sparrow tree, cut by cost"}
PATHS = {"in-process": "in-process", "grpc": "gRPC"}
SEED = 3 * 10**9                 # world videos: training < 1e9, world eval 4e9, speculative 2e9
TINY_LENGTHS = ((84, 8), (112, 8))    # 36 and 64 visual tokens with the world-style processor


@dataclass(frozen=True, slots=True)
class ConcurrencyConfig:
    models: str = "models"                               # DIR with world/{target,draft}
    lengths: tuple[tuple[int, int], ...] = (LADDER[0], LADDER[2])    # (side px, frames): 504 and 8,064 tokens
    streams: tuple[int, ...] = (1, 2, 4, 8, 16)
    tokens: int = 64
    reps: int = 5
    temperatures: tuple[float, ...] = (0.0,)            # T > 0: request i seeded with seed + i
    methods: tuple[str, ...] = ("plain", "sparrow")        # "sparrow@fixed" on request (--methods)
    paths: tuple[str, ...] = tuple(PATHS)
    k: int = 4
    tree: tuple[int, int, int] = (2, 2, 12)      # sparrow-tree: width, branch, node budget
    seed: int = SEED
    warmup_tokens: int = 8                               # one untimed request per method and path first
    # Before each length's first rep, the whole configuration once, untimed, on videos of its own:
    # a server in service has met its shapes (the path tuner's timings, the policy's cost fits)
    warm_lengths: bool = True
    prefill_video: tuple[int, int] | None = LADDER[-1]   # 25,056 tokens; None: no prefill scenario
    prefill_streams: int = 8
    prefill_reps: int = 5
    prefill_stream_tokens: int = 2048                    # enough to outlast the prefill (checked)
    before_s: float = 2.0
    prefill_shorts: int = 6                              # short uncached requests asked during the long prefill
    short_gap_s: float = 0.5                             # the pause before each of them
    share_prefill: bool = False          # in-process engines read one cached prefill per video (not one each)
    # A stream ends at the answer's end-of-turn (or `tokens`), as a user's does; False: every
    # stream runs `tokens` (past the answer's end: text the draft was never trained on)
    stop_at_eos: bool = False
    target_step: str = "eager"           # TargetModel.target_step; "compiled": every bucket built before timing
    world: str = "v1"                    # whose videos and prompts (benchmarks/world_videos.py); lengths in its units

    def __post_init__(self) -> None:
        if not self.streams or list(self.streams) != sorted(set(self.streams)) or self.streams[0] < 1:
            raise ValueError(f"streams must be increasing counts >= 1, got {self.streams}")
        for name, given, known in (("methods", self.methods, METHODS), ("paths", self.paths, PATHS)):
            if not given or any(x not in known for x in given):
                raise ValueError(f"{name} must be a non-empty subset of {list(known)}, got {given}")
        if not self.lengths or self.reps < 1 or self.tokens < 2 or self.prefill_streams < 1:
            raise ValueError("need lengths, reps >= 1, tokens >= 2 and prefill_streams >= 1")
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"temperatures must be a non-empty list of values >= 0, got {self.temperatures}")

    @property
    def videos_per_rep(self) -> int:
        """One video per stream; the prefill scenario's streams use the shortest length's."""
        return max(self.streams[-1], self.prefill_streams if self.prefill_video else 0)
