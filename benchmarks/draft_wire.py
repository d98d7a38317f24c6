"""What one remote-draft round sends back, in bytes, at the Qwen2.5-VL-7B vocabulary.

A round is one request's part of a DraftBatch reply: its k draft tokens, the draft's
distributions q (sampling only) and its generator state (sampling only). Before, q went as
k dense float32 rows; now as DraftProbs (services.draft): the same float32 values, sparse
(int32 index + float32 value) when that is smaller. A request's own top-k / top-p truncates q;
otherwise the draft's own cut does (SpecConfig.draft_mass / draft_max_candidates: the draft
draws from its q cut to its most likely tokens, and acceptance reads that very q, so the
output stays the target's distribution; acceptance loses at most the cut mass, reported).
Bytes are those of the pickled reply (pickle protocol 5, as Ray serializes it); the rows are
softmaxes of stand-in logits (Gaussian, std 4: only their nonzero count matters for the
bytes, which top-k fixes and top-p and the draft's cut take from the distribution's shape;
how much mass a cut drops depends on the shape too: a real draft's is what matters).

    python -m benchmarks.draft_wire [--vocab 152064] [--k 4] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from benchmarks.report import write_section
from sparrow.services.draft_service import DraftProbs, DraftReply
from sparrow.speculative.sampling import cut_tail, logits_to_probs

CASES = [  # (name, temperature, top_k, top_p, draft_mass, draft_max_candidates)
    ("T=0 (greedy)", 0.0, 0, 1.0, 1.0, 0),
    ("T=1, untruncated, no draft cut", 1.0, 0, 1.0, 1.0, 0),
    ("T=1, untruncated, draft cut 0.999 / 1024", 1.0, 0, 1.0, 0.999, 1024),
    ("T=1, untruncated, draft cut 0.999 / 4096 (remote default)", 1.0, 0, 1.0, 0.999, 4096),
    ("T=0.7, untruncated, draft cut 0.999 / 4096 (remote default)", 0.7, 0, 1.0, 0.999, 4096),
    ("T=1, top_k=50", 1.0, 50, 1.0, 0.999, 4096),
    ("T=1, top_k=20", 1.0, 20, 1.0, 0.999, 4096),
    ("T=0.7, top_p=0.8", 0.7, 0, 0.8, 0.999, 4096),
    ("T=1, top_k=20, top_p=0.8", 1.0, 20, 0.8, 0.999, 4096),
]


def reply_bytes(reply: DraftReply) -> int:
    return len(pickle.dumps(reply, protocol=5))


def measure(vocab: int, k: int, temperature: float, top_k: int, top_p: float, draft_mass: float = 1.0,
            draft_max_candidates: int = 0) -> dict:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab, (k,), generator=gen)
    if temperature == 0.0:
        size = reply_bytes(DraftReply(tokens))
        return {"nonzero": "-", "before": size, "after": size, "encode_ms": 0.0, "cut_mass": 0.0}
    rng = torch.Generator().manual_seed(1).get_state()
    full = logits_to_probs(torch.randn(k, vocab, generator=gen) * 4, temperature, top_k, top_p)   # (k, V)
    q = cut_tail(full, draft_mass, draft_max_candidates)                           # what the draft draws from
    cut_mass = float((full * (q == 0)).sum(-1).mean())
    before = reply_bytes(DraftReply(tokens, DraftProbs((k, vocab), full), rng))  # every row dense: the old wire
    wire = DraftProbs.encode(q)
    assert torch.equal(wire.decode(), q)                                           # exact, or no figure
    encode_ms = min(_timed(lambda: DraftProbs.encode(q).decode()) for _ in range(5)) * 1000
    after = reply_bytes(DraftReply(tokens, wire, rng))
    return {"nonzero": f"{int((q > 0).sum()) / k:.0f}", "before": before, "after": after, "encode_ms": encode_ms,
            "cut_mass": cut_mass}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=152_064)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=None, help="write the table into this BENCHMARKS.md")
    args = ap.parse_args(argv)
    rows = [f"| sampling | nonzero q entries per row | bytes per round before | after | before / after | "
            f"mass the draft's cut drops (acceptance loses at most this) | encode + decode ms (best of 5) |",
            "|---|---|---|---|---|---|---|"]
    for name, *case in CASES:
        m = measure(args.vocab, args.k, *case)
        rows.append(f"| {name} | {m['nonzero']} | {m['before']:,} | {m['after']:,} | "
                    f"{m['before'] / m['after']:.1f}x | {m['cut_mass']:.4f} | {m['encode_ms']:.1f} |")
    body = (f"k = {args.k} draft tokens, vocabulary {args.vocab:,}; one request's reply per round "
            f"(a step of n requests is one call carrying n of them: n calls before).\n\n" + "\n".join(rows))
    print(body)
    if args.out:
        write_section(args.out, "draft-wire", "Remote draft: bytes per round at the 7B vocabulary",
                      f"python -m benchmarks.draft_wire --vocab {args.vocab} --k {args.k} --out {args.out}", body)


if __name__ == "__main__":
    main()
