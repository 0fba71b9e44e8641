"""The rotary position tables, with the same bits in every process and on every CPU.

transformers takes them with torch's cos and sin, which run on MKL's vector math split over
the OpenMP threads. In about one load in ten, the second thread's half of the table came out
different: SmolLM2's 117 calibration positions had 3744 of 7488 cosines off, by up to 1.5e-4.
That moved the smoothing scales and the decode table, and flipped near-tie answers between
runs of the same code (the capital of France, in CI). Vector math also differs by CPU (numpy
and torch take other polynomials with AVX-512), so each entry here is the float32 nearest to
the true cosine or sine of transformers' own angle (float32 position x inv_freq, one
rounding each): numpy's float64 value decides, and where it lies too close to the midpoint
of two float32 values to decide for every CPU, the exact value does (decimal arithmetic).
inv_freq itself (base^(-2i/d), a torch pow) is taken the same way for the default rotary.
"""

from __future__ import annotations

from decimal import Decimal, localcontext

import numpy as np
import torch

# float64 libraries are within a few ulps; closer than this to a float32 midpoint (relative),
# the float64 value cannot tell which side the true one is on
_UNSURE = 2.0**-44
_PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628")


def _cos_sin_exact(angle: float) -> tuple[Decimal, Decimal]:
    """cos and sin of a float (its exact binary value) to ~40 digits, by Taylor series."""
    with localcontext() as ctx:
        ctx.prec = 60
        x = Decimal(angle)
        two_pi = 2 * _PI
        x -= two_pi * (x / two_pi).to_integral_value()  # |x| <= pi
        term, cos, sin, n = Decimal(1), Decimal(0), Decimal(0), 0
        while n < 200:
            if n % 4 == 0:
                cos += term
            elif n % 4 == 1:
                sin += term
            elif n % 4 == 2:
                cos -= term
            else:
                sin -= term
            n += 1
            term = term * x / n
            if abs(term) < Decimal("1e-45"):
                break
        return +cos, +sin


def _nearest_float32(approx: np.ndarray, exact) -> np.ndarray:
    """float32 of float64 `approx` (round to nearest), with the entries whose float64 value
    lies within _UNSURE of a float32 midpoint settled by `exact(index)` (a Decimal)."""
    out = approx.astype(np.float32)
    neighbour = np.where(
        out.astype(np.float64) < approx,
        np.nextafter(out, np.float32(np.inf)),
        np.nextafter(out, np.float32(-np.inf)),
    )
    midpoint = (out.astype(np.float64) + neighbour.astype(np.float64)) / 2  # exact in float64
    unsure = np.abs(approx - midpoint) <= np.abs(approx) * _UNSURE
    for index in zip(*np.nonzero(unsure), strict=True):
        value, mid = exact(index), Decimal(float(midpoint[index]))
        low, high = sorted((out[index], neighbour[index]))
        out[index] = high if value > mid else low
    return out


def inv_freq(rotary_emb) -> torch.Tensor:
    """The module's inv_freq; for the default rotary (1 / base^(2i/d)), recomputed with each
    power the nearest float32, as a correctly rounded pow gives on every CPU."""
    given = rotary_emb.inv_freq.detach().float()
    config = getattr(rotary_emb, "config", None)
    params = getattr(config, "rope_parameters", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    if getattr(rotary_emb, "rope_type", None) != "default" or base is None:
        return given
    d = 2 * given.numel()
    exponents = np.arange(0, d, 2, dtype=np.float32) / np.float32(d)  # as transformers' float
    powers = np.power(np.float64(base), exponents.astype(np.float64))

    def exact(index):
        with localcontext() as ctx:
            ctx.prec = 60
            return (Decimal(float(exponents[index])) * Decimal(base).ln()).exp()

    rounded = _nearest_float32(powers, exact)
    return torch.from_numpy(np.float32(1.0) / rounded)  # one float32 division, as torch's


def tables(rotary_emb, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [positions, head_dim], the tables `rotary_emb(x, arange(positions)
    [None])` gives for a transformers rotary module with `inv_freq` (Llama/Qwen2 style),
    but correctly rounded: MKL's float32 cos differs from them by one ulp in ~5% of entries."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq(rotary_emb)[None]
    angles = freqs.numpy()
    cos = _nearest_float32(
        np.cos(angles.astype(np.float64)), lambda i: _cos_sin_exact(float(angles[i]))[0]
    )
    sin = _nearest_float32(
        np.sin(angles.astype(np.float64)), lambda i: _cos_sin_exact(float(angles[i]))[1]
    )
    scaling = getattr(rotary_emb, "attention_scaling", 1.0)
    cos = torch.from_numpy(np.concatenate((cos, cos), axis=-1)) * scaling
    sin = torch.from_numpy(np.concatenate((sin, sin), axis=-1)) * scaling
    return cos.to(dtype), sin.to(dtype)
