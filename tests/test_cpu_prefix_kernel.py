"""The compiled CPU prefix kernel (kernels/cpu_prefix.py, csrc/cpu_prefix.cpp) under the packed
verify attention: equal to the reference attention within fp32 tolerance for chains, trees, GQA
groups, prefixes that are not whole blocks (1, 127, 129, 1023, 2000 keys), batches of several
rows; bf16 keys and values; the key range cut in splits when threads outnumber the kv heads;
greedy through it equal to HF greedy. A build that fails falls back to torch's op, logged once;
IMPL = "torch" keeps the kernel out.

The first test builds the kernel (~30-50 s on a 2-core box with a cold torch extension cache;
a cached build loads in well under a second).
"""

import fcntl
import logging
import os
import shutil
import threading
import time

import pytest
import torch
from helpers import OracleProposer
from test_kernels import FP32, random_tree
from test_verify_attention import PROMPT, _hf_greedy

import sparrow.kernels.packed as packed
from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.kernels import autotune, cpu_prefix, native
from sparrow.kernels.native import NativeExtension
from sparrow.kernels.packed import verify_attention_packed
from sparrow.kernels.reference import verify_attention_ref
from sparrow.tiny import tiny_draft


@pytest.fixture(scope="module")
def kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on this machine: the kernel cannot be built (torch's op is used)")
    module = cpu_prefix.load()
    assert module is not None, "the CPU prefix kernel did not build (see the log)"
    return module


@pytest.fixture(autouse=True)
def kernel_forced(monkeypatch):
    """The kernel serves wherever it can (SPARROW_ATTENTION_PATH=kernel): unforced, it serves only
    where the tuner measured it fastest, and the tests run with the tuner off."""
    monkeypatch.setattr(autotune, "FORCED", "kernel")
    monkeypatch.setattr(packed, "FORCED_PATH", "kernel")


@pytest.fixture
def calls(kernel, monkeypatch):
    """Forces the split path at every length and counts the kernel's calls that returned a result."""
    monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    monkeypatch.setattr(packed, "ONE_CALL", False)      # one call a request (the one-call kernel: below)
    monkeypatch.setattr(cpu_prefix, "IMPL", "kernel")
    done = []
    real = cpu_prefix.prefix_attention

    def counted(*args):
        out = real(*args)
        done.append(out is not None)
        return out
    monkeypatch.setattr(cpu_prefix, "prefix_attention", counted)
    return done


def _case(seed, heads, hkv, dim, nq, prefixes, tree, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    bsz = len(prefixes)
    capacity = max(prefixes) + nq + 5                          # a preallocated cache, partly filled
    q = torch.randn(bsz, heads, nq, dim, generator=g)
    k, v = (torch.randn(bsz, hkv, capacity, dim, generator=g).to(dtype) for _ in range(2))
    return q, k, v, torch.tensor(prefixes), (random_tree(nq, g) if tree else None)


CASES = [  # heads, kv heads, dim, tokens, prefixes (one per batch row), tree
    (4, 2, 32, 5, [1], False),                 # P = 1
    (4, 2, 32, 13, [127], True),               # under one block
    (4, 2, 32, 5, [129], False),               # a block and one key
    (8, 1, 64, 6, [1023], True),               # GQA 8:1
    (4, 4, 16, 3, [2000], False),              # 1:1, many blocks (the prefetch runs ahead)
    (4, 2, 24, 5, [300], True),                # a head dim that is not whole vectors
    (4, 2, 128, 4, [515], False),
    (4, 2, 32, 5, [700, 700, 700], True),      # batch > 1, one prefix length: one call for all rows
    (4, 2, 32, 9, [700, 33, 1500], False),     # batch > 1, ragged
    (4, 2, 32, 1, [2500], False),              # a decode step: prefix and own key in one call
    (8, 1, 64, 1, [700, 33, 1500], False),     # decode steps, ragged, GQA 8:1
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_kernel_matches_the_reference(case, calls):
    q, k, v, prefix, tree = _case(case, *CASES[case])
    same = len(set(prefix.tolist())) == 1
    got = verify_attention_packed(q, k, v, prefix, tree, prefix_len=int(prefix[0]) if same else None)
    torch.testing.assert_close(got, verify_attention_ref(q, k, v, prefix, tree), **FP32)
    assert calls and all(calls)


def test_every_row_count_matches_plain_softmax_attention(kernel):
    """Each row-group size is its own instance of the kernel's block function (1 .. RB rows, and
    counts past RB split into even groups): every count from 1 to 27 rows over keys that are not
    whole blocks, outputs and log-sum-exps against softmax(q k^T) v computed in float64."""
    g = torch.Generator().manual_seed(11)
    k, v = torch.randn(1, 2, 333, 32, generator=g), torch.randn(1, 2, 333, 32, generator=g)
    for rows in range(1, 28):
        q = torch.randn(1, 2, rows, 32, generator=g)
        out, lse = kernel.prefix_attention(q, k, v, 32 ** -0.5)
        scores = (q.double() @ k.double().transpose(-1, -2)) * 32 ** -0.5
        torch.testing.assert_close(out.double(), torch.softmax(scores, -1) @ v.double(), atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("case", [1, 3, 7, 9])
def test_kernel_bf16_cache(case, calls):
    """bf16 K/V (a bf16 cache): the kernel reads them as they are and computes in fp32, so it
    equals the reference on the same values upcast, within fp32 tolerance."""
    q, k, v, prefix, tree = _case(case, *CASES[case], dtype=torch.bfloat16)
    got = verify_attention_packed(q.bfloat16(), k, v, prefix, tree)
    assert got.dtype == torch.bfloat16 and all(calls)
    want = verify_attention_ref(q.bfloat16().float(), k.float(), v.float(), prefix, tree)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)    # the output rounded to bf16
    qh = q.bfloat16().float()[:, :k.shape[1]]                 # the kernel alone: one query head a kv head
    o, lse = cpu_prefix.prefix_attention(qh, k[:, :, :100], v[:, :, :100], 0.3)
    scores = qh @ k[:, :, :100].float().transpose(-1, -2) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), **FP32)
    torch.testing.assert_close(o, torch.softmax(scores, -1) @ v[:, :, :100].float(), **FP32)


def test_kernel_splits_the_keys_when_threads_outnumber_kv_heads(kernel):
    """One (batch, kv head) pair and 2+ threads: the keys are cut in splits merged by their
    log-sum-exps; the same as one thread's single pass."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 1, 10, 32, generator=g), torch.randn(1, 1, 4099, 32, generator=g), \
        torch.randn(1, 1, 4099, 32, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.prefix_attention(q, k, v, 0.2)
        torch.set_num_threads(4)
        split = kernel.prefix_attention(q, k, v, 0.2)
    finally:
        torch.set_num_threads(threads)
    scores = q @ k.transpose(-1, -2) * 0.2
    for got in (one, split):
        torch.testing.assert_close(got[1], torch.logsumexp(scores, -1), **FP32)
        torch.testing.assert_close(got[0], torch.softmax(scores, -1) @ v, **FP32)


def test_torch_switch_keeps_the_kernel_out(calls, monkeypatch):
    monkeypatch.setattr(cpu_prefix, "IMPL", "torch")
    q, k, v, prefix, tree = _case(0, *CASES[2])
    torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, tree),
                               verify_attention_ref(q, k, v, prefix, tree), **FP32)
    assert calls == []                         # the kernel switched off is not a path: torch's op computed it


def test_a_failed_build_falls_back_and_logs_once(tmp_path, monkeypatch, caplog):
    """A source that does not compile (as on a machine without a working compiler): the build is
    tried once (in a process of its own, started by the first verify that could use it), logged once,
    and every call is computed by torch's op."""
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    ext = NativeExtension("broken_for_test", bad, [], "CPU prefix attention kernel (a broken source)")
    monkeypatch.setattr(cpu_prefix, "EXTENSION", ext)
    monkeypatch.setattr(cpu_prefix, "IMPL", "kernel")
    monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    q, k, v, prefix, tree = _case(1, *CASES[1])
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        for _ in range(2):        # the first call starts the build in its own process and does not wait
            torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, tree),
                                       verify_attention_ref(q, k, v, prefix, tree), **FP32)
            for _ in range(6000):
                if not ext.background.is_set():
                    break
                time.sleep(0.01)
    assert ext.failed and cpu_prefix.load() is None
    assert len([r for r in caplog.records if "not built" in r.getMessage() and ext.what in r.getMessage()]) == 1


def test_a_build_started_at_startup_never_holds_up_a_verify(kernel, monkeypatch, tmp_path):
    """start_loading (or the first verify that could use the kernel) starts the build in a process
    of its own; until it is done every verify is computed by torch's op without waiting on it, and
    after it the kernel serves. The builder here waits on the owner lock another process holds
    (as it does while another process builds), which then leaves the built kernel behind."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ext = NativeExtension(cpu_prefix.EXTENSION.name, cpu_prefix.EXTENSION.source, cpu_prefix.EXTENSION.cflags,
                          "CPU prefix attention kernel")
    monkeypatch.setattr(cpu_prefix, "EXTENSION", ext)
    monkeypatch.setattr(packed, "DENSE_PREFIX", -1)
    ext.build_dir.mkdir(parents=True)
    owner = open(ext.build_dir / native.OWNER_LOCK, "a+")
    fcntl.flock(owner, fcntl.LOCK_EX)               # "another process is building"
    q, k, v, prefix, tree = _case(2, *CASES[1])
    want = verify_attention_ref(q, k, v, prefix, tree)
    p = int(prefix[0])
    operands = (q[:, :1], k[:, :1, :p], v[:, :1, :p], 0.1)            # one kv head's rows over its prefix
    try:
        first: list = []             # the first use on a thread that then ends, as a scheduler's does when idle
        user = threading.Thread(target=lambda: (first.append(cpu_prefix.prefix_attention(*operands)),
                                                time.sleep(3.0)))     # (the builder is up meanwhile)
        user.start()
        user.join(30)
        assert first == [None]       # a first use starts the build, never waits on it
        assert ext.background.is_set()
        time.sleep(1.0)              # the build must outlive the thread that asked for it
        cpu_prefix.start_loading()                                # (as a server does at startup: one build)
        assert cpu_prefix.prefix_attention(*operands) is None                # not waited on
        torch.testing.assert_close(verify_attention_packed(q, k, v, prefix, tree), want, **FP32)
        build_dir = ext.build_dir
        # The environment may change while a build runs (a later test, a caller's own setting): the
        # build is still awaited and loaded where it was started.
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
        shutil.copy(kernel.__file__, build_dir / f"{ext.build_name}.so")     # the same build key
        (build_dir / native.OK_MARKER).write_text("the other process's build\n")
    finally:
        fcntl.flock(owner, fcntl.LOCK_UN)
        owner.close()
    ext.wait(60)
    assert ext.module is not None and not ext.failed
    assert cpu_prefix.prefix_attention(*operands) is not None


def test_greedy_through_the_kernel_is_hf_greedy(any_target, small_video, calls):
    """Chains all accepted and none accepted, and draft trees: every verify step's prefix goes
    through the kernel, and the tokens are HF's."""
    reference = _hf_greedy(any_target, small_video, 16)
    sampling = SamplingParams(max_new_tokens=16)
    chain = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16)
    for corrupt in (False, True):
        oracle = OracleProposer(reference, corrupt=corrupt, vocab_size=any_target.vocab_size)
        assert Engine(any_target, spec=chain, proposer=oracle).generate(small_video, PROMPT, sampling
                                                                         ).token_ids == reference
    tree = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=2, tree_branch=2, tree_budget=6)
    out = Engine(any_target, tiny_draft(any_target, seed=1), tree).generate(small_video, PROMPT, sampling)
    assert out.token_ids == reference and out.metrics.draft_tokens > 0
    assert calls and all(calls)


# ----- a ragged batch in one call (cpu_prefix.ragged_attention) --------------------------------------

RAGGED = [  # heads, kv heads, dim, (prefix, tokens, tree) a request
    (4, 2, 32, [(512, 5, False)] * 8),                                      # the batch of 8 it is for
    (4, 2, 32, [(0, 3, False), (1, 1, False), (129, 13, True), (2000, 5, True), (33, 1, False)]),
    (8, 1, 64, [(700, 6, True), (1023, 1, False), (4100, 4, False)]),        # GQA 8:1, decode rows, long
    (4, 4, 24, [(300, 4, True), (5, 2, False)]),                             # 1:1, a dim not whole vectors
    (2, 1, 128, [(127, 9, True)]),
]


def _ragged_case(seed, heads, hkv, dim, requests, dtype=torch.float32):
    """A packed query (1, H, N, D), strided views into preallocated caches, bounds and trees, and
    the reference: verify_attention_ref of each request alone."""
    g = torch.Generator().manual_seed(seed)
    total = sum(n for _, n, _ in requests)
    q = torch.randn(1, total, heads, dim, generator=g).transpose(1, 2)      # as the model hands it over
    views, bounds, trees, want, row = [], [], [], [], 0
    for prefix, n, tree in requests:
        k, v = (torch.randn(1, hkv, prefix + n + 7, dim, generator=g).to(dtype) for _ in range(2))
        t = random_tree(n, g) if tree else None
        views.append((k[:, :, :prefix + n], v[:, :, :prefix + n]))
        bounds.append((row, row + n))
        trees.append(t)
        want.append(verify_attention_ref(q[:, :, row:row + n].to(dtype).float(), k.float(), v.float(),
                                         torch.tensor([prefix]), t))
        row += n
    return q, views, bounds, trees, torch.cat(want, dim=2).transpose(1, 2)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_one_call_matches_the_reference(kernel, case, threads):
    """Every request of a layer in one call: its rows over its own prefix and its own new keys
    (causal, or its tree), equal to each request alone through the reference; with more threads
    than requests x kv heads the long prefixes are cut in splits."""
    q, views, bounds, trees, want = _ragged_case(case, *RAGGED[case])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = packed.verify_attention_ragged(q, views, bounds, trees)
    finally:
        torch.set_num_threads(before)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got, want, **FP32)


def test_one_call_bf16_cache_and_bad_operands(kernel):
    q, views, bounds, trees, want = _ragged_case(11, *RAGGED[1], dtype=torch.bfloat16)
    got = packed.verify_attention_ragged(q.bfloat16(), views, bounds, trees)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    k, v = views[0]
    with pytest.raises(RuntimeError, match="do not fit"):            # rows past the packed query
        kernel.ragged_attention(q.float(), [k], [v], [0], [q.shape[2] + 1], [torch.empty(0, dtype=torch.bool)], 0.1)
    with pytest.raises(RuntimeError, match="own mask"):
        kernel.ragged_attention(q.float(), [k], [v], [0], [3], [torch.ones(2, 2, dtype=torch.bool)], 0.1)


def test_one_call_declines_where_it_does_not_apply(kernel, monkeypatch):
    q, views, bounds, trees, _ = _ragged_case(2, *RAGGED[0])
    monkeypatch.setattr(cpu_prefix, "IMPL", "torch")
    assert packed.verify_attention_ragged(q, views, bounds, trees) is None
    monkeypatch.setattr(cpu_prefix, "IMPL", "kernel")
    monkeypatch.setattr(packed, "ONE_CALL", False)
    assert packed.verify_attention_ragged(q, views, bounds, trees) is None
    monkeypatch.setattr(packed, "ONE_CALL", True)
    half = [(k.half(), v.half()) for k, v in views]                   # a dtype the kernel does not read
    assert packed.verify_attention_ragged(q, half, bounds, trees) is None


def test_one_call_or_each_is_measured_for_the_batch(kernel, monkeypatch):
    """Unforced, a ragged batch is served in one call or one call a request by what was measured for
    the batch's shape (its longest request, rows, size bucket), not by the per-request path's timing
    (at 0.5k keys the kernel loses to dense SDPA a request, where one call for 8 requests wins): the
    first batch is served by the rule while the worker times both forms, then by the faster; either
    form's output is each request's reference; a step asks once, its later layers take its choice."""
    monkeypatch.setattr(autotune, "FORCED", None)
    monkeypatch.setattr(packed, "FORCED_PATH", None)
    monkeypatch.setattr(autotune, "ENABLED", True)
    monkeypatch.setattr(packed, "TUNER", autotune.PathTuner("verify attention (test)", lambda: None))
    q, views, bounds, trees, want = _ragged_case(5, *RAGGED[0])
    k, (start, end) = views[0][0], bounds[0]
    rule = "one" if packed.cpu_path(q[:, :, start:end], k, 512) == "kernel" else "each"
    assert packed.ragged_form(q, views, bounds) == rule
    assert packed.TUNER.wait(120)
    key = ("ragged", *packed.shape_key(q[:, :, start:end], k, 512), packed.batch_bucket(8))
    times = packed.TUNER.times(key, packed.RAGGED_FORMS)
    assert times is not None and set(times) == {"one", "each"} and all(t > 0 for t in times.values())
    faster = min(times, key=times.get)
    assert packed.ragged_form(q, views, bounds) == faster
    got = packed.verify_attention_ragged(q, views, bounds, trees)
    assert (got is not None) == (faster == "one")
    if got is not None:
        torch.testing.assert_close(got, want, **FP32)
    step: dict = {}                  # a step's memo (RaggedBatch keeps one): asked by its first layer
    assert (packed.verify_attention_ragged(q, views, bounds, trees, forms=step) is not None) == (faster == "one")
    packed.TUNER._chosen[(*key, packed.RAGGED_FORMS)] = "one" if faster == "each" else "each"
    asked = []
    with monkeypatch.context() as m:
        m.setattr(packed, "ragged_form", lambda *a: asked.append(a) or packed.RAGGED_FORMS[0])
        same = packed.verify_attention_ragged(q, views, bounds, trees, forms=step)   # a later layer of that step
    assert (same is not None) == (faster == "one") and not asked
    flipped = packed.verify_attention_ragged(q, views, bounds, trees, forms={})  # the next step asks again
    assert (flipped is not None) == (faster == "each")
    if flipped is not None:
        torch.testing.assert_close(flipped, want, **FP32)
    assert (packed.verify_attention_ragged(q, views, bounds, trees) is not None) == (faster == "each")
    assert [packed.batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    packed.TUNER.stop()
