"""Video ingest throughput: decode + patchify against the target's prefill of the same request.

    python -m benchmarks.video [--quick] [--out BENCHMARKS.md]

For requests of 1.5k / 6k / 24.6k visual tokens (Qwen2.5-VL: 448x448 frames are 16x16
merged tokens per pair of frames), time PyAV decoding of an mp4 (`load_frames`), the numpy
patchify (`processor.process`), and the tiny target's prefill over the prompt that holds
them (`Engine.prepare` + `target.prefill`). Decode + patchify should be a small fraction of
prefill; with a 7B target the prefill is far dearer still, so the tiny model's ratio is an
upper bound on ingest's share. Encoding the synthetic video is not timed.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from benchmarks.report import write_section
from sparrow import Engine, SpecConfig
from sparrow.tiny import tiny_target
from sparrow.video import VideoOptions, load_frames, write_synthetic_video

PROMPT = "What happens in the video?"
FPS = 2.0


def _best_s(fn, reps: int) -> tuple[float, object]:
    """Best wall time of `fn` over `reps` runs (the least disturbed on a shared machine),
    and its last result."""
    times, out = [], None
    for _ in range(reps):
        out = None  # free the previous result first: a 24k-token video is ~0.5 GB of floats
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def measure(target, engine, num_frames: int, width: int, height: int, reps: int) -> dict:
    video = write_synthetic_video(None, num_frames=num_frames, width=width, height=height, fps=FPS, seed=0)
    options = VideoOptions(fps=FPS, max_frames=num_frames)
    decode_s, frames = _best_s(lambda: load_frames(video.data, options), reps)
    patch_s, processed = _best_s(lambda: target.processor.process(frames), reps)
    inputs = engine.prepare(processed, PROMPT)
    length = inputs["input_ids"].shape[1]
    with torch.inference_mode():
        prefill_s, _ = _best_s(lambda: target.prefill(inputs, capacity=length + 1), max(1, reps // 2))
    ingest = decode_s + patch_s
    return {"frames": len(frames), "size": f"{width}x{height}", "tokens": processed.num_visual_tokens,
            "decode_ms": decode_s * 1e3, "patch_ms": patch_s * 1e3, "fps": len(frames) / ingest,
            "tok_s": processed.num_visual_tokens / ingest, "prefill_ms": prefill_s * 1e3,
            "ratio": ingest / prefill_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", default=None, help="write the table into this BENCHMARKS.md")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: OpenMP threads spin badly on a shared, busy machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    reps = 1 if args.quick else 3
    target = tiny_target("qwen2_5_vl", seed=0)
    engine = Engine(target, spec=SpecConfig(method="none"))
    measure(target, engine, 4, 112, 112, 1)  # warm-up: first calls pay for lazy initialisation
    cases = [(12, 448, 448), (48, 448, 448), (192, 448, 448)]  # 1,536 / 6,144 / 24,576 tokens
    if not args.quick:
        cases.append((192, 1280, 720))  # 720p: the budget resizes it to 336x588 (PIL bicubic, timed in patchify)
    lines = [f"Machine: {platform.machine()}, {torch.get_num_threads()} torch threads, CPU only. Target: tiny "
             "random Qwen2.5-VL (hidden 64, 4 layers, 2-layer vision tower), fp32. Synthetic mp4 (x264) at 2 fps; "
             f"best of {reps}.", "",
             "| frames | source | visual tokens | decode ms | patchify ms | frames/s | visual tokens/s "
             "| prefill ms | ingest / prefill |",
             "|---|---|---|---|---|---|---|---|---|"]
    for num_frames, width, height in cases:
        r = measure(target, engine, num_frames, width, height, reps)
        lines.append(f"| {r['frames']} | {r['size']} | {r['tokens']} | {r['decode_ms']:.0f} | {r['patch_ms']:.0f} "
                     f"| {r['fps']:.0f} | {r['tok_s']:.0f} | {r['prefill_ms']:.0f} | {r['ratio']:.2f} |")
    lines += ["", "decode: PyAV to RGB of the sampled frames. patchify: resize (PIL bicubic, as HF; none at 448x448) "
              "+ normalise + patch layout. ingest = decode + patchify. The tiny target's prefill is a floor: a 7B "
              "target's is far dearer, so ingest's share there is smaller still."]
    text = "\n".join(lines)
    print(text)
    if args.out:
        cmd = "python -m benchmarks.video" + (" --quick" if args.quick else "") + f" --threads {args.threads}"
        write_section(args.out, "video", "Video ingest: decode + patchify vs prefill (tiny model)", cmd, text)


if __name__ == "__main__":
    main()
