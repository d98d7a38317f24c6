"""The concurrent-streams benchmark's videos: fresh world videos, one per stream, and their
prefills cached in every engine before anything is timed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from benchmarks.concurrency.streams import grpc_call
from benchmarks.shared_prefix import share_prefix
from benchmarks.world_videos import world_prompts, world_video
from sparrow import Engine, SamplingParams
from sparrow.prefix_cache import PrefixCache
from sparrow.services.client import SparrowClient
from sparrow.video import ProcessedVideo, prepare_video


# ----- videos, prefills ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Video:
    processed: ProcessedVideo | None                      # dropped once every engine cached its prefill
    visual_tokens: int
    data: bytes
    fps: float                                            # sent over gRPC: sampled as in-process
    prompt: str
    keys: dict[str, str] = dataclasses.field(default_factory=dict)   # method -> in-process prefix cache key
    video_id: str | None = None                           # gRPC upload


def make_videos(target, side: int, frames: int, count: int, seed: int, world: str = "v1") -> list[Video]:
    """`count` fresh videos of the world (frames: seconds in v2), stream i asking prompt i in turn."""
    videos, prompts = [], world_prompts(world)
    for i in range(count):
        video, options = world_video(side, frames, seed + i, world)
        processed = prepare_video(video.source, target.processor, options)
        videos.append(Video(processed, processed.num_visual_tokens, video.data, video.fps, prompts[i % len(prompts)]))
    return videos


def cache_prefills(videos: list[Video], engines: dict[str, Engine], clients: dict[str, SparrowClient],
                   tag: str, shared: PrefixCache | None = None, target=None) -> None:
    """Before timing, every engine caches every video's prefill, through the public API: a
    1-token request naming the video (in-process by a key, over gRPC by its upload id). With a
    `shared` cache, the in-process engines answering from it get one prefill per video, made
    once for all of them (shared_prefix.share_prefix: one per bridge layer, every engine's features)."""
    sharing = {m: e for m, e in engines.items() if shared is not None and e.prefix_cache is shared}
    for i, v in enumerate(videos):
        if sharing:
            keys, _ = share_prefix(target, v.processed, v.prompt, sharing, shared, f"{tag}v{i}")
            v.keys.update(keys)
        for method, engine in engines.items():
            if method not in sharing:
                v.keys[method] = f"{tag}v{i}"
                engine.generate(v.processed, v.prompt, SamplingParams(max_new_tokens=1), video_key=v.keys[method])
        for client in clients.values():
            v.video_id = client.upload(v.data)
            grpc_call(client, v.video_id, v.prompt, 1, v.fps)()
        v.processed = None          # its pixels (~150 MB at 8k) are not needed again
