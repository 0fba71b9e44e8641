"""The token embedding read straight from the checkpoint file, mapped, not copied.

A decode step looks up one row of the table per sequence, so only the rows of tokens
actually seen are ever read: the kernel pages them in on first touch (one 4 KB page holds a
Qwen row) and, as clean file pages, may drop them again under memory pressure (not under
`--mlock`, which locks each page as it is touched). Held as an
int8 copy instead (`Int8Embedding` below), Qwen2.5-0.5B's 151936 x 896 table cost 136 MB
of RSS whether used or not (the engine must stay under 1000 MB).

The rows looked up are the checkpoint's own values, not rounded (the rounding of
c54d999 only tipped one fp32 near-tie, SmolLM2's first token for the capital of France,
'The' vs 'L' 0.08 logits apart; tests now ask questions with large fp32 margins,
tests/support/margins.py).

The file must stay as it is while the server runs: a file replaced by rename (the embedded
model's conversion) leaves this mapping on the old one, but a file truncated or rewritten in
place (a download into the same cache folder while the server runs, a copy over it) can
make a lookup fail with SIGBUS. Restart the server after changing its model's files.
"""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

# safetensors dtype -> (numpy dtype of the same width, torch dtype to view it as)
_DTYPES = {
    "BF16": (np.int16, torch.bfloat16),
    "F16": (np.float16, torch.float16),
    "F32": (np.float32, torch.float32),
}


EMBED_GROUP = 64


def int8_groups(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [..., dim], float32 scale [..., dim / group]): symmetric, one scale per 64
    values of a row (per row when dim is not a multiple of 64). The input is not changed."""
    dim = rows.shape[-1]
    group = EMBED_GROUP if dim % EMBED_GROUP == 0 else dim
    grouped = rows.to(torch.float32, copy=True).reshape(*rows.shape[:-1], dim // group, group)
    scale = (grouped.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    grouped.div_(scale[..., None]).round_()
    return grouped.reshape(rows.shape).to(torch.int8), scale


def dequantize_groups(q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
    shape = q.shape
    rows = q.to(out_dtype).reshape(*shape[:-1], scale.shape[-1], -1)
    return (rows * scale.to(out_dtype).unsqueeze(-1)).reshape(shape)


def map_tensor(file: Path, name: str) -> torch.Tensor | None:
    """Tensor `name` of a safetensors file as a read-only view of the file's pages, or None
    when its dtype is not one of _DTYPES."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    entry = header[name]
    if entry["dtype"] not in _DTYPES:
        return None
    np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
    begin, _end = entry["data_offsets"]
    array = np.memmap(
        file, dtype=np_dtype, mode="r", offset=8 + length + begin, shape=tuple(entry["shape"])
    )
    with warnings.catch_warnings():
        # read-only by design: nothing writes to an embedding table
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.from_numpy(array).view(torch_dtype)


class MappedEmbedding(nn.Module):
    """nn.Embedding over a mapped table, handing out its rows exactly, as `out_dtype`."""

    def __init__(self, table: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.table = table  # a plain attribute: not a buffer that state_dict or .to() copies
        self.num_embeddings, self.embedding_dim = table.shape
        self.out_dtype = out_dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.table).to(self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mapped {self.table.dtype}"


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 with one scale per 64 values of a row (a quarter of
    fp32, half of bf16), handing out `out_dtype` vectors. Built from row blocks, so the float
    table never exists whole. One scale per whole row was measured too coarse: SmolLM2 then
    no longer answered "Paris" to the capital of France."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("q", q)  # [rows, dim] int8
        self.register_buffer("scale", scale)  # [rows, dim / group] float32
        self.out_dtype = out_dtype

    @classmethod
    def from_blocks(cls, rows: int, blocks, out_dtype: torch.dtype) -> Int8Embedding:
        q = scale = None
        for start, block in blocks:
            block_q, block_scale = int8_groups(block)
            if q is None:
                q = torch.empty(rows, block.shape[1], dtype=torch.int8)
                scale = torch.empty(rows, block_scale.shape[1], dtype=torch.float32)
            q[start : start + block.shape[0]] = block_q
            scale[start : start + block.shape[0]] = block_scale
        return cls(q, scale, out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        q = nn.functional.embedding(input_ids, self.q)
        scale = nn.functional.embedding(input_ids, self.scale)
        return dequantize_groups(q, scale, self.out_dtype)
