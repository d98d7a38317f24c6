"""What a server runs, for both hosts, and how its engine is built from that."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from sparrow.config import TARGET_STEPS, VERIFY_KERNELS, EngineConfig, SpecConfig
from sparrow.models.draft import DraftArchitecture, SparrowDraft
from sparrow.engine import Engine
from sparrow.models.placement import check_placement
from sparrow.kernels import cpu_prefix
from sparrow.kernels import draft_chain
from sparrow.prefix_cache import PrefixCache
from sparrow.speculative.sparrow_proposer import SparrowProposer
from sparrow.services.state_cache import StateCache, open_cache

from sparrow.services.models import load_draft, load_target
from sparrow.services.config import ServiceConfig

log = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "remote")
VERIFY_ATTENTION = ("auto", "sdpa", *VERIFY_KERNELS)
# A remote draft's sampled rounds send its q: a float32 softmax over the vocabulary has no zeros
# (2.4 MB a round at k = 4 and 152k tokens). Unless the settings' spec already cuts the draft's
# q (draft_mass / draft_max_candidates), the remote placement draws from q cut to its most likely
# tokens: at most 4,096 of them holding 99.9% (~138 KB a round; the output distribution is the
# target's either way, acceptance loses at most the cut mass: BENCHMARKS.md, remote draft bytes).
REMOTE_DRAFT_CUT = dict(draft_mass=0.999, draft_max_candidates=4096)


@dataclass(frozen=True)
class AppSettings:
    """target / draft: model specs (see services.models); draft None decodes without one.
    draft_placement: "colocated" (in the target's process) or "remote" (a DraftDeployment;
    Ray only). cache: "memory" or a redis:// URL. *_deployment: Ray Serve deployment options
    (num_replicas or autoscaling_config, ray_actor_options, max_ongoing_requests, ...)."""

    target: str
    draft: str | None = None
    draft_placement: str = "colocated"
    spec: SpecConfig = SpecConfig()
    # The spec fields the operator set (settings file, inline args, flags): every other window /
    # anchors / glimpse / k / context field comes from the draft's checkpoint (spec_for).
    spec_given: frozenset[str] = frozenset()
    draft_arch: DraftArchitecture = DraftArchitecture()     # a tiny: draft's shape; a loaded draft's attention backend
    engine: EngineConfig = EngineConfig()
    cache: str = "memory"
    service: ServiceConfig = ServiceConfig()
    prefix_cache_bytes: int = 8 << 30
    prefix_cache_entries: int = 32
    draft_failover_s: float = 1.0             # the most a step waits on draft replicas before drafting in process
    draft_session_idle_s: float = 30.0         # a draft replica frees a session idle this long
    target_deployment: dict = field(default_factory=dict)
    draft_deployment: dict = field(default_factory=dict)
    # The model name the OpenAI-compatible API serves (GET /v1/models; a request's `model`); None: the target spec.
    served_model_name: str | None = None
    # Where the models load (sparrow.models.placement): dtype float32 | bfloat16 | float16 | auto;
    # device cpu | cuda[:N] | auto; device_map "auto" splits a target too large for one GPU across
    # the visible ones (needs accelerate). The draft goes on the target's device, in its dtype.
    dtype: str = "float32"
    device: str = "cpu"
    device_map: str | None = None
    # Decode/verify attention over the cache (TargetModel.verify_attention): auto (the Triton
    # split-KV kernel on CUDA, "packed" on CPU), packed, sdpa, split or triton.
    verify_attention: str = "auto"
    # How decode/verify steps run (TargetModel.target_step): eager, or compiled (each token
    # bucket compiled on a background thread the first time a step needs it; eager until then).
    # `sparrow serve` passes compiled (a long-lived server); built in code, eager unless asked.
    target_step: str = "eager"

    def __post_init__(self) -> None:
        if self.verify_attention not in VERIFY_ATTENTION:
            raise ValueError(f"verify_attention must be one of {VERIFY_ATTENTION}, got {self.verify_attention!r}")
        if self.target_step not in TARGET_STEPS:
            raise ValueError(f"target_step must be one of {TARGET_STEPS}, got {self.target_step!r}")
        if self.draft_placement not in PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {PLACEMENTS}, got {self.draft_placement!r}")
        check_placement(self.dtype, self.device, self.device_map)
        if (self.draft_placement == "remote" and self.spec.draft_mass == 1.0
                and self.spec.draft_max_candidates == 0):
            object.__setattr__(self, "spec", dataclasses.replace(self.spec, **REMOTE_DRAFT_CUT))   # replicas + fallback

    def spec_for(self, draft: SparrowDraft) -> SpecConfig:
        """The spec a server runs `draft` with: the geometry it was trained with (its checkpoint's
        trained_with) wherever the settings do not set the field."""
        return self.spec.with_geometry(draft.trained_with, self.spec_given)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.target

    @property
    def placement(self) -> str:
        return "none" if self.draft is None else self.draft_placement


def warmed_proposer(draft, spec: SpecConfig, settings: AppSettings) -> SparrowProposer:
    """The draft's proposer; with compiled draft steps, its greedy chains for the batch sizes
    this server runs are compiled here, before it serves (a target replica's colocated draft,
    or a remote draft replica), not by its first requests."""
    proposer = SparrowProposer(draft, spec)
    sizes = tuple(n for n in (1, 2, 4, 8) if n <= settings.service.max_concurrent)
    seconds = proposer.warm_up(sizes)
    if seconds > 0:
        log.info("compiled the draft's greedy chain for batch sizes up to %d in %.1f s", max(sizes), seconds)
    return proposer


def build_engine(settings: AppSettings, draft_client=None) -> tuple[Engine, StateCache]:
    """The target's engine and state cache. With a draft_client (remote placement) the
    engine drafts through it, keeping a colocated draft as the fallback."""
    from sparrow.services.draft_service import RemoteDraftProposer

    target = load_target(settings.target, settings.dtype, settings.device, settings.device_map)
    target.verify_attention = settings.verify_attention
    target.target_step = settings.target_step
    if settings.draft is not None and target.device.type == "cpu" and settings.verify_attention in ("auto", "packed"):
        cpu_prefix.start_loading()       # the verify kernel builds while the server starts (kernels/cpu_prefix.py)
    if settings.draft is not None and target.device.type == "cpu":
        draft_chain.start_loading()      # and the draft's levels (kernels/draft_chain.py)
    cache = open_cache(settings.cache)
    prefix = PrefixCache(settings.prefix_cache_bytes, settings.prefix_cache_entries)
    if settings.draft is None:
        return Engine(target, spec=SpecConfig(method="none"), prefix_cache=prefix, config=settings.engine), cache
    draft = load_draft(settings.draft, target, settings.draft_arch)
    spec = settings.spec_for(draft)
    local = warmed_proposer(draft, spec, settings)
    proposer = local if draft_client is None else RemoteDraftProposer(
        draft_client, local, spec, cache, failover_s=settings.draft_failover_s)
    return Engine(target, spec=spec, proposer=proposer, prefix_cache=prefix, config=settings.engine), cache
