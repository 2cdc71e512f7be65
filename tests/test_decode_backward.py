"""Stage C's split-KV backward (stages/c_optimized/decode_backward.py) against float64 autograd.

Decoding-shaped problems (the group's query rows fit one tile, Nq < Nk) take this path; these tests
check that they do, that the gradients are the contract's with one split and with many, in every
dtype, with GQA, causal or not, key ranges, huge logits and gradients of any layout, that every
element is written (outputs are poisoned), that the result is bitwise reproducible, and that a cache
growing by a key per call compiles nothing new.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from stages.c_optimized import backward as bwd
from stages.c_optimized import decode, decode_backward
from stages.contract import Problem

from harness.reference import reference_gradients

from .helpers import ABS_FLOOR, DTYPES, check_gradients, make_qkv
from .test_stage_c_backward import attention, saved_forward


def many_splits(monkeypatch):
    """One K/V tile per split, so interpreter-sized caches still split several ways."""
    monkeypatch.setattr(decode, "MIN_TILES_PER_SPLIT", 1)


# (B, Hq, Hkv, Nq, Nk, D): decode MHA and MQA, GQA with a few new tokens, a padded head dim, the
# largest group of rows one tile takes (64), a ragged last tile, more splits than the reduction adds at once.
SHAPES = [
    (2, 2, 2, 1, 300, 16),
    (1, 4, 1, 1, 200, 32),
    (1, 8, 2, 3, 150, 80),
    (2, 4, 1, 16, 130, 16),
    (1, 2, 2, 1, 77, 64),
    (1, 2, 2, 1, 2560, 16),   # 40 splits: the reduction's second step of 32
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("splits", ["one", "many"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_split_backward_matches_float64(shape, splits, causal, monkeypatch, device):
    B, Hq, Hkv, Nq, Nk, D = shape
    if splits == "many":
        many_splits(monkeypatch)
    else:
        monkeypatch.setattr(decode_backward, "BACKWARD_WAVES", 0)  # (the count's floor: one split)
    q, k, v = make_qkv(B, Hq, Nq, D, torch.float16, device, Hkv=Hkv, Nk=Nk, seed=sum(shape))
    got = bwd.split_backward(q, k)
    assert got is not None, "a decoding-shaped backward should take the split kernel"
    assert (got[0] > 1) == (splits == "many"), got
    bwd._KEPT.clear()
    check_gradients(attention, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_split_backward_other_dtypes(dtype, monkeypatch, device):
    many_splits(monkeypatch)
    bwd._KEPT.clear()
    q, k, v = make_qkv(2, 6, 2, 48, DTYPES[dtype], device, Hkv=3, Nk=140, seed=11)
    check_gradients(attention, q, k, v, causal=True, dtype_name=dtype)


def test_huge_logits_and_strided_inputs(monkeypatch, device):
    """Inputs scaled so the logits reach the hundreds, in a [B, N, H, D] layout seen transposed: the
    recomputed P must still be the forward's, and the strides honoured."""
    many_splits(monkeypatch)
    bwd._KEPT.clear()
    q, k, v = make_qkv(2, 4, 2, 64, torch.float16, device, Hkv=2, Nk=150, seed=12, scale=4.0, layout="bnhd")
    assert not q.is_contiguous()
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp16", sm_scale=0.5)


def test_a_gradient_of_any_layout(monkeypatch, device):
    """``.sum()``'s gradient is an expanded tensor (stride 0): the backward takes it."""
    many_splits(monkeypatch)
    bwd._KEPT.clear()
    q, k, v = make_qkv(1, 4, 1, 32, torch.float16, device, Hkv=1, Nk=190, seed=13)
    do = torch.ones((), dtype=torch.float16, device=device).expand(1, 4, 1, 32)
    assert do.stride() == (0, 0, 0, 0)
    check_gradients(attention, q, k, v, causal=False, dtype_name="fp16", do=do)


def test_rows_that_see_no_key_and_keys_no_row_sees(monkeypatch, device):
    """Causal with a key range that leaves a batch entry no key: its rows' lse is +inf, their dQ
    exactly 0; every key outside a range gets exactly zero dK and dV, and nothing is NaN."""
    many_splits(monkeypatch)
    bwd._KEPT.clear()
    q, k, v = make_qkv(2, 4, 2, 16, torch.float16, device, Hkv=2, Nk=120, seed=14)
    starts = torch.tensor([10, 120], dtype=torch.int32, device=device)
    lengths = torch.tensor([90, 120], dtype=torch.int32, device=device)
    scale = 0.25
    o, lse = saved_forward(q[:, :, :, :], k[:, :, 10:90], v[:, :, 10:90], True, scale)
    o = torch.cat([o[:1], torch.zeros_like(o[1:])])
    lse = torch.cat([lse[:1], torch.full_like(lse[1:], math.inf)])
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(15)).to(q.dtype).to(device)
    dq, dk, dv = bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=scale, key_starts=starts,
                                        key_lengths=lengths)
    ref = reference_gradients(q[:1], k[:1, :, 10:90], v[:1, :, 10:90], do[:1], causal=True, sm_scale=scale)
    assert not dq[1].any() and not dk[1].any() and not dv[1].any()
    assert not dk[0, :, :10].any() and not dk[0, :, 90:].any() and not dv[0, :, 90:].any()
    for g, r in zip((dq[:1], dk[:1, :, 10:90], dv[:1, :, 10:90]), ref):
        assert (g.double() - r).abs().max() <= 4 * ABS_FLOOR["fp16"] * max(1.0, r.abs().max().item())


def test_bitwise_reproducible_and_deterministic_is_the_same_path(monkeypatch, device):
    """No atomics: two runs agree bit for bit, and ``deterministic=True`` runs the same kernels."""
    many_splits(monkeypatch)
    bwd._KEPT.clear()
    q, k, v = make_qkv(1, 8, 1, 64, torch.bfloat16, device, Hkv=2, Nk=400, seed=16)
    o, lse = saved_forward(q, k, v, False, 0.125)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(17)).to(q.dtype).to(device)
    runs = [bwd.attention_backward(do, q, k, v, o, lse, causal=False, scale=0.125, deterministic=d)
            for d in (False, False, True)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_path_is_for_decoding_shapes_and_the_switches_that_ask_for_it():
    """The split backward takes a problem when the group's rows fit one tile after a cache, with the
    tuned tiles and exp2 on and no kernel forced; never where the rows do not fit, Nq = Nk, or the
    ablation turned it off."""
    def split(Hq, Hkv, Nq, Nk, **kw):
        q = torch.empty(1, Hq, Nq, 64, device="meta", dtype=torch.float16)
        k = torch.empty(1, Hkv, Nk, 64, device="meta", dtype=torch.float16)
        return bwd.split_backward(q, k, **kw)

    assert split(32, 8, 1, 4096) is not None and split(32, 32, 1, 4096) is not None
    assert split(8, 2, 16, 4096) is not None           # 4 heads × 16 rows = 64: one tile
    assert split(8, 2, 17, 4096) is None               # 68 rows
    assert split(4, 4, 512, 512) is None               # a prompt: Nq = Nk
    assert split(32, 8, 1, 4096, tuned_tiles=False) is None
    assert split(32, 8, 1, 4096, exp2=False) is None
    assert split(32, 8, 1, 4096, forced=True) is None


def test_a_growing_cache_keeps_one_kernel():
    """Nk reaches the kernels as a runtime value: the launches of a cache growing one key at a time
    specialize identically (one compiled kernel for the whole loop, as Triton keys it), while the
    split count follows Nk."""
    from dataclasses import replace

    from .test_host_path import _jit_function

    specs, counts = set(), set()
    for Nk in range(4090, 4300, 7):
        q = torch.empty(4, 32, 1, 128, device="meta", dtype=torch.bfloat16)
        k = torch.empty(4, 8, Nk, 128, device="meta", dtype=torch.bfloat16)
        lse = torch.empty(4, 32, 1, device="meta")
        splits, chunk = bwd.split_backward(q, k)
        counts.add(splits)
        part = torch.empty(decode_backward.workspace_shape(4, 32, 1, 128, splits), device="meta")
        launches = decode_backward.plan(q, q, k, k, q, lse, q, k, k, part, causal=True, scale=0.1, splits=splits,
                                        chunk=chunk)
        for launch in launches:
            sig, constexprs, attrs = replace(launch, kernel=_jit_function(launch.kernel)).specialization()
            specs.add((_jit_function(launch.kernel).fn.__name__, tuple(sig.items()), tuple(sorted((n, str(c)) for n, c in constexprs.items())),
                       tuple(sorted((str(n), str(a)) for n, a in attrs.items()))))
    assert len(specs) == 2  # the split kernel's one and the reduction's one
    assert len(counts) > 1, counts


def test_traffic_model_is_the_least_a_backward_moves():
    """K and V read once and dK, dV written once, plus a few rows per split: within 1 % of that floor
    at a long cache."""
    p = Problem(B=4, H=32, N=1, D=128, dtype="fp16", Hkv=32, Nk=32768)
    traffic = bwd.bwd_hbm_bytes(p)
    assert traffic == decode_backward.hbm_bytes(p, 132)
    floor = 4 * p.kv_bytes
    assert floor <= traffic.read + traffic.write <= 1.01 * floor


@pytest.mark.skipif(sys.platform == "win32", reason="a child process with another environment")
def test_a_bad_switch_names_itself():
    env = dict(os.environ, LAB_BWD_SPLIT_KV="yes")
    r = subprocess.run([sys.executable, "-c", "import stages.c_optimized.decode_backward"], env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "LAB_BWD_SPLIT_KV must be 0 (off) or 1 (on), got 'yes'" in r.stderr


@pytest.mark.parametrize("D,dtype", [(128, "bf16"), (64, "fp16"), (256, "bf16")])
def test_compiles_for_sm90_without_spills(D, dtype):
    from harness.inspect_code import run_ptxas

    p = Problem(B=4, H=32, N=1, D=D, dtype=dtype, Hkv=8, Nk=32768)
    kernels = bwd.compile_backward(p, 90)
    assert [c.name for c in kernels] == ["split_kv_backward_kernel", "reduce_dq_kernel"]
    for c in kernels:
        usage = run_ptxas(c.asm["ptx"], "sm_90a")
        assert "ptxas_error" not in usage and usage["spill_stores"] == usage["spill_loads"] == 0, (c.name, usage)


@pytest.mark.parametrize("arch,D,dtype,Hq,Hkv,Nq", [(90, 256, "fp16", 8, 2, 16), (90, 128, "bf16", 8, 2, 1),
                                                   (80, 128, "fp32", 8, 2, 4), (80, 64, "fp16", 4, 1, 16)])
def test_the_shared_memory_estimate_bounds_the_compiled_kernel(arch, D, dtype, Hq, Hkv, Nq):
    """The path is taken only where ``shared_bytes`` fits the GPU: the estimate must not be below what
    Triton allocates (at 64 rows on sm_90 the matmul operands live in shared memory too)."""
    p = Problem(B=1, H=Hq, N=Nq, D=D, dtype=dtype, Hkv=Hkv, Nk=4096, causal=True)
    compiled = bwd.compile_backward(p, arch)[0]
    assert compiled.name == "split_kv_backward_kernel"
    e = p.element_bytes
    assert compiled.shared_bytes <= decode_backward.shared_bytes(decode_backward.split_backward_tiles(
        Hq // Hkv, Nq, D, e), D, e)
    # ... and a problem whose estimate does not fit takes the ordinary kernels
    wide = Problem(B=1, H=8, N=16, D=256, dtype="fp32", Hkv=2, Nk=4096)
    assert bwd.compile_backward(wide, arch)[0].name != "split_kv_backward_kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(4, 32, 32, 1, 4099, 128), (2, 32, 8, 1, 8192, 128), (1, 8, 2, 16, 2000, 64),
                                   (1, 16, 16, 1, 3000, 256), (3, 12, 4, 5, 1537, 80)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_gpu_split_backward_matches_float64(shape, causal, device):
    """On the GPU at decode sizes (the default split count, launched the lean and bound ways: three calls)."""
    B, Hq, Hkv, Nq, Nk, D = shape
    bwd._KEPT.clear()
    q, k, v = make_qkv(B, Hq, Nq, D, torch.bfloat16, device, Hkv=Hkv, Nk=Nk, seed=sum(shape))
    for _ in range(2):
        attention(*(t.detach().clone().requires_grad_(True) for t in (q, k, v)), causal=causal).sum().backward()
    check_gradients(attention, q, k, v, causal=causal, dtype_name="bf16")
