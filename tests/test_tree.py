"""Draft trees: lossless greedy output for many tree shapes, stub trees that are always / never /
sometimes accepted, tree acceptance's sampling distribution (pure and end to end through the
engine, chains and trees, with top-k and top-p), and the accepted path's KV kept in place."""

import copy
import math

import pytest
import torch
from helpers import OracleTreeProposer

from sparrow import Engine, SamplingParams, SpecConfig
from sparrow.prefix_cache import PrefixCache
from sparrow.config import EngineConfig
from sparrow.speculative.accept import accept_tree_speculative
from sparrow.speculative.sampling import logits_to_probs
from sparrow.speculative.specvlm import SpecVLMProposer
from sparrow.speculative.tree import DraftTree
from sparrow.tiny import synthetic_frames, tiny_draft

PROMPT = "What happens in the video?"


def hf_greedy(target, engine, video, prompt, n):
    inputs = engine.prepare(video, prompt)
    out = target.hf.generate(**inputs, do_sample=False, max_new_tokens=n)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("width,branch,depth,budget", [
    (1, 1, 4, 0), (2, 2, 3, 0), (4, 1, 6, 0), (1, 4, 2, 0), (3, 2, 5, 12), (4, 4, 6, 24), (2, 3, 1, 0),
])
def test_tree_greedy_equals_hf_generate(any_target, large_video, width, branch, depth, budget):
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=depth, window=8, anchors=16, tree_width=width, tree_branch=branch,
                      tree_budget=budget)
    engine = Engine(any_target, tiny_draft(any_target, seed=4), spec)
    expected = hf_greedy(any_target, engine, large_video, PROMPT, 24)
    gens = [engine.stream(large_video, PROMPT, SamplingParams(max_new_tokens=24)) for _ in range(2)]   # batched
    outs = [[t for d in g for t in d.token_ids] for g in gens]
    assert outs == [expected, expected]
    assert gens[0].output.metrics.draft_tokens > 0


@pytest.mark.parametrize("mode", ["always", "never", "sometimes"])
@pytest.mark.parametrize("width", [1, 3])
def test_stub_trees_always_never_sometimes_accepted(qwen_target, small_video, mode, width):
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True)
    reference = plain.generate(small_video, PROMPT, sampling).token_ids
    proposer = OracleTreeProposer(reference, qwen_target.vocab_size, width, mode)
    engine = Engine(qwen_target, spec=SpecConfig(adaptive_k=False, num_draft_tokens=4, tree_width=width), proposer=proposer)
    out = engine.generate(small_video, PROMPT, sampling)
    m = out.metrics
    assert out.token_ids == reference
    if mode == "never":
        assert m.accepted_tokens == 0
    elif mode == "sometimes":
        # exactly the first level, every step (the last one may have had no room to draft)
        assert m.steps - 1 <= m.accepted_tokens <= m.steps and m.accepted_per_position[1:] == [0] * 3
    else:
        assert m.accepted_per_position[0] == m.steps and m.mean_acceptance_length > 4.0


def test_tree_acceptance_samples_the_target_distribution():
    """A node with 3 children drawn i.i.d. from q, one of them with its own 2 children:
    the first emitted token follows p, and the second does too given the first."""
    vocab, trials = 5, 20000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(7, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=g) * 1.5, -1)
    counts = torch.zeros(vocab)
    second = torch.zeros(vocab, vocab)
    rng = torch.Generator().manual_seed(2)
    for _ in range(trials):
        kids = torch.multinomial(q[0], 3, replacement=True, generator=rng)
        grand = torch.multinomial(q[1], 2, replacement=True, generator=rng)
        tree = DraftTree(torch.cat([kids, grand]), q, torch.tensor([-1, -1, -1, 0, 0]), torch.tensor([0, 0, 0, 1, 1]))
        target = p[:6]                      # rows: the root, then nodes 0..4 (node 0's children come from q[1])
        r = accept_tree_speculative(tree, target, rng)
        toks = r.tokens(tree.tokens)
        counts[toks[0]] += 1
        if len(toks) > 1 and r.path and r.path[0] == 0:
            second[toks[0], toks[1]] += 1
    torch.testing.assert_close(counts / trials, p[0], atol=0.012, rtol=0)
    # Given that node 0 (a draw of token kids[0]) was accepted, the next token follows p[1].
    x = int(second.sum(1).argmax())
    torch.testing.assert_close(second[x] / second[x].sum(), p[1], atol=0.03, rtol=0)


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_distribution(target, engine, video, sampling, n: int) -> dict[tuple[int, ...], float]:
    """P(x_1..x_n) of the target itself under the request's sampling (temperature/top-k/top-p),
    by enumerating every answer the truncated distributions allow: HF's own forward over the
    prompt once, then each prefix's tokens on a copy of its cache."""
    inputs = engine.prepare(video, PROMPT)
    positions, delta = target.family.prefill_positions(target.hf, inputs)
    prompt_len = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        out = target.hf(**inputs, position_ids=positions, use_cache=True)
    dist: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], prob: float, logits: torch.Tensor, cache) -> None:
        p = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        for x in torch.nonzero(p).view(-1).tolist():
            answer = prefix + (x,)
            if len(answer) == n:
                dist[answer] = prob * float(p[x])
                continue
            with torch.inference_mode():
                step = target.hf(input_ids=torch.tensor([[x]]), cache=copy.deepcopy(cache), use_cache=True,
                                 position_ids=target.family.step_positions(prompt_len + len(prefix), 1, delta))
            expand(answer, prob * float(p[x]), step.logits[0, -1], step.cache)

    expand((), 1.0, out.logits[0, -1], out.cache)
    return dist


TRIALS = 1200
SEEDED_TRIALS = 240           # seeded speculative answers compared token for token with plain's


@pytest.fixture(scope="module")
def plain_answers() -> dict[tuple, dict[int, tuple[int, ...]]]:
    """truncation -> {seed: plain decoding's answer}, drawn once per module (module-scoped, so the
    module's tests share one xdist worker and the 1200 draws are never made twice)."""
    return {}


def _engine(target, tree, mass: float, cap: int) -> Engine:
    """A random Sparrow draft (a depth-1 chain or two i.i.d. siblings, mostly rejected) or a
    close one (the target itself on half the video, SpecVLM-style: q near p, so acceptance and
    the residual after a rejection both carry weight); "draft-cut": the drafts draw from their
    own q cut harder than the request (mass, at most cap candidates: SpecConfig draft_mass /
    draft_max_candidates)."""
    config = EngineConfig(max_waiting=2000)
    if tree == "none":
        return Engine(target, spec=SpecConfig(method="none"), prefix_cache=PrefixCache(), config=config)
    if tree == "specvlm":
        spec = SpecConfig(adaptive_k=False, method="specvlm", num_draft_tokens=2)
        proposer = SpecVLMProposer(target, target, keep_ratio=0.5, video_cache_entries=4,
                                   draft_mass=mass, draft_max_candidates=cap)
        return Engine(target, spec=spec, proposer=proposer, prefix_cache=PrefixCache(), config=config)
    width, branch = tree
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=2, window=8, anchors=16, tree_width=width, tree_branch=branch,
                      draft_mass=mass, draft_max_candidates=cap)
    return Engine(target, tiny_draft(target, seed=5), spec, prefix_cache=PrefixCache(), config=config)


def _answers(engine, video, sampling: SamplingParams, seeds) -> tuple[dict, int, int]:
    """{seed: answer} of requests all sent at once (seed None: unseeded), and the draft tokens
    they drafted and had accepted."""
    engine.generate(video, PROMPT, SamplingParams(max_new_tokens=1), video_key="v")      # the prefix, cached
    gens = [(seed, engine.stream(video, PROMPT, SamplingParams(**{**_fields(sampling), "seed": seed}), video_key="v"))
            for seed in seeds]
    answers, drafted, accepted = {}, 0, 0
    for i, (seed, g) in enumerate(gens):
        for _ in g:
            pass
        answers[i if seed is None else seed] = tuple(g.output.token_ids)
        drafted += g.output.metrics.draft_tokens
        accepted += g.output.metrics.accepted_tokens
    return answers, drafted, accepted


def _assert_the_targets_distribution(answers, exact: dict[tuple[int, ...], float]) -> None:
    """Chi-square (p = 0.001) of the answers' counts against the exact distribution."""
    trials = len(answers)
    counts: dict[tuple[int, ...], int] = {}
    for key in answers:
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact), "an answer the target cannot give"
    big = [k for k, p in exact.items() if p * trials >= 5]
    rest = 1 - sum(exact[k] for k in big)
    stat = sum((counts.get(k, 0) - exact[k] * trials) ** 2 / (exact[k] * trials) for k in big)
    cells = len(big)
    if rest * trials >= 5:
        observed_rest = trials - sum(counts.get(k, 0) for k in big)
        stat += (observed_rest - rest * trials) ** 2 / (rest * trials)
        cells += 1
    assert cells >= 3, "the target's answers are too concentrated for the test to mean anything"
    assert stat < _chi2_critical(cells - 1), f"chi-square {stat:.1f} over {cells} cells"


TRUNCATIONS = [dict(top_k=3, temperature=1.3), dict(top_p=0.7, temperature=0.3),
               dict(top_k=3, temperature=1.3, draft_cut=(0.6, 2))]


@pytest.mark.parametrize("tree", [(1, 1), (2, 2), "specvlm"], ids=["chain", "tree", "close-draft"])
@pytest.mark.parametrize("truncation", TRUNCATIONS, ids=["top_k", "top_p", "top_k-draft-cut"])
def test_engine_samples_the_targets_distribution_end_to_end(qwen_target, plain_answers, tree, truncation):
    """Seeded (request i has seed i: Gumbel-max keyed by position), a speculative answer is plain
    decoding's answer for that seed, token for token, whatever the draft; and plain decoding's
    TRIALS seeded three-token answers match the target's exact three-token distribution
    (chi-square, p = 0.001). Together: the batched speculative engine samples the target's
    distribution. Plain's answers are drawn once per truncation (TRIALS of them, all at once) and
    the speculative engine's SEEDED_TRIALS compared with theirs: equality per seed is the
    stronger check, and far cheaper than a chi-square of its own per draft (a tenth of the suite's
    time on a 2-core machine)."""
    truncation = dict(truncation)
    mass, cap = truncation.pop("draft_cut", (1.0, 0))
    video = synthetic_frames(4, 56, 56, seed=1)
    sampling = SamplingParams(max_new_tokens=3, ignore_eos=True, **truncation)
    key = tuple(sorted(truncation.items()))
    if key not in plain_answers:
        plain = _engine(qwen_target, "none", 1.0, 0)
        answers, _, _ = _answers(plain, video, sampling, range(TRIALS))
        _assert_the_targets_distribution(list(answers.values()), _exact_distribution(qwen_target, plain, video, sampling, 3))
        plain_answers[key] = answers
    engine = _engine(qwen_target, tree, mass, cap)
    answers, drafted, accepted = _answers(engine, video, sampling, range(SEEDED_TRIALS))
    assert drafted > 0
    if tree == "specvlm":
        assert accepted > SEEDED_TRIALS // 4                  # a close draft: acceptance matters
    differ = [seed for seed, got in answers.items() if got != plain_answers[key][seed]]
    assert not differ, f"{len(differ)} of {SEEDED_TRIALS} seeds answered unlike plain decoding: {differ[:10]}"


@pytest.mark.parametrize("truncation", [TRUNCATIONS[0], TRUNCATIONS[2]], ids=["top_k", "top_k-draft-cut"])
def test_engine_samples_the_targets_distribution_end_to_end_unseeded(qwen_target, truncation):
    """Unseeded: speculative rejection sampling with each request's own generator; TRIALS
    answers of the tree draft match the target's exact distribution (chi-square, p = 0.001; only
    the tree draft and top-k, to keep the suite's time: a statistic that is not reproducible run
    to run)."""
    truncation = dict(truncation)
    mass, cap = truncation.pop("draft_cut", (1.0, 0))
    video = synthetic_frames(4, 56, 56, seed=1)
    sampling = SamplingParams(max_new_tokens=3, ignore_eos=True, **truncation)
    engine = _engine(qwen_target, (2, 2), mass, cap)
    answers, drafted, _ = _answers(engine, video, sampling, [None] * TRIALS)
    assert drafted > 0
    _assert_the_targets_distribution(list(answers.values()), _exact_distribution(qwen_target, engine, video, sampling, 3))


def _fields(sampling: SamplingParams) -> dict:
    return {f: getattr(sampling, f) for f in sampling.__slots__}


def test_accepted_path_kv_is_compacted_in_place(qwen_target, small_video):
    """After a tree step the target's cache equals a plain prefill of the same tokens."""
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=3, tree_branch=2, window=8, anchors=16)
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=4), spec)
    out = engine.generate(small_video, PROMPT, SamplingParams(max_new_tokens=16, ignore_eos=True))
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    assert out.token_ids == plain.generate(small_video, PROMPT, SamplingParams(max_new_tokens=16,
                                                                                ignore_eos=True)).token_ids


def test_a_step_shares_its_node_budget_across_the_batch(qwen_target, large_video):
    """step_draft_nodes = 8 over 4 drafting requests: at most 2 nodes each per step; lossless."""
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, tree_width=2, tree_branch=2)
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=4), spec,
                    config=EngineConfig(step_draft_nodes=8))
    expected = hf_greedy(qwen_target, engine, large_video, PROMPT, 40)
    sizes = []
    real = engine.proposer.propose
    engine.proposer.propose = lambda batch: [sizes.append((len(batch), p.size)) or p for p in real(batch)]
    gens = [engine.stream(large_video, PROMPT, SamplingParams(max_new_tokens=40)) for _ in range(4)]
    assert [[t for d in g for t in d.token_ids] for g in gens] == [expected] * 4
    assert max(n for n, _ in sizes) >= 3 and all(size <= 8 // n for n, size in sizes)


def test_seeded_sampled_requests_share_the_step_budget_and_keep_their_solo_tokens(qwen_target, large_video):
    """step_draft_nodes is shared by every drafting request: a seeded sampled request's tokens
    do not depend on its tree (Gumbel-max keyed by position), so a smaller tree in a shared
    step leaves them those of its solo run, and of plain decoding with its seed."""
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, tree_width=2, tree_branch=2)
    engine = Engine(qwen_target, tiny_draft(qwen_target, seed=4), spec, config=EngineConfig(step_draft_nodes=8))
    plain = Engine(qwen_target, spec=SpecConfig(method="none"))
    samplings = [SamplingParams(max_new_tokens=24, temperature=1.0, seed=i) for i in range(3)]
    solo = [engine.generate(large_video, PROMPT, s).token_ids for s in samplings]
    assert solo == [plain.generate(large_video, PROMPT, s).token_ids for s in samplings]
    budgets = []
    real = engine.proposer.propose
    engine.proposer.propose = lambda batch: budgets.extend((len(batch), r.budget) for r in batch) or real(batch)
    gens = [engine.stream(large_video, PROMPT, s) for s in samplings]
    gens.append(engine.stream(large_video, PROMPT, SamplingParams(max_new_tokens=24)))
    assert [[t for d in g for t in d.token_ids] for g in gens[:3]] == solo
    assert max(n for n, _ in budgets) >= 2 and all(b == 8 // n for n, b in budgets)   # 8 nodes shared by all


def test_duplicate_sampled_paths_rank_by_their_first_score():
    """Children drawn with replacement can repeat a token path; such nodes are equal in exact
    arithmetic, but their scores differ in the last bits with the batch's shapes. Which one is
    expanded must not depend on those bits (a seeded request's tree, and so its draws, would)."""
    from sparrow.speculative.tree_growth import Node, TreeGrowth
    from sparrow.speculative.proposer import DraftRequest

    spec = SpecConfig(adaptive_k=False, num_draft_tokens=3, tree_width=1, tree_branch=2)
    growth = TreeGrowth(DraftRequest(None, 3, SamplingParams(temperature=1.0, seed=0),
                                      torch.Generator().manual_seed(0)), spec)
    logits = torch.full((16,), -40.0)
    logits[7] = 10.0                                         # every draw is token 7
    first, second = growth.add_children(Node(-1, None, 0.0), logits, 0)
    assert growth.tokens == [7, 7] and growth.parents == [-1, -1]
    for eps in (1e-6, -1e-6):                                # the duplicate a hair above or below
        nodes = [first, Node(second.index, None, second.score + eps)]
        assert [n.index for n in growth.to_expand(nodes)] == [first.index]
        assert [n.index for n in growth.to_expand(nodes[::-1])] == [first.index]


def test_best_nodes_keep_their_ancestors():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    tree = DraftTree(torch.tensor([10, 11, 12, 13, 14]), None, torch.tensor([-1, -1, 0, 0, 1]),
                     torch.arange(5), scores=torch.tensor([-0.1, -0.5, -0.2, -1.5, -0.6]))
    best = tree.best(3)                        # nodes 0, 2, 1 by score, kept in index order
    assert best.tokens.tolist() == [10, 11, 12] and best.parent_list() == [-1, -1, 0]
    assert tree.best(2).is_chain and tree.best(2).tokens.tolist() == [10, 12]      # a single path: a chain
    assert tree.best(9) is tree
    chain = DraftTree(torch.tensor([5, 6, 7]), None, scores=torch.tensor([-0.1, -0.3, -0.9]))
    assert chain.best(2).tokens.tolist() == [5, 6] and chain.best(2).is_chain


def test_tree_trim_follows_the_measured_verify_cost():
    from sparrow.draft_policy import TreeTrim
    from sparrow.request import Request

    def request(greedy=True):
        return Request(0, None, "q", SamplingParams(temperature=0.0 if greedy else 1.0), None, None, None, print)

    sure, unsure = math.log(0.95), math.log(0.05)
    def tree():
        return DraftTree(torch.tensor([1, 2, 3, 4]), None, torch.tensor([-1, 0, -1, 2]), torch.arange(4),
                         scores=torch.tensor([sure, 2 * sure, unsure, 2 * unsure]))
    trim = TreeTrim()
    next(trim._steps)                                       # past the first (exploring) step
    batch = [request(), request(), request(greedy=False)]
    cheap = trim.cut(batch, [tree(), tree(), tree()], fit=(0.010, 0.0))        # a GPU: extra tokens are free
    assert [p.size for p in cheap] == [4, 4, 4]
    costly = trim.cut(batch, [tree(), tree(), tree()], fit=(0.010, 0.004))     # 25k on a CPU: 40% of a step a token
    assert [p.size for p in costly[:2]] == [2, 2] and costly[2].size == 4       # the likely path only; sampled: whole
    assert costly[0].tokens.tolist() == [1, 2]
    hopeless = trim.cut(batch[:1], [tree()], fit=(0.010, 0.500))
    assert hopeless == [None]                                                  # plain decoding beats any draft here


def test_tree_trim_calibrates_each_depth_apart():
    """Deep nodes accepted more often than their draft probabilities say (acceptance comes in
    runs): once measured, the cut keeps a path three deep over a shallow sibling, where one
    calibration for every depth kept the first node alone; what it keeps is a tree (here a chain)."""
    from sparrow.draft_policy import TreeTrim
    from sparrow.request import Request

    def tree():
        return DraftTree(torch.arange(4), None, torch.tensor([-1, 0, -1, 1]), torch.arange(4),
                         scores=torch.log(torch.tensor([0.6, 0.42, 0.35, 0.294])))
    batch = [Request(0, None, "q", SamplingParams(temperature=0.0), None, None, None, print)]
    trim = TreeTrim()
    next(trim._steps)                                       # past the first (exploring) step
    assert trim.cut(batch, [tree()], fit=(0.010, 0.004))[0].tokens.tolist() == [0]
    for _ in range(200):
        trim.record([tree()], [3])                          # every step accepts the path 0 -> 1 -> 3
    assert 0.9 < trim.calibration(1) < 1.1 and trim.calibration(2) == trim.calibration(3) == 2.0
    cut = trim.cut(batch, [tree()], fit=(0.010, 0.004))[0]
    assert cut.tokens.tolist() == [0, 1, 3] and cut.is_chain


def test_adaptive_tree_greedy_equals_hf_generate(any_target, large_video):
    target = any_target
    spec = SpecConfig(adaptive_k=False, num_draft_tokens=4, window=8, anchors=16, tree_width=2, tree_branch=2, adaptive_tree=True)
    engine = Engine(target, tiny_draft(target, seed=4), spec)
    expected = hf_greedy(target, engine, large_video, PROMPT, 40)
    sizes = []
    real = engine.scheduler.trim.cut
    engine.scheduler.trim.cut = lambda b, p, fit: [sizes.append(x.size if x is not None else 0) or x
                                                   for x in real(b, p, fit)]
    gens = [engine.stream(large_video, PROMPT, SamplingParams(max_new_tokens=40)) for _ in range(2)]
    assert [[t for d in g for t in d.token_ids] for g in gens] == [expected] * 2
    full = spec.max_tree_nodes(4)
    assert min(sizes) < full                       # trees were cut (explored, then by cost)
