"""What each stage claims, read from the PTX Triton generates for sm_80 and sm_90 (no GPU needed)."""

from __future__ import annotations

import pytest

from harness.inspect_code import count_instructions
from stages import STAGES
from stages.contract import Problem

PROBLEM = Problem(B=4, H=32, N=4096, D=64, dtype="fp16")


def ops(ptx: str) -> dict[str, int]:
    """The instruction counts `harness inspect` prints, under short names."""
    c = count_instructions(ptx)
    return {"cp_async": c["cp.async.cg.shared.global"], "commit": c["cp.async.commit_group"],
            "wait": c["cp.async.wait_group"], "tma": c["cp.async.bulk.tensor"], "mbarrier": c["mbarrier"],
            "mma_sync": c["mma.sync"], "ldmatrix": c["ldmatrix"], "wgmma": c["wgmma.mma_async"],
            "ex2": c["ex2.approx"], "ld_v4": c["ld.global.v4"]}


@pytest.fixture(scope="module")
def compiled():
    """Every (stage, arch, causal) compiled once for the whole module."""
    out = {}
    for name in ("a", "b", "c"):
        for arch in (80, 90):
            for causal in (False, True):
                p = Problem(PROBLEM.B, PROBLEM.H, PROBLEM.N, PROBLEM.D, PROBLEM.dtype, causal)
                out[name, arch, causal] = STAGES[name].compile(p, arch)
    return out


@pytest.mark.parametrize("arch", [80, 90])
def test_stage_a_is_three_kernels_b_and_c_one(compiled, arch):
    assert [k.name for k in compiled["a", arch, False]] == list(STAGES["a"].kernel_names)
    assert len(compiled["b", arch, False]) == 1 and len(compiled["c", arch, False]) == 1


@pytest.mark.parametrize("arch", [80, 90])
def test_stage_b_has_no_async_copies(compiled, arch):
    (kernel,) = compiled["b", arch, True]
    c = ops(kernel.asm["ptx"])
    assert c["cp_async"] == c["commit"] == c["wait"] == c["tma"] == 0, c
    assert kernel.num_stages == 1
    assert c["ld_v4"] > 0, "K/V tiles should still be loaded with 16-byte vector loads"


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm80_pipelines_with_cp_async_and_mma_sync(compiled, causal):
    (kernel,) = compiled["c", 80, causal]
    c = ops(kernel.asm["ptx"])
    assert c["cp_async"] > 0 and c["commit"] > 0 and c["wait"] > 0, c
    assert c["mma_sync"] > 0 and c["ldmatrix"] > 0, c
    assert c["tma"] == 0 and c["wgmma"] == 0
    assert c["ex2"] > 0


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm90_uses_tma_mbarriers_and_wgmma(compiled, causal):
    (kernel,) = compiled["c", 90, causal]
    c = ops(kernel.asm["ptx"])
    assert c["tma"] > 0 and c["mbarrier"] > 0, c
    assert c["wgmma"] > 0 and c["mma_sync"] == 0, c


def test_stage_c_switches_really_switch():
    """The ablation is only honest if turning a switch off changes the code."""
    no_pipe = ops(STAGES["c"].compile(PROBLEM, 80, pipelining=False)[0].asm["ptx"])
    assert no_pipe["cp_async"] == 0 and no_pipe["commit"] == 0
    no_tma = ops(STAGES["c"].compile(PROBLEM, 90, tma=False)[0].asm["ptx"])
    assert no_tma["tma"] == 0 and no_tma["cp_async"] > 0
    causal = Problem(4, 32, 4096, 64, "fp16", causal=True)
    skip = STAGES["c"].compile(causal, 80)[0].asm["ttgir"]
    no_skip = STAGES["c"].compile(causal, 80, causal_skip=False)[0].asm["ttgir"]
    assert skip.count("scf.for") > no_skip.count("scf.for"), "causal skipping splits the loop in two"


def test_stage_c_shared_memory_fits_the_budget(compiled):
    for arch in (80, 90):
        (kernel,) = compiled["c", arch, False]
        limit = {80: 163 * 1024, 90: 227 * 1024}[arch]
        assert 0 < kernel.shared_bytes <= limit
