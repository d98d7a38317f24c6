"""The target's decode/verify step, compiled: TargetModel.target_step "compiled".

A step's forward is the HF model over the batch's packed tokens (ragged.py). Eager, a small
model's step is mostly per-op overhead: on the 2-core CPU a 0.5k decode step of the world
target costs ~1.3 ms eager, ~0.6 ms compiled (BENCHMARKS.md, "Compiled target steps").

What is compiled is the HF model's own forward (no modeling code of ours), fullgraph, over
a step padded to a token bucket: every shape in the graph is the bucket's. Attention is the
one part left out: it is the opaque op `sparrow::ragged_attend` (ragged.py), which writes each
request's keys into its own cache and attends through the step's RaggedBatch, so the batch's
make-up (how many requests, their cache lengths, chains or trees) never reaches the graph
and one graph serves every step whose tokens fit its bucket. The padding rows attend to
nothing and their outputs are dropped.

Compiling a bucket takes seconds (1-8 s on the 2-core CPU), so no step waits for it: the first
step of a bucket asks for its compile on a background thread and runs eagerly, as do the steps
after it until the graph is ready (the time logged at INFO). A compile never overlaps a model
forward on another thread (compiling.GATE: for a compile's duration torch's process-wide
"compiling" flag breaks transformers' hidden-state capture in eager forwards elsewhere); a
background compile starts only once no forward runs and no prefill ran for a second, so a
prefill under way is not held up, and a forward that arrives during a compile waits for that
one compile. `warm` compiles on the caller's thread before serving.

A graph runs under dynamo's "fail_on_recompile" stance without evaluating dynamo's guards
(they cost a quarter of a decode step): its inputs are made as its compile's were, and what
it baked in of the model (config values, attention functions, hooks, the module tree and
weights' identities, training flags: baked.py) is fingerprinted at compile and checked each
step in a few microseconds. A step whose model changed runs eagerly (logged once a graph; the
graph serves again if the model comes back as it was); a graph that raises has its step rerun
eagerly (the caches' writes undone first: RaggedBatch.rewind) and its bucket stays eager
(logged). Eager stays the reference the compiled step is tested equal to
(tests/test_step_graph.py); a bucket whose compile fails stays eager (logged). On CUDA the graph
is inductor's kernels without CUDA graphs: the attention op reads the step's batch from the
host, which a captured graph cannot replay.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from .baked import Baked, modules_run
from .compiling import GATE, compiled
from .ragged import RaggedBatch, RaggedStep, current_batch

log = logging.getLogger(__name__)

# Token counts a step is padded to: every count to 6 (one request's decode or verify step at
# k <= 5), then steps of 2, 4, 8 and 16. Padding costs: on the 2-core CPU a k = 4 verify
# step (5 tokens) takes 1.00 ms in its own graph, 1.15 ms padded to 8; eight of them (40
# tokens) 4.07 ms, 4.80 ms padded to 64. A step with more than the last runs eagerly.
TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)

_STEP = RaggedStep()


def _step_forward(hf, ids: torch.Tensor, positions: torch.Tensor, feature_layers: tuple[int, ...]):
    """The forward a compiled step runs: logits (N, V) float and the feature layers' hidden
    states (N, F*H) (None without layers), for ids (1, N) at positions (P, 1, N)."""
    out = hf(input_ids=ids, position_ids=positions, cache=_STEP, attention_mask=_STEP.as_mask(), use_cache=True,
             output_hidden_states=bool(feature_layers))
    feats = torch.cat([out.hidden_states[i][0] for i in feature_layers], dim=-1) if feature_layers else None
    return out.logits[0].float(), feats


class StepGraph:
    """A target's compiled steps, one graph per (token bucket, feature layers), each compiled
    on a background thread the first time a step needs it. `forward` returns None where the
    step runs eagerly (no bucket fits, or its graph is not ready). `target`: the TargetModel
    (its hf model, device and family)."""

    def __init__(self, target, buckets: tuple[int, ...] = TOKEN_BUCKETS, background: bool = True):
        self.target, self.buckets, self.background = target, tuple(sorted(buckets)), background
        self._ready: dict[tuple, object] = {}       # (bucket, layers) -> the compiled forward
        self._asked: set[tuple] = set()             # compiling, compiled or failed
        self.compile_seconds: dict[tuple, float] = {}
        self.failed: dict[tuple, str] = {}
        self.guard_misses: dict[tuple, int] = {}    # steps a graph did not fit (they ran eagerly)
        self._baked: dict[tuple, Baked] = {}        # key -> what its graph baked in of the model
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()

    def bucket(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= tokens), None)

    def forward(self, batch: RaggedBatch, ids: torch.Tensor, positions: torch.Tensor,
                feature_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """ids (1, N) at positions (P, 1, N), the batch's N packed tokens, through a compiled
        graph: (logits (N, V), features (N, F*H) or None); None: run it eagerly."""
        n = ids.shape[1]
        bucket = self.bucket(n)
        if bucket is None:
            return None
        key = (bucket, tuple(feature_layers))
        run = self._ready.get(key)
        if run is None:
            run, key = self._wider(bucket, key[1])     # a graph with more feature layers serves too
        if run is None:
            self._ask((bucket, tuple(feature_layers)))
            return None
        why = self._baked[key].changed()
        if why is not None:
            return self._miss(key, why)
        pad = bucket - n
        if pad:
            ids = torch.cat([ids, ids.new_zeros(1, pad)], dim=1)
            positions = torch.cat([positions, positions.new_zeros(*positions.shape[:-1], pad)], dim=-1)
        lengths = batch.lengths()
        try:
            # Dynamo's guards (~0.2 ms a call, a quarter of a decode step) are not evaluated: a
            # graph's copy has one entry, its inputs are made as its compile's were, and what
            # they would catch of the model is checked above (baked.py). The stance is
            # process-wide: no compile runs while a forward holds the gate.
            with GATE.forward(), torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True), \
                    current_batch(batch):
                logits, feats = run(self.target.hf, ids.contiguous(), positions.contiguous(), key[1])
        except Exception as e:      # noqa: BLE001 - the step reruns eagerly; the bucket stays eager
            batch.rewind(lengths)
            return self._broken(key, e)
        if feats is not None and key[1] != tuple(feature_layers):
            parts = feats.chunk(len(key[1]), dim=-1)         # one per layer the graph returns
            feats = torch.cat([parts[key[1].index(i)] for i in feature_layers], dim=-1) if feature_layers else None
        return logits[:n], (feats[:n] if feats is not None else None)

    def warm(self, tokens: tuple[int, ...], feature_layers: tuple[int, ...] = ()) -> float:
        """Compile the buckets of these token counts now, on this thread (a server before it
        serves; tests), each once the forwards running now end: the seconds it took."""
        t0 = time.perf_counter()
        for key in sorted({(self.bucket(n), tuple(feature_layers)) for n in tokens if self.bucket(n) is not None}):
            if self._claim(key):
                self._compile(key)
        return time.perf_counter() - t0

    def _miss(self, key: tuple, why: str) -> None:
        """A step its graph does not fit runs eagerly (never a recompile in line); logged once a graph."""
        if key not in self.guard_misses:
            log.warning("the compiled target step for %d tokens does not fit this step, so the step runs eagerly "
                        "(no recompile in line): %s", key[0], why)
        self.guard_misses[key] = self.guard_misses.get(key, 0) + 1
        return None

    def _broken(self, key: tuple, error: Exception) -> None:
        """A graph that raised: its step reruns eagerly, and its bucket stays eager (logged)."""
        with self._lock:
            if self._ready.pop(key, None) is None:
                return None                      # another thread's step got here first
            self.failed[key] = f"{type(error).__name__}: {error}"
        log.warning("the compiled target step for %d tokens (%d feature layers) raised, so its step reran eagerly "
                    "and that bucket stays eager: %s", key[0], len(key[1]), self.failed[key], exc_info=error)
        return None

    def _wider(self, bucket: int, layers: tuple[int, ...]) -> tuple[object, tuple]:
        for key, run in list(self._ready.items()):
            if key[0] == bucket and set(layers) <= set(key[1]):
                return run, key
        return None, (bucket, layers)

    def _claim(self, key: tuple) -> bool:
        """Whether this caller compiles `key` (no one asked for it before)."""
        with self._lock:
            if key in self._asked:
                return False
            self._asked.add(key)
            return True

    def _ask(self, key: tuple) -> None:
        if not self._claim(key):
            return
        if not self.background:
            self._compile(key)
            return
        self._jobs.put(key)
        with self._lock:                                    # engines sharing a target ask from their own threads
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="sparrow-step-compile", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            self._compile(self._jobs.get(), polite=True)

    @torch.inference_mode()
    def _compile(self, key: tuple, polite: bool = False) -> None:
        """Compile one graph and run it once on an empty batch (inductor builds its kernels on
        the first call), so the step that first uses it pays nothing. `polite`: start once the
        model is quiet (compiling.ModelGate)."""
        bucket, layers = key
        target = self.target
        try:
            ids = torch.zeros(1, bucket, dtype=torch.long, device=target.device)
            positions = target.family.step_positions(0, bucket, 0).to(target.device).contiguous()   # as forward's
            with GATE.compile(polite), current_batch(RaggedBatch([])):
                t0 = time.perf_counter()
                # Eagerly first, with hidden states asked for whatever the graph's layers:
                # transformers installs its capture hooks on a model's first forward that asks,
                # under a lock dynamo cannot trace, and every graph is then traced (and
                # fingerprinted) with the hooks the model keeps from then on.
                with modules_run() as ran:
                    _step_forward(target.hf, ids, positions, layers or (0,))
                baked = Baked(target.hf, list(ran.values()))
                run = compiled(_step_forward, (id(target.hf), bucket, layers, str(target.device), target.hf.dtype),
                               f"t{bucket}_f{len(layers)}_{id(target.hf):x}", target.device, cuda_graphs=False)
                run(target.hf, ids, positions, layers)
                seconds = time.perf_counter() - t0
        except Exception as e:          # a graph that cannot be built: that bucket stays eager
            self.failed[key] = f"{type(e).__name__}: {e}"
            log.warning("the target step for %d tokens could not be compiled, it stays eager: %s", bucket,
                        self.failed[key])
            return
        self.compile_seconds[key] = seconds
        self._baked[key] = baked
        self._ready[key] = run
        log.info("target step compiled for %d tokens (%d feature layers, %s %s) in %.1f s", bucket, len(layers),
                 target.device.type, target.hf.dtype, self.compile_seconds[key])
