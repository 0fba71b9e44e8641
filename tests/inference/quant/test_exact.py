"""inference/quant/exact.py and the sampler built on it: accurate, exact where it says so,
and the same bits under every torch kernel set this CPU runs (ATEN_CPU_CAPABILITY)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys

import torch

from inference.quant import exact
from tests.support.answers import capabilities
from tests.support.paths import ROOT


def inputs() -> dict[str, torch.Tensor]:
    """Fixed inputs made by integer arithmetic alone (torch.linspace, for one, differs by
    kernel set in its last bits)."""
    g = torch.Generator().manual_seed(7)
    ints = torch.randint(-(2**30), 2**30, (4, 4096), generator=g, dtype=torch.int64)
    return {
        "scores": (ints[0].double() * 2.0**-25).float(),  # +-32, logits' range
        "wide": ints[1].double() * 2.0**-21,  # +-512
        "a": (ints[2, :3072].double() * 2.0**-28).reshape(3, 1024),
        "b": (ints[3, :3072].double() * 2.0**-27).reshape(3, 1024),
    }


def digests() -> dict[str, str]:
    """A hash of each function's output on inputs(); the same in every process and CPU."""
    from inference.quant.rowint4 import quantize_weight
    from inference.runtime import sampler

    x = inputs()
    outputs = {
        "exp64": exact.exp(x["wide"]),
        "exp32": exact.exp(x["scores"]),
        "log": exact.log(x["wide"].abs() + 1e-300),
        "matmul": exact.matmul(x["a"], x["b"]),
        "row_sum": exact.row_sum(x["wide"]),
        "cumulative": exact.cumulative(x["wide"].abs()),
        "softmax": sampler.softmax(x["scores"] / 0.7),
        "logprobs": torch.tensor(sampler.logprobs(x["scores"], 3, 5)[1]),
        "rowint4": torch.cat(
            [p.contiguous().view(torch.uint8).flatten() for p in quantize_weight(x["a"].float())]
        ),
        "draws": torch.tensor(
            [
                sampler.pick(x["scores"], 0.8, 0.9, torch.Generator().manual_seed(s), 40, 0.01)
                for s in range(64)
            ]
        ),
    }
    return {
        k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in outputs.items()
    }


def test_exp_and_log_are_within_a_few_ulps():
    x = torch.arange(-700 * 64, 700 * 64, 7, dtype=torch.float64) / 64
    want = torch.tensor([math.exp(v) for v in x.tolist()], dtype=torch.float64)
    assert float(((exact.exp(x) - want) / want).abs().max()) < 4e-16
    assert exact.exp(torch.tensor([-math.inf, 0.0])).tolist() == [0.0, 1.0]
    x32 = (torch.arange(-87 * 256, 88 * 256, 3) / 256).float()
    want32 = torch.tensor([math.exp(v) for v in x32.double().tolist()], dtype=torch.float64)
    assert float(((exact.exp(x32).double() - want32) / want32).abs().max()) < 3e-7  # ~2 ulps
    y = torch.tensor([2.0**k * 1.37 for k in range(-1000, 1000, 7)], dtype=torch.float64)
    want_log = torch.tensor([math.log(v) for v in y.tolist()], dtype=torch.float64)
    assert float((exact.log(y) - want_log).abs().max()) < 1e-12  # |log| up to 693


def test_products_and_sums_are_exact_integers_whatever_the_order():
    x = inputs()
    a, b = x["a"], x["b"]
    bits = (53 - math.ceil(math.log2(a.shape[-1]))) // 2
    qa, sa = exact.fixed(a, bits)
    qb, sb = exact.fixed(b, bits)
    exact_ints = qa.to(torch.int64) @ qb.to(torch.int64).T  # integer: exact by definition
    assert torch.equal(exact.matmul(a, b), exact_ints.double() * sa * sb.T)
    assert float((exact.matmul(a, b) - a @ b.T).abs().max()) < 1e-5 * float((a @ b.T).abs().max())
    wide = x["wide"]
    order = torch.randperm(wide.numel(), generator=torch.Generator().manual_seed(1))
    assert torch.equal(exact.row_sum(wide), exact.row_sum(wide[order]))
    assert torch.equal(exact.cumulative(wide.abs())[-1:], exact.row_sum(wide.abs()))


def test_the_same_bits_under_every_torch_kernel_set():
    here = digests()
    environ = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    script = (
        "import json; from tests.inference.quant.test_exact import digests; "
        "print(json.dumps(digests()))"
    )
    for capability in capabilities():
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            env={**environ, "ATEN_CPU_CAPABILITY": capability},
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        assert json.loads(done.stdout) == here, capability
