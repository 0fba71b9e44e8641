"""Batch-invariant int8 Linear: one activation scale per row, on fbgemm's int8 GEMM.

Each row of the input is scaled on its own (symmetric: max |x| of the row -> the limit, 127,
or 63 where fbgemm's kernel would saturate), the weight once at load (symmetric, one scale
per output channel), and the integer product runs on fbgemm (`quantized::linear_with_input_
q_dq_qweight_dq_output_fp32`, the kernel torch.ao's dynamic Linear uses) with the input scale
fixed at 1.0: the rows are already integers, so fbgemm's own quantization only shifts them by
the zero point, and its output is the exact int32 sum times the weight scale. Multiplied by
each row's scale afterwards, a row's output is bitwise the same whatever other rows share the
forward (several requests' decode steps in one batch), which the torch.ao dynamic
Linear (one scale for the whole input) does not give.

Why fbgemm and 127/63: fbgemm multiplies uint8 activations by int8 weights. With VNNI the
sums are 32-bit and exact at 8 bits; without it (AVX2, AVX-512 before VNNI) a pair of
products is summed in 16 bits and 255 x 127 x 2 saturates, so rows get 7 bits there
(`row_limit` finds out once per process by a worst-case product). oneDNN, used before,
served the same bits but ran its reference kernel (45 ms per call) on any CPU without AMX;
with AMX it cost up to 20 us more per call at 1-4 rows and was faster from 16 rows
(python -m bench.engine.int8_kernels, docs/speed.md). The ops are
internal to torch, so `available()` checks at load that they exist and are exact and
batch-invariant here; the loader (inference/loading/checkpoint.py) falls back to the torch.ao Linear
when not.

q/k/v and gate/up are fused (one weight, one scaling of the input, one GEMM) behind
`FusedParts`: the decoder's own forward still calls q_proj(x), k_proj(x), v_proj(x), and each
gets its slice of the one product: fewer calls, and the per-call cost is what a decode step
at one row pays most for. This module knows nothing of checkpoints or smoothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings

import torch
from torch import nn

from inference.quant.weights import ROWS_PER_CHUNK, per_row_int8

log = logging.getLogger("deskchat.rowint8")

# Output rows per packed fbgemm weight: a 151936-row lm_head is packed in parts, so that its
# int8 and packed copies never exist whole at once while loading.
ROWS_PER_PACK = 16384


def scale_rows(x: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float [M, K] of integers in [-limit, limit], float32 scale [M, 1]): symmetric, one
    scale per row. Rounded here (half to even), not left to the kernel's quantization, which
    adds the zero point first and so rounds some values twice. Every op works row by row, so
    a row's result does not depend on the others. abs().amax() is exact, like the infinity
    norm used before, and 3-5x faster. Six ops: at one row each costs its dispatch, not its
    arithmetic, and this runs once per Linear (97 times a Qwen-shape decode step)."""
    # clamp: an all-zero row quantizes to zeros with a harmless scale
    scale = x.abs().amax(-1, keepdim=True).clamp_(min=1e-12).div_(limit)
    return x.div(scale).round_(), scale


def quantize_weight(
    weight: torch.Tensor, column_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scale [N]): symmetric in [-127, 127], one scale per output
    channel, of the weight with its columns multiplied by `column_scale` first."""
    return per_row_int8(weight, column_scale, divisor=127.0, low=-127, floor=1e-12)


@contextlib.contextmanager
def fbgemm_engine():
    """torch.ao's prepack follows the process-wide engine: fbgemm's packing while inside."""
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():
            # torch marks quantized tensors deprecated; the packed weight is one, for now.
            warnings.filterwarnings(
                "ignore", message=".*quantize.*deprecated", category=UserWarning
            )
            yield
    finally:
        torch.backends.quantized.engine = engine


def pack(q: torch.Tensor, scale: torch.Tensor):
    """fbgemm's packed form of an int8 weight [N, K] with one scale per output channel."""
    zeros = torch.zeros(q.shape[0], dtype=torch.int64)
    with fbgemm_engine():
        weight = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
        return torch.ops.quantized.linear_prepack(weight, None)


@functools.cache
def _product_op():
    """The op's C++ entry itself: torch.ops' Python wrappers look through every argument
    for traced stand-ins of the packed weight before each call (torchbind ops), a cost paid
    97 times a one-row decode step for nothing here. The public op if a torch release
    drops the private `_op` (the self-check at load goes through this same path)."""
    op = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default
    return getattr(op, "_op", op)


def integer_product(scaled: torch.Tensor, packed, limit: int) -> torch.Tensor:
    """float [M, N]: the exact int32 product of integer-valued rows and the weight, times the
    weight's scales. The rows go in as uint8 shifted by limit + 1 (1..2*limit+1)."""
    return _product_op()(scaled, 1.0, limit + 1, packed)


class RowInt8Linear(nn.Module):
    """Drop-in for nn.Linear (inference only, float32 in and out), batch-invariant per row.

    The weight is given in blocks of output rows (`from_blocks`) so that a big one (the
    lm_head) is quantized and packed a block at a time; the input is scaled once per call
    whatever the number of packed parts. `limit` is the rows' integer range: what this CPU's
    kernel sums exactly.
    """

    def __init__(self, in_features: int, bias: torch.Tensor | None = None, native=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = 0
        # With the native library (inference/native) the int8 weight is kept as it is, for
        # its own products (8-bit rows on every CPU: they never saturate there), and
        # fbgemm's packed copy is never made.
        self.native = native
        self.limit = 127 if native is not None else row_limit()
        # Packed fbgemm weights are opaque objects: plain attributes, not buffers, so that
        # state_dict() and .to() never see them.
        self._packed: list = []
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("weight_q", None)
        self.register_buffer("weight_scale", None)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None = None, native=None
    ) -> RowInt8Linear:
        rows = weight.shape[0]
        blocks = ((s, weight[s : s + ROWS_PER_CHUNK]) for s in range(0, rows, ROWS_PER_CHUNK))
        return cls.from_blocks(weight.shape[1], blocks, bias, native=native, out_features=rows)

    @classmethod
    def from_blocks(
        cls,
        in_features: int,
        blocks,
        bias: torch.Tensor | None = None,
        column_scale: torch.Tensor | None = None,
        native=None,
        out_features: int | None = None,
    ):
        """`blocks` yields (first row, float block [n, in_features]) in order; the weight is
        those rows with their columns multiplied by `column_scale` (when given). Blocks are
        quantized as they come and packed ROWS_PER_PACK rows at a time: small blocks keep
        the float temporaries of a big weight small, and few packs keep the calls few. For
        the native library they are written into one int8 weight of `out_features` rows."""
        linear = cls(in_features, bias, native)
        if native is not None:
            linear._keep(blocks, column_scale, out_features)
            return linear
        q_parts, scale_parts, pending = [], [], 0
        for _start, block in blocks:
            q, scale = quantize_weight(block, column_scale)
            q_parts.append(q)
            scale_parts.append(scale)
            pending += q.shape[0]
            if pending >= ROWS_PER_PACK:
                linear._add_pack(q_parts, scale_parts)
                q_parts, scale_parts, pending = [], [], 0
        if q_parts:
            linear._add_pack(q_parts, scale_parts)
        return linear

    def _keep(self, blocks, column_scale, rows: int) -> None:
        self.weight_q = torch.empty(rows, self.in_features, dtype=torch.int8)
        self.weight_scale = torch.empty(rows)
        for start, block in blocks:
            q, scale = quantize_weight(block, column_scale)
            self.weight_q[start : start + q.shape[0]] = q
            self.weight_scale[start : start + q.shape[0]] = scale
        self.out_features = rows

    def _add_pack(self, q_parts: list[torch.Tensor], scale_parts: list[torch.Tensor]) -> None:
        q = q_parts[0] if len(q_parts) == 1 else torch.cat(q_parts)
        q_parts.clear()  # the caller's parts go with the concatenation
        self._packed.append(pack(q, torch.cat(scale_parts)))
        self.out_features += q.shape[0]

    def _gemm(self, scaled: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        outs = [integer_product(scaled, packed, self.limit) for packed in self._packed]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        # Separate in-place ops, no fused multiply-add: the same arithmetic for every row.
        y.mul_(row_scale)
        if self.bias is not None:
            y.add_(self.bias)
        return y

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """forward for float32 [M, in_features], the decoder's own call (no reshapes, no
        module call)."""
        if self.native is not None:
            return self.native.linear(self.weight_q, self.weight_scale, self.bias, x)
        return self._gemm(*scale_rows(x, self.limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32:
            return self.rows(x)
        shape = x.shape
        flat = x.reshape(-1, self.in_features).float()
        y = self.rows(flat)
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, packs={len(self._packed)}, "
            f"native={self.native is not None}, "
            f"limit={self.limit}, bias={self.bias is not None}"
        )


class FusedParts(nn.Module):
    """One RowInt8Linear over several projections of the same input (q/k/v, gate/up).

    `part(i)` is the module that stands in for projection i: called with the input, it
    returns its slice of the fused product, computed once for that input tensor (by identity)
    and dropped when every part has taken its slice. A part called with another tensor
    (a forward that does not feed all parts the same input) still gets the right answer,
    only without the saving.
    """

    def __init__(self, linear: RowInt8Linear, sizes: list[int]):
        super().__init__()
        self.linear = linear
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._taken: set[int] = set()

    def slice_for(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x or index in self._taken:
            self._input = x
            self._outputs = self.linear(x).split(self.sizes, dim=-1)
            self._taken = set()
        out = self._outputs[index]
        self._taken.add(index)
        if len(self._taken) == len(self.sizes):  # all taken: hold no activations between calls
            self._input, self._outputs, self._taken = None, (), set()
        return out

    def part(self, index: int) -> FusedPart:
        return FusedPart(self, index)

    def extra_repr(self) -> str:
        return f"sizes={self.sizes}"


class FusedPart(nn.Module):
    """Projection `index` of a FusedParts (not registered as a child, so the fused weight
    appears once in the module tree)."""

    def __init__(self, fused: FusedParts, index: int):
        super().__init__()
        self._fused = [fused]  # a list hides it from nn.Module's child registration
        self.index = index
        self.out_features = fused.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].slice_for(self.index, x)

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused projection, out={self.out_features}"


def fuse(
    owner: nn.Module, names: list[str], fused_name: str, native=None, kind=RowInt8Linear
) -> None:
    """Replace owner's nn.Linear projections `names` (same input) by parts of one fused
    RowInt8Linear (or `kind`, a subclass), registered on owner as `fused_name`."""
    linears = [getattr(owner, n) for n in names]
    weight = torch.cat([lin.weight.detach() for lin in linears])
    biases = [lin.bias for lin in linears]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat(
            [
                b.detach().float() if b is not None else torch.zeros(lin.out_features)
                for b, lin in zip(biases, linears, strict=True)
            ]
        )
    sizes = [lin.out_features for lin in linears]
    fused = FusedParts(kind.from_weight(weight, bias, native), sizes)
    del weight
    setattr(owner, fused_name, fused)
    for i, name in enumerate(names):
        setattr(owner, name, fused.part(i))


def quantize_decoder_layer(layer: nn.Module, native=None, kind=RowInt8Linear) -> bool:
    """Llama/Qwen2-style layer: fused q/k/v and gate/up, o_proj and down_proj each their
    own, all RowInt8Linear (or `kind`, a subclass: inference/quant/rowint4.py's). False
    (layer untouched) when the layer is not of that shape."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    qkv, gate_up = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]
    wanted = [(attn, n) for n in [*qkv, "o_proj"]] + [(mlp, n) for n in [*gate_up, "down_proj"]]
    if not all(type(getattr(m, n, None)) is nn.Linear for m, n in wanted):
        return False
    fuse(attn, qkv, "qkv_proj", native, kind)
    fuse(mlp, gate_up, "gate_up_proj", native, kind)
    for module, name in [(attn, "o_proj"), (mlp, "down_proj")]:
        linear = getattr(module, name)
        setattr(module, name, kind.from_weight(linear.weight, linear.bias, native))
    return True


# The rows' integer ranges, widest first: 8 bits where the kernel sums exactly (VNNI), else 7.
LIMITS = (127, 63)


@functools.cache
def row_limit() -> int:
    """The widest row range whose worst case (every product at its maximum) this CPU's
    fbgemm kernel sums exactly; without VNNI 8 bits saturate a 16-bit pair sum. Raises when
    none does."""
    k = 64
    q = torch.full((8, k), 127, dtype=torch.int8)
    packed = pack(q, torch.ones(8))
    for limit in LIMITS:
        x = torch.full((1, k), float(limit))
        with torch.inference_mode():
            got = integer_product(x, packed, limit)
        if torch.equal(got, torch.full((1, 8), float(k * 127 * limit))):
            return limit
    raise RuntimeError("fbgemm's int8 product is not exact here even with 7-bit rows")


def _self_check() -> None:
    """Raises unless the ops exist and give exact, batch-invariant, plausible results here."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen)
    bias = torch.randn(48, generator=gen)
    x = torch.randn(5, 64, generator=gen)
    x[:, 0] *= 30  # an outlier channel, rows of different sizes
    x *= torch.arange(1, 6)[:, None]
    linear = RowInt8Linear.from_weight(weight, bias)
    together = linear(x)
    for i in range(x.shape[0]):
        if not torch.equal(linear(x[i : i + 1]), together[i : i + 1]):
            raise RuntimeError(f"row {i} alone differs from the same row in a batch")
    want = x @ weight.T + bias
    error = float((together - want).abs().max() / want.abs().max())
    if not error < 0.05:
        raise RuntimeError(f"result off by {error:.3f} of its range")


@functools.cache
def available() -> bool:
    """True when the per-row int8 Linear works on this machine (checked once per process);
    otherwise one WARNING line says why."""
    try:
        with torch.inference_mode():
            _self_check()
    except Exception as exc:  # missing op (AttributeError, RuntimeError), unsupported CPU, ...
        detail = " ".join(str(exc).split())[:200]
        log.warning(
            "per-row int8 Linear unavailable here (%s: %s): using torch.ao dynamic int8, "
            "whose answers depend on the other rows of a batch",
            type(exc).__name__,
            detail,
        )
        return False
    return True
