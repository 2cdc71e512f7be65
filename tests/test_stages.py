"""Every stage against a float64 reference, on CPU (Triton interpreter) and, marked `gpu`, on a GPU."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import stages
from stages import STAGES, contract
from stages.c_optimized import SWITCHES, VARIANTS, WS_LADDER, candidate_configs
from stages.c_optimized import hopper_ws
from stages.c_optimized import configs as c_configs
from stages.c_optimized import kernels as c_kernels

from .helpers import DTYPES, check_against_reference, make_qkv

TRITON_STAGES = ["a", "b", "c"]
# N = 1, below every tile, a whole tile, ragged, one past a power of two.
SIZES = [1, 17, 64, 100, 257]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_matches_float64_reference(stage, dtype, D, N, causal, device):
    # B = 2, H = 3: six heads with different data, so a batch or head offset bug shows.
    q, k, v = make_qkv(2, 3, N, D, DTYPES[dtype], device)
    o = STAGES[stage].attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_strided_inputs(stage, causal, device):
    """[B, N, H, D] tensors transposed to [B, H, N, D]: head stride D, row stride H·D."""
    q, k, v = make_qkv(2, 3, 100, 64, torch.float16, device, layout="bnhd")
    assert not q.is_contiguous()
    o = STAGES[stage].attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_large_logits_stay_finite(stage, dtype, device):
    """|scale·q·k| around 1e4: exp would overflow without the running-max subtraction.

    Each key is its query (k = q), so a query's own key, the last one it may see under the causal
    mask, scores |q|²/8 ≈ 3e4 while the others score ~1e4: the running max jumps in the last tile
    and every earlier partial sum must be rescaled to nothing. Independent random q and k would
    put some row's two largest logits within the rounding of S at this size (stage A stores S in
    the input dtype: bf16 spaces numbers 128 apart at 2e4), and then rounding, not the kernel,
    decides the row: the check against PyTorch's same-precision error failed at random."""
    q, _, v = make_qkv(1, 2, 80, 64, DTYPES[dtype], device, scale=60.0)
    k = q.clone()
    logits = (q[0, 0].double() @ k[0, 0].double().T) / 8
    assert logits.abs().max() > 5e3
    o = STAGES[stage].attention(q, k, v, causal=True)
    assert torch.isfinite(o).all()
    check_against_reference(o, q, k, v, causal=True, dtype_name=dtype)


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_custom_scale_and_other_head_dims(stage, device):
    for D in (32, 256):
        q, k, v = make_qkv(1, 2, 33, D, torch.float16, device)
        o = STAGES[stage].attention(q, k, v, sm_scale=0.3)
        check_against_reference(o, q, k, v, causal=False, dtype_name="fp16", sm_scale=0.3)


# ---------------------------------------------------------------------------------- stage C only

def _candidates():
    """Every configuration stage C can select, on either GPU family, for every head dim and dtype."""
    seen = []
    for arch in (80, 90):
        for D in (16, 64, 128):
            for dtype in ("fp16", "bf16", "fp32") if arch == 90 else ("fp16", "fp32"):
                for config in candidate_configs(D, DTYPES[dtype], arch):
                    seen.append((arch, D, dtype, config))
    return seen


@pytest.mark.parametrize("arch,D,dtype,config", _candidates(), ids=lambda x: str(x))
def test_every_candidate_config_is_correct(arch, D, dtype, config, device):
    """A configuration that is wrong on some shape is a bug, not a speedup. On a CPU ``arch=90``
    runs the TMA descriptor path in the interpreter; on a GPU only the device's own path runs."""
    if device == "cuda" and c_kernels.device_arch(torch.device("cuda")) < arch:
        pytest.skip(f"sm_{arch} path needs an sm_{arch} GPU")
    if config.ws and device != "cuda":
        pytest.skip("the warp-specialized Gluon kernel has no interpreter; test_compiled_code checks it on a CPU")
    for N, causal in ((193, True), (130, False)):
        q, k, v = make_qkv(2, 2, N, D, DTYPES[dtype], device)
        o = contract.new_output(q)
        plan = c_kernels.plan(q, k, v, o, causal=causal, scale=D ** -0.5, arch=arch, config=config)
        if config.ws:
            assert plan[0].kernel is hopper_ws.ws_attention_kernel
        else:
            assert plan[0].args["USE_TMA"] == (arch >= 90)
        for launch in plan:
            launch.run()
        check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_ablation_variant_is_correct(variant, device):
    if variant in WS_LADDER and device == "cpu":
        pytest.skip("a warp-specialization rung runs on sm_90 only (tests/test_ws_ladder.py checks the refusal)")
    for N, causal in ((150, True), (64, False)):
        q, k, v = make_qkv(2, 2, N, 64, torch.float16, device)
        o = STAGES["c"].attention(q, k, v, causal=causal, **VARIANTS[variant])
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


def test_all_switches_off_is_stage_b():
    """With every switch off, stage C launches stage B's configuration with B's masking."""
    q, k, v = (torch.empty((1, 2, 300, 64), dtype=torch.float16, device="meta"),) * 3
    (launch,) = c_kernels.plan(q, k, v, torch.empty_like(q), causal=True, scale=0.125, arch=90,
                               **{s: False for s in SWITCHES})
    assert (launch.args["BLOCK_M"], launch.args["BLOCK_N"]) == (stages.b_tiled.kernels.BLOCK_M,
                                                                stages.b_tiled.kernels.BLOCK_N)
    assert launch.num_warps == stages.b_tiled.kernels.NUM_WARPS and launch.num_stages == 1
    assert not launch.args["USE_TMA"] and not launch.args["EXP2"] and not launch.args["CAUSAL_SKIP"]


# ---------------------------------------------------------------------------------- bad input

def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(shape).to(dtype).to(device)


@pytest.mark.parametrize("stage", TRITON_STAGES)
@pytest.mark.parametrize("args,kwargs,error,message", [
    ((_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16)), {}, ValueError, r"q must be 4-D \[B, H, N, D\], got 3-D"),
    ((_t(1, 2, 8, 16), _t(1, 2, 9, 16), _t(1, 2, 8, 16)), {}, ValueError, r"same shape.*k \(1, 2, 9, 16\)"),
    ((_t(1, 2, 8, 44),) * 3, {}, ValueError, r"head dim D .* a multiple of 8 from 8 to 256, got 44"),
    ((_t(1, 2, 0, 16),) * 3, {}, ValueError, r"N >= 1"),
    ((_t(1, 2, 8, 16, dtype=torch.float64),) * 3, {}, TypeError, r"q.dtype must be one of float16, bfloat16, float32, got float64"),
    ((_t(1, 2, 8, 16), _t(1, 2, 8, 16, dtype=torch.float32), _t(1, 2, 8, 16)), {}, TypeError, r"share one dtype"),
    (("q", _t(1, 2, 8, 16), _t(1, 2, 8, 16)), {}, TypeError, r"q must be a torch.Tensor.*got str"),
    ((_t(1, 2, 8, 16),) * 3, {"sm_scale": float("nan")}, ValueError, r"sm_scale must be a finite positive float.*nan"),
    ((_t(1, 2, 8, 16),) * 3, {"sm_scale": -1.0}, ValueError, r"sm_scale must be a finite positive"),
    ((_t(1, 2, 8, 16),) * 3, {"sm_scale": "0.1"}, TypeError, r"sm_scale must be a float or None, got str"),
    ((_t(1, 2, 8, 16),) * 3, {"causal": 1}, TypeError, r"causal must be a bool, got int"),
    ((_t(1, 2, 16, 8).transpose(-1, -2),) * 3, {}, ValueError, r"contiguous in its last \(head\) dim"),
])
def test_bad_input_is_named(stage, args, kwargs, error, message):
    with pytest.raises(error, match=message):
        STAGES[stage].attention(*args, **kwargs)


# ---------------------------------------------------------------------------------- models

def test_traffic_models_follow_their_derivations():
    p = contract.Problem(B=2, H=4, N=1000, D=64, dtype="fp16")
    e, BH, N, D = 2, 8, 1000, 64
    # Stage A: S and P (N² each) dominate; B's K/V re-reads scale as N²·D/BLOCK_M.
    a = STAGES["a"].hbm_bytes(p)
    assert a.write == 2 * BH * N * N * e + BH * N * D * e
    assert a.read > 3 * BH * N * N * e
    b = STAGES["b"].hbm_bytes(p)
    assert b.read == BH * N * D * e * (1 + 2 * math.ceil(N / 64)) and b.write == BH * N * D * e
    # Both grow as N²: A with 5 N² elements per head (S written, read twice; P written, read), B with
    # 2·N²·D/BLOCK_M (K and V once per Q tile): at D = BLOCK_M = 64 only 2.5x apart in *requested*
    # bytes. The real gap is in DRAM bytes, where B's re-reads hit in L2 (see the stage READMEs).
    big = contract.Problem(B=2, H=4, N=4000, D=64, dtype="fp16")
    assert STAGES["a"].hbm_bytes(big).total > 15 * a.total
    assert 2.3 < STAGES["a"].hbm_bytes(big).total / STAGES["b"].hbm_bytes(big).total < 4
    # Stage C with causal skipping reads about half the K/V of the non-causal problem.
    full = STAGES["c"].hbm_bytes(contract.Problem(1, 1, 8192, 64, "fp16", causal=False))
    half = STAGES["c"].hbm_bytes(contract.Problem(1, 1, 8192, 64, "fp16", causal=True))
    assert 0.45 < (half.read - 8192 * 128) / (full.read - 8192 * 128) < 0.56


def test_workspace_models():
    p = contract.Problem(B=4, H=32, N=4096, D=64, dtype="fp16")
    # A worked example: P alone for N=4096, B=32, 32 heads in fp16 is 32 GiB.
    assert STAGES["a"].workspace_bytes(contract.Problem(32, 32, 4096, 64, "fp16")) == 2 * 32 * 2**30
    assert STAGES["a"].workspace_bytes(p) == 2 * 4 * 32 * 4096 * 4096 * 2
    assert STAGES["b"].workspace_bytes(p) == 0 and STAGES["c"].workspace_bytes(p) == 0


def test_registry_contract():
    for name in TRITON_STAGES:
        stage = STAGES[name]
        assert stage.name == name and stage.title and stage.techniques and stage.kernel_names
        assert stage.compile is not None
    with pytest.raises(KeyError, match="unknown stage 'z'; registered stages: a, b, .*c"):
        stages.get_stage("z")


# ---------------------------------------------------------------------------------- GPU

GPU_SIZES = [1, 17, 100, 1000, 4096, 4097]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("N", GPU_SIZES)
@pytest.mark.parametrize("D", [16, 64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gpu_matches_float64_reference(stage, dtype, D, N, causal):
    q, k, v = make_qkv(2, 3, N, D, DTYPES[dtype], "cuda")
    o = STAGES[stage].attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
    check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bnhd"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gpu_strided_large(stage, layout):
    q, k, v = make_qkv(2, 4, 4096, 64, torch.float16, "cuda", layout=layout)
    for causal in (False, True):
        o = STAGES[stage].attention(q, k, v, causal=causal)
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_warp_specialized_persistent_programs(dtype, D):
    """Every warp-specialized config, its persistent grid shrunk to three programs (six where two share
    an SM): each program walks several (batch, head, row block) items, so the K/V ring, the ping-pong
    turns, the two (or three) Q buffers and the item-to-item pipeline (one item's O stored while the next one runs) carry over
    between items. A persistent config also runs with one program per item."""
    if c_kernels.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    # B·H = 9: with an odd number of row blocks the item count is odd, so a causal pair of items
    # (see hopper_ws._tile_coords) can span two heads and the last one has no partner.
    for config in c_configs.WS_SHAPES[D]:
        for N, causal in ((1, True), (100, False), (257, True), (1000, False), (1000, True)):
            q, k, v = make_qkv(3, 3, N, D, DTYPES[dtype], "cuda")
            o = contract.new_output(q)
            # A config made for one program per item may not fit the persistent kernel's second Q buffer;
            # a persistent one also runs with a third (each Q fetched two items ahead) where that fits.
            variants = [replace(config, persistent=False, deep_q=False)]
            if config.persistent:
                variants += [replace(config, deep_q=deep) for deep in (False, True)
                             if c_configs.fits(replace(config, deep_q=deep), D, q.element_size(), 90)]
            for variant in variants:
                persistent = variant.persistent
                launch = hopper_ws.plan(q, k, v, o, causal=causal, qk_scale=D ** -0.5 * c_kernels.LOG2E,
                                        **variant.ws_options(), num_sms=3)
                total = launch.args["total"]
                programs = min(3 * variant.programs_per_sm, hopper_ws.work_units(total, causal, persistent=True))
                assert launch.grid[0] == (programs if persistent else total)
                o.fill_(float("nan"))
                launch.run()
                torch.cuda.synchronize()
                check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


def _late_maxima(q, k, *, causal, block_n, seed):
    """Make about a third of the query rows meet, in a K/V tile after their first one, a key that
    scores ~40 (natural log units) above the rest: the row's running maximum then jumps by far more
    than the lazy rescale's threshold (``hopper_ws.RESCALE_THRESHOLD``) and that row's part of O must
    be rescaled, while other rows of the same warp may need nothing. The rows are drawn at random,
    so a warp vote that missed one of a thread's two rows would leave some row unscaled."""
    g = torch.Generator().manual_seed(seed)
    B, H, N, D = q.shape
    c = 40.0 / D ** 0.5  # q_i·(c·q_i)/sqrt(D) ≈ c·sqrt(D)
    for b in range(B):
        for h in range(H):
            rows = torch.nonzero(torch.rand(N, generator=g) < 0.35).flatten().tolist()
            for i in rows:
                lo = block_n  # a key past the first tile ...
                hi = i if causal else N - 1  # ... that row i may see
                if hi < lo:
                    continue
                j = int(torch.randint(lo, hi + 1, (1,), generator=g))
                k[b, h, j] = (q[b, h, i].float() * c).to(k.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gpu_warp_specialized_lazy_rescale(dtype, D):
    """The warp-specialized kernel rescales O only when some row of a warp raised its maximum by more
    than the threshold (``hopper_ws._rescale_if_needed``). Rows whose maximum jumps in a later tile,
    drawn at random, every config, persistent and not, both causal settings, against float64."""
    if c_kernels.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    for config in c_configs.WS_SHAPES[D]:
        for N, causal in ((1000, False), (1000, True), (700, True)):
            q, k, v = make_qkv(2, 3, N, D, DTYPES[dtype], "cuda")
            _late_maxima(q, k, causal=causal, block_n=config.block_n, seed=N + causal)
            o = contract.new_output(q)
            launch = hopper_ws.plan(q, k, v, o, causal=causal, qk_scale=D ** -0.5 * c_kernels.LOG2E,
                                    **config.ws_options(), num_sms=5)
            o.fill_(float("nan"))
            launch.run()
            torch.cuda.synchronize()
            check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)
