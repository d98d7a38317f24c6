"""Fault injection against the embedded server and a real Redis-backed state cache, all on
loopback: Redis killed, frozen (SIGSTOP) and restarted mid-run; upload chunks deleted,
corrupted, swapped between keys; absurd manifests; a video file swapped for another of the
same size and mtime; requests gRPC cannot decode and options out of bounds.

What must hold, for every fault: each request ends with the right answer (token for token
the engine's) or the right status, nothing wrong is ever returned, and memory stays bounded.

Each test records a row of the fault -> outcome table; `SPARROW_FAULT_TABLE=FILE pytest
tests/test_faults.py` writes it as markdown (the table in BENCHMARKS.md was made so).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from conftest_services import SPEC_KWARGS, start_redis

from sparrow import SamplingParams, SpecConfig
from sparrow.services.client import SparrowClient
from sparrow.services.protos import pb
from sparrow.services.server import BackgroundServer
from sparrow.services.config import ServiceConfig
from sparrow.services.servicer import SparrowService
from sparrow.services.settings import AppSettings, build_engine
from sparrow.services.state_cache import RedisStateCache

MiB = 1 << 20
PROMPT = "What happens in the video?"
TOKENS = 10


# ----- the table -----------------------------------------------------------------------------------
@dataclass
class Row:
    fault: str
    injected: str
    requests: int = 0
    right: int = 0            # the right answer, or the right status
    worst_s: float = 0.0
    outcome: str = ""


ROWS: list[Row] = []


@pytest.fixture(scope="module", autouse=True)
def fault_table():
    yield
    path = os.environ.get("SPARROW_FAULT_TABLE")
    if path and ROWS:
        lines = ["| fault | what was injected | requests | right answer or status | worst latency | outcome |",
                 "|---|---|---:|---:|---:|---|"]
        lines += [f"| {r.fault} | {r.injected} | {r.requests} | {r.right} | {r.worst_s:.2f} s | {r.outcome} |"
                  for r in ROWS]
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


class Tally:
    """Counts one fault's requests: each is timed and must end as expected."""

    def __init__(self, fault: str, injected: str, outcome: str):
        self.row = Row(fault, injected, outcome=outcome)
        ROWS.append(self.row)

    def answer(self, call, expected: list[int]) -> None:
        got = self._timed(call)
        assert got.token_ids == expected, "a wrong answer was returned"
        self.row.right += 1

    def status(self, call, code: grpc.StatusCode) -> None:
        with pytest.raises(grpc.RpcError) as info:
            self._timed(call)
        assert info.value.code() == code, info.value.details()
        self.row.right += 1

    def _timed(self, call):
        self.row.requests += 1
        start = time.monotonic()
        try:
            return call()
        finally:
            self.row.worst_s = max(self.row.worst_s, time.monotonic() - start)


# ----- fixtures ------------------------------------------------------------------------------------
def make_service(model_dirs, media_root, cache: str) -> SparrowService:
    config = ServiceConfig(max_new_tokens=2000, max_video_bytes=2 * MiB, max_message_bytes=4 * MiB,
                           max_frames=64, media_root=str(media_root))
    settings = AppSettings(target=str(model_dirs[0]), draft=str(model_dirs[1]), spec=SpecConfig(**SPEC_KWARGS),
                           cache=cache, service=config)
    engine, state_cache = build_engine(settings)
    return SparrowService(engine, state_cache, config)


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("faults-redis"))
    yield server
    os.kill(int(server.pidfile.read_text()), signal.SIGCONT)       # in case a test left it frozen
    server.stop()


@dataclass
class Replicas:
    """Two replicas sharing one Redis, as two target replicas would: each has its own local
    tier, so what one uploaded the other can only read from Redis."""

    a: BackgroundServer
    b: BackgroundServer
    on_a: SparrowClient
    on_b: SparrowClient


@pytest.fixture(scope="module")
def replicas(tiny_model_dirs, clips, redis):
    with BackgroundServer(make_service(tiny_model_dirs, clips.root, redis.url)) as a, \
            BackgroundServer(make_service(tiny_model_dirs, clips.root, redis.url)) as b, \
            SparrowClient(a.address) as on_a, SparrowClient(b.address) as on_b:
        yield Replicas(a, b, on_a, on_b)


@pytest.fixture(scope="module")
def expected(reference_engine, clips):
    """The engine's own answer for each clip (the golden reference)."""
    cache: dict[bytes, list[int]] = {}

    def answer(video: bytes) -> list[int]:
        if video not in cache:
            cache[video] = reference_engine.generate(video, PROMPT, SamplingParams(max_new_tokens=TOKENS)).token_ids
        return cache[video]
    return answer


def upload(client: SparrowClient, video: bytes) -> pb.VideoRef:
    """One upload that names its SHA-256 first, as SparrowClient does; returns the reply."""
    import hashlib
    digest = hashlib.sha256(video).hexdigest()
    return client.stub.UploadVideo(iter([pb.VideoChunk(data=video, sha256=digest)]), timeout=30)


def by_id(client: SparrowClient, video_id: str):
    return lambda: client.generate(PROMPT, video_id=video_id, max_new_tokens=TOKENS, timeout=60)


_fps = iter(range(10**6))


def by_id_uncached(replica: BackgroundServer, client: SparrowClient, video_id: str):
    """A request that must read the upload from Redis: the replica's local copy is evicted
    (as its LRU would), and sampling options no earlier request used miss its prefix cache
    (a prefill made from verified bytes may rightly answer without reading them again)."""
    replica.service.cache.local.delete(f"video:{video_id}")
    options = pb.VideoOptions(fps=1.0 + next(_fps) / 1000)
    return lambda: client.generate(PROMPT, video_id=video_id, max_new_tokens=TOKENS, timeout=60,
                                   video_options=options)


def entry_keys(redis, video_id: str) -> tuple[str, dict]:
    """(manifest key, manifest) of an upload's entry in Redis."""
    key = f"sparrow:video:{video_id}:m"
    return key, json.loads(redis.client().get(key))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ----- uploads damaged in Redis -----------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["delete", "corrupt", "truncate"])
def test_damaged_upload_is_refused_then_healed_by_uploading_again(replicas, redis, clips, expected, damage):
    video = clips.data["a"]
    done = {"delete": "deleted", "corrupt": "corrupted (a byte flipped)", "truncate": "truncated"}[damage]
    tally = Tally(f"upload chunk {done.split()[0]}", f"chunk 0 of an upload {done} in Redis, twice",
                  "NOT_FOUND, or healed by the next upload; never a wrong answer")
    video_id = upload(replicas.on_a, video).video_id
    client = redis.client()

    def harm() -> None:
        mkey, manifest = entry_keys(redis, video_id)
        chunk = f"sparrow:video:{video_id}:{manifest['nonce']}:0"
        if damage == "delete":
            client.delete(chunk)
        elif damage == "corrupt":
            byte = client.getrange(chunk, 100, 100)
            client.setrange(chunk, 100, bytes([byte[0] ^ 0xFF]))
        else:
            client.set(chunk, client.getrange(chunk, 0, 99), keepttl=True)

    harm()
    # Uploading the same bytes again over the damaged entry rewrites it: not "already stored".
    again = upload(replicas.on_b, video)
    assert again.video_id == video_id and not again.already_stored
    tally.answer(by_id(replicas.on_b, video_id), expected(video))
    assert upload(replicas.on_b, video).already_stored            # now whole: said stored, not written again
    harm()
    # A replica that has only Redis's copy refuses it (and deletes it); the uploader still
    # answers from its own tier; an upload heals it for everyone.
    tally.status(by_id_uncached(replicas.b, replicas.on_b, video_id), grpc.StatusCode.NOT_FOUND)
    assert not client.exists(f"sparrow:video:{video_id}:m")
    tally.answer(by_id(replicas.on_a, video_id), expected(video))
    assert not upload(replicas.on_b, video).already_stored
    tally.answer(by_id(replicas.on_b, video_id), expected(video))


@pytest.mark.parametrize("how", ["rewritten as a valid entry", "keys copied"])
def test_another_videos_entry_under_an_id_is_never_served(replicas, redis, clips, expected, how):
    """The entry under b's id holds a's bytes: well-formed, checksummed, and not b."""
    a, b = clips.data["b"], clips.data["c"]
    tally = Tally(f"entry swapped ({how})", "an upload's entry replaced by another video's",
                  "NOT_FOUND and deleted, then healed by an upload")
    id_a, id_b = upload(replicas.on_a, a).video_id, upload(replicas.on_a, b).video_id
    client = redis.client()
    if how == "rewritten as a valid entry":     # what anyone who can write to Redis could do
        import numpy as np
        import torch
        RedisStateCache(redis.url).put(f"video:{id_b}", {"bytes": torch.from_numpy(np.frombuffer(a, np.uint8).copy())})
    else:                                       # a's keys renamed to b's (a key collision)
        mkey, manifest = entry_keys(redis, id_a)
        client.set(f"sparrow:video:{id_b}:m", client.get(mkey))
        client.set(f"sparrow:video:{id_b}:{manifest['nonce']}:0", client.get(f"sparrow:video:{id_a}:{manifest['nonce']}:0"))
    tally.status(by_id_uncached(replicas.b, replicas.on_b, id_b), grpc.StatusCode.NOT_FOUND)
    assert not client.exists(f"sparrow:video:{id_b}:m")
    assert not upload(replicas.on_b, b).already_stored
    tally.answer(by_id(replicas.on_b, id_b), expected(b))
    tally.answer(by_id(replicas.on_b, id_a), expected(a))


ABSURD = {
    "10^6 chunks": {"chunks": 10**6},
    "10^15 bytes": {"nbytes": 10**15, "chunks": 10**15 // MiB},
    "1-byte chunks": {"chunk_bytes": 1},
    "a 10^12-element tensor": {"tensors": {"bytes": {"dtype": "uint8", "shape": [10**12]}}},
    "not JSON": None,
}


@pytest.mark.parametrize("case", list(ABSURD))
def test_absurd_manifest_is_a_fast_bounded_miss(replicas, redis, clips, expected, case):
    video = clips.data["d"]
    tally = Tally(f"absurd manifest: {case}", "the manifest of an upload rewritten",
                  "NOT_FOUND at once, memory flat; healed by an upload")
    video_id = upload(replicas.on_a, video).video_id
    mkey, manifest = entry_keys(redis, video_id)
    raw = b"{" * 100_000 if ABSURD[case] is None else json.dumps({**manifest, **ABSURD[case]})
    redis.client().set(mkey, raw)
    before = rss_bytes()
    tally.status(by_id_uncached(replicas.b, replicas.on_b, video_id), grpc.StatusCode.NOT_FOUND)
    assert rss_bytes() - before < 64 * MiB
    assert tally.row.worst_s < 5.0
    assert not upload(replicas.on_b, video).already_stored
    tally.answer(by_id(replicas.on_b, video_id), expected(video))


# ----- Redis itself failing mid-run --------------------------------------------------------------------
def test_redis_killed_frozen_and_restarted_mid_run(replicas, redis, clips, expected):
    tally = Tally("Redis killed, restarted, frozen", "SIGKILL, restart, SIGSTOP, SIGCONT while requests run",
                  "every answer right; a frozen Redis costs one socket timeout")
    videos = [clips.data[n] for n in "abcd"]
    ids = [upload(replicas.on_a, v).video_id for v in videos]
    stop = threading.Event()
    failures: list[BaseException] = []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            video, video_id = videos[i % 4], ids[i % 4]
            try:
                if i % 2:
                    tally.answer(by_id(replicas.on_a, video_id), expected(video))
                else:
                    tally.answer(lambda: replicas.on_a.generate(PROMPT, data=video, max_new_tokens=TOKENS,
                                                                timeout=60), expected(video))
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                failures.append(exc)
                return
            i += 1

    for video in videos:
        expected(video)                         # references first: torch off the traffic's clock
    worker = threading.Thread(target=traffic)
    worker.start()
    pid = lambda: int(redis.pidfile.read_text())                 # noqa: E731
    try:
        time.sleep(1.0)
        redis.stop()                                             # killed
        time.sleep(1.5)
        redis.restart()
        time.sleep(3.0)                                          # the cache retries Redis 2 s after an error
        os.kill(pid(), signal.SIGSTOP)                           # frozen: connections hang
        time.sleep(2.5)
        os.kill(pid(), signal.SIGCONT)
        time.sleep(1.0)
    finally:
        os.kill(pid(), signal.SIGCONT)
        stop.set()
        worker.join(120)
    assert not failures, failures
    assert tally.row.requests >= 6 and tally.row.right == tally.row.requests
    assert tally.row.worst_s < 15.0
    # Redis is back and used again: a new upload reaches it.
    time.sleep(2.5)
    video_id = upload(replicas.on_b, clips.data["e"]).video_id
    assert redis.client().exists(f"sparrow:video:{video_id}:m")
    tally.answer(by_id(replicas.on_a, video_id), expected(clips.data["e"]))


# ----- the path cache -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["renamed over", "written in place"])
def test_same_size_same_mtime_file_swap_gets_the_new_videos_answer(replicas, clips, expected, how):
    """`rsync -t` / `cp -p` put another video of the same size under the path and restore its
    mtime: the path's cached prefill must not answer for it."""
    first, second = clips.data["a"], clips.data["c"]
    size = max(len(first), len(second))
    first, second = first + bytes(size - len(first)), second + bytes(size - len(second))   # MP4 ignores the tail
    assert expected(first) != expected(second)
    tally = Tally(f"file swap ({how})", "same size, mtime restored", "the new video's answer")
    path = clips.root / f"swap-{how.split()[0]}.mp4"
    path.write_bytes(first)
    ask = lambda: replicas.on_a.generate(PROMPT, path=path.name, max_new_tokens=TOKENS, timeout=60)   # noqa: E731
    tally.answer(ask, expected(first))
    tally.answer(ask, expected(first))            # a prefix-cache hit
    st = path.stat()
    if how == "renamed over":
        (clips.root / "incoming.tmp").write_bytes(second)
        os.replace(clips.root / "incoming.tmp", path)
    else:
        with open(path, "r+b") as f:
            f.write(second)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    tally.answer(ask, expected(second))
    tally.answer(ask, expected(second))


# ----- edges: one status per fault ------------------------------------------------------------------------
def raw_generate(client: SparrowClient, data: bytes, metadata=(), timeout=None):
    """Generate with the request's bytes as given (no serialization)."""
    call = client.channel.unary_stream("/sparrow.v1.Sparrow/Generate", request_serializer=None,
                                       response_deserializer=pb.GenerateResponse.FromString)
    return list(call(data, metadata=metadata, timeout=timeout))


def good_request(clips, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=PROMPT, video=pb.VideoSource(data=clips.data["a"]), **fields)


EDGES = {
    "prompt not UTF-8": (lambda clips: good_request(clips).SerializeToString().replace(PROMPT.encode(),
                                                                                        b"\xff\xfe" * 13),
                         grpc.StatusCode.INVALID_ARGUMENT),
    "corrupt wire": (lambda clips: b"\x0a\xff\xff\xff\xff\x0f" + b"\x00" * 10, grpc.StatusCode.INVALID_ARGUMENT),
    "temperature inf": (lambda clips: good_request(clips, sampling=pb.SamplingParams(temperature=float("inf"))),
                        grpc.StatusCode.INVALID_ARGUMENT),
    "temperature nan": (lambda clips: good_request(clips, sampling=pb.SamplingParams(temperature=float("nan"))),
                        grpc.StatusCode.INVALID_ARGUMENT),
    "top_p nan": (lambda clips: good_request(clips, sampling=pb.SamplingParams(top_p=float("nan"))),
                  grpc.StatusCode.INVALID_ARGUMENT),
    "min_pixels 2^32-1": (lambda clips: good_request(clips, video_options=pb.VideoOptions(min_pixels=2**32 - 1)),
                          grpc.StatusCode.INVALID_ARGUMENT),
    "min_pixels over the budget": (lambda clips: good_request(clips, video_options=pb.VideoOptions(
        min_pixels=16384 * 28 * 28)), grpc.StatusCode.INVALID_ARGUMENT),
    "num_frames over max_frames": (lambda clips: good_request(clips, video_options=pb.VideoOptions(
        num_frames=16, max_frames=8)), grpc.StatusCode.INVALID_ARGUMENT),
    "end_s inf": (lambda clips: good_request(clips, video_options=pb.VideoOptions(end_s=float("inf"))),
                  grpc.StatusCode.INVALID_ARGUMENT),
    "missing file": (lambda clips: pb.GenerateRequest(prompt=PROMPT, video=pb.VideoSource(path="no-such.mp4")),
                     grpc.StatusCode.NOT_FOUND),
}


@pytest.mark.parametrize("case", list(EDGES))
def test_each_edge_gets_its_status_fast_and_no_traceback(replicas, clips, expected, caplog, case):
    make, code = EDGES[case]
    tally = Tally(f"edge: {case}", "one request", code.name)
    message = make(clips)
    data = message if isinstance(message, bytes) else message.SerializeToString()
    with caplog.at_level(logging.INFO):
        tally.status(lambda: raw_generate(replicas.on_a, data, timeout=30), code)
    assert tally.row.worst_s < 2.0                      # refused before any decoding
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    tally.answer(lambda: replicas.on_a.generate(PROMPT, data=clips.data["a"], max_new_tokens=TOKENS, timeout=60),
                 expected(clips.data["a"]))


def test_undecodable_upload_chunk_is_invalid_argument(replicas, clips, caplog):
    tally = Tally("edge: upload chunk not decodable", "one upload", "INVALID_ARGUMENT")
    call = replicas.on_a.channel.stream_unary("/sparrow.v1.Sparrow/UploadVideo", request_serializer=None,
                                              response_deserializer=pb.VideoRef.FromString)
    chunks = [pb.VideoChunk(data=clips.data["a"][:100]).SerializeToString(), b"\x0a\xff\xff\xff\xff\x0f"]
    with caplog.at_level(logging.INFO):
        tally.status(lambda: call(iter(chunks), timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_deadline_metadata_is_honoured_by_the_embedded_host(replicas, clips):
    """No gRPC deadline, only `sparrow-timeout-ms` (what a client behind Ray Serve's proxy
    sends): the stream ends DEADLINE_EXCEEDED and the generation stops."""
    tally = Tally("edge: sparrow-timeout-ms only", "a 2000-token request with 800 ms", "DEADLINE_EXCEEDED")
    request = good_request(clips, sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True))
    tally.status(lambda: raw_generate(replicas.on_a, request.SerializeToString(),
                                      metadata=(("sparrow-timeout-ms", "800"),)), grpc.StatusCode.DEADLINE_EXCEEDED)
    assert tally.row.worst_s < 3.0
    assert replicas.a.service.live == {}


def test_deadline_from_metadata_ends_the_call_as_soon_as_the_grpc_deadline(replicas, clips):
    """The same deadline given two ways ends the call at the same time: the backstop that
    serves metadata-only deadlines fires at the deadline itself, not a grace period later."""
    request = good_request(clips, sampling=pb.SamplingParams(max_new_tokens=2000, ignore_eos=True)).SerializeToString()

    def ended_after(**how) -> float:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            raw_generate(replicas.on_a, request, **how)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        return time.monotonic() - start

    by_grpc = sorted(ended_after(timeout=0.4) for _ in range(3))[1]
    by_metadata = sorted(ended_after(metadata=(("sparrow-timeout-ms", "400"),)) for _ in range(3))[1]
    assert by_metadata < by_grpc + 0.15, (by_metadata, by_grpc)
