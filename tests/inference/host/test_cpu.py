"""The CPU's paths: the choice for every generation (faked flags), the refusal of an explicit
--quantize that cannot run, and the flags read from /proc/cpuinfo and CPUID."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inference.host import cpu
from service.config import ConfigError

ALL_ENGINES = ("qnnpack", "onednn", "x86", "fbgemm")
NO_FBGEMM = ("qnnpack", "onednn")  # what torch offers without AVX2 (seen under qemu)

SSE42 = {"sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt"}
AVX = SSE42 | {"avx"}
AVX2 = AVX | {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}


def facts(flags: set[str], capability: str, engines=ALL_ENGINES, bf16=False) -> cpu.CpuFacts:
    return cpu.CpuFacts(frozenset(flags), capability, engines, bf16)


# (generation, facts, isa, vnni, int8 engine, int8-row, int4)
GENERATIONS = [
    ("Core 2", facts({"sse", "sse2", "ssse3"}, "DEFAULT", NO_FBGEMM), "older", False, "none",
     "none", "none"),
    ("Nehalem / Westmere", facts(SSE42, "DEFAULT", NO_FBGEMM), "sse4.2", False, "qnnpack",
     "none", "aten-default"),
    ("Sandy / Ivy Bridge", facts(AVX, "DEFAULT", NO_FBGEMM), "avx", False, "qnnpack", "none",
     "aten-default"),
    ("AMD Bulldozer (FMA4, no AVX2)", facts(AVX | {"fma4"}, "DEFAULT", NO_FBGEMM), "avx", False,
     "qnnpack", "none", "aten-default"),
    ("Haswell", facts(AVX2, "AVX2"), "avx2", False, "fbgemm", "fbgemm", "aten"),
    ("Alder Lake (AVX-VNNI)", facts(AVX2 | {"avx_vnni"}, "AVX2"), "avx2", True, "fbgemm",
     "fbgemm", "aten"),
    ("Skylake-X", facts(AVX512, "AVX512"), "avx512", False, "fbgemm", "fbgemm", "aten"),
    ("Cascade Lake (VNNI)", facts(AVX512 | {"avx512_vnni"}, "AVX512"), "avx512", True,
     "fbgemm", "fbgemm", "aten"),
]  # fmt: skip


@pytest.mark.parametrize(
    "facts_, isa, vnni, int8, row, int4",
    [g[1:] for g in GENERATIONS],
    ids=[g[0] for g in GENERATIONS],
)
def test_each_generation_gets_its_paths(facts_, isa, vnni, int8, row, int4):
    paths = cpu.choose(facts_)
    assert (paths.isa, paths.vnni, paths.int8, paths.int8_row, paths.int4) == (
        isa,
        vnni,
        int8,
        row,
        int4,
    )


def test_bf16_only_where_onednn_has_it_natively():
    assert cpu.choose(facts(AVX512, "AVX512", bf16=True)).bf16 == "native"
    assert cpu.choose(facts(AVX2, "AVX2")).bf16 == "none"


def test_torch_capability_caps_the_generation():
    """ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine: treated as AVX2 (its VNNI is AVX-512
    VNNI, so gone too); =default: as AVX, so fbgemm is not used even though torch lists it."""
    capped = cpu.choose(facts(AVX512 | {"avx512_vnni"}, "AVX2"))
    assert (capped.isa, capped.vnni, capped.int8, capped.int8_row) == (
        "avx2",
        False,
        "fbgemm",
        "fbgemm",
    )
    default = cpu.choose(facts(AVX512, "DEFAULT"))
    assert (default.isa, default.int8) == ("avx", "qnnpack")


def test_an_engine_torch_lacks_is_not_chosen():
    assert cpu.choose(facts(AVX2, "AVX2", engines=NO_FBGEMM)).int8 == "onednn"
    assert cpu.choose(facts(AVX, "DEFAULT", engines=("onednn",))).int8 == "onednn"
    assert cpu.choose(facts(SSE42, "DEFAULT", engines=("onednn",))).int8 == "none"


def test_onednn_int8_is_never_chosen_without_avx():
    """It died with SIGILL under qemu -cpu Nehalem, even where torch offers it."""
    assert cpu.int8_engines("sse4.2", ALL_ENGINES) == ["qnnpack"]


def test_default_int8_falls_back_to_fp32_where_no_int8_kernel_works():
    older = cpu.choose(facts({"sse2"}, "DEFAULT", NO_FBGEMM))
    plan = cpu.plan(older, "int8")
    assert plan.quantize == "none"
    assert "serving quantize=none (asked int8" in plan.summary()


@pytest.mark.parametrize("generation", ["Nehalem / Westmere", "Sandy / Ivy Bridge"])
def test_int8_row_without_avx2_is_refused_saying_why_and_what_to_use(generation):
    paths = paths_of(generation)
    with pytest.raises(cpu.CpuUnsupported) as refused:
        cpu.plan(paths, "int8-row")
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError)  # reported like any bad setting: exit 2
    assert message.startswith("--quantize int8-row")
    assert "AVX2" in message and paths.isa in message
    assert f"--quantize auto (the default), int8 ({paths.int8} here)" in message
    assert "\n" not in message


def test_int4_is_refused_only_where_it_was_never_checked():
    older = cpu.choose(facts({"sse2"}, "DEFAULT", NO_FBGEMM))
    with pytest.raises(cpu.CpuUnsupported, match="--quantize int4"):
        cpu.plan(older, "int4")
    assert cpu.plan(cpu.choose(facts(SSE42, "DEFAULT", NO_FBGEMM)), "int4").quantize == "int4"


@pytest.mark.parametrize("generation", ["Nehalem / Westmere", "Sandy / Ivy Bridge"])
def test_auto_serves_torch_ao_int8_without_avx2(generation):
    plan = cpu.plan(paths_of(generation), "auto")
    assert plan.quantize == "int8" and "(auto: " in plan.summary()


@pytest.mark.parametrize("generation", ["Haswell", "Skylake-X", "Cascade Lake (VNNI)"])
def test_auto_serves_int8_row_from_avx2_on(generation):
    assert cpu.plan(paths_of(generation), "auto").quantize == "int8-row"


def test_auto_serves_fp32_on_cpus_without_an_int8_kernel():
    older = cpu.choose(facts({"sse2"}, "DEFAULT", NO_FBGEMM))
    assert cpu.plan(older, "auto").quantize == "none"


def test_what_works_is_served_as_asked():
    vnni = cpu.choose(facts(AVX512 | {"avx512_vnni"}, "AVX512"))
    for quantize in ("none", "int8", "int8-row", "int4"):
        assert cpu.plan(vnni, quantize).quantize == quantize


def test_health_shape():
    plan = cpu.plan(cpu.choose(facts(SSE42, "DEFAULT", NO_FBGEMM)), "int8")
    shown = plan.as_dict()
    assert shown["isa"] == "sse4.2" and shown["quantize"] == "int8"
    assert shown["paths"]["int8"] == "qnnpack" and shown["paths"]["int8_row"] == "none"


def test_proc_flags_reads_the_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel Core i5-2400\nflags\t\t: fpu sse4_2 avx\n")
    assert cpu.proc_flags(info) == frozenset({"fpu", "sse4_2", "avx"})
    assert cpu.proc_flags(tmp_path / "missing") is None


def test_a_flag_counts_only_when_kernel_and_cpuid_agree():
    kernel = frozenset({"sse4_2", "avx", "avx2", "fma", "avx_vnni"})
    # qemu-x86_64 -cpu SandyBridge: the host's /proc/cpuinfo, the emulated CPUID
    cpuid = {"sse4_2": True, "avx": True, "avx2": False, "fma": False}
    assert cpu.merge_flags(kernel, cpuid) == frozenset({"sse4_2", "avx", "avx_vnni"})
    assert cpu.merge_flags(None, cpuid) == frozenset({"sse4_2", "avx"})
    # the kernel disabled AVX (clearcpuid=avx): CPUID alone does not bring it back
    assert "avx" not in cpu.merge_flags(frozenset({"sse4_2"}), {"avx": True})


def test_this_machine_detects_and_plans_the_default():
    plan = cpu.plan_here("auto")
    assert plan.paths.isa in ("avx512", "avx2", "avx", "sse4.2")
    assert plan.paths.int8 != "none"
    assert plan.quantize == ("int8-row" if plan.paths.int8_row != "none" else "int8")


def paths_of(generation: str) -> cpu.Paths:
    return cpu.choose(next(g[1] for g in GENERATIONS if g[0] == generation))


@pytest.mark.parametrize(
    "generation, engine",
    [("Nehalem / Westmere", "onednn"), ("Nehalem / Westmere", "fbgemm"),
     ("Sandy / Ivy Bridge", "fbgemm")],
)  # fmt: skip
def test_an_int8_engine_this_cpu_cannot_run_is_refused(generation, engine):
    with pytest.raises(cpu.CpuUnsupported) as refused:
        cpu.plan(paths_of(generation), "int8", engine)
    message = str(refused.value)
    assert message.startswith(f"--int8-engine {engine}") and "usable here: " in message


def test_an_int8_engine_that_works_is_used_as_asked():
    chosen = cpu.plan(paths_of("Haswell"), "int8", "qnnpack")
    assert chosen.paths.int8 == "qnnpack" and chosen.as_dict()["paths"]["int8"] == "qnnpack"
    assert cpu.plan(paths_of("Sandy / Ivy Bridge"), "int8", "onednn").paths.int8 == "onednn"


def test_the_plan_names_the_step_that_serves():
    library = SimpleNamespace(isa="avx2")  # what the plan reads of a native library
    paths = paths_of("Haswell")
    native = cpu.plan(paths, "auto", library=library)
    assert native.quantize == "int8-row" and native.native is library
    assert native.step == native.as_dict()["step"] == "native avx2"
    assert "step native avx2" in native.summary()
    assert cpu.plan(paths, "int8", library=library).step == "torch"  # torch.ao's int8 weights
    assert cpu.plan(paths, "auto").step == "torch"
    assert native.on_torch().as_dict()["step"] == "torch"


GB = 2**30
LARGE = cpu.FOUR_BIT_PARAMS


def size(params: int, int8_bytes: int | None = None, four_bit: bool = True) -> cpu.ModelSize:
    return cpu.ModelSize(params, params if int8_bytes is None else int8_bytes, four_bit)


@pytest.mark.parametrize(
    "model, ram, weights",
    [
        (size(LARGE - 1), 64 * GB, "int8-row"),  # just under the size threshold
        (size(LARGE), 64 * GB, "int4-row"),  # at it
        (size(494_000_000, GB), 4 * GB, "int8-row"),  # int8 weights at exactly the RAM share
        (size(494_000_000, GB + 1), 4 * GB, "int4-row"),  # one byte over it
        (size(494_000_000), 7 * GB // 4, "int4-row"),  # Qwen2.5-0.5B on a 1.75 GB PC
        (size(494_000_000), 2 * GB, "int8-row"),  # ... on a 2 GB one
        (size(3 * LARGE, four_bit=False), GB, "int8-row"),  # int4-row cannot load it
        (None, GB, "int8-row"),  # size not known
    ],
    ids=["under 1B", "1B", "at the RAM share", "over it", "0.5B 1.75 GB", "0.5B 2 GB",
         "not Llama-style", "unknown"],
)  # fmt: skip
def test_auto_weights_by_size_and_ram(model, ram, weights):
    chosen, why = cpu.auto_weights(model, ram)
    assert chosen == weights and why


def test_auto_weights_say_why():
    assert cpu.auto_weights(size(1_543_569_408), 16 * GB)[1] == "1.54B parameters, 1B or more"
    small = cpu.auto_weights(size(134_479_872), 384 * 2**20)[1]
    assert small == "int8-row's 128 MB of weights over 1/4 of 384 MB RAM"


def test_auto_takes_4_bit_for_a_large_model_only_on_the_native_step():
    library = SimpleNamespace(isa="avx2")
    paths = paths_of("Haswell")
    native = cpu.plan(paths, "auto", library=library).for_model(size(LARGE), 64 * GB)
    assert native.quantize == "int4-row" and native.native is library
    assert native.as_dict()["quantize"] == "int4-row" and native.as_dict()["requested"] == "auto"
    assert "serving quantize=int4-row (auto: avx2, no VNNI; 1.00B parameters, 1B or more)" in (
        native.summary()
    )
    small = cpu.plan(paths, "auto", library=library).for_model(size(LARGE - 1), 64 * GB)
    assert small.quantize == "int8-row" and small.native is library
    # No native step: fbgemm's int8 rows, whatever the size; the log line says why
    torch_rows = cpu.plan(paths, "auto").for_model(size(LARGE), GB)
    assert torch_rows.quantize == "int8-row" and torch_rows.step == "torch"
    assert "no native step, which 4-bit weights need" in torch_rows.summary()
    assert cpu.plan(paths_of("Sandy / Ivy Bridge"), "auto").for_model(size(LARGE), GB).quantize == (
        "int8"
    )
    # A pinned format is served as pinned, on any PC (docs/fleet.md)
    for pinned in ("int8-row", "int4-row"):
        plan = cpu.plan(paths, pinned, library=library).for_model(size(LARGE - 1), GB // 8)
        assert plan.quantize == pinned and plan.as_dict()["requested"] == pinned


def test_autos_weights_keep_the_thread_governor_made_before_the_model_is_known():
    """server.py makes the governor from the plan before the load settles auto's weights."""
    from inference.host.threads import THREAD_INVARIANT

    assert set(cpu.NATIVE_KINDS) <= THREAD_INVARIANT
