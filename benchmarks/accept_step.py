"""A decode step's acceptance and KV bookkeeping alone: per request (accept.py through
accept_one, then keep_path request by request: the reference) against the whole batch at once
(accept_batch.accept_all, then keep_paths), on the world target's vocabulary and KV arena, with
random drafts whose target logits agree with their first path's first few nodes. Timed in the
thread's CPU time (a shared machine's other processes count far less than in wall time),
median over --reps.

    python -m benchmarks.accept_step [--batches 1,8] [--reps 200] [--models models]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from sparrow.config import SamplingParams
from sparrow.models.kv_cache import KVArena
from sparrow.models.prefill import TargetState
from sparrow.models.target import TargetModel
from sparrow.speculative.accept_batch import accept_all, accept_one
from sparrow.speculative.sampling import new_generator
from sparrow.speculative.tree import DraftTree

SHAPES = {"chain k=4": [-1, 0, 1, 2], "tree 12 nodes": [-1, -1, 0, 0, 1, 1, 2, 2, 4, 4, 6, 6]}


def _batch(shape: list[int], batch: int, vocab: int, sampled: bool, gen: torch.Generator):
    trees, logits = [], []
    chain = shape == list(range(-1, len(shape) - 1))
    for _ in range(batch):
        tokens = torch.randint(0, vocab, (len(shape),), generator=gen)
        q = torch.softmax(torch.randn(len(shape), vocab, generator=gen), -1) if sampled else None
        parents = None if chain else torch.tensor(shape)
        trees.append(DraftTree(tokens, q, parents, None if chain or not sampled else torch.arange(len(shape))))
        lg = torch.randn(len(shape) + 1, vocab, generator=gen)
        for i in range(min(2, len(shape))):                       # the target agrees with the first two
            lg[0 if i == 0 else shape.index(i - 1) + 1, tokens[shape.index(i - 1) if i else 0]] += 8.0
        logits.append(lg)
    return trees, logits


def _states(target: TargetModel, batch: int, nodes: int) -> list[TargetState]:
    c = target.text_config
    arena = KVArena(c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads,
                    batch * (600 + nodes), target.hf.dtype, target.device)
    out = []
    for _ in range(batch):
        slot = arena.allocate(600 + nodes)
        for layer in slot.cache.layers:
            layer.length = 504 + 1 + nodes
        out.append(TargetState(slot.cache, 504 + 1 + nodes, 0))
    return out


def time_once(target, trees, logits, sampling, batched: bool) -> float:
    states = _states(target, len(trees), trees[0].size)
    gens = [new_generator(i) for i in range(len(trees))]
    verified = [lg.shape[0] for lg in logits]
    t0 = time.thread_time()
    if batched:
        results = accept_all(trees, logits, [sampling] * len(trees), gens, [None] * len(trees))
        target.keep_paths(states, verified, [list(r.path) for r in results])
    else:
        for t, lg, g, s, n in zip(trees, logits, gens, states, verified):
            r = accept_one(t, lg, sampling, g, None)
            target.keep_path(s, n, list(r.path))
    return time.thread_time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    target = TargetModel.from_pretrained(f"{args.models}/world/target")
    gen = torch.Generator().manual_seed(0)
    print(f"world target vocab {target.vocab_size}; thread CPU time per step, median of {args.reps}")
    print("| draft | sampling | batch | per request us | batched us | per request / batched |\n|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        for sampled in (False, True):
            sampling = SamplingParams(temperature=1.0) if sampled else SamplingParams()
            for b in (int(x) for x in args.batches.split(",")):
                cost = {}
                for batched in (False, True):
                    times = []
                    for _ in range(args.reps):
                        trees, logits = _batch(shape, b, target.vocab_size, sampled, gen)
                        times.append(time_once(target, trees, logits, sampling, batched))
                    cost[batched] = 1e6 * statistics.median(times)
                print(f"| {name} | {'T=1 unseeded' if sampled else 'T=0'} | {b} | {cost[False]:.0f} | {cost[True]:.0f} | "
                      f"{cost[False] / cost[True]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
