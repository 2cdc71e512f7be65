"""Stage C on the extended contract: grouped-query attention, Nq != Nk with bottom-right causal masks,
every head dim (padded inside the kernel), the split-KV path, the row log-sum-exp the backward
needs, the lean cached host path and the shape-aware choice. Small shapes, Triton interpreter;
GPU-only checks are marked ``gpu``."""

from __future__ import annotations

import math

import pytest
import torch

from stages import STAGES, contract
from stages.c_optimized import configs, decode, hopper_ws
from stages.c_optimized import kernels as c_kernels
from stages.contract import Problem

from .helpers import DTYPES, check_against_reference, make_qkv

attention = STAGES["c"].attention


def _reference_lse(q, k, *, causal, sm_scale=None):
    """log2 Σ_j 2^(q·k_j · scale · log2 e) per row in float64 (+inf for a row that sees no key)."""
    scale = q.shape[-1] ** -0.5 if sm_scale is None else sm_scale
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    Nq, Nk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(Nq)[:, None]
        j = torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    lse = torch.logsumexp(s, dim=-1) / math.log(2)
    return torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)


def _check_lse(lse, q, k, *, causal):
    ref = _reference_lse(q.cpu(), k.cpu(), causal=causal)
    lse = lse.cpu().double()
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float64
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] > 0).all(), "rows with no key need lse = +inf"
    # fp32 sums of exponentials of (dtype-rounded) scores: a few ulps of the log2 sum
    assert (lse[~empty] - ref[~empty]).abs().max() < 1e-3 * max(1.0, ref[~empty].abs().max().item())


# ------------------------------------------------------------------------------- forward shapes

SHAPES = [
    # B, Hq, Hkv, Nq, Nk: GQA, MQA, Nq < Nk (decode-like), Nq > Nk (rows with no key when causal)
    (2, 4, 2, 37, 37),
    (1, 4, 1, 20, 90),
    (1, 2, 2, 90, 20),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}".format(*s))
def test_gqa_and_unequal_lengths(shape, causal, device):
    B, Hq, Hkv, Nq, Nk = shape
    q, k, v = make_qkv(B, Hq, Nq, 64, torch.float16, device, Hkv=Hkv, Nk=Nk)
    o = attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


def test_rows_that_see_no_key_are_exactly_zero(device):
    """Nq > Nk, causal: the first Nq - Nk rows see no key and output exactly 0, on the TMA
    (arch 90) and pointer (arch 80) paths, with and without causal skipping."""
    q, k, v = make_qkv(1, 2, 70, 16, torch.float16, device, Nk=30)
    for arch in (80, 90):
        for causal_skip in (True, False):
            o = contract.new_output(q)
            lse = torch.full(q.shape[:3], float("nan"), device=device)
            for launch in c_kernels.plan(q, k, v, o, causal=True, scale=0.25, arch=arch, lse=lse, split_kv=1,
                                         causal_skip=causal_skip):
                launch.run()
            assert not o[:, :, :40].any() and torch.isinf(lse[:, :, :40]).all()
            check_against_reference(o, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.25)


@pytest.mark.parametrize("D", [8, 72, 80, 96, 112, 200])
def test_head_dims_padded_inside_the_kernel(D, device):
    """Head dims that are not powers of two: padded to ``padded_head_dim(D)`` with masks (pointer
    path, arch 80) or the copy engine's zero fill (TMA path, arch 90; more keys than one K/V tile, since
    a call of one tile reads by pointers, ``kernels.one_key_tile``), never a copy of the inputs."""
    dtype = {8: "fp32", 72: "fp16", 80: "bf16", 96: "fp16", 112: "fp32", 200: "fp16"}[D]
    q, k, v = make_qkv(1, 2, 40, D, DTYPES[dtype], device, Hkv=1, Nk=140)
    for arch in (80, 90):
        o = contract.new_output(q)
        (launch,) = c_kernels.plan(q, k, v, o, causal=True, scale=D ** -0.5, arch=arch, split_kv=1)
        assert launch.args["BLOCK_D"] == contract.padded_head_dim(D) and launch.args["USE_TMA"] == (arch == 90)
        launch.run()
        check_against_reference(o, q, k, v, causal=True, dtype_name=dtype)


@pytest.mark.parametrize("rows", ["aligned", "off 16 bytes"])
@pytest.mark.parametrize("path", ["tl", "split"])
def test_row_alignment_is_what_the_strides_allow(rows, path, device):
    """D 72: rows 144 bytes apart (16-byte aligned, which the kernels are told: aligned.py) or slices of
    76-element rows (152 bytes: not, so they are not told; a kernel told so would read the wrong rows),
    forward and backward against float64."""
    from .helpers import check_gradients

    D = 72
    if rows == "aligned":
        q, k, v = make_qkv(2, 4, 37, D, torch.float16, device, Hkv=2, Nk=70)
    else:
        wide = make_qkv(2, 4, 37, D + 4, torch.float16, device, Hkv=2, Nk=70)
        q, k, v = (t[..., :D] for t in wide)
    expected = 8 if rows == "aligned" else 1
    o = contract.new_output(q)
    launches = c_kernels.plan(q, k, v, o, causal=True, scale=D ** -0.5, arch=80, split_kv=1 if path == "tl" else 3)
    assert launches[0].args["ALIGN"] == expected
    options = dict(split_kv=1 if path == "tl" else 3)
    check_against_reference(attention(q, k, v, causal=True, **options), q, k, v, causal=True, dtype_name="fp16")
    check_gradients(lambda q, k, v, **kw: attention(q, k, v, **kw, **options), q, k, v, causal=True,
                    dtype_name="fp16")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_strided_gqa_inputs(dtype, device):
    q, k, v = make_qkv(2, 4, 45, 48, DTYPES[dtype], device, layout="bnhd", Hkv=2, Nk=60)
    assert not q.is_contiguous() and not k.is_contiguous()
    o = attention(q, k, v, causal=True)
    check_against_reference(o, q, k, v, causal=True, dtype_name=dtype)


# ------------------------------------------------------------------------------- split-KV

@pytest.mark.parametrize("dtype,causal", [("fp16", True), ("bf16", False), ("fp32", True)])
def test_split_kv_decode(dtype, causal, device):
    """Nq = 1 (and 3) against a longer Nk through the split-KV path, all query heads of a group in
    one program; the keys split into chunks whose partials the merge kernel combines."""
    for Hq, Hkv, Nq in ((4, 1, 1), (4, 2, 3)):
        q, k, v = make_qkv(2, Hq, Nq, 40, DTYPES[dtype], device, Hkv=Hkv, Nk=333)
        o, lse = c_kernels.attention_with_lse(q, k, v, causal=causal, split_kv=4)
        check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)
        _check_lse(lse, q, k, causal=causal)


@pytest.fixture(params=decode.MERGES)
def merge(request, monkeypatch):
    """Each way of merging the splits (``decode.MERGE``: the merge kernel's two shapes, and the merge
    fused into the split kernel), with every plan made under another forgotten."""
    def clear():
        c_kernels._recipe.cache_clear()
        c_kernels._LAYOUT_PLANS.clear()

    monkeypatch.setattr(decode, "MERGE", request.param)
    clear()
    yield request.param
    monkeypatch.undo()
    clear()


def test_split_kv_many_splits(merge, device):
    """More splits than the wide merge folds in one step (70 chunks of one tile, 32 per step: a ragged
    last step), GQA rows, causal both; and 24 chunks (fewer than one step)."""
    # one K/V tile per chunk, of the width the decoding plan gives this call on an sm_80
    block_n = decode.decode_tiles(2, 1, 32, 2, configs.SHARED_MEMORY_LIMIT[80]).block_n
    for split_kv, causal in ((70, False), (70, True), (24, True)):
        q, k, v = make_qkv(1, 4, 1, 32, torch.float16, device, Hkv=2, Nk=block_n * 70 - 5)
        launches = c_kernels.plan(q, k, v, contract.new_output(q), causal=causal, scale=0.2, arch=80,
                                  split_kv=split_kv)
        if merge == "fused":  # one kernel, which counts its programs in
            assert len(launches) == 1 and launches[0].args["COUNTERS"] is not None
        else:
            assert launches[1].grid[0] == -(-4 // decode.merge_shape()[0]) and launches[1].args["SPLITS"] == split_kv
        o, lse = c_kernels.attention_with_lse(q, k, v, causal=causal, split_kv=split_kv)
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")
        _check_lse(lse, q, k, causal=causal)


def test_split_kv_with_empty_rows_and_chunks(merge, device):
    """Causal, Nq > Nk: rows with no key at all (every partial's lse is -inf) get 0 and lse = +inf,
    and chunks past a row's diagonal contribute nothing."""
    q, k, v = make_qkv(1, 2, 40, 16, torch.float16, device, Nk=300)
    q2, k2, v2 = make_qkv(1, 2, 320, 16, torch.float16, device, Nk=300)
    for q_, k_, v_ in ((q, k, v), (q2, k2, v2)):
        o, lse = c_kernels.attention_with_lse(q_, k_, v_, causal=True, split_kv=5)
        check_against_reference(o, q_, k_, v_, causal=True, dtype_name="fp16")
        _check_lse(lse, q_, k_, causal=True)


def test_split_kv_is_chosen_from_the_work(waves_plan):
    """Too few programs for the SMs and a long key sequence: split; enough programs, or short keys:
    do not. Decoding under the "waves" plan splits to about DECODE_WAVES programs per SM, each chunk
    whole tiles and at least a few of them (the deep plan's counts: the test named for it below); a
    prefill with few programs splits to about one wave."""
    sms = 132
    split = decode.choose_splits(B=1, Hkv=8, group=4, Nq=1, Nk=8192, D=128, sms=sms)
    assert split is not None and split.splits >= 2
    assert 1 * 8 * split.splits <= decode.DECODE_WAVES * sms and split.chunk % split.block_n == 0
    assert decode.choose_splits(B=16, Hkv=8, group=4, Nq=1, Nk=8192, D=128, sms=sms).splits == 4
    prefill = decode.choose_splits(B=1, Hkv=1, group=1, Nq=128, Nk=65536, D=64, sms=sms)
    assert prefill is not None and 2 * prefill.splits <= sms
    # fp32 (exact products on the FMA units) takes 8 warps, and 32 keys from D 128 on, prefill or decode
    # (and at most 16 rows there: wider fp32 tiles spill)
    fp32 = decode.choose_splits(B=1, Hkv=1, group=1, Nq=128, Nk=65536, D=128, sms=sms,
                                tiles=decode.call_tiles(1, 128, 65536, 128, 4, configs.SHARED_MEMORY_LIMIT[90]))
    assert (fp32.block_m, fp32.block_n, fp32.num_warps) == (16, 32, 8)
    fp32 = c_kernels.select(1, 8, 8, 64, 65536, 128, torch.float32, False, 90, sms, split_kv=4).config
    assert (fp32.block_m, fp32.block_n, fp32.num_warps) == (16, 32, 8)
    assert split.chunk >= decode.MIN_TILES_PER_SPLIT * split.block_n
    assert split.splits * split.chunk >= 8192 > (split.splits - 1) * split.chunk
    assert decode.choose_splits(B=1, Hkv=8, group=4, Nq=1, Nk=128, D=128, sms=sms).splits == 1  # too short
    # Decoding stays on the split kernel however short the cache (one chunk): the path never changes
    # as a cache grows; a full GPU of multi-head decoding runs the one-pass kernel at every length.
    assert decode.choose_splits(B=1, Hkv=8, group=1, Nq=1, Nk=128, D=128, sms=sms).splits == 1
    assert all(decode.choose_splits(B=4, Hkv=12, group=1, Nq=1, Nk=nk, D=64, sms=sms) is not None
               for nk in range(2, 2000, 7))
    assert decode.choose_splits(B=256, Hkv=32, group=1, Nq=1, Nk=8192, D=128, sms=sms) is None  # GPU full
    p = dict(D=128, dtype=torch.float16, causal=True, arch=90, sms=sms)
    assert c_kernels.select(1, 32, 8, 1, 8192, **p).path == "split"
    assert c_kernels.select(16, 32, 8, 4096, 4096, **p).path == "ws"
    assert c_kernels.select(1, 32, 8, 1, 8192, split_kv=1, **p).path == "tl"


# ------------------------------------------------------------------------------- log-sum-exp

@pytest.mark.parametrize("arch,dtype", [(80, "fp32"), (90, "fp16")])
def test_lse_matches_logsumexp(arch, dtype, device):
    """The training forward's row log-sum-exp (base 2) against torch.logsumexp in float64, on the
    TMA and pointer paths, with the causal offset and empty rows; and with exp2 switched off (the
    kernel then works in natural units and converts)."""
    q, k, v = make_qkv(1, 4, 50, 24, DTYPES[dtype], device, Hkv=2, Nk=30)
    for exp2 in (True, False):
        o = contract.new_output(q)
        lse = torch.full(q.shape[:3], float("nan"), device=device)
        for launch in c_kernels.plan(q, k, v, o, causal=True, scale=24 ** -0.5, arch=arch, lse=lse, exp2=exp2):
            launch.run()
        check_against_reference(o, q, k, v, causal=True, dtype_name=dtype)
        _check_lse(lse, q, k, causal=True)


def test_gradient_path_saves_lse_and_calls_the_backward(device, monkeypatch):
    """With inputs that require grad, the forward writes lse and the backward receives exactly
    (do, q, k, v, o, lse) and the options; without, no autograd node is made."""
    import sys
    import types

    seen = {}

    def fake_backward(do, q, k, v, o, lse, *, causal, scale, deterministic=False, **switches):
        seen.update(lse=lse, causal=causal, scale=scale, deterministic=deterministic, o=o)
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)

    def fake_run_backward(do, q, k, v, o, lse, causal, scale, deterministic=False, *switches):
        # (the autograd node's positional entry into the same backward)
        return fake_backward(do, q, k, v, o, lse, causal=causal, scale=scale, deterministic=deterministic)

    monkeypatch.setitem(sys.modules, "stages.c_optimized.backward",
                        types.SimpleNamespace(attention_backward=fake_backward, run_backward=fake_run_backward))
    q, k, v = make_qkv(1, 4, 20, 16, torch.float16, device, Hkv=2, Nk=24)
    q.requires_grad_(True)
    o = attention(q, k, v, causal=True, deterministic=True)
    assert o.grad_fn is not None
    o.backward(torch.ones_like(o))
    assert seen["causal"] and seen["deterministic"] and seen["scale"] == 16 ** -0.5
    _check_lse(seen["lse"], q.detach(), k, causal=True)
    assert torch.equal(seen["o"], o.detach()) and torch.equal(q.grad, torch.ones_like(q))
    assert attention(q.detach(), k, v).grad_fn is None


# ------------------------------------------------------------------------------- host path, choice

def test_plan_is_cached_per_shape():
    """A second call with the same shapes, strides and switches reuses the recipe (no config choice,
    no grid arithmetic); only tensors and descriptors are bound."""
    q = torch.empty((2, 8, 256, 64), dtype=torch.float16)
    k = torch.empty((2, 2, 256, 64), dtype=torch.float16)
    o = torch.empty_like(q)
    c_kernels._recipe.cache_clear()
    first = c_kernels.plan(q, k, k, o, causal=True, scale=0.125, arch=90)
    second = c_kernels.plan(q, k, k, o, causal=True, scale=0.125, arch=90)
    info = c_kernels._recipe.cache_info()
    assert info.misses == 1 and info.hits == 1
    assert first[0].grid == second[0].grid and first[0].args["GROUP"] == 4


def test_shape_aware_config_prefers_smaller_tiles_when_the_gpu_is_not_full():
    big = configs.Config(128, 64, 8, 3)
    assert configs.shape_aware_config(big, 16, 16, 4096, 128, torch.float16, 80, 132) == big
    small = configs.shape_aware_config(big, 1, 2, 4096, 128, torch.float16, 80, 132)
    assert small.block_m == 64 and small.num_warps == 4
    assert configs.shape_aware_config(big, 64, 16, 40, 128, torch.float16, 80, 132).block_m == 64  # short Nq
    ws = configs.WS_SHAPES[64][0]
    assert ws.block_m == 192 and ws.persistent
    # 4 heads of 8192 rows: 172 items of 192 rows take two waves on 132 SMs, 256 of 128 rows too
    few = configs.shape_aware_config(ws, 2, 2, 8192, 64, torch.float16, 90, 132)
    assert few.ws and few.block_m == 128 and few.persistent
    # 197-row sequences: a second 192-row item holds 5 rows
    assert configs.shape_aware_config(ws, 64, 12, 197, 64, torch.float16, 90, 132).block_m == 128
    # one 64-row head: the tl kernel's 64-row tile
    tiny = configs.shape_aware_config(ws, 1, 1, 64, 64, torch.float16, 90, 132)
    assert not tiny.ws and tiny.block_m == 64
    # the FA-paper grid keeps its tuned config
    for B, N in ((32, 512), (16, 1024), (4, 4096), (1, 16384)):
        assert configs.shape_aware_config(ws, B, 32, N, 64, torch.float16, 90, 132) == ws


def test_items_of_one_or_two_kv_tiles_fetch_q_two_items_ahead():
    """A persistent warp-specialized program whose items average under two K/V tiles takes a third Q
    buffer (``configs.with_deep_q``); longer items, one program per item and a config the third
    buffer would not fit keep theirs. The choice goes through ``select`` (what a call runs)."""
    def chosen(B, H, N, D, causal, dtype=torch.float16):
        return c_kernels.select(B, H, H, N, N, D, dtype, causal, 90, 132).config

    short = chosen(128, 16, 128, 64, False)  # one 128-key tile per item
    assert short.ws and short.persistent and short.deep_q and str(short).endswith("-Q3")
    assert chosen(64, 16, 256, 128, True, torch.bfloat16).deep_q  # causal items of one or two tiles
    for B, H, N, causal in ((64, 12, 197, False), (48, 16, 384, False), (16, 32, 1024, True), (4, 32, 4096, False)):
        assert not chosen(B, H, N, 64, causal).deep_q, (B, H, N, causal)
    # the counting behind it
    assert configs.mean_kv_tiles(256, 128, 128, True) == 1.5
    assert configs.mean_kv_tiles(256, 128, 128, False) == 2
    assert configs.mean_kv_tiles(100, 192, 128, True) == 1
    # a config without a persistent grid has no next item to fetch for
    one_per_item = configs.ws_config(128, 128, 3, persistent=False)
    assert configs.with_deep_q(one_per_item, 128, False, 64, 2, 90) == one_per_item
    with pytest.raises(ValueError, match="persistent"):
        configs.ws_config(128, 128, 3, persistent=False, deep_q=True)
    # at D 128 a 3-slot ring and three Q buffers would not fit the 227 KB of an sm_90 block
    big_ring = configs.ws_config(128, 128, 3, persistent=True)
    assert configs.with_deep_q(big_ring, 128, False, 128, 2, 90) == big_ring
    assert configs.Config.parse(str(short)) == short


def test_a_head_dim_takes_the_tuned_entry_of_its_tile_width(monkeypatch):
    """The forward's tuned winners are keyed by the warp-specialized kernel's tile width: D 168-184 run
    128 + 64 columns as D 192 does and take D 192's entry, D 200 takes D 256's; without warp
    specialization (the tl kernel) a head dim reads its own key, and a fp32 one never the table's ws entry."""
    table = {"bf16/D192/causal0/N4096": "WS-M128-N64-s3", "bf16/D256/causal1/N4096": "WS-M128-N32-s4"}
    monkeypatch.setattr(configs, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(configs, "tuned_table", lambda slug, which="best": table if which == "best" else {})
    configs.choose_config.cache_clear()
    try:
        for D in (168, 176, 184, 192):
            assert configs.tuned_head_dim(D, torch.bfloat16, 90) == 192
            assert str(configs.choose_config(D, torch.bfloat16, False, 90, 4096)) == "WS-M128-N64-s3"
        assert str(configs.choose_config(200, torch.bfloat16, True, 90, 4096)) == "WS-M128-N32-s4"
        assert configs.tuned_head_dim(176, torch.bfloat16, 90, warp_specialization=False) == 176
        assert configs.tuned_head_dim(176, torch.float32, 90) == 176
        assert configs.tuned_head_dim(176, torch.bfloat16, 80) == 176
        # a head dim with no entry at its width keeps the first candidate of that width
        assert configs.choose_config(80, torch.bfloat16, False, 90, 4096) == configs.candidate_configs(
            80, torch.bfloat16, 90)[0]
    finally:
        configs.choose_config.cache_clear()


def test_d256_has_a_sm90_config_of_its_own():
    config = configs.candidate_configs(256, torch.float16, 90)[0]
    assert configs.fits(config, 256, 2, 90) and config != configs.Config(32, 32, 4, 1)
    assert configs.candidate_configs(200, torch.float16, 90)[0] == config  # padded to 256


@pytest.mark.parametrize("args,kwargs,error,message", [
    ((), {"split_kv": 0}, ValueError, r"split_kv must be >= 1"),
    ((), {"split_kv": 2.0}, TypeError, r"split_kv must be None or an int"),
    ((), {"deterministic": 1}, TypeError, r"deterministic must be a bool"),
])
def test_bad_options_are_named(args, kwargs, error, message, device):
    q = torch.randn(1, 2, 8, 16).half().to(device)
    with pytest.raises(error, match=message):
        attention(q, q, q, **kwargs)


def test_cuda_twin_refuses_the_extended_contract():
    """The CUDA C++ twin covers Hq = Hkv, Nq = Nk, D 64/128 only: it says so before compiling."""
    from stages.c_optimized import cuda_twin

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 4, 16, 64).half().to(device)
    kv = torch.randn(1, 2, 16, 64).half().to(device)
    with pytest.raises(ValueError, match="Hq == Hkv"):
        cuda_twin.attention(q, kv, kv)
    kv = torch.randn(1, 4, 24, 64).half().to(device)
    with pytest.raises(ValueError, match="Nq == Nk"):
        cuda_twin.attention(q, kv, kv)
    q = torch.randn(1, 4, 16, 80).half()
    with pytest.raises(ValueError, match="head dim"):
        cuda_twin.attention(q, q, q)


# ------------------------------------------------------------------------------- compiled code

@pytest.mark.slow
@pytest.mark.parametrize("problem,switches", [
    (Problem(2, 8, 300, 80, "fp16", True, Hkv=2, Nk=500), {}),
    (Problem(2, 8, 300, 80, "fp16", True, Hkv=2, Nk=500), {"store_lse": True}),
    (Problem(1, 32, 1, 128, "bf16", True, Hkv=8, Nk=8192), {}),
    (Problem(2, 8, 1024, 64, "fp16", True, Hkv=2), {}),
], ids=["gqa-d80", "gqa-d80-lse", "decode", "ws-gqa"])
def test_extended_problems_compile_for_sm90(problem, switches):
    kernels = STAGES["c"].compile(problem, 90, **switches)
    names = [k.name for k in kernels]
    expected = {"gqa-d80": ["optimized_attention_kernel"], "decode": ["split_kv_attention_kernel",
                                                                     "merge_splits_kernel"]}
    if problem.Nq == 1:
        assert names == expected["decode"]
    elif problem.D == 80:
        assert names == expected["gqa-d80"]
        assert "cp.async.bulk.tensor" in kernels[0].asm["ptx"]  # the padded head dim still goes through TMA
    else:
        assert names == ["ws_attention_kernel"]
    for k in kernels:
        assert 0 <= k.shared_bytes <= 227 * 1024


# ------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_warp_specialized_gqa(D):
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    for config in configs.WS_SHAPES[D]:
        for N, causal in ((1000, True), (1000, False)):
            q, k, v = make_qkv(2, 8, N, D, torch.float16, "cuda", Hkv=2)
            o = contract.new_output(q)
            launch = hopper_ws.plan(q, k, v, o, causal=causal, qk_scale=D ** -0.5 * c_kernels.LOG2E,
                                    **config.ws_options(), num_sms=7)
            launch.run()
            torch.cuda.synchronize()
            check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 72, 128, 200, 256])
def test_gpu_extended_shapes(D):
    """GQA, unequal lengths, padded head dims (TMA zero fill past D on sm_90), split-KV decode with
    many splits, the training forward's lse: at GPU sizes against float64."""
    cases = [dict(B=2, H=8, Hkv=2, N=1000, Nk=1000), dict(B=1, H=8, Hkv=8, N=500, Nk=1500),
             dict(B=1, H=4, Hkv=4, N=1500, Nk=500), dict(B=1, H=32, Hkv=8, N=1, Nk=20000),
             dict(B=2, H=16, Hkv=2, N=4, Nk=9000)]
    for case in cases:
        for causal in (False, True):
            q, k, v = make_qkv(case["B"], case["H"], case["N"], D, torch.float16, "cuda", Hkv=case["Hkv"],
                               Nk=case["Nk"])
            o = attention(q, k, v, causal=causal)
            check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")
            o2, lse = c_kernels.attention_with_lse(q, k, v, causal=causal)
            check_against_reference(o2, q, k, v, causal=causal, dtype_name="fp16")
            _check_lse(lse, q, k, causal=causal)


def test_ws_padded_head_dims_compile_for_sm90(ws_padded_head_dims):
    """With PADDED_HEAD_DIMS, a head dim between the powers of two takes the warp-specialized kernel
    in tiles of its padded width (64, 128 or 256 columns), or of half that and a narrow tail where
    that is narrower (hopper_ws.tile_widths: 16, 32 or 64 more columns, as their own TMA tiles and
    wgmma), with no L2 prefetch of lines past the row; D 32 keeps the tl kernel; the Hopper backward
    takes the same head dims (above 128 columns with the head dim split between its consumers) and,
    without the padding, 64, 128 and 256 only."""
    for D, widths in ((40, (64, 0)), (96, (64, 32)), (120, (128, 0)), (136, (128, 16)), (168, (128, 64)),
                      (200, (256, 0)), (256, (256, 0))):
        assert hopper_ws.supported(torch.bfloat16, D, 90)
        assert hopper_ws.tile_widths(D) == widths
        kernels = c_kernels.compile(Problem(2, 8, 1000, D, "bf16", True), 90)
        assert [k.name for k in kernels] == ["ws_attention_kernel"], (D, kernels)
        ptx = kernels[0].asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        assert D == sum(widths) or "prefetch.global.L2" not in ptx
        # the tail's products: wgmma with its width as N (P·V_tail) and as K (Q_tail·K_tailᵀ, in steps of 16)
        tail = widths[1]
        assert (f"wgmma.mma_async.sync.aligned.m64n{tail}k16" in ptx) == (tail > 0), D
        choice = c_kernels.select(2, 8, 8, 1000, 1000, D, torch.bfloat16, True, 90, 132)
        assert choice.path == "ws" and choice.config in configs.ws_shapes(D)
    assert not hopper_ws.supported(torch.bfloat16, 32, 90)
    for D in (120, 136, 256):
        assert hopper_ws.supported(torch.bfloat16, D, 90, "backward")
    assert not hopper_ws.supported(torch.bfloat16, 32, 90, "backward")
    assert not hopper_ws.supported(torch.bfloat16, 264, 90, "backward")
    assert not hopper_ws.supported(torch.float32, 96, 90) and not hopper_ws.supported(torch.bfloat16, 96, 80)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [40, 56, 72, 80, 96, 120, 136, 152, 168, 192, 200, 256])
def test_gpu_ws_padded_head_dims(D, ws_padded_head_dims):
    """The warp-specialized kernel at a padded head dim: GQA, ragged N, causal both, fp16 and bf16,
    strided inputs, against float64 (the GPU check that PADDED_HEAD_DIMS waits for)."""
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    for dtype_name, layout, N in (("fp16", "bhnd", 1000), ("bf16", "bnhd", 333), ("bf16", "bhnd", 4096)):
        for causal in (False, True):
            q, k, v = make_qkv(2, 8, N, D, DTYPES[dtype_name], "cuda", Hkv=2, layout=layout)
            choice = c_kernels.select(2, 8, 2, N, N, D, q.dtype, causal, 90, 132)
            # a problem this small may take the tl kernel's 64-row tiles (configs.shape_aware_config):
            # each of the head dim's warp-specialized configs is checked by forcing it
            assert choice.path == "ws" or choice.config.block_m == 64, choice
            for config in configs.ws_shapes(D):
                o = attention(q, k, v, causal=causal, config=config)
                check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype_name)


def test_training_forward_takes_the_warp_specialized_kernel_on_hopper():
    """The training forward (log-sum-exp stored) runs the warp-specialized kernel where the forward
    does, compiled with the store of each row's lse (a masked fp32 store of 64 rows per consumer)
    and without it when no lse is asked for."""
    for D in (64, 96, 256):
        choice = c_kernels.select(2, 8, 2, 1000, 1000, D, torch.bfloat16, True, 90, 132, store_lse=True)
        assert choice.path == "ws", (D, choice)
        training = c_kernels.compile(Problem(2, 8, 1000, D, "bf16", True, Hkv=2), 90, store_lse=True)
        inference = c_kernels.compile(Problem(2, 8, 1000, D, "bf16", True, Hkv=2), 90)
        assert [k.name for k in training] == [k.name for k in inference] == ["ws_attention_kernel"]
        assert "st.global.b32" in training[0].asm["ptx"] or "st.global.v" in training[0].asm["ptx"]
        assert "st.global" not in inference[0].asm["ptx"]  # O leaves by TMA; nothing else is written


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 96, 128, 152, 192, 256])
def test_gpu_ws_training_forward_lse(D):
    """The warp-specialized kernel's row log-sum-exps (every config of the head dim, forced): GQA,
    ragged N, causal both, and logits large enough that the lazy rescale keeps a maximum below the
    row's true one, against float64; lse poisoned with NaN first, so an unwritten row fails."""
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    for N, scale in ((1000, 1.0), (333, 12.0)):
        for causal in (False, True):
            q, k, v = make_qkv(2, 8, N, D, torch.bfloat16, "cuda", Hkv=2, scale=scale)
            for config in configs.ws_shapes(D):
                o = contract.new_output(q)
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                launches = c_kernels.plan(q, k, v, o, causal=causal, scale=D ** -0.5, arch=90, lse=lse, config=config)
                assert [launch.kernel for launch in launches] == [hopper_ws.ws_attention_kernel]
                for launch in launches:
                    launch.run()
                check_against_reference(o, q, k, v, causal=causal, dtype_name="bf16")
                _check_lse(lse, q, k, causal=causal)


@pytest.mark.gpu
def test_gpu_ws_two_programs_per_sm():
    """The one-consumer kernel two to an SM (``-P2``: a persistent grid of 2 × SMs, the register pool
    halved): GQA, ragged N, causal both, many one-tile heads and long ones, with the row
    log-sum-exps, against float64; outputs poisoned first, so an item no program took fails."""
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    for name, D in (("WS-M64-N128-s3-P2", 64), ("WS-M64-N64-s3-P2", 64), ("WS-M64-N64-s2-P2", 128)):
        config = configs.Config.parse(name)
        for B, H, Hkv, N in ((64, 8, 8, 128), (2, 8, 2, 1000), (1, 4, 1, 4099)):
            for causal in (False, True):
                q, k, v = make_qkv(B, H, N, D, torch.bfloat16, "cuda", Hkv=Hkv, scale=4.0)
                o = contract.new_output(q)
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                launches = c_kernels.plan(q, k, v, o, causal=causal, scale=D ** -0.5, arch=90, lse=lse,
                                          config=config)
                units = hopper_ws.work_units(B * H * -(-N // 64), causal, persistent=True)
                assert [launch.grid for launch in launches] == [(min(units, 2 * configs.num_sms(q.device)),)]
                for launch in launches:
                    launch.run()
                check_against_reference(o, q, k, v, causal=causal, dtype_name="bf16")
                _check_lse(lse, q, k, causal=causal)


@pytest.fixture
def use_fresh_pv(monkeypatch):
    """``use(on)``: ``hopper_ws.FRESH_PV`` on or off, with the launches planned under the other setting
    forgotten; afterwards the module's own setting again, and its plans."""
    def forget():
        c_kernels._recipe.cache_clear()
        c_kernels._LAYOUT_PLANS.clear()

    def use(on: bool) -> None:
        monkeypatch.setattr(hopper_ws, "FRESH_PV", on)
        forget()

    yield use
    monkeypatch.undo()
    forget()


@pytest.mark.gpu
def test_gpu_ws_fresh_pv_is_the_ordinary_kernel_bit_for_bit(use_fresh_pv):
    """An item's first ``P·V`` starting the accumulator afresh (``FRESH_PV``) instead of the softmax
    scaling the previous item's O by 0 leaves every output and log-sum-exp bit for bit as it was (0 + x
    is x): one-tile items (the suite's ``short``), many tiles, causal, a ragged N, GQA, a head-dim tail,
    every persistent config of the head dim and the default choice; outputs poisoned first."""
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    cases = [(128, 16, 16, 128, 64, False), (64, 8, 2, 128, 128, True), (2, 8, 2, 1000, 64, True),
             (1, 8, 8, 4099, 128, False), (4, 8, 2, 333, 80, True), (2, 4, 4, 700, 136, False)]
    for B, H, Hkv, N, D, causal in cases:
        q, k, v = make_qkv(B, H, N, D, torch.bfloat16, "cuda", Hkv=Hkv, scale=4.0)
        for config in [None] + [c for c in configs.ws_shapes(D) if c.persistent]:
            outputs = {}
            for on in (False, True):
                use_fresh_pv(on)
                o = torch.full_like(q, float("nan"))
                lse = torch.full(q.shape[:3], float("nan"), device="cuda")
                launches = c_kernels.plan(q, k, v, o, causal=causal, scale=D ** -0.5, arch=90, lse=lse,
                                          **({"config": config} if config else {}))
                for launch in launches:
                    launch.run()
                outputs[on] = (o, lse)
            assert torch.equal(outputs[True][0], outputs[False][0]), (B, H, N, D, causal, config)
            assert torch.equal(outputs[True][1], outputs[False][1]), (B, H, N, D, causal, config)
        check_against_reference(outputs[True][0], q, k, v, causal=causal, dtype_name="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("fresh_pv", [
    None,
    pytest.param(False, marks=pytest.mark.xfail(
        strict=False, reason="without FRESH_PV a persistent program starts each item by scaling the last item's O "
                             "by alpha = 0, and NaN · 0 is NaN (seen on an H100: why the switch is on)")),
    True])
def test_gpu_ws_nan_in_one_head_stays_in_that_head(use_fresh_pv, fresh_pv):
    """A key with an infinite component makes its head's rows NaN, as textbook attention does (inf / inf).
    A persistent program goes on to other heads' items after that head's: their outputs must be finite
    and right. 512 heads of one 128-row item each: each program takes about four in turn. ``fresh_pv``:
    the kernel as it ships (None), and with ``hopper_ws.FRESH_PV`` off and on."""
    if configs.device_arch(torch.device("cuda")) != 90:
        pytest.skip("the warp-specialized kernel is for sm_90")
    q, k, v = make_qkv(1, 512, 128, 64, torch.float16, "cuda")
    q[..., 0] = q[..., 0].abs() + 0.1
    k[0, 0, 7, 0] = float("inf")
    if fresh_pv is not None:
        use_fresh_pv(fresh_pv)
    assert c_kernels.select(1, 512, 512, 128, 128, 64, q.dtype, False, 90, configs.num_sms(q.device)).path == "ws"
    o = attention(q, k, v)
    assert torch.isnan(o[0, 0]).any()
    assert torch.isfinite(o[:, 1:]).all(), torch.isnan(o[0]).flatten(1).any(1).nonzero().flatten().tolist()
    check_against_reference(o[:, 1:], q[:, 1:], k[:, 1:], v[:, 1:], causal=False, dtype_name="fp16")


def test_grouped_decode_on_a_full_gpu_reads_each_kv_head_once(monkeypatch, device):
    """Many sequences of grouped-query decoding fill the GPU without splitting, but still take the
    split kernel, unsplit (one program holds a KV head's whole query group), never the one-pass
    kernel that would read the cache once per query head."""
    split = decode.choose_splits(B=64, Hkv=8, group=4, Nq=1, Nk=4096, D=128, sms=132)
    assert split is not None and split.splits == 1
    assert decode.choose_splits(B=64, Hkv=32, group=1, Nq=1, Nk=4096, D=128, sms=132) is None
    if device == "cpu":  # make this small problem "fill" the interpreter's pretend GPU
        monkeypatch.setattr(c_kernels, "_arch_and_sms", lambda q: (80, 1))
    q, k, v = make_qkv(2, 4, 1, 64, torch.float16, device, Hkv=2, Nk=300)
    o = attention(q, k, v)
    check_against_reference(o, q, k, v, causal=False, dtype_name="fp16")


def _plan_decoding(monkeypatch, plan: str):
    """Decoding calls planned as ``plan`` says (``decode.DECODE_PLAN``), every plan made under another
    forgotten, before and after."""
    def clear():
        c_kernels._select.cache_clear()
        c_kernels._recipe.cache_clear()
        c_kernels._LAYOUT_PLANS.clear()
        decode._wanted_splits.cache_clear()

    monkeypatch.setattr(decode, "DECODE_PLAN", plan)
    clear()
    yield plan
    monkeypatch.undo()
    clear()


@pytest.fixture
def deep_plan(monkeypatch):
    yield from _plan_decoding(monkeypatch, "deep")


@pytest.fixture
def waves_plan(monkeypatch):
    yield from _plan_decoding(monkeypatch, "waves")


@pytest.fixture(params=decode.DECODE_PLANS)
def each_plan(request, monkeypatch):
    yield from _plan_decoding(monkeypatch, request.param)


def test_deep_decode_plan_fills_one_program_per_sm(deep_plan):
    """The deep plan: three-stage tiles, as wide as the shared memory holds for the dtype and GPU (an
    sm_80 block has less than an sm_90 one; fp32 needs twice the bytes and more registers per key, so
    no wider than the waves plan's), and a split count aiming at one program per SM: a grid that
    already has one runs unsplit, with no merge."""
    for D, element_bytes, arch, tile in ((128, 2, 90, (128, 3)), (128, 2, 80, (64, 3)), (128, 4, 90, (32, 3)),
                                         (256, 2, 90, (64, 3)), (64, 2, 80, (128, 3)),
                                         (64, 4, 90, (64, 3)),  # fp32: no wider than split_tiles' (spills)
                                         (256, 4, 80, (32, 2))):  # (no ring of three fits: the waves plan's tiles)
        tiles = decode.decode_tiles(4, 1, D, element_bytes, configs.SHARED_MEMORY_LIMIT[arch])
        assert (tiles.block_n, tiles.num_stages) == tile, (D, element_bytes, arch)
        assert tiles.num_warps == (8 if element_bytes == 4 else 4)  # fp32's FMA products: 8 warps share them
    sms = 132
    assert decode.decode_splits(16, 8, 4, 1, 8192, 128, sms, 128) == 1       # 128 programs unsplit: a wave
    assert decode.decode_splits(8, 8, 4, 1, 16384, 128, sms, 128) == 2       # 64: two chunks each
    assert decode.decode_splits(1, 8, 4, 1, 32768, 128, sms, 128) == 16
    assert decode.decode_splits(1, 8, 4, 1, 1024, 128, sms, 128) == 2        # a short cache: whole tiles first
    # The path does not change with the plan: multi-head decoding on a full GPU stays one-pass.
    assert decode.decoding_splits_keys(256, 32, 1, 1, 128, sms) is False
    choice = c_kernels.select(1, 32, 8, 1, None, 128, torch.bfloat16, False, 90, sms)
    assert choice.path == "split" and (choice.config.block_n, choice.config.num_stages) == (128, 3)


def test_split_kv_fp32_wide_head_dim(device):
    """fp32's own split tiles (8 warps, 16 rows of 32 keys from D 128 on): a prefill forced to split
    and a grouped decode step at D 136 (padded to 256 columns), causal both, against float64."""
    for B, Hq, Hkv, Nq, Nk, causal in ((1, 2, 1, 40, 300, True), (2, 4, 2, 1, 200, False)):
        q, k, v = make_qkv(B, Hq, Nq, 136, torch.float32, device, Hkv=Hkv, Nk=Nk)
        o, lse = c_kernels.attention_with_lse(q, k, v, causal=causal, split_kv=3)
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp32")
        _check_lse(lse, q, k, causal=causal)


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_each_decode_plan_matches_float64(each_plan, dtype, device):
    """Decoding under each plan (the default and the one a user may switch to), one chunk and many,
    GQA and MHA, causal both, against float64."""
    for B, Hq, Hkv, Nq, Nk, causal in ((2, 8, 2, 1, 700, False), (1, 4, 4, 2, 900, True), (3, 2, 1, 1, 130, True)):
        q, k, v = make_qkv(B, Hq, Nq, 40, DTYPES[dtype], device, Hkv=Hkv, Nk=Nk)
        o, lse = c_kernels.attention_with_lse(q, k, v, causal=causal)
        check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)
        _check_lse(lse, q, k, causal=causal)
