"""The Sparrow proposer (and the EAGLE-style baselines, the same draft over a context with
visual entries): batched chain and tree drafting from a request's draft context
(draft_context.py).

It follows the Proposer contract (proposer.py); the engine sees nothing else. Proposers keep
no per-request state on themselves, so one serves many requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from sparrow.config import SamplingParams, SpecConfig
from sparrow.errors import InvalidRequest
from sparrow.models.draft import DraftKV, DraftSegment, SparrowDraft
from sparrow.models.draft_compile import STATIC_BACKENDS, DraftBatch, DraftLevels, Seeded
from sparrow.models.prefill import FeatureNeeds
from sparrow.anchored_window import PAD_POS
from sparrow.speculative.draft_context import DraftContext, build_context, draft_attention
from sparrow.speculative.proposer import BeginInput, DraftRequest, DraftState, Pending, Proposal, StepResult
from sparrow.speculative.tree_growth import Node, TreeGrowth


@dataclass(slots=True)
class SparrowState(DraftState):
    kv: DraftKV
    next_pos: int                # draft position of the next entry
    committed: int               # entries in kv that hold target-verified inputs
    last_hidden: torch.Tensor    # (H,) draft output at the last committed entry
    # Emitted entries not yet run through the draft (proposer.Pending: commits wait there): the
    # next greedy chain's call runs them (`_gather`), any other propose alone first (`_flush`).
    # next_pos, committed, last_hidden exclude them.
    pending: Pending = field(default_factory=Pending)

    def kv_bytes(self) -> int:
        """The draft cache's key/value buffers as allocated (DraftKV.nbytes: capacity, not fill)."""
        return self.kv.nbytes

    def max_keys(self) -> int:
        return self.kv.max_visible


# Room the draft cache keeps beyond its visible entries: one step's drafts and commits.
_STEP_ROOM = 2 * 33
# A draft that sees every context entry (draft_context "all", "pruned") builds its cache over the
# whole prompt at a request's start: in slices of at most this many (query x key) mask entries, so
# the mask and the attention scores stay bounded (one dense 25k x 25k pass was 16 s and ~10 GB
# on the CPU; on a GPU with a 7B-width draft it would not fit).
BEGIN_SLICE_ENTRIES = 1 << 22


class SparrowProposer:
    """Chain drafting with the Sparrow draft. With the "text" draft context (Sparrow) it runs
    text-anchored window attention; with "all" / "pruned" (the EAGLE-style baselines) the
    same draft attends causally to every entry, visual ones included, and keeps them all.
    Every draft forward is batched over the requests of a step."""

    def __init__(self, draft: SparrowDraft, spec: SpecConfig):
        self.draft = draft
        self.spec = spec
        needs_bridge = spec.glimpse > 0 or spec.draft_context == "pruned"
        self.needs = FeatureNeeds(tuple(draft.config.feature_layers),
                                  draft.config.bridge_layer if needs_bridge else None,
                                  spec.draft_context != "text")
        self.window = draft_attention(spec.draft_context, spec.window, spec.anchors, 0)[0]
        self.levels = static_levels(draft, spec)

    @classmethod
    def from_spec(cls, target, draft, spec: SpecConfig) -> "SparrowProposer":
        """The registry's "sparrow" and "eagle-style": a SparrowDraft, bound to the target."""
        if not isinstance(draft, SparrowDraft):
            raise InvalidRequest(f"method {spec.method!r} needs a Sparrow draft, got {type(draft).__name__}")
        if not draft.bound:
            draft.bind(target)
        return cls(draft, spec)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.needs.feature_layers

    def begin(self, start: BeginInput) -> SparrowState:
        spec = self.spec
        ctx = build_context(start.prefill, start.first_token, spec.glimpse, spec.draft_context, spec.prune_keep)
        return self.begin_context(ctx, start.max_new_tokens)

    @torch.inference_mode()
    def _entries(self, z: torch.Tensor, pos: torch.Tensor, pinned: torch.Tensor,
                 segments: list[DraftSegment]) -> torch.Tensor:
        """draft.forward_packed (the requests' new entries z (N, H) through the layers into their
        caches), by the static levels's C++ kernel where it runs (kernels/draft_chain.py), a call a request."""
        levels = self.levels
        kernel = levels.kernel() if levels is not None else None
        if kernel is None or any(g.spec_mask is not None for g in segments):
            return self.draft.forward_packed(z, pos, pinned, segments)
        w = levels.weights()
        return torch.cat([kernel.entries(levels.dims, w, z[g.start:g.end], pos[g.start:g.end],
                                         pinned[g.start:g.end], g.kv, g.window) for g in segments])

    def _evict(self, kv: DraftKV, next_pos: int, window: int) -> None:
        """kv.evict (room for a step), by the kernel where the static levels run."""
        if len(kv) + _STEP_ROOM <= kv.capacity:         # room: nothing to do (the rule of both)
            return
        kernel = self.levels.kernel() if self.levels is not None else None
        if kernel is not None:
            kernel.evict(kv, next_pos, window, _STEP_ROOM)
        else:
            kv.evict(next_pos, window, _STEP_ROOM)

    def begin_context(self, ctx: DraftContext, max_new_tokens: int = 0) -> SparrowState:
        """Process glimpse + anchors + window of the context. Entries that are neither an
        anchor nor in the final window are never visible to a later query: skipped."""
        spec, draft, n = self.spec, self.draft, ctx.token_ids.shape[0]
        window, anchors = draft_attention(spec.draft_context, spec.window, spec.anchors, ctx.num_prompt)
        device = ctx.features.device
        pos = torch.arange(n, device=device)
        anchor = (pos >= ctx.num_prompt - anchors) & (pos < ctx.num_prompt)
        keep = anchor | (pos > n - 1 - window)
        g = ctx.glimpse.shape[0]
        visible = g + int(keep.sum())
        # A sliding window keeps its cache bounded: room for glimpse + anchors + two windows, so a
        # step compacts it once a window of entries has come, not every step (at a request's start
        # the window lies inside the anchors); full attention keeps every entry it is given.
        grows = max_new_tokens if spec.draft_context != "text" else \
            min(max_new_tokens, max(window, g + anchors + 2 * window - visible))
        kv = draft.new_kv(visible + grows + _STEP_ROOM)
        if g > 0:
            self._entries(draft.inputs_from_glimpse(ctx.glimpse), torch.full((g,), -1, device=device),
                          torch.ones(g, dtype=torch.bool, device=device), [DraftSegment(kv, 0, g, window)])
        z = draft.inputs_from_target(ctx.token_ids[keep], ctx.features[keep])
        kept_pos, kept_pinned = pos[keep], anchor[keep]
        # Each slice attends to the entries before it through the cache, as a commit does.
        rows = max(64, BEGIN_SLICE_ENTRIES // max(1, g + z.shape[0]))
        for start in range(0, z.shape[0], rows):
            m = min(rows, z.shape[0] - start)
            hidden = self._entries(z[start:start + m], kept_pos[start:start + m], kept_pinned[start:start + m],
                                   [DraftSegment(kv, 0, m, window)])
        self._evict(kv, n, window)
        return SparrowState(kv, n, len(kv), hidden[-1])

    @property
    def is_chain(self) -> bool:
        return self.spec.tree_width == 1 and self.spec.tree_branch == 1

    @torch.inference_mode()
    def propose(self, batch: list[DraftRequest]) -> list[Proposal]:
        """A draft tree of depth k_i for every request i (a chain when tree_width and
        tree_branch are 1), grown level by level: each level expands the tree_width most
        probable nodes of the last one (cumulative draft log-probability) with tree_branch
        children each, up to tree_budget nodes. Children are the top tokens at T=0 and i.i.d.
        draws from the draft's q otherwise (what lossless tree acceptance needs; siblings are
        never pruned by their values). The nodes to expand next are fed through the draft in
        one packed pass per level; each sees the request's context and its own ancestors.

        With a static levels (SpecConfig.draft_step), the levels run over the batch's keys
        gathered once (models.draft_compile); chains that are greedy or seeded (`_one_call`)
        then run in one call and read the host once."""
        run = self._gather(batch)
        if run is not None and self._one_call(batch):
            return self._chains(batch, run)
        trees = [TreeGrowth(r, self.spec) for r in batch]
        frontier = [[Node(-1, r.state.last_hidden, 0.0)] for r in batch]       # the root
        for depth in range(1, max((r.k for r in batch), default=0) + 1):
            live = [i for i, r in enumerate(batch) if r.k >= depth and frontier[i]]
            if not live:
                break
            expand = [(i, node) for i in live for node in frontier[i]]
            if all(node.logits is not None for _, node in expand):      # a static level gave them
                logits = torch.stack([node.logits for _, node in expand])                      # (b, V)
            else:
                logits = self.draft.logits(torch.stack([node.hidden for _, node in expand]))      # (b, V)
            top = self._greedy_top(batch, expand, logits)
            grown: dict[int, list[Node]] = {i: [] for i in live}
            for row, (i, node) in enumerate(expand):        # in order: each request's draws, in a fixed order
                grown[i] += trees[i].add_children(node, logits[row], depth, top and (top[0][row], top[1][row]))
            feed = {i: trees[i].to_expand(nodes) for i, nodes in grown.items() if batch[i].k > depth}
            frontier = [feed.get(i, []) for i in range(len(batch))]
            if run is None:
                self._feed(batch, trees, feed, depth)
            else:
                self._feed_static(run, batch, trees, feed, depth)
        if run is not None and run.seen:
            for r, seen in zip(batch, run.max_seen()[: len(batch)].tolist()):
                r.state.kv.max_visible = max(r.state.kv.max_visible, seen)
        return [t.tree() for t in trees]

    def _greedy_top(self, batch: list[DraftRequest], expand: list, logits: torch.Tensor):
        """The level's top tree_branch tokens and log-probabilities of every expanded node, as
        host lists, read once for the level (None when no request of the batch is greedy)."""
        if not any(batch[i].sampling.greedy for i, _ in expand):
            return None
        top = torch.topk(torch.log_softmax(logits.float(), -1), min(self.spec.tree_branch, logits.shape[-1]))
        return top.indices.tolist(), top.values.tolist()

    def _gather(self, batch: list[DraftRequest]) -> DraftBatch | None:
        """The batch's keys in the static levels's buffers, or None: no static levels, or the batch
        does not fit its shapes (the reference path runs it). Compiled greedy chains always run
        num_draft_tokens - 1 levels (one shape a bucket; a shorter chain's rows are padding).
        Chains in one call (`_one_call`: greedy or seeded) take the requests' pending commits
        along (their entries run first, in the same call); any other propose runs them alone
        first (`_flush`)."""
        states = [r.state for r in batch]
        if self.levels is None or not batch:
            self._flush(states)
            return None
        levels = max(r.k for r in batch) - 1
        one_call = self._one_call(batch)
        if one_call:
            lengths = _chain_lengths(batch, self.spec)
            levels = max(lengths) - 1
            if self.levels.compiled and levels >= 1:
                levels = max(levels, self.spec.num_draft_tokens - 1)
        else:
            lengths = [levels + 1] * len(batch)
        kvs = [s.kv for s in states]
        along = one_call and levels >= 1 and self.levels.fits(kvs, levels, emitted=True) and \
            max(len(s.pending) for s in states) <= self.levels.emitted_rows
        if not along:
            self._flush(states)
            if levels < 1 or not self.levels.fits(kvs, levels):
                return None
        emitted = [(s.pending.tokens, s.pending.joined_features(), s.next_pos) if s.pending else None
                   for s in states] if along else None
        # each level's query position per request (a chain that is over: PAD_POS), after its emitted entries
        first = [s.next_pos + len(s.pending) - 1 for s in states]
        return self.levels.gather(kvs, [[first[i] + d if lengths[i] > d else PAD_POS for i in range(len(batch))]
                                        for d in range(1, levels + 1)], emitted)

    def _one_call(self, batch: list[DraftRequest]) -> bool:
        """Whether the batch's chains run as one greedy_chain call: chains, each greedy or seeded
        with the request's plain tempered distribution as the draft's q (no top-k / top-p, no
        draft_mass cut: the call draws from softmax(logits / T)), seeded ones not compiled."""
        spec = self.spec
        plain_q = spec.draft_mass >= 1.0 and spec.draft_max_candidates == 0
        return self.is_chain and all(
            r.sampling.greedy or (r.noise is not None and plain_q and r.sampling.top_k == 0 and r.sampling.top_p >= 1.0
                                  and not self.levels.compiled)
            for r in batch)

    def _chains(self, batch: list[DraftRequest], run: DraftBatch) -> list[Proposal]:
        """Chains over a static batch: one call (models.draft_compile.greedy_chain) picks every
        level's token on the device (a seeded request's by its noise, as TreeGrowth would draw
        it) and feeds it back; one host read at the end."""
        n, bb, width = len(batch), run.bucket, run.q_pos.shape[0] + 1
        last = [r.state.last_hidden for r in batch]
        hidden = torch.stack(last + [torch.zeros_like(last[0])] * (bb - n))[:, None]     # (Bb, 1, H)
        seeded = None
        if not all(r.sampling.greedy for r in batch):      # per row (temperature, seed, position); greedy: T 0
            rows = [(0.0, 0, 0) if r.sampling.greedy else (r.sampling.temperature, r.noise.seed_bits, r.noise.position)
                    for r in batch] + [(0.0, 0, 0)] * (bb - n)
            temps, seeds, positions = zip(*rows)
            seeded = Seeded(torch.tensor(temps, dtype=torch.float64), torch.tensor(seeds), torch.tensor(positions))
        host, start = self.levels.greedy_chains(run, hidden, seeded)
        host = host[:n].tolist()     # tokens | scores | keys seen
        if run.emitted is not None:
            self._keep_emitted(run, [r.state for r in batch], start)
        # the batch's tokens and scores as two tensors, each request's chain a view of its row
        tokens = torch.tensor([row[:width] for row in host], dtype=torch.long).unbind(0)
        scores = torch.tensor([row[width: 2 * width] for row in host], dtype=torch.float32).unbind(0)
        for r, row in zip(batch, host):
            r.state.kv.max_visible = max(r.state.kv.max_visible, int(row[-1]))
        return [Proposal(t[:m], None, scores=c[:m])
                for t, c, m in zip(tokens, scores, _chain_lengths(batch, self.spec))]

    def _feed(self, batch: list[DraftRequest], trees: list["TreeGrowth"], feed: dict[int, list["Node"]],
              depth: int) -> None:
        """Run the nodes to expand next through the draft (one packed pass for the batch);
        their hidden states give the next level's distributions."""
        rows = [(i, node) for i, nodes in feed.items() for node in nodes]
        if not rows:
            return
        draft = self.draft
        device = self.draft.fuse.weight.device
        ids = torch.tensor([trees[i].tokens[node.index] for i, node in rows], device=device)
        z = draft.inputs_from_draft(ids, torch.stack([trees[i].parent_hidden[node.index] for i, node in rows]))
        pos = torch.tensor([batch[i].state.next_pos + depth - 1 for i, _ in rows], device=device)
        segments, start = [], 0
        for i, nodes in feed.items():
            if not nodes:
                continue
            state, tree = batch[i].state, trees[i]
            spec_mask = None if self.is_chain else tree.spec_mask(nodes)
            segments.append(DraftSegment(state.kv, start, start + len(nodes), self.window,
                                         state.committed, spec_mask))
            start += len(nodes)
        out = draft.forward_packed(z, pos, torch.zeros(len(rows), dtype=torch.bool, device=device), segments)
        for row, (i, node) in enumerate(rows):
            node.hidden = out[row]

    def _feed_static(self, run: DraftBatch, batch: list[DraftRequest], trees: list["TreeGrowth"],
                     feed: dict[int, list["Node"]], depth: int) -> None:
        """`_feed` over the static batch: request i's nodes are rows (i, 0..) of one level of
        R rows a request (the rest padding); a tree's rows see their ancestors' slots."""
        if not any(feed.values()):
            return
        bb, rows = run.bucket, run.rows
        tokens = [[0] * rows for _ in range(bb)]
        real = [[False] * rows for _ in range(bb)]
        zero = torch.zeros_like(batch[0].state.last_hidden)
        parents = [zero] * (bb * rows)
        for i, nodes in feed.items():
            tree = trees[i]
            for r, node in enumerate(nodes):
                tokens[i][r], real[i][r] = tree.tokens[node.index], True
                parents[i * rows + r] = tree.parent_hidden[node.index]
                tree.slots[node.index] = (depth - 1) * rows + r
        device = zero.device
        if self.levels.tree:
            run.allow(torch.tensor(self._tree_rule(trees, feed, bb, rows, depth), device=device))
        hidden, logits, _, _ = self.levels.level(run, depth, torch.tensor(tokens, device=device),
                                                 torch.stack(parents).view(bb, rows, -1),
                                                 torch.tensor(real, device=device))
        for i, nodes in feed.items():
            for r, node in enumerate(nodes):
                node.hidden, node.logits = hidden[i, r], logits[i, r]

    @staticmethod
    def _tree_rule(trees: list["TreeGrowth"], feed: dict[int, list["Node"]], bb: int, rows: int,
                   depth: int) -> list:
        """(Bb, R, depth * R) nested lists: row (i, r) of this level may see the drafted slots of
        its ancestors and itself (a padding row: itself, so its softmax is never empty)."""
        rule = [[[False] * (depth * rows) for _ in range(rows)] for _ in range(bb)]
        for i in range(bb):
            for r in range(rows):
                rule[i][r][(depth - 1) * rows + r] = True
        for i, nodes in feed.items():
            slots = trees[i].slots
            for r, node in enumerate(nodes):
                for a in trees[i].ancestors[node.index]:
                    rule[i][r][slots[a]] = True
        return rule


    def _keep_emitted(self, run: DraftBatch, states: list[SparrowState], start: torch.Tensor) -> None:
        """After a greedy chain ran the requests' pending entries (run.emitted): their keys,
        from the batch's buffers, appended to each request's own cache, as a commit leaves it."""
        s = run.start                     # the emitted rows sit at slots [S, S + M)
        counts = [len(state.pending) for state in states]
        for state, m in zip(states, counts):
            state.kv.reserve(m)
        kernel = self.levels.kernel()
        if kernel is not None:            # every request's copies in one kernel call
            kernel.scatter(run.pos, run.keys, run.values, s, counts, [state.kv for state in states])
        last = start[:, 0].unbind(0)      # each request's last output, (H,) views
        for b, (state, m) in enumerate(zip(states, counts)):
            if not m:
                continue
            kv = state.kv
            if kernel is None:
                kv.append_meta(run.emitted.pos[b, :m], torch.zeros(m, dtype=torch.bool, device=run.pos.device))
                for layer in range(len(run.keys)):
                    kv.write(layer, run.keys[layer][b: b + 1, :, s: s + m], run.values[layer][b: b + 1, :, s: s + m])
            kv.advance(m)
            state.next_pos += m
            self._evict(kv, state.next_pos, self.window)
            state.committed, state.last_hidden = len(kv), last[b]
            state.pending = Pending()

    def commit(self, states: list[SparrowState], results: list[StepResult]) -> None:
        """The draft learns what each request's step emitted, at its next propose (the contract's
        deferred commit, proposer.py): the entries wait in `SparrowState.pending`, and a greedy
        chain over static levels runs them in its own call (one draft call a step, not two), any
        other propose alone first (`_flush`). Speculative entries are dropped now."""
        for state, res in zip(states, results):
            state.kv.truncate(state.committed)
            state.pending.add(res)

    def _flush(self, states: list[SparrowState]) -> None:
        """Run the pending entries of these requests now (one packed pass)."""
        late = [s for s in states if s.pending]
        if late:
            self._run_commit(late, [s.pending.take() for s in late])

    @torch.inference_mode()
    def _run_commit(self, states: list[SparrowState], results: list[StepResult]) -> None:
        """Drop the speculative entries; run every request's emitted tokens, paired with the
        target's features before each, through the draft in one packed pass."""
        if not states:
            return
        draft = self.draft
        segments, ids, feats, pos, row = [], [], [], [], 0
        for state, res in zip(states, results):
            state.kv.truncate(state.committed)
            m = len(res.tokens)
            segments.append(DraftSegment(state.kv, row, row + m, self.window))
            ids.extend(res.tokens)
            feats.append(res.features[:m])
            pos.append(torch.arange(state.next_pos, state.next_pos + m))
            row += m
        device = feats[0].device
        hidden = self._entries(draft.inputs_from_target(torch.tensor(ids, device=device), torch.cat(feats)),
                               torch.cat(pos).to(device), torch.zeros(row, dtype=torch.bool, device=device), segments)
        for state, seg in zip(states, segments):
            state.next_pos += seg.end - seg.start
            self._evict(state.kv, state.next_pos, self.window)
            state.committed = len(state.kv)
            state.last_hidden = hidden[seg.end - 1]

    def end(self, state: SparrowState) -> None:
        """Nothing to release beyond the state itself (its buffers go with it)."""

    def warm_up(self, batch_sizes: tuple[int, ...]) -> float:
        """With compiled draft steps: compile the greedy chain of the batch buckets these batch
        sizes run in now, on synthetic contexts, rather than on the first requests that meet
        them (a server calls this before it serves). Returns the seconds it took (0: nothing to
        compile). The other shapes (sampled levels, other buckets) still compile on first use."""
        if self.levels is None or not self.levels.compiled:
            return 0.0
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        prompt = self.spec.anchors + self.spec.window
        for bucket in sorted({self.levels.bucket(n) for n in batch_sizes} - {None}):
            states = [self.begin_context(DraftContext.synthetic(self.draft, prompt, self.spec.glimpse, g),
                                         self.spec.num_draft_tokens + 1) for _ in range(bucket)]
            self.propose([DraftRequest(s, self.spec.num_draft_tokens, SamplingParams(), g) for s in states])
        return time.perf_counter() - t0

    # One request at a time (benchmarks, tests, a draft replica's single session).
    def propose_one(self, state: SparrowState, k: int, sampling: SamplingParams,
                    generator: torch.Generator) -> Proposal:
        return self.propose([DraftRequest(state, k, sampling, generator)])[0]

    def commit_one(self, state: SparrowState, tokens: list[int], features: torch.Tensor) -> None:
        self.commit([state], [StepResult(None, list(tokens), features)])


def static_levels(draft: SparrowDraft, spec: SpecConfig) -> DraftLevels | None:
    """The static levels (SpecConfig.draft_step "static" or "compiled") of this draft and spec,
    or None for the reference path: asked for, or the context is not "text" (a full-attention
    context grows with the video: no fixed shape), or the attention backend takes no batched mask."""
    if spec.draft_step == "reference" or spec.draft_context != "text" or draft.attention_backend not in STATIC_BACKENDS:
        return None
    rows, tree = spec.tree_width, spec.tree_width > 1 or spec.tree_branch > 1
    # A "text" draft cache holds at most glimpse + anchors + 2 windows of entries when a step
    # begins (begin_context sizes it so; commit evicts before it runs short); then k - 1 levels.
    slots = spec.glimpse + spec.anchors + 2 * spec.window + 1 + (spec.num_draft_tokens - 1) * rows
    # Greedy chains also run the last steps' emitted entries (at most k + 1 a step) first.
    emitted = 0 if tree else spec.num_draft_tokens + 1
    return DraftLevels(draft, spec.window, -(-(slots + emitted) // 16) * 16, rows, tree,
                       compiled=spec.draft_step == "compiled", emitted_rows=emitted)


def _chain_lengths(batch: list[DraftRequest], spec: SpecConfig) -> list[int]:
    """Each request's chain length: its k, cut by its node budget (as TreeGrowth cuts it)."""
    return [min(r.k, spec.max_tree_nodes(r.k), r.budget or 1 << 30) for r in batch]
