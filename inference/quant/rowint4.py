"""4-bit weights for the native step (`--quantize int4-row`): about half the bytes a token
reads.

Per output channel, groups of GROUP (32) along k, each weight w ~ S s u - M t: u in 0..15
stored as nibbles, per group an unsigned 8-bit step s (1..255) and a signed 8-bit offset t
(-127..127), per channel float scales S and M. Asymmetric, as llama.cpp's Q4_1 and Q4_K:
symmetric q in [-8, 7] cost the embedded model a mean KL of 0.46 against fp32 from the
weights alone, a grid with an offset nothing (its weights are Q4_1's; docs/native.md). The
native product (inference/native/step.c, dot4_rows) stays two exact integer sums,
sum_g s_g sum u x and sum_g t_g sum x, and the activations int8 per row as with int8-row.
4.5 bits a weight plus 8 bytes a channel.

The conversion gives the same bytes on every CPU (docs/same-answers.md): IEEE basic operations
one per torch call, in float32 (correctly rounded in any vector width: the weights are float32 after
smoothing anyway), maxima and comparisons, and the one sum (a group's squared error) as a
fixed tree of elementwise adds instead of torch's sum, whose order follows the CPU's lanes.
"""

from __future__ import annotations

import torch

from inference.quant.rowint8 import RowInt8Linear

GROUP = 32
BLOCK = 64  # elements a packed block holds: byte j = element j (low nibble), 32 + j (high)
U_MAX = 15  # nibbles: 0..15
SUB_MAX = 255  # a group's step: s x S, s in 1..255
MIN_MAX = 127  # a group's offset: -t x M, t in -127..127
# Each group's range [lo, hi] is tried whole and narrowed by these fractions of its width
# at the bottom and top (clipping an outlier for finer steps): the least squared error wins.
SHRINK = ((0.0, 0.0), (0.0, 0.0625), (0.0625, 0.0), (0.0625, 0.0625), (0.125, 0.125))
# Weights converted at a time: float32 temporaries of 512 KB, below the loader's mmap
# threshold (inference/host/heap.py), so they come from the heap, not fresh faulted pages
# (8x slower on a [4864, 896] weight).
ELEMENTS_PER_BLOCK = 1 << 17


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the first dimension (a power of two) by halves: the same adds in the same
    order on every CPU (torch's sum orders them by the CPU's lanes)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def _grid(groups, lo, hi, step_scale, min_scale):
    """(s, t, u, squared error) of groups [32, n, G] on the grid s x S x u - t x M that spans
    [lo, hi] (s and t rounded to their integers first, then u)."""
    sub = ((hi - lo) / U_MAX / step_scale).round_().clamp_(1, SUB_MAX)
    t = (-lo / min_scale).round_().clamp_(-MIN_MAX, MIN_MAX)
    step, offset = sub * step_scale, t * min_scale
    u = ((groups + offset) / step).round_().clamp_(0, U_MAX)
    diff = groups - (u * step - offset)
    return sub, t, u, tree_sum(diff.mul_(diff))


def quantize_block(w: torch.Tensor):
    """(u [n, k] float, s [n, G], t [n, G], S [n], M [n]) of float32 w [n, k]. The groups'
    elements go first ([32, n, G]): the tree's halves are then contiguous."""
    groups = w.view(w.shape[0], -1, GROUP).permute(2, 0, 1).contiguous()
    lo, hi = groups.amin(0), groups.amax(0)
    step_scale = ((hi - lo).amax(-1) / (U_MAX * SUB_MAX)).clamp_(min=1e-30)[:, None]
    min_scale = (lo.abs().amax(-1) / MIN_MAX).clamp_(min=1e-30)[:, None]
    best = None
    for bottom, top in SHRINK:
        width = hi - lo
        found = _grid(groups, lo + width * bottom, hi - width * top, step_scale, min_scale)
        if best is None:
            best = found
        else:
            better = found[3] < best[3]
            best = tuple(torch.where(better, f, b) for f, b in zip(found, best, strict=True))
    sub, t, u, _ = best
    u = u.permute(1, 2, 0).reshape(w.shape)
    return u, sub, t, step_scale[:, 0], min_scale[:, 0]


def quantize_weight(weight: torch.Tensor, column_scale: torch.Tensor | None = None):
    """(nibbles uint8 [N, K / 2], s uint8 [N, K / 32], S float32 [N], t int8 [N, K / 32],
    M float32 [N]) of the weight with its columns multiplied by `column_scale` first
    (smoothing): w ~ S s u - M t per group. K a multiple of 64; rounded half to even."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"4-bit weights need k a multiple of {BLOCK}, not {k}")
    q4 = torch.empty(n, k // 2, dtype=torch.uint8)
    subs = torch.empty(n, k // GROUP, dtype=torch.uint8)
    mins = torch.empty(n, k // GROUP, dtype=torch.int8)
    scale, min_scale = torch.empty(n), torch.empty(n)
    per_block = max(1, ELEMENTS_PER_BLOCK // k)
    for start in range(0, n, per_block):
        rows = slice(start, start + per_block)
        w = weight.detach()[rows].to(torch.float32, copy=True)
        if column_scale is not None:
            w.mul_(column_scale)
        u, sub, t, scale[rows], min_scale[rows] = quantize_block(w)
        q4[rows] = pack(u.to(torch.uint8))
        subs[rows], mins[rows] = sub.to(torch.uint8), t.to(torch.int8)
    return q4, subs, scale, mins, min_scale


def pack(u: torch.Tensor) -> torch.Tensor:
    """Nibbles u uint8 [N, K] in 0..15 as step.c's bytes [N, K / 2]."""
    u = u.view(u.shape[0], -1, 2, BLOCK // 2)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(u.shape[0], -1)


def unpack(q4: torch.Tensor) -> torch.Tensor:
    """The nibbles u uint8 [N, K] of bytes [N, K / 2]."""
    b = q4.view(q4.shape[0], -1, BLOCK // 2)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(q4.shape[0], -1)


def dequantize(q4, sub, scale, mins, min_scale) -> torch.Tensor:
    """The float32 weight [N, K] that the parts stand for (S s u - M t per group)."""
    u = unpack(q4).float().view(len(q4), -1, GROUP)
    step = sub.float() * scale[:, None]
    return (u * step[..., None] - (mins.float() * min_scale[:, None])[..., None]).flatten(1)


class RowInt4Linear(RowInt8Linear):
    """The per-row Linear with 4-bit weights (nibbles, sub-scales, a scale per channel),
    which only the native library multiplies: a drop-in wherever RowInt8Linear goes."""

    PARTS = ("weight_q4", "weight_sub", "weight_scale", "weight_min", "weight_min_scale")

    def __init__(self, in_features: int, bias: torch.Tensor | None = None, native=None):
        if native is None:
            raise ValueError("4-bit weights (int4-row) run on the native step only")
        super().__init__(in_features, bias, native)
        for name in self.PARTS:
            self.register_buffer(name, None)

    def _keep(self, blocks, column_scale, rows: int) -> None:
        pieces = [[] for _ in self.PARTS]
        for _start, block in blocks:  # in order, so concatenated they are the weight
            for piece, part in zip(pieces, quantize_weight(block, column_scale), strict=True):
                piece.append(part)
        for name, piece in zip(self.PARTS, pieces, strict=True):
            setattr(self, name, torch.cat(piece))
        self.out_features = rows

    def parts(self) -> list[torch.Tensor]:
        """What the native library takes, in its order (step.c's dc_linear4)."""
        return [getattr(self, name) for name in self.PARTS]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return self.native.linear4(self.parts(), self.bias, x)
