"""The v2 target's vision tower, hand-set and frozen: Qwen2.5-VL's own tower (3 blocks at width
32, its 2-D rotary attention, its patch merger) whose visual tokens say *what* is in each 14 px
patch and, on the patches an object covers, *where* that patch is.

Why (models/world-v2/MODEL_CARD.md, "Third look"): a from-scratch language model on these cores
learns "where is the X" when the object's own tokens carry their place (0.93 held-out), and not
when the place reaches it only as M-RoPE's h/w rotations (0.20), nor when every token carries its
place (0.11: picking the object's tokens out by their content and reading theirs is not learned).
Qwen2.5-VL's tower has no absolute position embedding and its rotary attention cannot make one
over a flat background, so v2's frames have a lit background (render_v2.background): a fixed
colour gradient whose red channel grows left to right and blue top to bottom, at a constant
brightness (R + G + B), as a room's light would give. The tower then reads a patch's place off the
background around it:

- block 0: a large constant channel (its MLP's bias), which makes every later RMSNorm a fixed
  scale (the norms' weights undo it);
- block 1 (its MLP, SiLU-gated): presence P, a soft step of the patch's brightness (the
  background's R + G + B is constant, every palette colour is far brighter), and X, a steeper
  step just above the video codec's noise, set by a sliver of an object too faint for P but
  enough to tint the background the patch shows;
- block 2 (full attention within a frame pair): each patch averages the colour of the patches
  around it (a Gaussian of ~1 patch, from the rotary pairs that turn 0.1 rad a patch) that hold
  nothing (a key term -X from the pairs that barely turn), which is the background's colour
  there, so its place; its MLP gates that place by P (SiLU(G (P - 1/2)) times the place);
- the merger: per patch, the colour minus the local background (so an empty patch is zero), the
  change between the two frames, the gated place and P; centred so that an empty token is the
  marker alone, as v1's tower gives.

Named (`placed_vision_init(visual, named=True)`, the target's `vision_init="named"`): as a
pretrained tower's features name colours, each token also carries one code per palette colour,
the sum over its patches and both frames of a bump GELU(s (1 - |x - c|^2 / r_c^2)) of the frame's
patch colour x around the colour c (r_c: 0.45 of c's distance to the nearest other palette or
background colour). |x|^2 comes from block 2's MLP (products of its gated units); the rest is
linear in the merger's input. A patch an object only partly covers mixes in the background and
lights nothing: at 112 px a small object may light no code in a frame.

Every weight is set here; nothing is trained. `check_placed_tower` measures what it gives.
"""

from __future__ import annotations

import math

import torch

from sparrow.video.processors import OPENAI_CLIP_MEAN as MEAN, OPENAI_CLIP_STD as STD
from sparrow.world.v2.render_v2 import BACKGROUND_BASE, BACKGROUND_SPAN, background

DEPTH = 3                      # the tower's blocks (the config's vision_depth)
CONST = 100.0                  # the constant channel: RMSNorm of a residual dominated by it is ~linear
# residual channels (width 32)
COLOUR, CHANGE, PRESENCE, LOCAL, PLACE, TINT, ONE = 0, 3, 6, 7, 10, 12, 31
# presence: a soft step of R + G + B (0-765) from THRESHOLD over WIDTH levels; the background's is
# constant (3 * BASE + 2 * SPAN), the dimmest palette colour's is 300
THRESHOLD, WIDTH = 3 * BACKGROUND_BASE + 2 * BACKGROUND_SPAN + 36, 3.0
# X: the same at TINT_THRESHOLD over TINT_WIDTH (an mp4 round trip moves a background patch's
# R + G + B by ~4 levels, rarely 8)
TINT_THRESHOLD, TINT_WIDTH = 3 * BACKGROUND_BASE + 2 * BACKGROUND_SPAN + 5, 1.0
STEP = 10.0                    # the soft steps' height before scaling to 1 (see block 1)
SIGMA = 1.0                    # patches: the width of the neighbourhood the background is read from
EXCLUDE = 30.0                 # attention logit taken from a patch that holds any of an object (X = 1)
GATE = 20.0                    # SiLU(GATE (P - 1/2)): ~GATE/2 on an object's patch, ~0 elsewhere
# named (placed_vision_init(named=True)): block 2's MLP also writes each frame's |colour|^2 /
# SQUARE_DIV (units SQUARE_UNITS on), and the merger turns each patch's colour in each frame into a
# bump per palette colour c, GELU(NAME_SHARPNESS (1 - |colour - c|^2 / r_c^2)), summed over the token
SQUARE, SQUARE_DIV, SQUARE_UNITS, SQUARE_BIAS = 13, 4.0, 2, 20.0   # SQUARE, SQUARE + 1: the two frames
NAME_REACH = 0.45              # a colour's radius: this share of its distance to the nearest other or the background
NAME_SHARPNESS = 2.0
NAME_OUT, NAME_AMPLITUDE = 68, 0.5
# the merger's codes per patch, and where they land in the language model's input
CODES = 9                      # colour - local background (3), change (3), place x, y (2), presence (1)
# per token (4 patches): colours 0-11, changes 12-23, places 24-31, presences 32-35, then the
# marker (a constant 0.25) on up to 32 channels (fewer in a language model narrower than 68)
PLACE_OUT, PRESENCE_OUT, MARKER_OUT, MARKER_WIDTH = 24, 32, 36, 32
# the place reaches the language model as about PLACE_AMPLITUDE * x (x in [-1, 1]), presence as
# about PRESENCE_AMPLITUDE * P: the merger's rows are GELU(v/4 + 1.5), slope GELU'(1.5) / 4 there
_SLOPE = 0.25 * (0.5 * (1 + math.erf(1.5 / math.sqrt(2))) + 1.5 * math.exp(-1.125) / math.sqrt(2 * math.pi))
PLACE_AMPLITUDE, PRESENCE_AMPLITUDE = 3.0, 3.0
PLACE_SCALE, PRESENCE_SCALE = PLACE_AMPLITUDE / _SLOPE, PRESENCE_AMPLITUDE / _SLOPE


def _levels(channel: int) -> tuple[float, float]:
    """(a, b) with pixel level = a * normalised value + b, for one colour channel."""
    return 255.0 * STD[channel], 255.0 * MEAN[channel]


def _rms_of_constant(dim: int) -> float:
    return CONST / math.sqrt(dim)


@torch.no_grad()
def placed_vision_init(visual, named: bool = False) -> None:
    """Set Qwen2.5-VL's vision tower `visual` (depth 3, width 32, 2 heads, merge 2) as the module
    docstring says; named: each token also says which palette colours its patches show (one code
    per colour, NAME_OUT on), as a pretrained tower's features name colours."""
    cfg = visual.config
    dim, heads = cfg.hidden_size, cfg.num_heads
    head_dim = dim // heads
    if cfg.depth != DEPTH or dim != 32 or head_dim != 16 or visual.spatial_merge_size != 2:
        raise ValueError(f"the placed tower is depth {DEPTH}, width 32, head dim 16, merge 2; got depth {cfg.depth}, "
                         f"width {dim}, head dim {head_dim}, merge {visual.spatial_merge_size}")
    if list(cfg.fullatt_block_indexes) != [DEPTH - 1]:
        raise ValueError("the placed tower's last block must attend over the whole frame pair")
    for p in visual.parameters():
        p.zero_()
    # patch embedding: the mean colour (normalised units, as the processor gives) and the change
    w = visual.patch_embed.proj.weight                     # (dim, 3, tp, p, p)
    _, _, tp, p, _ = w.shape
    area = tp * p * p
    for c in range(3):
        w[COLOUR + c, c] = 1 / area
        w[CHANGE + c, c, 1], w[CHANGE + c, c, 0] = 2 / area, -2 / area
    rms = _rms_of_constant(dim)
    for block in visual.blocks:                            # norms: undo the constant's fixed scale
        block.norm1.weight.fill_(rms)
        block.norm2.weight.fill_(rms)
    b0, b1, b2 = visual.blocks
    b0.mlp.down_proj.bias[ONE] = CONST

    # block 1: P and X, each (silu(z) - silu(z - STEP)) / STEP with z = STEP (R + G + B - threshold)
    # / width: 0 below the threshold, 1 from width levels above it (the dip below 0 just under the
    # threshold, -0.1 / STEP, would otherwise draw the next block's attention to a faint sliver)
    gate, up, down = b1.mlp.gate_proj, b1.mlp.up_proj, b1.mlp.down_proj
    for units, channel, threshold, width in (((0, 1), PRESENCE, THRESHOLD, WIDTH),
                                             ((2, 3), TINT, TINT_THRESHOLD, TINT_WIDTH)):
        per_level = STEP / width
        offset = -threshold * per_level
        for c in range(3):
            a, b = _levels(c)
            gate.weight[units[0], COLOUR + c] = gate.weight[units[1], COLOUR + c] = a * per_level
            offset += b * per_level
        gate.bias[units[0]], gate.bias[units[1]] = offset, offset - STEP
        up.bias[units[0]], up.bias[units[1]] = 1.0 / STEP, -1.0 / STEP
        down.weight[channel, units[0]] = down.weight[channel, units[1]] = 1.0

    q, k, v, scale = 0, dim, 2 * dim, head_dim ** -0.5

    def gaussian(attn, sigma: float) -> None:
        """Head 0's logits s^2 (cos 0.1 dh + cos 0.1 dw) ~ const - (dh^2 + dw^2) / (2 sigma^2).
        The rotary layout: dims 0-3 turn with the row at 1, 0.1, 0.01, 0.001 rad a patch, 4-7
        with the column; dim i pairs with i + 8."""
        s = math.sqrt(1 / (2 * sigma ** 2) / (scale * 0.005))    # cos(0.1 d) ~ 1 - 0.005 d^2
        for pair in (1, 5):
            attn.qkv.bias[q + pair] = s
            attn.qkv.bias[k + pair] = s

    # block 2's attention: the background's colour around each patch; a key that holds any of an
    # object loses EXCLUDE * X (the row pair at 0.001 rad: ~unrotated)
    qkv = b2.attn.qkv
    gaussian(b2.attn, SIGMA)
    qkv.bias[q + 3] = -1.0
    qkv.weight[k + 3, TINT] = EXCLUDE / scale
    for c in range(3):
        qkv.weight[v + c, COLOUR + c] = 1.0
        b2.attn.proj.weight[LOCAL + c, c] = 1.0

    # block 2's MLP: the place (x, y in [-1, 1], from the local background's red and blue) gated by P
    gate, up, down = b2.mlp.gate_proj, b2.mlp.up_proj, b2.mlp.down_proj
    for unit, channel in enumerate((0, 2)):                # red: x, blue: y
        a, b = _levels(channel)
        gate.weight[unit, PRESENCE] = GATE
        gate.bias[unit] = -GATE / 2
        # level = a * local + b; place = 2 (level - BASE) / SPAN - 1
        up.weight[unit, LOCAL + channel] = 2 * a / BACKGROUND_SPAN
        up.bias[unit] = 2 * (b - BACKGROUND_BASE) / BACKGROUND_SPAN - 1
        down.weight[PLACE + unit, unit] = 2 / GATE

    if named:
        _square_colour(b2.mlp)

    # the merger: ln_q undoes the constant's scale; per patch q, CODES near-linear GELU rows
    merger = visual.merger
    merger.ln_q.weight.fill_(rms)
    first, last = merger.mlp[0], merger.mlp[2]
    patches = first.in_features // dim
    if last.out_features < MARKER_OUT + 8:
        raise ValueError(f"the language model's width {last.out_features} is too small for the placed codes")
    for qi in range(patches):
        row, col = qi * CODES, qi * dim
        for c in range(3):
            first.weight[row + c, col + COLOUR + c] = 0.25
            first.weight[row + c, col + LOCAL + c] = -0.25
            first.weight[row + 3 + c, col + CHANGE + c] = 0.25
            last.weight[3 * qi + c, row + c] = 8.0
            last.weight[12 + 3 * qi + c, row + 3 + c] = 8.0
        for j in range(2):
            first.weight[row + 6 + j, col + PLACE + j] = 0.25
            last.weight[PLACE_OUT + 2 * qi + j, row + 6 + j] = PLACE_SCALE
        first.weight[row + 8, col + PRESENCE] = 0.25
        last.weight[PRESENCE_OUT + qi, row + 8] = PRESENCE_SCALE
    first.bias[:patches * CODES] = 1.5                     # x/4 + 1.5 keeps GELU near-linear
    if named:
        _name_colours(first, last, dim, patches)
    # centred on an empty token (the middle of a blank frame pair), then the marker
    empty = _tokens(visual, torch.from_numpy(background(112).copy()))
    last.bias.copy_(-empty[empty.shape[0] // 2 + 1])
    last.bias[MARKER_OUT:MARKER_OUT + MARKER_WIDTH] += 0.25


def _square_colour(mlp) -> None:
    """Block 2's MLP writes each frame's |colour|^2 / SQUARE_DIV (normalised units) to SQUARE and
    SQUARE + 1: a frame's colour is COLOUR -/+ CHANGE / 2 (the pair's mean and difference), and per
    channel two units, silu(B + x) x and silu(B) x, differ by x^2 (silu(z) = z at the large B)."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    for frame, sign in enumerate((-0.5, 0.5)):
        for c in range(3):
            product = SQUARE_UNITS + 6 * frame + 2 * c
            linear = product + 1
            for unit in (product, linear):
                up.weight[unit, COLOUR + c], up.weight[unit, CHANGE + c] = 1.0, sign
            gate.weight[product, COLOUR + c], gate.weight[product, CHANGE + c] = 1.0, sign
            gate.bias[product] = gate.bias[linear] = SQUARE_BIAS
            down.weight[SQUARE + frame, product], down.weight[SQUARE + frame, linear] = 1 / SQUARE_DIV, -1 / SQUARE_DIV


def _name_colours(first, last, dim: int, patches: int) -> None:
    """The merger's class rows: per patch, frame and palette colour c, GELU(a) with a =
    NAME_SHARPNESS (1 - |x - c|^2 / r_c^2), linear in the frame's colour x and |x|^2 (|x - c|^2 =
    |x|^2 - 2 c.x + |c|^2): a bump, NAME_SHARPNESS at c and 0 from r_c out, summed over the token's
    patches and both frames into NAME_OUT + c."""
    from sparrow.video.synthetic import PALETTE

    rows = patches * CODES
    if rows + 2 * patches * len(PALETTE) > first.out_features or NAME_OUT + len(PALETTE) > last.out_features:
        raise ValueError("the merger or the language model is too narrow for the colour names")
    scales = [_levels(c)[0] for c in range(3)]                     # pixel levels per normalised unit
    s2 = sum(scale ** 2 for scale in scales) / 3
    lit = [tuple(rgb) for rgb in background(112).reshape(-1, 3)[::7].tolist()]    # the background's colours
    unit = rows
    for ci, rgb in enumerate(PALETTE.values()):
        radius = NAME_REACH * min(math.dist(rgb, other) for other in (*PALETTE.values(), *lit) if other != rgb)
        centre = [(rgb[c] - _levels(c)[1]) / scales[c] for c in range(3)]    # c in normalised units
        # the distance is taken in normalised units and the radius brought to them by the channels'
        # mean scale (the three are within 5% of each other)
        k = NAME_SHARPNESS / radius ** 2 * s2
        for qi in range(patches):
            col = qi * dim
            for frame, sign in enumerate((-0.5, 0.5)):
                for c in range(3):
                    first.weight[unit, col + COLOUR + c] = 2 * k * centre[c]
                    first.weight[unit, col + CHANGE + c] = 2 * k * centre[c] * sign
                first.weight[unit, col + SQUARE + frame] = -k * SQUARE_DIV
                first.bias[unit] = NAME_SHARPNESS - k * sum(v * v for v in centre)
                last.weight[NAME_OUT + ci, unit] = NAME_AMPLITUDE
                unit += 1


def _tokens(visual, frame: torch.Tensor) -> torch.Tensor:
    """The tower's tokens for one frame pair of the uint8 (H, W, 3) picture `frame`, shown twice,
    patchified and normalised by the serving processor (row-major tokens)."""
    from sparrow.video.processors import QwenVLVideoProcessor

    pair = frame.numpy()[None].repeat(2, axis=0)                      # (2, H, W, 3)
    patches, grid = QwenVLVideoProcessor(patch_size=visual.patch_size, merge_size=visual.spatial_merge_size)._patchify(pair)
    out = visual(torch.from_numpy(patches), grid_thw=torch.tensor([grid]))
    return out if torch.is_tensor(out) else out.pooler_output


@torch.no_grad()
def check_placed_tower(visual, side: int = 112) -> dict:
    """What the tower gives on single frames: the largest code an empty token carries (beside the
    marker), and for a 1-patch white square at each patch of a frame, the place code its token
    reads against the truth (max error in [-1, 1] units)."""
    from sparrow.video.synthetic import PALETTE

    p = visual.patch_size
    patches_side = side // p
    blank = _tokens(visual, torch.from_numpy(background(side).copy()))
    marker = torch.zeros_like(blank[0])
    marker[MARKER_OUT:MARKER_OUT + MARKER_WIDTH] = 0.25
    worst_empty = float((blank - marker).abs().max())
    errors = []
    for row in range(patches_side):
        for col in range(patches_side):
            frame = background(side).copy()
            frame[row * p:(row + 1) * p, col * p:(col + 1) * p] = PALETTE["white"]
            tokens = _tokens(visual, torch.from_numpy(frame))
            token = (row // 2) * (patches_side // 2) + col // 2
            q = (row % 2) * 2 + col % 2
            got = tokens[token, PLACE_OUT + 2 * q:PLACE_OUT + 2 * q + 2] / PLACE_AMPLITUDE
            want = torch.tensor([(col + 0.5) / patches_side * 2 - 1, (row + 0.5) / patches_side * 2 - 1])
            errors.append(float((got - want).abs().max()))
    return {"empty_max": worst_empty, "place_error_max": max(errors), "place_error_mean": sum(errors) / len(errors)}
