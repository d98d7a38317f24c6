"""What differs between the target model families, in one place.

The engine never branches on the model type: it asks the family for the placeholder token,
the extra model inputs and the positions. Qwen2.5-VL uses 3-axis M-RoPE positions, computed
here explicitly from the prefill's rope delta, so nothing is read from or left on the HF
model between calls (`model.model.rope_deltas` would be shared by concurrent requests).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InvalidRequest


class Family:
    model_type: str
    video_token_attr: str
    # Whether a video's frames sit at positions of real time (a live stream can be appended
    # to: live_positions), or are placed by their count (a video is whole before it is read).
    real_time_video: bool = False

    def video_token_id(self, config) -> int:
        return int(getattr(config, self.video_token_attr))

    def extra_inputs(self, input_ids: torch.Tensor, video_token_id: int) -> dict[str, torch.Tensor]:
        return {}

    def prefill_positions(self, hf, inputs: dict) -> tuple[torch.Tensor, int]:
        """(position_ids for the prompt, rope delta): position of sequence index i >= prompt is i + delta."""
        n = inputs["input_ids"].shape[1]
        return torch.arange(n).view(1, n), 0

    def step_positions(self, start: int, n: int, delta: int, time_shift: int = 0) -> torch.Tensor:
        return self.text_positions(torch.arange(start, start + n), delta, time_shift)

    def text_positions(self, index: torch.Tensor, delta: int, time_shift: int = 0) -> torch.Tensor:
        """Positions of text tokens at sequence indices `index` (n,) after the prompt: (1, n).
        time_shift: added on the temporal axis (families with one; a live window, live_window.py)."""
        if time_shift:
            raise InvalidRequest(f"{self.model_type} positions have no temporal axis to shift")
        return (index + delta).view(1, -1)

    def shift_time(self, position_ids: torch.Tensor, start: int, shift: int) -> torch.Tensor:
        """A copy of prefill `position_ids` with `shift` added on the temporal axis from
        sequence index `start` on."""
        raise InvalidRequest(f"{self.model_type} positions have no temporal axis to shift")

    def live_positions(self, start: int, pairs: Sequence[int], interval: float, grid: tuple[int, int]) -> torch.Tensor:
        """Positions (3, 1, len(pairs) * rows * cols) of frame pairs appended to a live video
        that follows `start` text positions (real-time families only; see QwenVLFamily)."""
        raise InvalidRequest(f"{self.model_type} places a video's frames by count, not real time")

    def pair_time(self, pair: int, interval: float) -> int:
        """The temporal position of frame pair `pair` counted from the video's first pair."""
        raise InvalidRequest(f"{self.model_type} places a video's frames by count, not real time")

    def video_embeds(self, hf, inputs: dict) -> torch.Tensor:
        """(Nv, H) the visual tokens' embeddings in prompt order, from the model's public
        `get_video_features`, as its own forward builds them."""
        raise NotImplementedError

    def prompt_embeds(self, hf, inputs: dict, start: int, end: int, video_token_id: int) -> torch.Tensor:
        """(1, end - start, H) input embeddings of prompt positions [start, end): token
        embeddings with the video's visual tokens scattered over its placeholders, exactly
        as the HF forward does (it then runs the language model on them)."""
        ids = inputs["input_ids"][:, start:end]
        embeds = hf.get_input_embeddings()(ids)
        placeholders = ids == video_token_id
        if not bool(placeholders.any()):
            return embeds
        if start != 0:
            raise ValueError("a prompt slice with video placeholders must start at 0 (the video's pixels are whole)")
        visual = self.video_embeds(hf, inputs)
        count = int((inputs["input_ids"] == video_token_id).sum())
        if visual.shape[0] != count:
            raise InvalidRequest(f"the vision tower made {visual.shape[0]} visual tokens for {count} placeholders")
        visual = visual[: int(placeholders.sum())].to(embeds.device, embeds.dtype)
        return embeds.masked_scatter(placeholders[..., None].expand_as(embeds), visual)


class QwenVLFamily(Family):
    model_type = "qwen2_5_vl"
    video_token_attr = "video_token_id"
    real_time_video = True

    def extra_inputs(self, input_ids: torch.Tensor, video_token_id: int) -> dict[str, torch.Tensor]:
        # transformers 5 builds 3-axis positions only when it sees these (0 text, 1 image, 2 video).
        return {"mm_token_type_ids": (input_ids == video_token_id).to(torch.int32) * 2}

    def prefill_positions(self, hf, inputs: dict) -> tuple[torch.Tensor, int]:
        position_ids, deltas = hf.model.get_rope_index(   # pure: returns, stores nothing
            inputs["input_ids"],
            inputs["mm_token_type_ids"],
            video_grid_thw=inputs.get("video_grid_thw"),
            second_per_grid_ts=inputs.get("second_per_grid_ts"),
            attention_mask=inputs.get("attention_mask"),
        )
        return position_ids, int(deltas.view(-1)[0])    # position_ids: (3, 1, T)

    def video_embeds(self, hf, inputs: dict) -> torch.Tensor:
        out = hf.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"], return_dict=True)
        return torch.cat(out.pooler_output, dim=0)

    def text_positions(self, index: torch.Tensor, delta: int, time_shift: int = 0) -> torch.Tensor:
        # After the prompt every token is text: the three axes share one position (3, 1, n),
        # except that a live window's text sits time_shift later on the temporal axis.
        n = index.shape[0]
        pos = (index + delta).view(1, 1, n).expand(3, 1, n)
        if time_shift:
            pos = pos.clone()
            pos[0] += time_shift
        return pos

    def shift_time(self, position_ids: torch.Tensor, start: int, shift: int) -> torch.Tensor:
        out = position_ids.clone()
        out[0, :, start:] += shift
        return out

    def pair_time(self, pair: int, interval: float) -> int:
        # HF (transformers 5) puts pair t at floor(t x tokens_per_second x seconds per pair).
        return int(pair * interval)

    def live_positions(self, start: int, pairs: Sequence[int], interval: float, grid: tuple[int, int]) -> torch.Tensor:
        """Pair p (counted from the video's first pair) at temporal position start +
        pair_time(p, interval) (interval: tokens_per_second x seconds per pair); its merged
        patch (r, c) of the grid (rows, cols) at height start + r and width start + c. These
        are the positions HF gives the same pairs of a whole video: they never depend on the
        pairs still to come, so pairs appended one by one read as the video prefilled at once."""
        rows, cols = grid
        h = torch.arange(rows).view(rows, 1).expand(rows, cols) + start
        w = torch.arange(cols).view(1, cols).expand(rows, cols) + start
        return torch.cat([torch.stack([torch.full_like(h, start + self.pair_time(p, interval)), h, w])
                          .view(3, 1, rows * cols) for p in pairs], dim=-1)


class LlavaOnevisionFamily(Family):
    model_type = "llava_onevision"
    video_token_attr = "video_token_index"

    def video_embeds(self, hf, inputs: dict) -> torch.Tensor:
        return hf.model.get_video_features(inputs["pixel_values_videos"], return_dict=True).pooler_output.flatten(0, 1)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (QwenVLFamily(), LlavaOnevisionFamily())}
