"""The native decode step as Python sees it: load the library for this CPU, hand it the
weights the loader already holds, run a step.

The library keeps pointers into the torch tensors given to it (int8 weights, scales, norms,
rotary tables); `NativeModel` holds those tensors for as long as it lives. ctypes releases
the GIL during a call, so the HTTP threads run while a step computes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path

import torch

from inference.native import build

log = logging.getLogger("deskchat.native")

# 2: the cache holds float16; 3: 4-bit weights; 4: the pool steals; 5: every pass; 6: per-head
# query and key norms
ABI_VERSION = 6
_P = ctypes.c_void_p
_I = ctypes.c_int
_F = ctypes.c_float
_SIGNATURES = {
    "dc_abi": (_I, []),
    "dc_isa": (ctypes.c_char_p, []),
    "dc_cpu_ok": (_I, []),
    "dc_model_new": (_P, [_I, _I, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P]),
    "dc_model_free": (None, [_P]),
    "dc_layer_set": (_I, [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "dc_layer_qk_norm_set": (_I, [_P, _I, _P, _P]),
    "dc_head_set": (None, [_P, _P, _P]),
    "dc_linear4_set": (_I, [_P, _I, _I, _P, _P, _P, _P, _P]),
    "dc_forward": (_I, [_P, _I, _P, _P, _P, _P, _I, _P, _P, _I]),
    "dc_linear": (_I, [_P, _P, _P, _I, _I, _I, _P, _P, _I]),
    "dc_linear4": (_I, [_P, _P, _P, _P, _P, _P, _I, _I, _I, _P, _P, _I]),
    "dc_half": (None, [_P, _I, _P, _P]),
    "dc_pool_quiet": (_I, []),
    "dc_test_pause": (None, [_I, _I, _I]),
    "dc_test_paused": (_I, []),
    "dc_test_ended_in_pause": (_I, []),
}
# dc_test_pause's passes, by number: its work functions (step.c's `pausable`) in this order
PAUSABLE = ("products", "norm", "rotary", "attention", "attention output", "silu", "gather")


class Library:
    """One loaded build of step.c."""

    def __init__(self, path: Path):
        self.dll = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(self.dll, name)
            fn.restype, fn.argtypes = restype, argtypes
        if self.dll.dc_abi() != ABI_VERSION:
            raise OSError(f"{path.name} speaks ABI {self.dll.dc_abi()}, not {ABI_VERSION}")
        self.isa = self.dll.dc_isa().decode()
        if not self.dll.dc_cpu_ok():  # before any step: a missing instruction is SIGILL
            raise OSError(f"this CPU's CPUID lacks what the {self.isa} build uses")

    def linear(self, q, scale, bias, x: torch.Tensor) -> torch.Tensor:
        """x [rows, k] float32 through the int8 weight q [n, k] with per-row scales."""
        return self._alone(self.dll.dc_linear, [q, scale], bias, x)

    def linear4(self, parts: list[torch.Tensor], bias, x: torch.Tensor) -> torch.Tensor:
        """The same through 4-bit weights: `parts` as RowInt4Linear.parts() gives them
        (inference/quant/rowint4.py)."""
        return self._alone(self.dll.dc_linear4, parts, bias, x)

    def _alone(self, fn, weight: list[torch.Tensor], bias, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        rows, k = x.shape
        y = torch.empty(rows, len(weight[0]))
        code = fn(
            *[w.data_ptr() for w in weight], _ptr(bias), len(weight[0]), k, rows,
            x.data_ptr(), y.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if code:
            raise MemoryError("native Linear: out of memory")
        return y

    def half(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's conversions: float32 x [n] (n a multiple of 8) as float16, and back."""
        if x.dtype != torch.float32 or x.dim() != 1 or len(x) % 8:
            raise ValueError("float32 values, a multiple of 8 of them")
        x = x.contiguous()
        half, back = torch.empty(len(x), dtype=torch.float16), torch.empty(len(x))
        self.dll.dc_half(x.data_ptr(), len(x), half.data_ptr(), back.data_ptr())
        return half, back


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@functools.cache
def load(levels: tuple[str, ...], spare: Path | None = None) -> Library | None:
    """The library of the first of `levels` (build.runnable's, preferred first) that can be
    had: the one `make install` built, else one built now (into the venv, or `spare` where
    the venv is read-only, as under systemd). A level whose build fails (GCC 10 knows no
    -mavxvnni) or that the CPUID refuses gives way to the next, with an INFO line; None, and
    one WARNING line saying what that costs, when none can be had. DESKCHAT_NATIVE_ISA names
    the one level to use (old-CPU builds tried on a newer CPU)."""
    if isinstance(levels, str):  # its letters would be taken for levels: "older" served
        raise TypeError(f"levels is a tuple of level names, not the one name {levels!r}")
    forced = os.environ.get("DESKCHAT_NATIVE_ISA")
    levels = (forced,) if forced else levels
    folders = [build.library_dir(), *([spare] if spare else [])]
    problem = None
    for isa in levels:
        for folder in folders:
            try:
                library = Library(build.built(isa, folder) or build.build(isa, folder))
            except (build.BuildError, OSError) as exc:
                problem = problem or exc
                continue
            if isa != levels[0]:
                why = " ".join(str(problem).split())[:200]
                log.info("native %s build unavailable (%s): %s serves", levels[0], why, isa)
            return library
    log.warning(
        "native decode step unavailable (%s): the torch step serves, 2-4x slower per token "
        "(docs/native.md)",
        " ".join(str(problem).split())[:200],
    )
    return None


class NativeModel:
    """A decoder's weights registered with the library, and its forward. The library keeps
    the step's working buffers with the model, grown to the largest step run, and frees them
    with it (dc_model_free, when this object goes)."""

    def __init__(self, lib: Library, d):
        """`d`: the Decoder (inference/model/decoder.py) whose weights these are."""
        self.lib = lib
        self._keep = []  # every tensor the library points into
        self._late: list[tuple] = []  # steps' buffers a late pool thread may still read
        self.vocab = d.lm_head.out_features
        self.handle = lib.dll.dc_model_new(
            len(d.layers), d.embed.embedding_dim, d.heads, d.kv_heads, d.head_dim,
            d.intermediate, self.vocab, d.cos.shape[0], d.eps, d.scaling,
            self._hold(d.cos), self._hold(d.sin), self._hold(d.model.model.norm.weight),
        )  # fmt: skip
        if not self.handle:
            raise ValueError("the native step does not fit this model's shape")
        for i, parts in enumerate(d.native_layers()):
            norm_in, norm_post, qkv, o, gate_up, down, q_norm, k_norm = parts
            lib.dll.dc_layer_set(
                self.handle, i, self._hold(norm_in), self._hold(norm_post),
                *self._linear(qkv, bias=True), *self._linear(o), *self._linear(gate_up),
                *self._linear(down),
            )  # fmt: skip
            for part, linear in enumerate([qkv, o, gate_up, down]):
                self._four_bit(i, part, linear)
            if q_norm is not None and lib.dll.dc_layer_qk_norm_set(
                self.handle, i, self._hold(q_norm), self._hold(k_norm)
            ):
                raise ValueError("the native step does not take per-head norms of this width")
        lib.dll.dc_head_set(self.handle, *self._linear(d.lm_head))
        self._four_bit(-1, 0, d.lm_head)
        # The step's own thread count (the pool in step.c) once Decoder.set_threads has set
        # it (the server does, in the thread that steps); until then torch's in the caller.
        self.threads: int | None = None

    def _hold(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().contiguous().float() if t.is_floating_point() else t.contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _linear(self, linear, bias: bool = False) -> list:
        """An int8 Linear's pointers; a 4-bit one's (no weight_q) go by _four_bit after."""
        parts = [self._hold(linear.weight_q), self._hold(linear.weight_scale)]
        return parts + [self._hold(linear.bias)] if bias else parts

    def _four_bit(self, layer: int, part: int, linear) -> None:
        """Layer `layer`'s Linear `part` (the head for -1) made 4-bit when its weights are."""
        if getattr(linear, "weight_q4", None) is None:
            return
        code = self.lib.dll.dc_linear4_set(
            self.handle, layer, part, *[self._hold(t) for t in linear.parts()]
        )
        if code:
            raise ValueError("the native step does not take these 4-bit weights' shape")

    def __del__(self):
        handle = getattr(self, "handle", None)
        if handle:
            self.lib.dll.dc_model_free(handle)

    def forward(self, hidden, positions, caches, out_rows) -> torch.Tensor:
        """hidden [rows, hidden] float32 (changed in place); row r goes at positions[r] (an
        integer tensor) of caches[r] (a SequenceCache already reserved for it). Returns
        float32 logits of the rows `out_rows`, [len(out_rows), vocab]."""
        if self.lib.dll.dc_pool_quiet():
            self._late.clear()
        pos = positions.to(torch.int32)
        ptrs = torch.tensor([c.buffer().data_ptr() for c in caches], dtype=torch.int64)
        alloc = torch.tensor([c.allocated for c in caches], dtype=torch.int32)
        out = torch.tensor(out_rows, dtype=torch.int32)
        logits = torch.empty(len(out), self.vocab)
        with torch.profiler.record_function("deskchat::native_step"):  # a name for profiles
            code = self.lib.dll.dc_forward(
                self.handle, hidden.shape[0], hidden.data_ptr(), pos.data_ptr(),
                ptrs.data_ptr(), alloc.data_ptr(), len(out), out.data_ptr(),
                logits.data_ptr(), self.threads or torch.get_num_threads(),
            )  # fmt: skip
        # A pool thread kept off its CPU may still read this step's buffers after the call
        # (step.c's stealing): they live until no thread is inside (checked at the next step)
        self._late.append((hidden, pos, ptrs, alloc, out, [c.buffer() for c in caches]))
        if code == -2:
            raise ValueError("a position past the rotary table (the context)")
        if code:
            raise MemoryError("native step: out of memory")
        return logits
