"""Float math whose bits are the same on every CPU, whatever kernels torch dispatches to.

torch's exp, log, pow, softmax, sums and matrix products change their last bits with the
CPU's vector width (ATEN_CPU_CAPABILITY default, avx2, avx512) and with MKL's own kernels:
a sum's order follows the lanes, transcendental functions are different polynomials. Such a
bit, in a smoothing scale or a sampling weight, turns into a different int8 weight or a
different token, and a PC answers differently from its neighbour.

Here only IEEE's basic operations are used, one per torch call (+, -, *, /, sqrt, round,
comparisons, max: correctly rounded, so the same bits in any vector width), and sums are
made exact, so their order cannot matter: values become integers in float64 (fixed point,
a power-of-two scale per row) small enough that every partial sum stays below 2^53. exp and
log are polynomials of basic operations; they are accurate to a few float64 ulps, and,
above all, the same everywhere.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
# ln 2 in two parts (fdlibm's): the first has 32 bits, so n * LN2_HI is exact for |n| < 2^21
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
SQRT_HALF = 0.7071067811865476
_EXP_TERMS = [1.0 / math.factorial(k) for k in range(14)]  # |r| <= 0.35: error < 1e-17
_LOG_TERMS = [1.0 / (2 * k + 1) for k in range(12)]  # |t| <= 0.172: error < 1e-17


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent (integers in [-1022, 1023]) as float64, built from its bits: exact."""
    bits = (exponent.to(torch.int64).clamp(-1022, 1023) + 1023) << 52
    return bits.view(torch.float64)


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x in x's own precision: float64, or float32 by the native step's polynomial
    (inference/native/step.c's exp8, Cephes'), op for op, so the same bits as it. -inf
    gives 0; large values saturate."""
    if x.dtype == torch.float32:
        return _exp32(x)
    x = x.to(torch.float64)
    clamped = x.clamp(-708.0, 709.0)
    n = torch.round(clamped * LOG2E)
    r = clamped - n * LN2_HI
    r = r - n * LN2_LO
    p = torch.full_like(r, _EXP_TERMS[-1])
    for c in reversed(_EXP_TERMS[:-1]):
        p = p * r
        p = p + c
    out = p * pow2(n)
    return torch.where(x == -math.inf, 0.0, out)


_EXP32_TERMS = (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _exp32(x: torch.Tensor) -> torch.Tensor:
    clamped = x.clamp(-87.3, 88.3)
    fx = clamped * LOG2E
    fx = fx + 0.5
    n = torch.floor(fx)
    r = clamped - n * 0.693359375
    r = r + n * 2.12194440e-4
    y = torch.full_like(r, 1.9875691500e-4)
    for c in _EXP32_TERMS:
        y = y * r
        y = y + c
    y = (y * r) * r
    y = y + r
    y = y + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x == -math.inf, 0.0, y * scale)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64 values (normal ones: callers clamp away from 0)."""
    mantissa, exponent = torch.frexp(x.to(torch.float64))  # x = m * 2^e, m in [0.5, 1)
    low = mantissa < SQRT_HALF
    mantissa = torch.where(low, mantissa * 2.0, mantissa)  # m in [0.707, 1.414)
    e = (exponent - low.to(exponent.dtype)).to(torch.float64)
    t = (mantissa - 1.0) / (mantissa + 1.0)  # log m = 2 atanh t
    t2 = t * t
    series = torch.full_like(t, _LOG_TERMS[-1])
    for c in reversed(_LOG_TERMS[:-1]):
        series = series * t2
        series = series + c
    log_m = (t * 2.0) * series
    return e * LN2_HI + (e * LN2_LO + log_m)


def fixed(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x ~ q * scale, q integers in [-2^bits, 2^bits] (float64), scale a power
    of two per row (the last dimension's), [..., 1]. Scaled and rounded in x's own float32
    where it is one (bits <= 23: the same integers, half the bytes moved)."""
    if x.dtype not in (torch.float32, torch.float64) or bits > 23:
        x = x.to(torch.float64)
    top = torch.linalg.vector_norm(x, math.inf, dim=-1, keepdim=True)  # max |x|, no temporary
    _, e = torch.frexp(top)  # max < 2^e (e = 0 for zeros)
    q = torch.round(x * pow2(bits - e).to(x.dtype))
    return q.to(torch.float64), pow2(e - bits)


def _bits(k: int) -> int:
    """Bits per value such that a sum of k products of two stays below 2^53."""
    return (53 - max(1, math.ceil(math.log2(max(k, 2))))) // 2


def sum_bits(k: int) -> int:
    """Bits per value such that a sum of k values stays below 2^53."""
    return 53 - max(1, math.ceil(math.log2(max(k, 2))))


def matmul(a: torch.Tensor, *bs: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """a [..., M, K] @ b [..., N, K]^T in float64 (several b: their rows one after the other),
    each row of a and b rounded to fixed point first (~20 bits of its largest value): an
    exact integer product, whatever the kernel's order of summing. b goes a block of rows
    at a time, so a big weight never exists whole in float64."""
    bits = _bits(a.shape[-1])
    qa, sa = fixed(a, bits)
    parts = []
    for b in bs:
        for start in range(0, b.shape[-2], block):
            qb, sb = fixed(b[..., start : start + block, :], bits)
            parts.append((qa @ qb.transpose(-1, -2)) * sa * sb.transpose(-1, -2))
    return torch.cat(parts, dim=-1)


def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """sum(x^2) over the last dimension, [..., 1], exact on the fixed-point x."""
    q, scale = fixed(x, _bits(x.shape[-1]))
    return (q * q).sum(-1, keepdim=True) * (scale * scale)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """sum(x) over the last dimension, [..., 1], float64, exact on the fixed-point x (to
    2^-(53 - log2 n) of its largest value)."""
    q, scale = fixed(x, sum_bits(x.shape[-1]))
    return q.sum(-1, keepdim=True) * scale


def cumulative(x: torch.Tensor) -> torch.Tensor:
    """Running sums over the last dimension, float64, exact on the fixed-point x."""
    q, scale = fixed(x, sum_bits(x.shape[-1]))
    return torch.cumsum(q, -1) * scale
