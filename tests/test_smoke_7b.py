"""A Qwen2.5-VL with the 7B model's text widths (1 layer), bf16, sharded safetensors, served
by `sparrow serve --dtype bfloat16` and answered through `sparrow generate` (benchmarks/smoke_7b.py;
about 31 s and 2 GB on the 2-core CI machine)."""

from benchmarks.smoke_7b import run


def test_7b_widths_serve_and_answer_in_bf16(tmp_path):
    # 2 frames (one temporal pair, 144 visual tokens; 8 frames gave 288): a 3584-wide bf16 prefill
    # runs at ~21 GFLOP/s on a CPU without bf16 instructions. Compiled steps: tests/test_step_graph*.py
    result = run(tmp_path, max_new_tokens=6, target_step="eager", num_frames=2)
    assert result["returncode"] == 0, result["server_log_tail"]
    assert result["shards"] > 1 and result["target_params"] > 2.5e8          # really 3584 wide, really sharded
    (summary,) = result["summary"]
    assert summary.startswith(("[length] 6 tokens", "[stop]")), summary
    assert result["server_peak_rss_mb"] is None or result["server_peak_rss_mb"] < 4096
