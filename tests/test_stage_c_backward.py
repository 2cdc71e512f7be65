"""Stage C's backward kernels (stages/c_optimized/backward.py) against float64 autograd.

The forward here is float64 torch (o and the base-2 lse the forward kernel would save), so these
tests check the backward alone; the stage's own autograd (forward kernel + this backward) is tested
with the other stages. Interpreter-sized problems: a few dozen rows, one or two heads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from stages.c_optimized import backward as bwd, configs
from stages.contract import Problem, validate_backward_inputs

from harness.reference import reference_gradients

from .helpers import ABS_FLOOR, DTYPES, check_gradients, make_qkv


def saved_forward(q, k, v, causal, scale):
    """(o, lse) as the forward kernel saves them: o in q's dtype, lse fp32 [B, Hq, Nq] in base 2 of
    the scaled scores, +inf for a row that sees no key. Computed in float64."""
    group = q.shape[1] // k.shape[1]
    q64 = q.double()
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    s = (q64 @ k64.transpose(-2, -1)) * scale
    Nq, Nk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    lse_e = torch.logsumexp(s, dim=-1)                   # -inf for a row with no visible key
    p = torch.exp(s - lse_e[..., None]).nan_to_num(0.0)  # such a row: all zeros
    o = (p @ v64).to(q.dtype)
    lse = torch.where(torch.isinf(lse_e), torch.inf, lse_e / math.log(2.0)).float().contiguous()
    return o, lse


class _Float64ForwardOurBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, switches):
        o, lse = saved_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.switches = causal, scale, switches
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = bwd.attention_backward(do, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale,
                                            **ctx.switches)
        return dq, dk, dv, None, None, None


def attention(q, k, v, *, causal=False, sm_scale=None, **switches):
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    return _Float64ForwardOurBackward.apply(q, k, v, causal, scale, switches)


# (B, Hq, Hkv, Nq, Nk, D): one row, ragged, Nq < Nk, Nq > Nk (causal: rows that see no key), GQA, MQA.
SHAPES = [
    (1, 2, 2, 1, 3, 16),      # one query row
    (2, 2, 1, 37, 37, 64),    # GQA, ragged N
    (1, 3, 1, 20, 45, 80),    # MQA, Nq < Nk, D padded 80 -> 128
    (1, 4, 2, 45, 20, 8),     # GQA, Nq > Nk: causal rows 0..24 see no key; D = 8 padded to 16
    (1, 2, 1, 150, 290, 16),  # several tiles each way: causal skipping's first / diagonal / mask-free split
    (1, 2, 2, 290, 150, 16),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_gradients_match_float64(shape, causal, device):
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v = make_qkv(B, Hq, Nq, D, torch.float16, device, Hkv=Hkv, Nk=Nk, seed=0)
    check_gradients(attention, q, k, v, causal=causal, dtype_name="fp16")


def test_one_row_one_key(device):
    """N = Nk = 1: P = 1, so dq is mathematically 0; the kernel's Δ (from the stored O) and dP (a
    dot with V) round differently, so allow rounding noise there (check_gradients demands an exact
    zero wherever the float64 reference is all zeros)."""
    q, k, v = make_qkv(2, 2, 1, 16, torch.float16, device, seed=8)
    o, lse = saved_forward(q, k, v, False, 0.25)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)).to(q.dtype).to(q.device)
    ref = reference_gradients(q, k, v, do, sm_scale=0.25)
    for deterministic in (False, True):
        grads = bwd.attention_backward(do, q, k, v, o, lse, causal=False, scale=0.25, deterministic=deterministic)
        for g, r in zip(grads, ref):
            assert (g.double() - r).abs().max() <= ABS_FLOOR["fp16"]
        assert torch.equal(grads[2], do)  # dV = P^T dO with P = 1


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_other_dtypes(dtype, device):
    q, k, v = make_qkv(1, 2, 33, 32, DTYPES[dtype], device, Hkv=1, Nk=50, seed=1)
    check_gradients(attention, q, k, v, causal=True, dtype_name=dtype)


def test_strided_inputs_and_custom_scale(device):
    q, k, v = make_qkv(1, 4, 30, 64, torch.float16, device, Hkv=2, layout="bnhd", seed=2)
    assert not q.is_contiguous()
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.3)


@pytest.mark.parametrize("switch", ["tuned_tiles", "pipelining", "exp2", "causal_skip", "tma", "all",
                                    "all+deterministic"])
def test_every_switch_off_is_still_correct(switch, device):
    switches = ({s: False for s in ("tuned_tiles", "pipelining", "exp2", "causal_skip", "tma")}
                if switch.startswith("all") else {switch: False})
    if switch.endswith("deterministic"):
        switches["deterministic"] = True
    q, k, v = make_qkv(1, 2, 70, 24, torch.float16, device, Hkv=1, Nk=90, seed=3)
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", **switches)


@pytest.mark.parametrize("dtype,Nq,Nk", [("fp16", 290, 150), ("fp32", 45, 30)])
def test_deterministic_dq_is_correct_and_bitwise_reproducible(dtype, Nq, Nk, device):
    q, k, v = make_qkv(1, 4, Nq, 40, DTYPES[dtype], device, Hkv=2, Nk=Nk, seed=4)
    check_gradients(attention, q, k, v, causal=True, dtype_name=dtype, deterministic=True)
    if dtype == "fp16":  # several tiles the other way round (Nq < Nk); fp32 is slow in the interpreter
        q, k, v = make_qkv(1, 2, 150, 40, DTYPES[dtype], device, Hkv=1, Nk=290, seed=4)
        check_gradients(attention, q, k, v, causal=True, dtype_name=dtype, deterministic=True)
    scale = 40 ** -0.5
    o, lse = saved_forward(q, k, v, True, scale)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5)).to(q.dtype).to(device)
    first = bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale, deterministic=True)
    second = bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale, deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(_bits(a), _bits(b))


def _bits(t):
    """The raw bits of a tensor (torch.equal on floats would call -0.0 == 0.0 and NaN != NaN)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def test_rows_that_see_no_key_get_zero_gradients(device):
    """Causal with Nq > Nk: the first Nq − Nk rows see nothing (lse = +inf); their dq must be exactly
    0, and they must not leak NaN into dk, dv."""
    q, k, v = make_qkv(1, 2, 40, 16, torch.float16, device, Nk=10, seed=6)
    o, lse = saved_forward(q, k, v, True, 0.25)
    assert torch.isinf(lse[:, :, :30]).all()
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(q.dtype).to(q.device)
    for deterministic in (False, True):
        dq, dk, dv = bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=0.25,
                                            deterministic=deterministic)
        assert (dq[:, :, :30] == 0).all()
        assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


def test_bad_arguments_name_themselves(device):
    q, k, v = make_qkv(1, 2, 8, 16, torch.float16, device)
    o, lse = saved_forward(q, k, v, False, 0.25)
    with pytest.raises(ValueError, match="lse"):
        bwd.attention_backward(o, q, k, v, o, lse.double(), causal=False, scale=0.25)
    with pytest.raises(ValueError, match="do"):
        bwd.attention_backward(o[:, :1], q, k, v, o, lse, causal=False, scale=0.25)
    with pytest.raises(ValueError, match="sm_scale"):
        bwd.attention_backward(o, q, k, v, o, lse, causal=False, scale=float("nan"))


def test_a_layout_is_checked_at_its_first_call_and_a_changed_one_again(device, monkeypatch):
    """The backward keeps each layout it has seen, keyed on every fact its checks read, so a model's later
    calls skip the checks; a call that differs in any of them (lse's dtype or layout, do's shape or dtype,
    a device) misses the table and is checked, and refused with the argument's name."""
    checked = []
    monkeypatch.setattr(bwd, "validate_backward_inputs",
                        lambda *a, **kw: (checked.append(1), validate_backward_inputs(*a, **kw))[1])
    monkeypatch.setattr(bwd, "_KEPT", {})
    q, k, v = make_qkv(1, 2, 8, 16, torch.float16, device)
    o, lse = saved_forward(q, k, v, False, 0.25)
    first = [bwd.attention_backward(o, q, k, v, o, lse, causal=False, scale=0.25) for _ in range(3)]
    assert len(checked) == 1 and len(bwd._KEPT) == 1
    for a, b in zip(first[0], first[2]):
        assert torch.equal(a, b)
    for bad, name in ((dict(lse=lse.double()), "lse"), (dict(lse=lse.transpose(1, 2).contiguous().transpose(1, 2)), "lse"),
                      (dict(do=o[:, :1]), "do"), (dict(do=o.float()), "do"), (dict(o=o.float()), "o")):
        args = dict(do=o, q=q, k=k, v=v, o=o, lse=lse) | bad
        with pytest.raises((ValueError, TypeError), match=name):
            bwd.attention_backward(args["do"], args["q"], args["k"], args["v"], args["o"], args["lse"], causal=False,
                                   scale=0.25)
    with pytest.raises(TypeError, match="do"):
        bwd.attention_backward(None, q, k, v, o, lse, causal=False, scale=0.25)
    assert len(bwd._KEPT) == 1


def test_models():
    """The traffic and workspace models follow from their definitions: causal skipping reads less,
    the deterministic dQ needs no fp32 accumulator, fp32 accumulates in place."""
    p = Problem(2, 8, 1024, 64, "fp16", True, Hkv=2)
    full = bwd.bwd_hbm_bytes(p, causal_skip=False)
    skip = bwd.bwd_hbm_bytes(p)
    # Skipping reads fewer Q/dO rows; it writes fewer bytes only where dQ is atomic (fewer adds).
    assert skip.read < full.read and skip.write <= full.write
    atomic = bwd.backward_plan(p.D, torch.float16, bwd.device_arch(None), p.causal).atomic_dq
    assert (skip.write < full.write) == atomic
    rows = p.heads * p.N
    assert bwd.train_workspace_bytes(p) == 2 * rows * 4 + (rows * p.D * 4 if atomic else 0)
    assert bwd.train_workspace_bytes(p, deterministic=True) == 2 * rows * 4
    assert bwd.train_workspace_bytes(Problem(2, 8, 1024, 64, "fp32")) == 2 * rows * 4


def test_configs_fit_shared_memory():
    for arch in (80, 90):
        for D in (8, 64, 128, 200, 256):
            for dtype in DTYPES.values():
                config = bwd.backward_config(D, dtype, arch)
                e = torch.empty((), dtype=dtype).element_size()
                assert bwd.fits(config, bwd.padded_head_dim(D), e, arch), (arch, D, dtype, config)


def test_compiles_for_sm90():
    kernels = bwd.compile_backward(Problem(1, 4, 200, 80, "fp16", True, Hkv=2, Nk=300), 90)
    assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "attention_bwd_dkdv_kernel"]
    ptx = kernels[1].asm["ptx"]
    assert "red.global" in ptx or "atom.global" in ptx  # the atomic dQ


def _tuned_plans():
    """Every plan a backward tuning file on main selects: (file, key, entry)."""
    import json

    out = []
    for path in sorted(configs.TUNED_DIR.glob("*-backward.json")):
        for key, entry in json.loads(path.read_text())["best"].items():
            out.append((path.name, key, entry))
    return out


@pytest.mark.parametrize("name,key,entry", _tuned_plans(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_tuned_backward_plan_is_correct(name, key, entry, device):
    """The tiles a GPU's tuning picked, forced here, on a problem with several tiles each way, a ragged
    last tile, GQA and a head dim below the padded one (so the column mask runs too)."""
    dtype_name, d, c = key.split("/")
    # A head dim below the padded one (the column mask), except where the entry has Hopper kernels
    D, causal = int(d[1:]) - (0 if "ws" in entry or "ws_dq" in entry else 8), c == "causal1"
    config = bwd.BwdConfig.parse(entry["dkdv"])
    dq_config = bwd.BwdConfig.parse(entry["dq"]) if "dq" in entry else None
    q, k, v = make_qkv(1, 2, 150, D, DTYPES[dtype_name], device, Hkv=1, Nk=130, seed=7)
    hopper = {name: entry[key] for name, key in (("ws_config", "ws"), ("ws_dq_config", "ws_dq")) if key in entry}
    on_hopper = device == "cuda" and torch.cuda.get_device_capability()[0] == 9
    if hopper and not (on_hopper and (D in (64, 128, 256) or bwd.tuned_width(D) != bwd.padded_head_dim(D))):
        hopper = {}  # (the Hopper kernels run on sm_90: elsewhere the entry's tl kernels are tested)
    fused = hopper.get("ws_dq_config") == bwd.FUSED_DQ  # (atomics: never deterministic)
    check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, config=config, dq_config=dq_config,
                    deterministic=entry["dq_method"] == "separate" and not fused, **hopper)
    if hopper and "deterministic" in entry:  # the plan kept for a deterministic backward, too
        fixed = {name: entry["deterministic"][key] for name, key in (("ws_config", "ws"), ("ws_dq_config", "ws_dq"))
                 if key in entry["deterministic"]}
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, config=config,
                        dq_config=dq_config, deterministic=True, **fixed)


def test_backward_plan_reads_the_tuned_table(monkeypatch):
    """On a GPU with a tuning file, the default plan is the tuned one (its dQ method included) and fp16
    takes bf16's entry; another architecture, fp32 and the switches off fall back."""
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "h200")
    bwd.backward_plan.cache_clear()
    try:
        table = bwd.tuned_backward_table("h200")
        key = next(k for k in table if k.startswith("bf16/D128/causal0"))
        entry = table[key]
        for dtype in (torch.bfloat16, torch.float16):
            plan = bwd.backward_plan(128, dtype, table["arch"], False)
            assert str(plan.dkdv) == entry["dkdv"] and plan.separate_dq == (entry["dq_method"] == "separate")
        assert bwd.backward_plan(128, torch.bfloat16, 80, False) == bwd.BwdPlan(
            bwd._hand_config(128, torch.bfloat16, 80, 2), False, bwd._hand_config(128, torch.bfloat16, 80, 2))
        assert bwd.backward_plan(128, torch.float32, table["arch"], False).separate_dq is False
        assert bwd.backward_plan(128, torch.bfloat16, table["arch"], False, tuned_tiles=False).dkdv == bwd.BASELINE
        assert bwd.backward_plan(128, torch.bfloat16, table["arch"], False, deterministic=True).separate_dq
        assert bwd.backward_plan(128, torch.bfloat16, table["arch"], False, pipelining=False).dkdv.num_stages == 1
    finally:
        bwd.backward_plan.cache_clear()


def test_a_tuned_fused_dq_plan_is_atomic_and_not_deterministic(monkeypatch):
    """An entry whose ``ws_dq`` is "fused": dQ by the Hopper dK/dV kernel's atomics (no separate dQ
    kernel, the fp32 accumulator); ``deterministic`` takes the separate tl dQ kernel instead; the
    traffic model counts the accumulator's read-modify-writes."""
    table = {"arch": 90, "bf16/D64/causal0": {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3",
                                             "dq_method": "separate", "ws": "ws-M64-c2-s3", "ws_dq": "fused"}}
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: table)
    monkeypatch.setattr(bwd, "device_arch", lambda device: 90)
    bwd.backward_plan.cache_clear()
    try:
        plan = bwd.backward_plan(64, torch.bfloat16, 90, False)
        assert (plan.ws, plan.ws_dq) == (bwd.WsConfig(64, 2, 3), bwd.FUSED_DQ)
        assert str(plan) == "dkdv:ws-M64-c2-s3+fused-dq"
        exact = bwd.backward_plan(64, torch.bfloat16, 90, False, deterministic=True)
        assert (exact.ws, exact.ws_dq, exact.separate_dq) == (bwd.WsConfig(64, 2, 3), None, True)
        p = Problem(2, 4, 1000, 64, "bf16", False)
        fused, separate = bwd.bwd_hbm_bytes(p), bwd.bwd_hbm_bytes(p, deterministic=True)
        assert fused.write > separate.write + 2 * p.heads * p.N * p.D * 4  # zeroing + the RMWs' writes, at least
        assert bwd.train_workspace_bytes(p) == bwd.train_workspace_bytes(p, deterministic=True) + p.heads * p.N * p.D * 4
    finally:
        bwd.backward_plan.cache_clear()


@pytest.mark.parametrize("fixed, expect", [
    ({"ws": "ws-M64-c2-s2", "ws_dq": "ws-M32-c2-s3"}, (bwd.WsConfig(64, 2, 2), bwd.WsConfig(32, 2, 3))),
    ({"ws": "ws-M64-c2-s3"}, (bwd.WsConfig(64, 2, 3), None)),  # the tl dQ kernel beside the Hopper dK/dV
    ({}, (None, None)),  # the tl kernels alone
])
def test_a_deterministic_backward_takes_the_plan_the_tuner_kept_for_it(fixed, expect, monkeypatch):
    """Where fused dQ won, the entry also names the fastest plan without atomics ("deterministic"):
    that is what ``deterministic=True`` runs (not the fused kernel's tiles with the tl dQ kernel), and
    only where the Hopper kernels may run; the default plan ignores it."""
    entry = {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3", "dq_method": "separate", "ws": "ws-M64-c2-s3",
             "ws_dq": "fused", "deterministic": fixed}
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: {"arch": 90, "bf16/D128/causal1": entry})
    bwd.backward_plan.cache_clear()
    try:
        exact = bwd.backward_plan(128, torch.bfloat16, 90, True, deterministic=True)
        assert (exact.ws, exact.ws_dq, exact.separate_dq) == (*expect, True)
        assert str(exact.dq) == "M64-N128-w8-s3" and not exact.atomic_dq
        assert bwd.backward_plan(128, torch.bfloat16, 90, True).ws_dq == bwd.FUSED_DQ
        off = bwd.backward_plan(128, torch.bfloat16, 90, True, deterministic=True, warp_specialization=False)
        assert (off.ws, off.ws_dq, off.separate_dq) == (None, None, True)
    finally:
        bwd.backward_plan.cache_clear()


@pytest.mark.parametrize("n_tiles,heads", [(1, 1), (7, 3), (64, 8), (5, 40)])
def test_program_order_visits_every_tile_once_heaviest_chunk_first(n_tiles, heads):
    """The launch order both Hopper backward kernels decode (``hopper_bwd.program_order``): every (tile,
    batch·head) exactly once for any chunk and group; a whole batch·head's tiles at a time when the chunk
    is all of them (the order of a two-dimensional grid); chunk by chunk across the batch·heads otherwise,
    every one of them or a group's, one group after another (the last one smaller where they do not
    divide)."""
    from stages.c_optimized import hopper_bwd

    every = {(t, h) for t in range(n_tiles) for h in range(heads)}
    for group in (0, 1, 2, 3, heads, heads + 5):
        size = heads if group == 0 else min(group, heads)
        for chunk in range(1, n_tiles + 1):
            order = hopper_bwd.program_order(n_tiles, heads, chunk, group)
            assert len(order) == len(every) and set(order) == every
            groups = [h // size for _, h in order]
            assert groups == sorted(groups)  # group after group
            for g in set(groups):
                tiles = [t // chunk for t, h in order if h // size == g]
                assert tiles == sorted(tiles)  # within a group, chunk after chunk
        assert hopper_bwd.program_order(n_tiles, heads, n_tiles, group) == [
            (t, h) for h in range(heads) for t in range(n_tiles)]
    assert hopper_bwd.program_order(n_tiles, heads, 1) == [(t, h) for t in range(n_tiles) for h in range(heads)]
    assert hopper_bwd.program_order(n_tiles, heads, 1, 0) == hopper_bwd.program_order(n_tiles, heads, 1, heads)


def test_heavy_first_is_for_causal_grids_and_balances_the_model(monkeypatch):
    """``tiles_per_chunk``: one batch·head after another where the switch is off or the mask is not
    causal; and in the list-scheduling model the Llama 3 8B cell's causal dK/dV programs (64 K/V tiles of 8
    heads, each meeting 4 query heads' Q tiles from its own on) end much nearer the balanced time chunk by
    chunk."""
    from stages.c_optimized import hopper_bwd

    work = hopper_bwd.causal_dkdv_work(8192, 8192, group=4)
    assert hopper_bwd.order_chunk(work, 8, sms=132, heavy_first=0) == 64
    assert hopper_bwd.order_chunk(work, 8, sms=132, heavy_first=4) == 4
    assert hopper_bwd.order_chunk(work[:3], 8, sms=132, heavy_first=4) == 3
    assert work[:2] == [4 * 128, 4 * 126] and work[-1] == 4 * 2 and len(work) == 64
    assert hopper_bwd.causal_dkdv_work(100, 300) == [2, 2, 2]  # Nk > Nq: every query sees the first 200 keys
    assert hopper_bwd.causal_dkdv_work(300, 100) == [2]  # Nq > Nk: only rows 200 on see a key (Q tiles from 192)
    balanced = 8 * sum(work) / 132
    head_by_head, chunked = (hopper_bwd.makespan([work[t] for t, _ in hopper_bwd.program_order(64, 8, c)], 132)
                             for c in (64, 2))
    assert head_by_head > 1.2 * balanced and chunked < 1.03 * balanced
    monkeypatch.setattr(hopper_bwd, "HEAVY_FIRST", 2)
    for causal, chunk in ((True, 2), (False, 8)):  # (8 tiles of 128 keys: head by head)
        (launch,) = [launch for launch in bwd.plan_backward(
            *(torch.empty(s, dtype=torch.bfloat16, device="meta") for s in [(1, 8, 1000, 64)] * 5),
            torch.empty((1, 8, 1000), dtype=torch.float32, device="meta"),
            torch.empty((1, 8, 1000), dtype=torch.float32, device="meta"),
            *(torch.empty((1, 8, 1000, 64), dtype=torch.bfloat16, device="meta") for _ in range(3)), None,
            causal=causal, scale=0.125, arch=90, deterministic=True, ws=bwd.WsConfig(64, 2, 2))
            if launch.kernel is hopper_bwd.ws_bwd_dkdv_kernel]
        assert launch.args["tiles_per_chunk"] == chunk and launch.grid == (8 * 8,)
        assert launch.args["heads_per_group"] == 8  # (every batch·head: LAB_BWD_HEAD_GROUP=0)
    monkeypatch.setattr(hopper_bwd, "HEAD_GROUP", 3)
    assert hopper_bwd.causal_order(work, 8, 132, heavy_first=2) == dict(tiles_per_chunk=2, heads_per_group=3)
    assert hopper_bwd.causal_order(work, 2, 132, heavy_first=2) == dict(tiles_per_chunk=2, heads_per_group=2)


def test_auto_order_takes_the_fewest_heads_side_by_side_that_the_model_balances():
    """``hopper_bwd.auto_order``: of head by head, chunks of one tile in groups of 2, 4, 8, ... batch·heads
    and chunks of 8 across all, the first within 2 % of the balanced time of the best modelled end. The
    grouped Llama 3 8B cell (8 K/V heads of 64 tiles) takes groups of 2; the FA grid's N 4096 cell groups of
    4; a 16k-token cell whose head-by-head order is already balanced stays head by head; a grid of one tile
    per head too. Every choice ends within 2 % of the best candidate, and the kernels' arguments follow it
    where both switches are ``auto``."""
    from stages.c_optimized import hopper_bwd

    for Nq, heads, group, expected in ((8192, 8, 4, (1, 2)), (4096, 64, 1, (1, 4)), (16384, 16, 1, (128, 16)),
                                       (100, 40, 1, (1, 40)), (1500, 60, 1, None)):
        work = hopper_bwd.causal_dkdv_work(Nq, Nq, group=group)
        chunk, size = hopper_bwd.auto_order(tuple(work), heads, 132)
        if expected is not None:
            assert (chunk, size) == expected, (Nq, heads)
        balanced = sum(work) * heads / 132
        ends = [hopper_bwd.makespan([work[t] for t, _ in hopper_bwd.program_order(len(work), heads, c, g)], 132)
                for c, g in [(len(work), heads), (8, heads)] + [(1, g) for g in (2, 4, 8, 16, 32) if g < heads]]
        mine = hopper_bwd.makespan([work[t] for t, _ in hopper_bwd.program_order(len(work), heads, chunk, size)], 132)
        assert mine <= min(ends) + hopper_bwd.AUTO_MIN_GAIN * balanced + 1e-9
        assert hopper_bwd.causal_order(work, heads, 132, "auto", "auto") == dict(tiles_per_chunk=chunk,
                                                                                heads_per_group=size)
    work = hopper_bwd.causal_dkdv_work(8192, 8192, group=4)
    assert hopper_bwd.causal_order(work, 8, 132, "auto", 0) == dict(tiles_per_chunk=8, heads_per_group=8)  # entry 76's


@pytest.mark.parametrize("value", ["-1", "eight", "1.5"])
def test_a_bad_head_group_switch_names_itself_and_its_values(value):
    """``LAB_BWD_HEAD_GROUP`` is read at import: anything but ``auto`` or a whole number ≥ 0 stops the
    import with the switch's name, the allowed values and what was given."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, LAB_BWD_HEAD_GROUP=value)
    done = subprocess.run([sys.executable, "-c", "import stages.c_optimized.hopper_bwd"], env=env,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0
    assert (f"LAB_BWD_HEAD_GROUP must be auto, 0 (every batch·head) or a group of batch·heads >= 1, got {value!r}"
            in done.stderr)


@pytest.mark.parametrize("value", ["-1", "eight", "1.5"])
def test_a_bad_heavy_first_switch_names_itself_and_its_values(value):
    """``LAB_BWD_HEAVY_FIRST`` is read at import: a value that is not ``auto`` or a whole number ≥ 0
    stops the import with the switch's name, the allowed values and what was given."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, LAB_BWD_HEAVY_FIRST=value)
    done = subprocess.run([sys.executable, "-c", "import stages.c_optimized.hopper_bwd"], env=env,
                          capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode != 0
    assert f"LAB_BWD_HEAVY_FIRST must be auto, 0 (head by head) or a chunk of tiles >= 1, got {value!r}" in done.stderr


def test_dq_work_counts_the_key_tiles_each_query_block_walks_last_rows_first():
    """The dQ kernel's causal work per query block, in its launch order (it starts the last rows, which
    see the most keys), bottom-right aligned: brute force over every row and key."""
    from stages.c_optimized import hopper_bwd

    for Nq, Nk, rows, block_n in [(1000, 1000, 128, 128), (300, 1000, 128, 64), (1000, 300, 64, 128), (1, 77, 128, 128)]:
        want = []
        for start in range(0, Nq, rows):
            seen = {j // block_n for i in range(start, min(start + rows, Nq)) for j in range(Nk) if j <= i + Nk - Nq}
            want.append(max(seen) + 1 if seen else 0)  # (the kernel walks every tile up to the last it needs)
        assert hopper_bwd.causal_dq_work(Nq, Nk, rows, block_n) == want[::-1]


def test_auto_order_chunks_only_where_the_model_promises_a_gain():
    """``auto`` (the default): chunks of ``AUTO_CHUNK`` where head by head ends ≥ ``AUTO_MIN_GAIN`` of the
    balanced time later in the model (the grouped Llama 3 8B cell, an odd-sized one), head by
    head where it does not (many heads of a long sequence, where chunks only cost L2 sharing)."""
    from stages.c_optimized import hopper_bwd

    def auto(N, heads, group=1):
        return hopper_bwd.order_chunk(hopper_bwd.causal_dkdv_work(N, N, 128, 64, group), heads, 132, "auto")

    assert auto(8192, 8, group=4) == hopper_bwd.AUTO_CHUNK  # Llama 3 8B: 24 % over the balanced time
    assert auto(1500, 60) == hopper_bwd.AUTO_CHUNK  # B 3, H 20, N 1500: 21 % over
    assert auto(16384, 16) == 128  # 1 % over: nothing to gain, 5 % of L2 sharing to lose (measured)
    assert auto(100, 1) == 1  # one tile: no order to choose
    for N, heads in [(1024, 512), (4096, 128), (1500, 60), (333, 7)]:  # the rule is the model's, not a table
        work = hopper_bwd.causal_dkdv_work(N, N, 128, 64)
        end = {c: hopper_bwd.makespan([work[t] for t, _ in hopper_bwd.program_order(len(work), heads, c)], 132)
               for c in (len(work), min(hopper_bwd.AUTO_CHUNK, len(work)))}
        gain = (end[len(work)] - end[min(hopper_bwd.AUTO_CHUNK, len(work))]) / (sum(work) * heads / 132)
        chunked = auto(N, heads) != len(work)
        assert chunked == (gain >= hopper_bwd.AUTO_MIN_GAIN and len(work) > hopper_bwd.AUTO_CHUNK), (N, heads, gain)


def test_fused_dq_takes_32_row_q_tiles_only_when_a_pair_adds(monkeypatch):
    """Which Hopper dK/dV tiles fused dQ runs with, as the tuner races them: 64-row Q tiles always; 32-row
    ones only with two consumers adding once per pair (the transposed product); never 128-row ones."""
    from stages.c_optimized import hopper_bwd
    from stages.c_optimized.tune_backward import ws_candidates

    fused = lambda: {str(c) for c in ws_candidates(128, 2) if bwd.fused_dq_fits(c)}  # noqa: E731
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    assert {"ws-M32-c2-s2", "ws-M64-c2-s2", "ws-M64-c1-s2"} <= fused() and "ws-M128-c1-s2" not in fused()
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "tma")
    assert "ws-M64-c2-s2" in fused() and not any(c.startswith("ws-M32") for c in fused())


def test_fused_dq_needs_64_row_q_tiles_and_atomics(device):
    """plan_backward refuses fused dQ with another Q tile (32 rows only with two consumers adding once
    per pair), without the accumulator or deterministic, and says which argument and what it needs."""
    q, k, v = make_qkv(1, 2, 8, 64, torch.bfloat16, device)
    o, lse = saved_forward(q, k, v, False, 0.125)
    t = bwd._allocate(q, k, v, separate=False)
    common = dict(causal=False, scale=0.125, arch=90)
    args = (o, q, k, v, o, lse, t["delta"], t["dq"], t["dk"], t["dv"])
    for ws, acc, deterministic in ((bwd.WsConfig(32, 1, 2), t["dq_acc"], False), (bwd.WsConfig(128, 1, 2), t["dq_acc"], False),
                                   (bwd.WsConfig(64, 2, 2), None, False), (bwd.WsConfig(64, 2, 2), t["dq_acc"], True)):
        with pytest.raises(ValueError, match="ws_dq_config='fused'.*64-row Q tiles, or 32-row ones with two"):
            bwd.plan_backward(*args, acc, ws=ws, ws_dq=bwd.FUSED_DQ, deterministic=deterministic, **common)
    with pytest.raises(ValueError, match="ws_dq_config"):  # (on a CPU: no Hopper kernel; on sm_90: atomics)
        bwd.attention_backward(o, q, k, v, o, lse, causal=False, scale=0.125, ws_dq_config="fused",
                               deterministic=True)


# ------------------------------------------------------------------------ the Hopper dK/dV kernel

#: (B, Hq, Hkv, Nq, Nk, D): ragged N with GQA, one query row, MQA with Nq < Nk, Nq > Nk (causal rows
#: that see no key), K/V tiles past Nk in a program that also has real keys, several Q tiles per K/V tile.
WS_SHAPES = [
    (2, 4, 2, 300, 300, 64),
    (1, 2, 2, 1, 3, 128),
    (1, 4, 1, 200, 450, 128),
    (1, 2, 2, 450, 200, 64),
    (1, 2, 1, 70, 130, 64),
    (2, 2, 2, 512, 512, 128),
]
WS_CONFIGS = ["ws-M64-c2-s2", "ws-M32-c2-s3", "ws-M128-c1-s2", "ws-M64-c1-s3"]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", WS_SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_hopper_dkdv_kernel_matches_float64(shape, causal, device):
    """The Gluon dK/dV kernel (forced; dQ from the tl kernel) against float64 autograd."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    B, Hq, Hkv, Nq, Nk, D = shape
    config = "ws-M32-c2-s2" if D == 128 else "ws-M64-c2-s2"
    for dtype_name, kernels in (("bf16", {"ws_config": config}), ("fp16", {"ws_dq_config": "ws-M64-c2-s2"}),
                                ("bf16", {"ws_config": config, "ws_dq_config": "ws-M128-c1-s2"}),
                                ("bf16", {"ws_config": "ws-M64-c2-s2", "ws_dq_config": "fused"}),
                                ("fp16", {"ws_config": "ws-M64-c1-s3", "ws_dq_config": "fused"})):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=11)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, **kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("atomics", ["mma", "rows", "tma", "pair"])
@pytest.mark.parametrize("shape", WS_SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_fused_dq_matches_float64_every_way_of_adding(shape, atomics, monkeypatch, device):
    """Fused dQ by each way of adding its tiles (``hopper_bwd.FUSED_DQ_ATOMICS``), causal and not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", atomics)
    monkeypatch.setattr(bwd, "_KEPT", {})  # (the kept launches were planned under the default)
    B, Hq, Hkv, Nq, Nk, D = shape
    for causal in (False, True):
        q, k, v = make_qkv(B, Hq, Nq, D, torch.bfloat16, device, Hkv=Hkv, Nk=Nk, seed=13)
        check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config="ws-M64-c2-s2",
                        ws_dq_config="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ws-M64-c2-s2", "ws-M32-c2-s3", "ws-M64-c1-s3"])
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80), (2, 2, 1, 130, 1100, 96)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_fused_dq_with_staggered_q_tiles_matches_float64(shape, config, monkeypatch, device):
    """Fused dQ with each program walking its Q tiles from its own one on (``FUSED_DQ_STAGGER``):
    producer and consumers must agree on the order, and every tile (the wrapped-around ones, and
    under causal masking the diagonal ones, now met in the middle of the loop) must still be visited
    once, causal and not, with GQA, Nq ≠ Nk both ways and a head-dim tail."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    B, Hq, Hkv, Nq, Nk, D = shape
    if D % 64 and config != "ws-M64-c2-s2":
        pytest.skip("fused dQ takes a head-dim tail with 64-row Q tiles and two consumers only")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_STAGGER", True)
    monkeypatch.setattr(bwd, "_KEPT", {})
    for causal, dtype_name in ((False, "bf16"), (True, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=16)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=config,
                        ws_dq_config="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ws-M64-c2-s2-r", "ws-M32-c2-s3-r"])
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80), (2, 2, 1, 130, 1100, 96)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_reordered_fused_dq_config_matches_float64(shape, config, device):
    """A reordered fused config (``-r``: staggered Q tiles and dQ a tile late, the tuner's candidate)
    by its name alone, the module's switches as they are: causal and not, GQA, Nq ≠ Nk, a tail."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    B, Hq, Hkv, Nq, Nk, D = shape
    if D % 64 and not config.startswith("ws-M64-c2"):
        pytest.skip("fused dQ takes a head-dim tail with 64-row Q tiles and two consumers only")
    for causal, dtype_name in ((False, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=17)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=config,
                        ws_dq_config="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,group", [(1, 0), (3, 0), (1, 3), (2, 2)])
@pytest.mark.parametrize("shape", WS_SHAPES + [(2, 4, 2, 1000, 700, 80), (3, 6, 3, 640, 640, 64)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_heavy_first_order_matches_float64(shape, chunk, group, monkeypatch, device):
    """Both Hopper kernels with their programs in chunks of tiles across batch·heads
    (``LAB_BWD_HEAVY_FIRST``), over every batch·head or in groups of them (``LAB_BWD_HEAD_GROUP``, a
    last group smaller than the others included): every tile computed once (dK/dV poisoned before, fused
    dQ's atomics would count a tile twice), causal, GQA, Nq ≠ Nk, a tail, fused dQ and the dQ kernel."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "HEAVY_FIRST", chunk)
    monkeypatch.setattr(hopper_bwd, "HEAD_GROUP", group)
    monkeypatch.setattr(bwd, "_KEPT", {})
    B, Hq, Hkv, Nq, Nk, D = shape
    q, k, v = make_qkv(B, Hq, Nq, D, torch.bfloat16, device, Hkv=Hkv, Nk=Nk, seed=23)
    for ws, ws_dq in (("ws-M64-c2-s2", "fused"), ("ws-M64-c2-s2", "ws-M64-c2-s3")):
        if ws_dq == "fused" and D % 64 and not hopper_bwd.fused_dq_takes_tail(64, 2):
            continue
        check_gradients(attention, q, k, v, causal=True, dtype_name="bf16", ws_config=ws, ws_dq_config=ws_dq)


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ws-M32-c2-s2", "ws-M32-c2-s3"])
@pytest.mark.parametrize("shape", WS_SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_fused_dq_pair_with_32_row_q_tiles_matches_float64(shape, config, monkeypatch, device):
    """Fused dQ added once per pair of consumers with 32-row Q tiles, where its product runs transposed
    (dQᵀ = Kᵀ·dSᵀ: the head dim as wgmma's M), causal and not, fp16 and bf16."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(bwd, "_KEPT", {})
    B, Hq, Hkv, Nq, Nk, D = shape
    for causal, dtype_name in ((False, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=14)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=config,
                        ws_dq_config="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("switch", ["FUSED_DQ_AHEAD", "FUSED_DQ_LAG"])
@pytest.mark.parametrize("config", ["ws-M32-c2-s3", "ws-M64-c2-s2"])
@pytest.mark.parametrize("shape", WS_SHAPES + [(2, 8, 2, 700, 1000, 128)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_fused_dq_out_of_step_matches_float64(shape, config, switch, monkeypatch, device):
    """The pair's dQ slice of a Q tile formed out of step with the tile (at D 128, where each consumer
    forms its column slice every tile; at D 64 the switches change nothing): issued at the start of the
    next tile's turn (``LAB_FUSED_DQ_AHEAD``) or formed during the next tile (``LAB_FUSED_DQ_LAG``),
    causal and not, GQA: the first turn's product, over a buffer not yet written, must add nothing, the
    last tile's must still be added after the loop, and a slice must go to the rows of the tile it was
    formed for, also where the loop passes from one query head of the group to the next."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, switch, True)
    monkeypatch.setattr(bwd, "_KEPT", {})
    B, Hq, Hkv, Nq, Nk, D = shape
    for causal, dtype_name in ((False, "bf16"), (True, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=15)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=config,
                        ws_dq_config="fused")


@pytest.mark.gpu
@pytest.mark.parametrize("first,prefetch,joined,early", [(False, False, False, False), (True, False, False, False),
                                                         (False, True, False, False), (True, False, True, True)],
                         ids=["plain", "first-early", "prefetch", "first-joined-early-release"])
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_row_statistics_and_slot_release_switches_match_float64(shape, first, prefetch, joined, early, monkeypatch,
                                                                 device):
    """The first Q tile's row statistics asked for before the K/V wait (``FIRST_ROW_STATS_EARLY``), or
    every tile's a tile ahead (``PREFETCH_ROW_STATS``: the next tile's, across the
    step from one query head of the group to the next, and none after the last), spread in one
    conversion or two (``JOINED_ROW_STATS``, where :func:`hopper_bwd.joined_row_stats` lets it), and the
    ring slot handed back before or after fused dQ's share (``EARLY_SLOT_RELEASE``): with fused dQ and
    without, 64- and 32-row Q tiles, causal and not, GQA, Nq ≠ Nk both ways and a head-dim tail. An
    early release must not let the producer overwrite a Q or dO tile a product still reads."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "FIRST_ROW_STATS_EARLY", first)
    monkeypatch.setattr(hopper_bwd, "PREFETCH_ROW_STATS", prefetch)
    monkeypatch.setattr(hopper_bwd, "JOINED_ROW_STATS", joined)
    monkeypatch.setattr(hopper_bwd, "EARLY_SLOT_RELEASE", early)
    monkeypatch.setattr(bwd, "_KEPT", {})
    B, Hq, Hkv, Nq, Nk, D = shape
    for causal, dtype_name, kernels in (
            (False, "bf16", {"ws_config": "ws-M64-c2-s2", "ws_dq_config": "fused"}),
            (True, "fp16", {"ws_config": "ws-M32-c2-s3", "ws_dq_config": "fused"}),
            (True, "bf16", {"ws_config": "ws-M64-c2-s2"})):
        if D % 64 and kernels["ws_config"] != "ws-M64-c2-s2":
            continue  # (fused dQ takes a head-dim tail with 64-row Q tiles and two consumers only)
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=17)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, **kernels)


def test_the_first_row_statistics_go_early_only_without_a_mask_up_to_64_columns(monkeypatch):
    """``FIRST_ROW_STATS_EARLY`` reaches the kernel where :func:`hopper_bwd.first_row_stats_early` says
    (non-causal, at most 64 dK/dV columns: causal and from 80 columns on it measured no faster), and
    nowhere else: with the switch on and off the D 64 non-causal kernel differs, the causal one and the
    D 128 one are the same."""
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "FIRST_ROW_STATS_EARLY", True)
    assert hopper_bwd.first_row_stats_early(64, False) and hopper_bwd.first_row_stats_early(40, False)
    assert not hopper_bwd.first_row_stats_early(64, True) and not hopper_bwd.first_row_stats_early(80, False)
    ptx = {}
    for on in (False, True):
        monkeypatch.setenv("LAB_FIRST_ROW_STATS_EARLY", "1" if on else "0")  # (a compile in a child process)
        monkeypatch.setattr(hopper_bwd, "FIRST_ROW_STATS_EARLY", on)
        for D, causal in ((64, False), (64, True), (128, False)):
            kernel = bwd.compile_backward(Problem(2, 8, 1024, D, "bf16", causal), 90, ws_config="ws-M64-c2-s2")[1]
            ptx[on, D, causal] = re.sub(r"\.loc.*|// .*", "", kernel.asm["ptx"])
    assert ptx[True, 64, False] != ptx[False, 64, False]
    assert ptx[True, 64, True] == ptx[False, 64, True] and ptx[True, 128, False] == ptx[False, 128, False]


def test_joined_row_statistics_take_two_warpgroup_barriers_out_where_they_fit(monkeypatch):
    """``JOINED_ROW_STATS`` (off: it measured no faster, performance-log entry 82): at D 64 with 64-row
    Q tiles (fused dQ) the two statistics take one trip through shared memory, so the kernel has fewer
    warpgroup barriers (named ``bar.sync`` of 128 threads) and spills no more; at D 128 with 64-row
    tiles, where the Δs' registers would spill, :func:`hopper_bwd.joined_row_stats` declines and the
    kernel is the same either way."""
    from harness.inspect_code import run_ptxas
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "JOINED_ROW_STATS", True)
    assert hopper_bwd.joined_row_stats(64, 64) and hopper_bwd.joined_row_stats(64, 32)
    assert not hopper_bwd.joined_row_stats(128, 64) and not hopper_bwd.joined_row_stats(96, 64)
    ptx, spills = {}, {}
    for on in (False, True):
        monkeypatch.setenv("LAB_JOINED_ROW_STATS", "1" if on else "0")  # (a compile in a child process)
        monkeypatch.setattr(hopper_bwd, "JOINED_ROW_STATS", on)
        for D in (64, 128):
            kernel = bwd.compile_backward(Problem(2, 8, 1024, D, "fp16", False), 90, ws_config="ws-M64-c2-s2",
                                          ws_dq_config="fused")[1]
            ptx[on, D] = re.sub(r"\.loc.*|// .*", "", kernel.asm["ptx"])
            facts = run_ptxas(kernel.asm["ptx"], "sm_90a")
            assert "ptxas_error" not in facts, facts
            spills[on, D] = facts["spill_stores"] + facts["spill_loads"]
    named = lambda text: len(re.findall(r"bar\.sync\s+\d+,\s*128;", text))  # noqa: E731
    assert named(ptx[True, 64]) < named(ptx[False, 64]), (named(ptx[True, 64]), named(ptx[False, 64]))
    assert spills[True, 64] <= spills[False, 64], spills
    assert ptx[True, 128] == ptx[False, 128]


@pytest.mark.gpu
@pytest.mark.parametrize("config", WS_CONFIGS)
def test_every_hopper_dkdv_config_is_correct(config, device):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    for D, causal in ((64, True), (128, False)):
        q, k, v = make_qkv(1, 4, 333, D, torch.bfloat16, device, Hkv=2, Nk=333, seed=12, layout="bnhd")
        check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config=config)
        check_gradients(attention, q, k, v, causal=not causal, dtype_name="bf16", ws_dq_config=config)
        if config.startswith("ws-M64"):  # fused dQ: 64-row Q tiles only
            check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config=config,
                            ws_dq_config="fused")


def test_hopper_dkdv_kernel_compiles_for_sm90():
    """Compiled without a GPU: TMA loads and stores, wgmma, register reallocation, no atomics, no
    spills to local memory; dQ from the tl kernel after it."""
    kernels = bwd.compile_backward(Problem(1, 4, 200, 128, "bf16", True, Hkv=2, Nk=300), 90,
                                   ws_config="ws-M32-c2-s2")
    assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel", "attention_bwd_dq_kernel"]
    both = bwd.compile_backward(Problem(1, 4, 200, 64, "bf16", False, Hkv=2, Nk=300), 90,
                                ws_config="ws-M64-c2-s2", ws_dq_config="ws-M64-c2-s3")
    assert [k.name for k in both] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel", "ws_bwd_dq_kernel"]
    for kernel in (kernels[1], *both[1:]):
        ptx = kernel.asm["ptx"]
        assert "cp.async.bulk.tensor" in ptx and "wgmma.mma_async" in ptx and "setmaxnreg" in ptx
        assert "atom.global" not in ptx and "red.global" not in ptx
        assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("atomics,instruction", [("mma", "atom.global.gpu.relaxed.add.v2.f32"),
                                                  ("rows", "atom.global.gpu.relaxed.add.v4.f32"),
                                                  ("tma", "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add"),
                                                  ("pair", "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add")])
def test_fused_dq_compiles_for_sm90(atomics, instruction, monkeypatch):
    """Fused dQ: two launches (the pre-pass, which zeroes the accumulator, and the dK/dV kernel), the
    kernel adding dQ after a wgmma whose A operand (dS) is read from shared memory, by each way of
    adding (``hopper_bwd.FUSED_DQ_ATOMICS``): the threads' vector atomics from the accumulator's
    layout or from whole rows, or the copy engine's bulk reduce; at D 64 nothing spills (at D 128 it
    does: performance-log entry 48)."""
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", atomics)  # (a compile in a child process reads it at import)
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", atomics)
    kernels = bwd.compile_backward(Problem(1, 4, 200, 64, "bf16", False, Hkv=2, Nk=300), 90,
                                   ws_config="ws-M64-c2-s2", ws_dq_config="fused")
    assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel"]
    ptx = kernels[1].asm["ptx"]
    assert instruction in ptx and "wgmma.mma_async" in ptx
    assert ("atom.global" in ptx) == (atomics not in ("tma", "pair"))
    assert "ld.local" not in ptx and "st.local" not in ptx
    padded = bwd.compile_backward(Problem(1, 4, 200, 48, "bf16", True), 90, ws_config="ws-M64-c1-s2",
                                  ws_dq_config="fused")
    assert instruction in padded[1].asm["ptx"]
    # The way of adding is the fused rung's alone: the dK/dV kernel without fused dQ compiles under
    # every setting (the bulk reduce once asked for the accumulator's descriptor that it has not got).
    unfused = bwd.compile_backward(Problem(1, 4, 200, 64, "bf16", False, Hkv=2, Nk=300), 90,
                                   ws_config="ws-M64-c2-s2")
    assert [k.name for k in unfused][1] == "ws_bwd_dkdv_kernel"
    assert "cp.reduce.async.bulk" not in unfused[1].asm["ptx"] and "atom.global" not in unfused[1].asm["ptx"]


def test_fused_dq_pair_with_32_row_q_tiles_compiles_without_spills(monkeypatch):
    """At D 128 fused dQ's 32-row Q tiles (the pair's transposed product) compile for sm_90a with no
    spills, where 64-row ones spill hundreds of bytes per thread (performance-log entry 54)."""
    from harness.inspect_code import run_ptxas
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")  # (a compile in a child process reads it at import)
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    kernels = bwd.compile_backward(Problem(1, 4, 200, 128, "bf16", True, Hkv=2, Nk=300), 90,
                                   ws_config="ws-M32-c2-s3", ws_dq_config="fused")
    assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel"]
    ptx = kernels[1].asm["ptx"]
    assert ptx.count("cp.reduce.async.bulk.tensor") == 2  # one reduce site per consumer: its column slice
    facts = run_ptxas(ptx, "sm_90a")
    assert "ptxas_error" not in facts, facts
    assert (facts["spill_stores"], facts["spill_loads"]) == (0, 0), facts


@pytest.mark.parametrize("switch", ["AHEAD", "LAG"])
def test_fused_dq_out_of_step_compiles_for_sm90(switch, monkeypatch):
    """``LAB_FUSED_DQ_AHEAD`` and ``LAB_FUSED_DQ_LAG`` at D 128: each consumer's dQ slice of a Q tile is
    issued ahead of the next tile's Sᵀ, or formed during the next tile, so the kernel has one more
    product and reduce site (the last tile's, after the loop) and still adds by the bulk reduce; at D 64
    (one slice, the consumers taking turns) the switch leaves the kernel as it is."""
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")  # (a compile in a child process reads them at import)
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    sites = {}
    for D in (64, 128):
        problem = Problem(1, 4, 200, D, "bf16", True, Hkv=2, Nk=300)
        for on in (False, True):
            monkeypatch.setenv(f"LAB_FUSED_DQ_{switch}", "1" if on else "0")
            monkeypatch.setattr(hopper_bwd, f"FUSED_DQ_{switch}", on)
            ptx = bwd.compile_backward(problem, 90, ws_config="ws-M32-c2-s2", ws_dq_config="fused")[1].asm["ptx"]
            sites[D, on] = ptx.count("cp.reduce.async.bulk.tensor")
    assert sites[128, True] > sites[128, False] > 0
    assert sites[64, True] == sites[64, False] > 0


def test_a_reordered_fused_config_is_the_two_switches_for_its_tiles_alone(monkeypatch):
    """``ws-...-r``: fused dQ with staggered Q tiles and dQ a tile late, per config (so the tuner can race
    it), compiled exactly as the module-wide switches would compile it; without fused dQ it is refused,
    naming the argument, and a deterministic plan (no fused dQ) drops it."""
    from stages.c_optimized import hopper_bwd

    for text in ("ws-M64-c2-s2-r", "ws-M32-c2-s3-r-pad", "ws-M64-c2-s2"):
        assert str(bwd.WsConfig.parse(text)) == text
    assert bwd.WsConfig.parse("ws-M64-c2-s2-r").reorder and not bwd.WsConfig.parse("ws-M64-c2-s2").reorder
    with pytest.raises(ValueError, match="-r"):
        bwd.WsConfig.parse("ws-M64-c2-s2-pad-r")
    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    problem = Problem(1, 4, 200, 128, "bf16", False, Hkv=2, Nk=300)
    # (the compile runs in a child process without the interpreter, which reports the ValueError it raised)
    with pytest.raises((ValueError, RuntimeError), match="ws_config='ws-M64-c2-s2-r'.*ws_dq_config='fused'"):
        bwd.compile_backward(problem, 90, ws_config="ws-M64-c2-s2-r", ws_dq_config="ws-M64-c2-s2")
    strip = lambda text: re.sub(r"\.loc.*|// .*", "", text)  # noqa: E731 - (debug line numbers)
    reordered = bwd.compile_backward(problem, 90, ws_config="ws-M64-c2-s2-r", ws_dq_config="fused")[1].asm["ptx"]
    for switch in ("STAGGER", "LAG"):
        monkeypatch.setenv(f"LAB_FUSED_DQ_{switch}", "1")  # (a compile in a child process)
        monkeypatch.setattr(hopper_bwd, f"FUSED_DQ_{switch}", True)
    switched = bwd.compile_backward(problem, 90, ws_config="ws-M64-c2-s2", ws_dq_config="fused")[1].asm["ptx"]
    assert strip(reordered) == strip(switched) and "rem.s32" in reordered
    table = {"arch": 90, "bf16/D128/causal0": {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3",
                                              "dq_method": "separate", "ws": "ws-M64-c2-s2-r", "ws_dq": "fused"}}
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: table)
    bwd.backward_plan.cache_clear()
    try:
        assert str(bwd.backward_plan(128, torch.bfloat16, 90, False)) == "dkdv:ws-M64-c2-s2-r+fused-dq"
        exact = bwd.backward_plan(128, torch.bfloat16, 90, False, deterministic=True)
        assert (exact.ws, exact.ws_dq, exact.separate_dq) == (bwd.WsConfig(64, 2, 2), None, True)
    finally:
        bwd.backward_plan.cache_clear()


def test_staggered_q_tiles_change_only_the_fused_kernel(monkeypatch):
    """``FUSED_DQ_STAGGER`` reorders the fused dK/dV kernel's Q tiles (a remainder by the tile count in
    producer and consumers); the kernel without fused dQ, whose order nothing else depends on, is the same
    with it on or off."""
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    problem = Problem(1, 4, 200, 64, "bf16", True, Hkv=2, Nk=300)
    ptx = {}
    for stagger in (False, True):
        monkeypatch.setenv("LAB_FUSED_DQ_STAGGER", "1" if stagger else "0")
        monkeypatch.setattr(hopper_bwd, "FUSED_DQ_STAGGER", stagger)
        for dq in ("fused", "ws-M128-c1-s2"):
            ptx[stagger, dq] = bwd.compile_backward(problem, 90, ws_config="ws-M64-c2-s2", ws_dq_config=dq)[1].asm["ptx"]
    strip = lambda text: re.sub(r"\.loc.*|// .*", "", text)  # noqa: E731 - (debug line numbers)
    assert strip(ptx[False, "ws-M128-c1-s2"]) == strip(ptx[True, "ws-M128-c1-s2"])
    assert "rem.s32" not in ptx[False, "fused"] and "rem.s32" in ptx[True, "fused"]


def test_walking_down_changes_only_the_causal_kernels_it_may(monkeypatch):
    """``CAUSAL_WALK_DOWN`` turns a causal program's walk over its Q tiles around (from the last tile down to
    its diagonal), with fused dQ and with a dQ kernel of its own; a problem without a mask, whose programs
    all start at the first tile anyway, and ordered dQ, whose turns follow the walk up, compile the same."""
    from stages.c_optimized import hopper_bwd

    assert hopper_bwd.q_walk(True) == hopper_bwd.WALK_UP  # (off by default until timed)
    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    strip = lambda text: re.sub(r"\.loc.*|// .*", "", text)  # noqa: E731 - (debug line numbers)
    ptx = {}
    for down in (False, True):
        monkeypatch.setenv("LAB_BWD_WALK_DOWN", "1" if down else "0")  # (a compile in a child process)
        monkeypatch.setattr(hopper_bwd, "CAUSAL_WALK_DOWN", down)
        for causal in (False, True):
            for dq in ("fused", "ordered", "ws-M128-c1-s2"):
                problem = Problem(1, 4, 200, 64, "bf16", causal, Hkv=2, Nk=300)
                kernels = bwd.compile_backward(problem, 90, ws_config="ws-M64-c2-s2", ws_dq_config=dq,
                                               deterministic=dq == "ordered")
                ptx[down, causal, dq] = strip(next(k for k in kernels if k.name == "ws_bwd_dkdv_kernel").asm["ptx"])
    for dq in ("fused", "ordered", "ws-M128-c1-s2"):
        assert ptx[False, False, dq] == ptx[True, False, dq]
        assert (ptx[False, True, dq] == ptx[True, True, dq]) == (dq == "ordered"), dq
    assert hopper_bwd.q_walk(True) == hopper_bwd.WALK_DOWN and hopper_bwd.q_walk(False) == hopper_bwd.WALK_UP
    assert hopper_bwd.q_walk(True, fused_dq=True, ordered=True) == hopper_bwd.WALK_UP
    assert hopper_bwd.q_walk(True, fused_dq=True, reorder=True) == hopper_bwd.WALK_STAGGERED


@pytest.mark.gpu
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80), (2, 2, 1, 130, 1100, 96),
                                               (1, 2, 1, 300, 420, 256)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_causal_walk_down_matches_float64(shape, monkeypatch, device):
    """Causal programs walking their Q tiles from the last one down (``CAUSAL_WALK_DOWN``): producer and
    consumers (the split head dim's, which share the scores, too) must agree on the order, and every tile be
    visited once, the diagonal ones, met last now, masked: the default plan, fused dQ and a dQ kernel of its
    own, one consumer and two, with GQA, Nq ≠ Nk both ways and a head-dim tail."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper dK/dV kernel needs sm_90")
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "CAUSAL_WALK_DOWN", True)
    monkeypatch.setattr(bwd, "_KEPT", {})  # (the kept launches were planned under the default)
    B, Hq, Hkv, Nq, Nk, D = shape
    ways = [{}]
    if D <= 128:
        ways += [{"ws_config": "ws-M64-c2-s2", "ws_dq_config": "fused"},
                 {"ws_config": "ws-M64-c2-s2", "ws_dq_config": "ws-M128-c1-s2"}]
        if D % 64 == 0:
            ways.append({"ws_config": "ws-M64-c1-s3", "ws_dq_config": "fused"})
    for i, kernels in enumerate(ways):
        dtype_name = ("bf16", "fp16")[i % 2]
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=17 + i)
        check_gradients(attention, q, k, v, causal=True, dtype_name=dtype_name, **kernels)


def test_compact_row_statistics_go_through_shared_memory_and_cut_the_causal_spills(monkeypatch):
    """``COMPACT_ROW_STATS``: each consumer loads a Q tile's log-sum-exps and Δs one per thread and
    spreads them through shared memory (a 4-byte store, 16-byte loads) right before their use. At
    D 128 with 64-row Q tiles, causal, that is what spills (hundreds of bytes per thread); the switch
    must leave fewer, with and without fused dQ, and compile at every width (a tail at D 96). In the
    machine code a Q tile (one pass of the consumers' loop) runs fewer instructions with it and fewer
    local-memory accesses (where cuobjdump is at hand to disassemble it)."""
    from harness.inspect_code import first_mma_loop, run_ptxas, sass
    from stages.c_optimized import hopper_bwd

    monkeypatch.setenv("LAB_FUSED_DQ_ATOMICS", "pair")
    monkeypatch.setattr(hopper_bwd, "FUSED_DQ_ATOMICS", "pair")
    spills, ptx = {}, {}
    for on in (False, True):
        monkeypatch.setenv("LAB_COMPACT_ROW_STATS", "1" if on else "0")  # (a compile in a child process)
        monkeypatch.setattr(hopper_bwd, "COMPACT_ROW_STATS", on)
        for dq in (None, "fused"):
            kernel = bwd.compile_backward(Problem(4, 16, 4096, 128, "bf16", True), 90, ws_config="ws-M64-c2-s2",
                                          ws_dq_config=dq)[1]
            ptx[on, dq] = kernel.asm["ptx"]
            facts = run_ptxas(ptx[on, dq], "sm_90a")
            assert "ptxas_error" not in facts, facts
            spills[on, dq] = facts["spill_stores"] + facts["spill_loads"]
        assert bwd.compile_backward(Problem(1, 4, 200, 96, "bf16", True, Hkv=2, Nk=300), 90,
                                    ws_config="ws-M64-c2-s2")[1].name == "ws_bwd_dkdv_kernel"
    for dq in (None, "fused"):
        assert spills[True, dq] < spills[False, dq], spills
        assert ptx[True, dq].count("ld.shared.v4.b32") > ptx[False, dq].count("ld.shared.v4.b32")
    loops = {key: first_mma_loop(sass(text, "sm_90a")) for key, text in ptx.items()}  # (the Q-tile loop)
    if all(loops.values()):
        for dq in (None, "fused"):
            off, on = loops[False, dq], loops[True, dq]
            assert on.wgmma == off.wgmma and on.instructions < 0.9 * off.instructions, (off, on)
            assert on.local_loads + on.local_stores < off.local_loads + off.local_stores, (off, on)


def test_hopper_dkdv_config_errors_name_the_argument(device):
    with pytest.raises(ValueError, match="ws-M64-c2-s2"):
        bwd.WsConfig.parse("M64-c2")
    assert str(bwd.WsConfig.parse("ws-M32-c2-s3")) == "ws-M32-c2-s3"
    q, k, v = make_qkv(1, 2, 8, 16, torch.float16, device)  # D 16: no GPU runs the Hopper kernel there
    o, lse = saved_forward(q, k, v, False, 0.25)
    with pytest.raises(ValueError, match="ws_config"):
        bwd.attention_backward(o, q, k, v, o, lse, causal=False, scale=0.25, ws_config="ws-M64-c2-s2")


def test_a_layout_is_planned_once_and_its_launches_take_new_tensors(monkeypatch, device):
    """The second call of a layout runs the kept launches on its own tensors (right gradients for new
    data, nothing planned); a new scale or a new stride is a new layout."""
    calls = []
    plan = bwd.plan_backward
    monkeypatch.setattr(bwd, "plan_backward", lambda *a, **kw: calls.append(1) or plan(*a, **kw))
    bwd._KEPT.clear()
    for seed in (21, 22, 24):
        q, k, v = make_qkv(1, 4, 70, 32, torch.float16, device, Hkv=2, Nk=90, seed=seed)
        check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.2)
    assert len(calls) == 1
    # On a GPU the first call also binds the launches (launch.BoundKeptLaunch), and the later calls
    # ran bound; the interpreter has no compiled kernel to bind.
    (layout,) = bwd._KEPT.values()
    assert bool(layout.bound) == (device == "cuda")
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.3)
    q, k, v = make_qkv(1, 4, 70, 32, torch.float16, device, Hkv=2, Nk=90, seed=23, layout="bnhd")
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.3)
    assert len(calls) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bound_hopper_backward_takes_new_tensors(D, device):
    """The Hopper backward's launches bound at a layout's first call (TMA descriptors among their
    arguments) run the next calls on new tensors: right gradients for new data every time, the
    outputs poisoned before each call (``new_output``), causal and not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    for causal in (False, True):
        bwd._KEPT.clear()
        for seed in (41, 42, 43):
            q, k, v = make_qkv(2, 4, 300, D, torch.bfloat16, device, Hkv=2, Nk=300, seed=seed + causal)
            check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16")
        (layout,) = bwd._KEPT.values()
        assert layout.bound, "the layout's launches were not bound"
        assert any(b.desc_roles for b in layout.bound), "no launch with TMA descriptors was bound"


def test_hopper_backward_at_padded_head_dims_compiles_for_sm90(ws_padded_head_dims):
    """With PADDED_HEAD_DIMS the Hopper backward kernels take D 96 in tiles of 128 columns."""
    both = bwd.compile_backward(Problem(1, 4, 200, 96, "bf16", True, Hkv=2, Nk=300), 90,
                                ws_config="ws-M32-c2-s2", ws_dq_config="ws-M64-c2-s2")
    assert [k.name for k in both] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel", "ws_bwd_dq_kernel"]
    assert all("wgmma.mma_async" in k.asm["ptx"] and "ld.local" not in k.asm["ptx"] for k in both[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [48, 80, 96, 120])
def test_gpu_hopper_backward_at_padded_head_dims(D, ws_padded_head_dims, device):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    for causal in (False, True):
        q, k, v = make_qkv(2, 4, 300, D, torch.bfloat16, device, Hkv=2, Nk=300, seed=31)
        check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config="ws-M32-c2-s2",
                        ws_dq_config="ws-M64-c2-s2")


# ---------------------------------------------------- the head-dim tail (D 72-96 as 64 + 16 or 64 + 32)

def test_backward_tile_widths():
    """The Hopper backward runs the forward's tail where one consumer keeps dK and dV whole; padded above
    128 columns (the split head dim) and with ``pad``."""
    from stages.c_optimized import hopper_bwd

    assert [hopper_bwd.tile_widths(D) for D in (64, 72, 80, 88, 96, 104, 112, 128)] == \
        [(64, 0), (64, 16), (64, 16), (64, 32), (64, 32), (128, 0), (128, 0), (128, 0)]
    assert [hopper_bwd.tile_widths(D) for D in (16, 32, 40, 48, 56, 136, 192, 200)] == \
        [(16, 0), (32, 0), (64, 0), (64, 0), (64, 0), (256, 0), (256, 0), (256, 0)]
    assert hopper_bwd.tile_widths(80, pad=True) == (128, 0)
    assert [bwd.tuned_width(D) for D in (40, 48, 56, 64, 72, 80, 88, 96, 104, 136, 256)] == \
        [64, 64, 64, 64, 80, 80, 96, 96, 128, 256, 256]
    assert str(bwd.WsConfig.parse("ws-M64-c2-s2-pad")) == "ws-M64-c2-s2-pad"
    assert bwd.WsConfig.parse("ws-M64-c2-s2-pad").pad and not bwd.WsConfig.parse("ws-M64-c2-s2").pad
    with pytest.raises(ValueError, match="'-pad' last"):
        bwd.WsConfig.parse("ws-M64-c2-pad-s2")


def test_a_tail_width_has_its_own_tuned_entry(monkeypatch):
    """A head dim with a tail takes the entry tuned under its own width when there is one, else its
    padded width's (the tl kernels' tiles and the Hopper kernels' as tuned there)."""
    table = {"arch": 90,
             "bf16/D128/causal0": {"dkdv": "M64-N128-w8-s2", "dq_method": "separate", "ws": "ws-M32-c2-s2",
                                   "ws_dq": "ws-M64-c2-s2"},
             "bf16/D80/causal0": {"dkdv": "M64-N128-w8-s2", "dq_method": "separate", "ws": "ws-M64-c2-s3",
                                  "ws_dq": "ws-M64-c1-s2"}}
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: table)
    bwd.backward_plan.cache_clear()
    try:
        for D in (72, 80):
            plan = bwd.backward_plan(D, torch.float16, 90, False)
            assert (plan.ws, plan.ws_dq) == (bwd.WsConfig(64, 2, 3), bwd.WsConfig(64, 1, 2)), D
        for D in (96, 112, 128):
            plan = bwd.backward_plan(D, torch.bfloat16, 90, False)
            assert (plan.ws, plan.ws_dq) == (bwd.WsConfig(32, 2, 2), bwd.WsConfig(64, 2, 2)), D
    finally:
        bwd.backward_plan.cache_clear()


@pytest.mark.parametrize("told", [True, False], ids=["alignment told", "not told"])
def test_rows_not_a_multiple_of_16_keep_the_tuned_plan_when_told_their_alignment(told, monkeypatch):
    """Where a plan pairs the Hopper dK/dV kernel with the tl dQ kernel, a head dim whose rows are not a
    multiple of 16 elements keeps the tuned plan while the kernels are told their rows' alignment
    (aligned.py, the default: the tl dQ kernel then loads 16-byte rows); not told, Triton cannot
    vectorize the tl kernel's loads there, and such a head dim takes the Hopper dQ kernel instead,
    deterministic mode included. A head dim of whole 16s keeps the tuned plan either way."""
    from stages.c_optimized import aligned

    table = {"arch": 90,
             "bf16/D64/causal0": {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3", "dq_method": "separate",
                                  "ws": "ws-M64-c2-s3"},
             "bf16/D128/causal0": {"dkdv": "M64-N128-w8-s2", "dq": "M32-N64-w4-s3", "dq_method": "separate",
                                   "ws": "ws-M64-c2-s2", "ws_dq": "fused"}}
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: table)
    monkeypatch.setattr(aligned, "ROW_ALIGNMENT", told)
    bwd.backward_plan.cache_clear()
    try:
        assert bwd.backward_plan(48, torch.bfloat16, 90, False).ws_dq is None
        for D, deterministic in ((40, False), (40, True), (120, True)):
            plan = bwd.backward_plan(D, torch.bfloat16, 90, False, deterministic=deterministic)
            if told:
                assert plan.separate_dq and plan.ws_dq is None, (D, deterministic, plan)
            else:
                assert plan.separate_dq and isinstance(plan.ws_dq, bwd.WsConfig), (D, deterministic, plan)
        assert bwd.backward_plan(120, torch.bfloat16, 90, False).ws_dq == bwd.FUSED_DQ
        assert bwd.backward_plan(128, torch.bfloat16, 90, False, deterministic=True).ws_dq is None
    finally:
        bwd.backward_plan.cache_clear()


def _wgmma_shapes(ptx: str) -> set:
    import re

    return set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx))


@pytest.mark.parametrize("D,ws,ws_dq", [(80, "ws-M64-c2-s2", "ws-M64-c2-s2"), (96, "ws-M32-c2-s3", "ws-M64-c2-s2"),
                                        (72, "ws-M64-c1-s3", "ws-M32-c2-s3")])
def test_hopper_backward_tail_compiles_for_sm90(D, ws, ws_dq, ws_padded_head_dims):
    """Compiled without a GPU: at D 72-96 both Hopper kernels multiply a tail as narrow as the
    head dim needs (wgmma with N = the tail: dK's, dV's and dQ's tail columns) beside the main part, and
    no product is as wide as the padded head dim, as ``-pad``'s are; two consumers compile with no
    spills (the tail's accumulators are 8-16 registers per thread)."""
    from harness.inspect_code import run_ptxas
    from stages.c_optimized import hopper_bwd

    tail, full = hopper_bwd.tile_widths(D)[1], bwd.padded_head_dim(D)
    p = Problem(1, 4, 200, D, "bf16", True, Hkv=2, Nk=300)
    kernels = bwd.compile_backward(p, 90, ws_config=ws, ws_dq_config=ws_dq)
    padded = bwd.compile_backward(p, 90, ws_config=ws + "-pad", ws_dq_config=ws_dq + "-pad")
    assert [k.name for k in kernels[1:]] == ["ws_bwd_dkdv_kernel", "ws_bwd_dq_kernel"]
    for kernel, pad in zip(kernels[1:], padded[1:]):
        shapes, padded_shapes = _wgmma_shapes(kernel.asm["ptx"]), _wgmma_shapes(pad.asm["ptx"])
        # (these tiles' score products are narrower than the padded head dim: a wgmma that wide is dK's,
        # dV's or dQ's)
        assert f"m64n{tail}k16" in shapes and f"m64n{full}k16" not in shapes, (kernel.name, shapes)
        assert f"m64n{full}k16" in padded_shapes, (kernel.name, padded_shapes)
        if ws.endswith("c2-s2") or ws.endswith("c2-s3"):
            assert run_ptxas(kernel.asm["ptx"], "sm_90a")["spill_stores"] == 0, kernel.name


def test_every_tensor_argument_of_the_hopper_kernels_has_a_role():
    """A kept backward layout hands each launch its call's tensors by role (``backward._ROLES``): every
    tensor and descriptor argument of the Hopper kernels, the tail's included, must name one."""
    from stages.c_optimized import hopper_bwd

    for kernel in (hopper_bwd.ws_bwd_dkdv_kernel, hopper_bwd.ws_bwd_dq_kernel):
        names = {p.name for p in kernel.params if p.name.endswith("_desc") or p.name.isupper() and not p.is_constexpr}
        assert names - {"Hq", "Hkv", "Nq", "Nk"} <= set(bwd._ROLES), (kernel.fn.__name__, names - set(bwd._ROLES))


def test_fused_dq_with_a_tail_compiles_for_sm90(ws_padded_head_dims):
    """Fused dQ beside a tail (64-row Q tiles, the pair taking turns): the tail's dQ product and a
    bulk reduce of its own per consumer, twice the reduces of D 64's kernel; with 32-row Q tiles
    (whose transposed product cannot take a 16-column tail as its M) the kernel keeps the padded width."""
    from stages.c_optimized import hopper_bwd

    if not hopper_bwd.fused_dq_takes_tail(64, 2):
        pytest.skip(f"fused dQ adds by {hopper_bwd.FUSED_DQ_ATOMICS!r} here, not by the pair")
    reduces = lambda p, ws: bwd.compile_backward(p, 90, ws_config=ws, ws_dq_config="fused")[1].asm["ptx"].count(  # noqa: E731
        "cp.reduce.async.bulk")
    assert reduces(Problem(1, 4, 200, 80, "bf16", False, Hkv=2, Nk=300), "ws-M64-c2-s2") == \
        2 * reduces(Problem(1, 4, 200, 64, "bf16", False, Hkv=2, Nk=300), "ws-M64-c2-s2")
    narrow = bwd.compile_backward(Problem(1, 4, 200, 80, "bf16", False, Hkv=2, Nk=300), 90, ws_config="ws-M32-c2-s2",
                                  ws_dq_config="fused")[1].asm["ptx"]
    assert "m64n16k16" not in narrow and "m64n128k16" in narrow


#: (B, Hq, Hkv, Nq, Nk): several Q and K/V tiles, a ragged last tile, GQA; one query row; Nq > Nk (causal rows
#: that see no key) with MQA; Nq < Nk; more Q tiles than K/V ones, grouped.
TAIL_SHAPES = [(2, 4, 2, 300, 300), (1, 2, 2, 1, 3), (1, 4, 1, 200, 70), (1, 2, 1, 70, 260), (2, 6, 2, 333, 129)]


@pytest.mark.gpu
@pytest.mark.parametrize("D", [72, 80, 88, 96])
def test_gpu_hopper_backward_with_a_head_dim_tail(D, ws_padded_head_dims, device):
    """The tail's dK/dV and dQ kernels against float64, every config kind (two consumers with 32- and
    64-row tiles, one consumer with 64 and 128, fused dQ with its tail reduce), both dtypes, causal and
    not, odd shapes."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    configs = [("ws-M64-c2-s2", "ws-M64-c2-s2"), ("ws-M32-c2-s3", "ws-M32-c2-s3"), ("ws-M128-c1-s2", "ws-M64-c1-s3"),
               ("ws-M64-c2-s3", "fused"), ("ws-M64-c1-s3", "ws-M128-c1-s2"), ("ws-M64-c2-s2", "fused")]
    for i, (B, Hq, Hkv, Nq, Nk) in enumerate(TAIL_SHAPES):
        for causal in (False, True):
            ws, ws_dq = configs[(i + causal) % len(configs)]
            dtype_name = ("bf16", "fp16")[(i + causal) % 2]
            q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=40 + i)
            check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=ws,
                            ws_dq_config=ws_dq)


# ------------------------------------------------- the Hopper backward above 128 columns (split head dim)

#: Head dims above 128 (padded to 256 where not 256 itself) and the tiles that fit shared memory
#: there: the dK/dV kernel's two consumers share one 64-row K/V tile and split its head dim; the dQ
#: kernel with one consumer (64 query rows) or two (128) and 32- or 64-row K/V tiles.
WIDE_HEAD_DIMS = [136, 200, 256]
WIDE_CONFIGS = [("ws-M32-c2-s3", "ws-M64-c1-s2"), ("ws-M64-c2-s2", "ws-M32-c2-s2"),
                ("ws-M32-c2-s3-x", "ws-M32-c2-s3"), ("ws-M64-c2-s2-x", "ws-M64-c1-s2")]


def test_split_head_dim_tiles_and_shared_memory():
    """Above 128 columns the dK/dV kernel keeps one 64-row K/V tile (two consumers, a head-dim half
    each): its shared memory counts 64 resident rows, it takes only two-consumer configs, and the
    tuner's candidates say so; the dQ kernel is unchanged."""
    from stages.c_optimized import hopper_ws
    from stages.c_optimized.tune_backward import ws_candidates

    assert [hopper_ws.split_head_dim(d) for d in (64, 128, 256)] == [1, 1, 2]
    ws = bwd.WsConfig(64, 2, 2)
    assert ws.resident_rows(128) == 128 and ws.resident_rows(256) == 64 and ws.resident_rows(256, "dq") == 128
    assert ws.shared_bytes(256, 2) == (2 * 64 + 2 * 2 * 64) * 256 * 2
    assert not bwd.WsConfig(64, 1, 2).fits_head_dim(256) and bwd.WsConfig(64, 1, 2).fits_head_dim(256, "dq")
    dkdv, dq = ws_candidates(256, 2, "dkdv"), ws_candidates(256, 2, "dq")
    assert dkdv and all(c.consumers == 2 for c in dkdv) and bwd.WsConfig(64, 2, 2) in dkdv
    assert bwd.WsConfig(64, 1, 2) in dq and bwd.WsConfig(64, 2, 2) not in dq  # (256 KB: over the limit)
    assert all(c.shared_bytes(256, 2, "dq") <= 227 * 1024 for c in dq)
    # Sharing the scores ("-x"): two consumers that split the head dim, two buffers of Pᵀ and dSᵀ more.
    shared = bwd.WsConfig.parse("ws-M64-c2-s2-x")
    assert shared == bwd.WsConfig(64, 2, 2, True) and str(shared) == "ws-M64-c2-s2-x"
    assert shared.shared_bytes(256, 2) == ws.shared_bytes(256, 2) + 2 * 2 * 64 * 64 * 2
    assert shared.fits_head_dim(256) and not shared.fits_head_dim(128) and not shared.fits_head_dim(256, "dq")
    assert shared in dkdv and not any(c.share for c in dq + ws_candidates(128, 2, "dkdv"))
    with pytest.raises(ValueError, match="-x"):
        bwd.WsConfig.parse("ws-M64-c1-s2-x")


def test_split_head_dim_compiles_for_sm90():
    """D 256 and D 200 (padded to 256): the dK/dV kernel with the head dim split between two
    consumers (its epilogue waits on an mbarrier for both halves), with the scores recomputed and
    shared, the Hopper dQ kernel after it; a one-consumer dK/dV config is refused, naming what it
    takes."""
    for D, ws in ((256, "ws-M32-c2-s3"), (200, "ws-M32-c2-s3"), (256, "ws-M32-c2-s3-x")):
        kernels = bwd.compile_backward(Problem(1, 4, 200, D, "bf16", True, Hkv=2, Nk=300), 90,
                                       ws_config=ws, ws_dq_config="ws-M64-c1-s2")
        assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel", "ws_bwd_dq_kernel"]
        for kernel in kernels[1:]:
            ptx = kernel.asm["ptx"]
            assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "ld.local" not in ptx
        assert "mbarrier.arrive" in kernels[1].asm["ptx"]
    with pytest.raises((ValueError, RuntimeError), match="c2"):  # (on a CPU: the compiling child's error, passed on)
        bwd.compile_backward(Problem(1, 4, 200, 256, "bf16", False), 90, ws_config="ws-M64-c1-s2")


@pytest.mark.gpu
@pytest.mark.parametrize("configs", WIDE_CONFIGS, ids=lambda c: "+".join(c))
@pytest.mark.parametrize("D", WIDE_HEAD_DIMS)
def test_gpu_hopper_backward_above_128_columns(D, configs, ws_padded_head_dims, device):
    """The split-head-dim dK/dV kernel and the Hopper dQ kernel against float64, over ragged N with
    GQA, one query row, MQA with Nq < Nk and Nq > Nk (causal rows that see no key), causal and not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    ws, ws_dq = configs
    for B, Hq, Hkv, Nq, Nk in ((2, 4, 2, 300, 300), (1, 2, 2, 1, 3), (1, 4, 1, 200, 450), (1, 2, 2, 450, 200)):
        for causal in (False, True):
            q, k, v = make_qkv(B, Hq, Nq, D, torch.bfloat16, device, Hkv=Hkv, Nk=Nk, seed=41)
            check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config=ws, ws_dq_config=ws_dq)
    q, k, v = make_qkv(1, 2, 130, D, torch.float16, device, seed=42, layout="bnhd")
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", ws_config=ws, ws_dq_config=ws_dq)


# ---------------------------------------------------- the persistent dK/dV grid (hopper_bwd.PERSISTENT_DKDV)

@pytest.fixture
def persistent_dkdv(monkeypatch):
    """``hopper_bwd.PERSISTENT_DKDV`` on (and for ``compile``'s child process, through the environment),
    with the kept layouts planned under the other setting forgotten."""
    from stages.c_optimized import hopper_bwd

    monkeypatch.setattr(hopper_bwd, "PERSISTENT_DKDV", True)
    monkeypatch.setenv("LAB_BWD_PERSISTENT", "1")
    monkeypatch.setattr(bwd, "_KEPT", {})
    return hopper_bwd


def _dkdv_launch(q_shape, kv_shape, causal, ws, sms=None, **kw):
    """The dK/dV kernel's launch planned over meta tensors of these shapes (bf16), deterministic dQ."""
    meta = lambda *s, dt=torch.bfloat16: torch.empty(s, dtype=dt, device="meta")  # noqa: E731
    q, o, do, dq = (meta(*q_shape) for _ in range(4))
    k, v, dk, dv = (meta(*kv_shape) for _ in range(4))
    lse, delta = (meta(*q_shape[:3], dt=torch.float32) for _ in range(2))
    (launch,) = [launch for launch in bwd.plan_backward(
        do, q, k, v, o, lse, delta, dq, dk, dv, None, causal=causal, scale=0.125, arch=90, deterministic=True,
        ws=bwd.WsConfig.parse(ws), **kw) if launch.kernel.fn.__name__ == "ws_bwd_dkdv_kernel"]
    return launch


def test_persistent_dkdv_grid_has_a_program_per_sm_at_most(persistent_dkdv, monkeypatch):
    """With the persistent grid a program walks items: the grid is the SM count where the items are more,
    the items' count where they are fewer (a grid of one item per program, as without it), and the
    kernel is told so; dK and dV are handed to it as tensors (the persistent epilogue stores them from
    the registers). Off, one program per item."""
    monkeypatch.setattr(persistent_dkdv, "sm_count", lambda device: 7)
    many = _dkdv_launch((2, 8, 1000, 64), (2, 4, 1000, 64), False, "ws-M64-c2-s2")  # 8 tiles × 8 heads
    assert many.grid == (7,) and many.args["PERSISTENT"] and many.args["heads"] == 8
    assert many.args["DK"].shape == (2, 4, 1000, 64)
    few = _dkdv_launch((1, 2, 200, 128), (1, 2, 200, 128), True, "ws-M64-c2-s2")  # 2 tiles × 2 heads
    assert few.grid == (4,) and few.args["PERSISTENT"]
    monkeypatch.setattr(persistent_dkdv, "PERSISTENT_DKDV", False)
    assert _dkdv_launch((2, 8, 1000, 64), (2, 4, 1000, 64), False, "ws-M64-c2-s2").grid == (64,)


def test_persistent_dkdv_compiles_for_sm90_with_the_register_epilogue(persistent_dkdv):
    """Compiled for sm_90a, the persistent dK/dV kernel stores dK and dV from the registers (``st.global``)
    where one program per item stores them by TMA through the K/V buffers, and it loops over its items
    (the producer's wait on the consumers' ``kv_free``); D 256's split head dim keeps the TMA epilogue."""
    from harness.inspect_code import run_ptxas

    p = Problem(2, 4, 300, 64, "bf16", False, Hkv=2)
    persistent = bwd.compile_backward(p, 90, ws_config="ws-M64-c2-s2", ws_dq_config="fused")[1]
    assert persistent.name == "ws_bwd_dkdv_kernel" and "st.global" in persistent.asm["ptx"]
    assert run_ptxas(persistent.asm["ptx"], "sm_90a")["spill_stores"] == 0
    split = bwd.compile_backward(Problem(1, 2, 200, 256, "bf16", True), 90, ws_config="ws-M32-c2-s3-x",
                                 ws_dq_config="ws-M64-c1-s2")[1]
    assert "cp.async.bulk.tensor" in split.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", [
    dict(ws_config="ws-M64-c2-s2", ws_dq_config="fused"),
    dict(ws_config="ws-M32-c2-s2", ws_dq_config="ws-M64-c2-s2"),
    dict(ws_config="ws-M64-c1-s3", ws_dq_config="fused"),
    dict(ws_config="ws-M128-c1-s2", ws_dq_config="ws-M128-c1-s2"),
], ids=lambda k: "+".join(k.values()))
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80), (2, 2, 1, 130, 1100, 96)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_gpu_persistent_dkdv_matches_float64(shape, kernels, persistent_dkdv, monkeypatch, device):
    """The persistent grid against float64, with a grid of 3 programs so that every program walks several
    items (a GPU's 132 SMs would give these small shapes one item each): the ring's slots and the
    barriers' phases must run on across items, the next item's K/V must not land before the consumers
    are done with the last one's, fused dQ's reduces must be waited for before the program ends. Causal
    and not, GQA, Nq ≠ Nk both ways, ragged tiles, head-dim tails, fp16 and bf16."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    B, Hq, Hkv, Nq, Nk, D = shape
    if D % 64 and kernels["ws_config"] != "ws-M64-c2-s2":
        pytest.skip("a head-dim tail takes 64-row Q tiles and two consumers with fused dQ")
    monkeypatch.setattr(persistent_dkdv, "sm_count", lambda device: 3)
    for causal, dtype_name in ((False, "bf16"), (True, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=17)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, **kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("ws", ["ws-M32-c2-s3-x", "ws-M32-c2-s3"])
def test_gpu_persistent_dkdv_with_a_split_head_dim_matches_float64(ws, persistent_dkdv, monkeypatch, device):
    """D 256 (the consumers split the head dim, sharing the scores or recomputing them) on the persistent
    grid: the TMA epilogue through the shared K/V tile, then ``kv_free``, item after item."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    monkeypatch.setattr(persistent_dkdv, "sm_count", lambda device: 2)
    for causal in (False, True):
        q, k, v = make_qkv(2, 4, 300, 256, torch.bfloat16, device, Hkv=2, Nk=400, seed=19)
        check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16", ws_config=ws,
                        ws_dq_config="ws-M64-c1-s2")


@pytest.mark.gpu
def test_gpu_persistent_dkdv_default_plan_matches_float64(persistent_dkdv, device):
    """The default plan (the tuned tiles) on the persistent grid with the GPU's own SM count, at a size
    with more items than SMs (B 2, H 16, N 1100: 2 · 16 · 9 K/V tiles), causal and not."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Hopper backward kernels need sm_90")
    for D in (64, 128):
        for causal in (False, True):
            q, k, v = make_qkv(2, 16, 1100, D, torch.bfloat16, device, seed=23 + causal)
            check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16")
