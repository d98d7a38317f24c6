"""A 7B-dimension smoke run: a Qwen2.5-VL with Qwen2.5-VL-7B's text widths (hidden 3584,
28 heads, 4 KV heads, MLP 18944, M-RoPE sections 16/24/24) but 1 decoder layer and a 1-layer
vision tower, random bf16 weights saved as sharded safetensors, with a Sparrow draft of the
same width; served by `sparrow serve --dtype bfloat16` in its own process and asked one
question through `sparrow generate`. It checks the plumbing at real widths (sharded loading,
bf16 end to end, the draft bound to a 3584-wide target, gRPC), not quality: the answer is noise.

    python -m benchmarks.smoke_7b [--vocab 152064] [--workdir DIR] [--device cpu]

--vocab 152064 is the real vocabulary (1.39B parameters, embedding + lm_head 2.2 GB in bf16;
measured on the 2-core CPU machine: 45 s in all, the builder peaks at 3.7 GB, the server at
2.7 GB; the answer text is empty, as the test tokenizer has 512 ids). The default, the
tokenizer's 512 ids (0.3B parameters), keeps the run small enough for the test suite
(tests/test_smoke_7b.py: ~33 s, server 2.1 GB).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN7B_TEXT = dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                   rope_theta=1_000_000.0, mrope_section=[16, 24, 24])


def build_checkpoint(out: Path, vocab: int | None = None, layers: int = 1, shard: str = "200MB", seed: int = 0) -> dict:
    """Write the 7B-shaped target (out/target) and a Sparrow draft for it (out/draft)."""
    # sparrow first: importing the Qwen2.5-VL classes before anything else of transformers 5.24
    # hits a circular import (transformers.activations <- integrations.finegrained_fp8).
    from sparrow.models import SparrowDraft, TargetModel
    from sparrow.tokenizer import qwen_vl_tokenizer
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_vl_tokenizer()
    ids = tok.convert_tokens_to_ids
    t = QWEN7B_TEXT
    text = dict(vocab_size=vocab or len(tok), hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
                num_hidden_layers=layers, num_attention_heads=t["num_attention_heads"],
                num_key_value_heads=t["num_key_value_heads"], max_position_embeddings=128000,
                eos_token_id=ids("<|im_end|>"), pad_token_id=tok.pad_token_id, bos_token_id=None,
                tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"],
                                                             "mrope_section": t["mrope_section"]})
    vision = dict(depth=1, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=t["hidden_size"],
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=[0], tokens_per_second=2)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                              video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                              vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    from transformers.initialization import no_init_weights

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)       # built in bf16: no float32 copy (5 GB at the real vocab)
    try:
        # Built without torch's and HF's initialisers (they drew every weight twice: 7.6 s of the
        # 17 s build on 2 cores), then filled from one seeded block of noise (fill_noise).
        with no_init_weights():
            hf = Qwen2_5_VLForConditionalGeneration(config).eval()
            hf.generation_config.eos_token_id = text["eos_token_id"]
            hf.generation_config.pad_token_id = tok.pad_token_id
            target = TargetModel(hf, tok)
            draft = SparrowDraft.for_target(target).eval()
        fill_noise(hf, seed)
        fill_noise(draft, seed + 1)
    finally:
        torch.set_default_dtype(old)
    target.save_pretrained(out / "target", max_shard_size=shard)
    draft.save_pretrained(out / "draft")
    params = sum(p.numel() for p in hf.parameters())
    shards = len(list((out / "target").glob("model-*.safetensors")))
    return {"target_params": params, "draft_params": sum(p.numel() for p in draft.parameters()), "shards": shards}


@torch.no_grad()
def fill_noise(model: torch.nn.Module, seed: int, block: int = 1 << 16, scale: float = 0.02) -> None:
    """Every matrix filled with one seeded block of N(0, scale) noise, repeated (a row offset
    differs from the next, as no width here divides the block); vectors: norm weights 1, biases 0.
    Noise, not a trained model: the smoke checks plumbing at real widths, not answers."""
    noise = torch.randn(block, generator=torch.Generator().manual_seed(seed)) * scale
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            flat, whole = p.view(-1), p.numel() - p.numel() % block
            flat[:whole].view(-1, block).copy_(noise.expand(whole // block, block))
            flat[whole:].copy_(noise[:p.numel() - whole])
        elif name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "sparrow.cli", *args]


def _peak_rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def _wait_ready(server: subprocess.Popen, port: int, timeout_s: float) -> None:
    import grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"sparrow serve exited with {server.returncode}")
            with contextlib.suppress(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=1.0)
                return
    raise TimeoutError(f"sparrow serve was not ready within {timeout_s:.0f} s")


def run(workdir: Path, vocab: int | None = None, device: str = "cpu", max_new_tokens: int = 8,
        ready_timeout_s: float = 300.0, target_step: str = "compiled", num_frames: int | None = None) -> dict:
    """Build, serve, ask (num_frames: sampled from the 8-frame clip, default the server's fps);
    returns the figures and the answer's last line (finish reason...)."""
    from sparrow.video import write_synthetic_video

    t0 = time.perf_counter()
    # Built in a child process, so this one never holds the weights while the server does.
    child = subprocess.run([sys.executable, "-m", "benchmarks.smoke_7b", "--build-only", "--workdir", str(workdir),
                            *(["--vocab", str(vocab)] if vocab else [])], capture_output=True, text=True, check=False)
    if child.returncode != 0:
        raise RuntimeError(f"building the checkpoint failed:\n{child.stderr[-2000:]}")
    built = json.loads(child.stdout.strip().splitlines()[-1])
    t_build = time.perf_counter() - t0
    video = workdir / "clip.mp4"
    write_synthetic_video(video, num_frames=8, width=112, height=112, fps=4.0, seed=1)
    port = _free_port()
    env = {**os.environ, "OMP_WAIT_POLICY": "passive"}
    server = subprocess.Popen(_cli("serve", "--target", str(workdir / "target"), "--draft", str(workdir / "draft"),
                                   "--dtype", "bfloat16", "--device", device, "--port", str(port), "--target-step", target_step,
                                   "--log-format", "text", "--log-level", "WARNING"),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t1 = time.perf_counter()
        _wait_ready(server, port, ready_timeout_s)
        t_load = time.perf_counter() - t1
        t2 = time.perf_counter()
        answer = subprocess.run(_cli("generate", "--server", f"127.0.0.1:{port}", str(video),
                                     "What happens in the video?", "--max-new-tokens", str(max_new_tokens),
                                     "--timeout", "120", *(["--num-frames", str(num_frames)] if num_frames else [])), env=env, capture_output=True, text=True, timeout=180)
        t_answer = time.perf_counter() - t2
        rss = _peak_rss_mb(server.pid)
    finally:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=20)
        if server.poll() is None:
            server.kill()
    log = server.stdout.read() if server.stdout else ""
    return {**built, "vocab": vocab, "returncode": answer.returncode, "summary": answer.stderr.strip().splitlines()[-1:],
            "stdout": answer.stdout, "server_log_tail": log[-2000:], "build_s": round(t_build, 1),
            "load_s": round(t_load, 1), "answer_s": round(t_answer, 1), "server_peak_rss_mb": rss}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=None, help="model vocabulary (default: the tokenizer's; 7B: 152064)")
    ap.add_argument("--device", default="cpu", help="where the server loads the models (cpu, cuda, auto)")
    ap.add_argument("--workdir", help="keep the checkpoint here (default: a temporary directory)")
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--build-only", action="store_true", help="write the checkpoint to --workdir and stop")
    args = ap.parse_args(argv)
    if args.build_only:
        print(json.dumps(build_checkpoint(Path(args.workdir), args.vocab)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        result = run(workdir, args.vocab, args.device, args.max_new_tokens)
    print(json.dumps({k: v for k, v in result.items() if k != "server_log_tail" or result["returncode"]}, indent=1))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
