"""The rotary position tables, with the same bits in every process.

transformers takes them with torch's cos and sin, which run on MKL's vector math split over
the OpenMP threads. In about one load in ten, the second thread's half of the table came out
different: SmolLM2's 117 calibration positions had 3744 of 7488 cosines off, by up to 1.5e-4.
That moved the smoothing scales and the decode table, and flipped near-tie answers between
runs of the same code (the capital of France, in CI). Here the angles are transformers' own
(float32 position x inv_freq, one rounding each). Their cosine and sine are taken in float64
by numpy, in one thread, then rounded to float32 and scaled as transformers scales them.
"""

from __future__ import annotations

import numpy as np
import torch


def tables(rotary_emb, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [positions, head_dim], the tables `rotary_emb(x, arange(positions)
    [None])` gives for a transformers rotary module with `inv_freq` (Llama/Qwen2 style),
    but correctly rounded: MKL's float32 cos differs from them by one ulp in ~5% of entries."""
    inv_freq = rotary_emb.inv_freq.detach().float()
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None]
    angles = torch.cat((freqs, freqs), dim=-1).double().numpy()
    scaling = getattr(rotary_emb, "attention_scaling", 1.0)
    cos = torch.from_numpy(np.cos(angles)).float() * scaling
    sin = torch.from_numpy(np.sin(angles)).float() * scaling
    return cos.to(dtype), sin.to(dtype)
