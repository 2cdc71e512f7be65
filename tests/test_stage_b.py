"""Stage B on the extended contract: GQA/MQA, Nq != Nk with bottom-right causal masking (rows that
see no key), head dims padded inside the kernel, and its own backward kernels with both ways of
computing dQ. Small shapes: everything here runs in the CPU interpreter in well under a minute."""

from __future__ import annotations

import re

import pytest
import torch

from stages import STAGES
from stages.b_tiled import cuda_twin, kernels
from stages.contract import HbmTraffic, Problem, cdiv
from tests.helpers import DTYPES, check_against_reference, check_gradients, make_qkv

attention = STAGES["b"].attention

# (B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout): each line an odd corner of the contract.
SHAPES = [
    pytest.param(1, 2, 2, 1, 5, 16, "fp16", True, "bhnd", id="decode-one-query"),
    pytest.param(1, 2, 1, 70, 65, 80, "fp16", True, "bnhd", id="gqa-ragged-d80-strided"),
    pytest.param(1, 4, 1, 37, 100, 8, "bf16", False, "bhnd", id="mqa-nq<nk-d8"),
    pytest.param(1, 2, 2, 100, 37, 24, "fp32", True, "bhnd", id="nq>nk-empty-rows"),
    pytest.param(1, 4, 2, 90, 20, 16, "fp16", True, "bnhd", id="gqa-empty-rows-strided"),
    pytest.param(2, 3, 3, 33, 65, 32, "fp32", False, "bnhd", id="batch-strided-fp32"),
    pytest.param(1, 2, 1, 9, 40, 256, "fp32", True, "bhnd", id="d256-fp32-small-tiles"),
    pytest.param(1, 2, 2, 6, 7, 136, "bf16", False, "bnhd", id="d136-padded-to-256"),
    pytest.param(1, 2, 1, 45, 70, 200, "fp16", True, "bhnd", id="d200-gqa-several-backward-tiles"),
]


def _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, layout, seed=0):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return make_qkv(B, Hq, Nq, D, DTYPES[dtype], device, Hkv=Hkv, Nk=Nk, layout=layout, seed=seed)


@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,dtype,causal,layout", SHAPES)
def test_forward(B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout):
    q, k, v = _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, layout)
    o = attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.parametrize("dq_method", kernels.DQ_METHODS)
@pytest.mark.parametrize("B,Hq,Hkv,Nq,Nk,D,dtype,causal,layout", SHAPES)
def test_gradients(B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout, dq_method):
    q, k, v = _inputs(B, Hq, Hkv, Nq, Nk, D, dtype, layout)
    check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype, dq_method=dq_method)


@pytest.mark.parametrize("dq_method", kernels.DQ_METHODS)
def test_rows_that_see_no_key_are_exactly_zero(dq_method):
    """Causal with Nq > Nk: the first Nq - Nk query rows see no key. Their output and their dQ must
    be exactly 0 (not NaN, not tiny), while the other rows still get their gradients."""
    Nq, Nk = 80, 30
    q, k, v = (t.requires_grad_(True) for t in _inputs(1, 2, 1, Nq, Nk, 16, "fp16", "bhnd"))
    o = attention(q, k, v, causal=True, dq_method=dq_method)
    o.backward(torch.randn(o.shape).to(o.dtype).to(o.device))
    empty = Nq - Nk
    assert torch.equal(o[:, :, :empty], torch.zeros_like(o[:, :, :empty]))
    assert torch.equal(q.grad[:, :, :empty], torch.zeros_like(q.grad[:, :, :empty]))
    assert q.grad[:, :, empty:].abs().amax() > 0 and k.grad.abs().amax() > 0


def test_separate_dq_is_bitwise_reproducible():
    """Every gradient element is summed by one program in a fixed order: same inputs, same bits."""
    q, k, v = _inputs(1, 4, 2, 70, 90, 24, "fp16", "bhnd")
    do = torch.randn(q.shape).to(q.dtype).to(q.device)

    def run():
        qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o = attention(qs, ks, vs, causal=True, dq_method="separate")
        o.backward(do)
        return o.detach(), qs.grad, ks.grad, vs.grad

    for first, second in zip(run(), run()):
        assert torch.equal(first, second)


def test_broadcast_output_gradient():
    """``o.sum().backward()`` hands the backward a dO whose strides are all 0."""
    q, k, v = _inputs(1, 2, 1, 20, 30, 16, "fp32", "bhnd")
    do = torch.ones(1, 1, 1, 1, dtype=q.dtype, device=q.device).expand(q.shape)
    assert do.stride(-1) == 0
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp32", do=do)


def test_forward_only_call_skips_autograd():
    """Without gradients only the forward kernel runs (no L is written, no graph is kept)."""
    q, k, v = _inputs(1, 2, 2, 10, 10, 16, "fp16", "bhnd")
    assert attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert attention(q.requires_grad_(True), k, v).grad_fn is None
    assert attention(q, k, v).grad_fn is not None


def test_bad_dq_method_is_named():
    q, k, v = _inputs(1, 1, 1, 4, 4, 16, "fp16", "bhnd")
    p = Problem(1, 1, 4, 16)
    for call in (lambda: attention(q, k, v, dq_method="fast"),
                 lambda: kernels.bwd_hbm_bytes(p, dq_method="fast"),
                 lambda: kernels.hbm_bytes(p, dq_method="fast"),
                 lambda: kernels.train_workspace_bytes(p, dq_method="fast")):
        with pytest.raises(ValueError, match=r"dq_method must be one of 'separate', 'atomic', got 'fast'"):
            call()


# ---------------------------------------------------------------------------------- models

def test_forward_model_counts_kv_per_query_head():
    """Each (query head, Q tile) program re-reads its group's K/V head: the requested bytes depend on
    Hq and Nk, not on how many K/V heads there are; L is counted only when asked for."""
    B, Hq, Hkv, Nq, Nk, D = 2, 8, 2, 300, 500, 80
    e = 2
    gqa = kernels.hbm_bytes(Problem(B, Hq, Nq, D, "fp16", Hkv=Hkv, Nk=Nk))
    assert gqa.read == B * Hq * D * e * (Nq + 2 * cdiv(Nq, kernels.BLOCK_M) * Nk)
    assert gqa.write == B * Hq * Nq * D * e
    assert gqa == kernels.hbm_bytes(Problem(B, Hq, Nq, D, "fp16", Hkv=Hq, Nk=Nk))
    with_lse = kernels.hbm_bytes(Problem(B, Hq, Nq, D, "fp16", Hkv=Hkv, Nk=Nk), write_lse=True)
    assert with_lse.write - gqa.write == B * Hq * Nq * 4 and with_lse.read == gqa.read


def test_tiles_shrink_only_where_registers_force_it():
    full = (kernels.BLOCK_M, kernels.BLOCK_N)
    assert kernels.tile_shape(256, "bf16") == kernels.tile_shape(128, "fp16") == kernels.tile_shape(8, "bf16") == full
    half = kernels.tile_shape(256, "fp32")
    assert half == kernels.tile_shape(8, torch.float32) and half[0] < full[0] and half[1] < full[1]
    # the traffic model follows the tile: half-height Q tiles re-read K and V twice as often
    p = Problem(1, 1, 1024, 64, "fp32")
    assert kernels.hbm_bytes(p).read == 1024 * 64 * 4 * (1 + 2 * cdiv(1024, half[0]))
    # the backward's two fp32 accumulators: halved at every D > 128, whatever the input dtype
    assert kernels.tile_shape(256, "bf16", backward=True) == kernels.tile_shape(136, "fp16", backward=True) == half
    assert kernels.tile_shape(128, "fp16", backward=True) == full
    wide, narrow = (kernels.bwd_hbm_bytes(Problem(1, 1, 1024, D, "fp16")) for D in (256, 128))
    assert wide.read > 2 * narrow.read  # twice the columns, and the Q/dO re-reads of twice the K/V tiles


def test_backward_model_follows_its_derivation():
    B, Hq, Hkv, Nq, Nk, D = 2, 8, 2, 300, 500, 80
    p = Problem(B, Hq, Nq, D, "bf16", True, Hkv=Hkv, Nk=Nk)
    row, R, Tk, Tq = D * 2, B * Hq * Nq, cdiv(Nk, kernels.BLOCK_N), cdiv(Nq, kernels.BLOCK_M)
    kv = 2 * B * Hkv * Nk * row
    common_read = 2 * R * row + kv + Tk * R * (2 * row + 8)
    common_write = 4 * R + kv
    sep = kernels.bwd_hbm_bytes(p)
    assert sep == HbmTraffic(read=common_read + R * (2 * row + 8) + 2 * B * Hq * Tq * Nk * row,
                             write=common_write + R * row)
    acc = 4 * R * D
    assert kernels.bwd_hbm_bytes(p, dq_method="atomic") == HbmTraffic(
        read=common_read + Tk * acc + acc, write=common_write + acc + Tk * acc + R * row)
    # fp32: the atomics add straight into dQ, so there is no cast (and no buffer besides dQ)
    p32 = Problem(B, Hq, Nq, D, "fp32", True, Hkv=Hkv, Nk=Nk)
    row32, kv32 = D * 4, 2 * B * Hkv * Nk * D * 4
    Tk32 = cdiv(Nk, kernels.tile_shape(D, "fp32", backward=True)[1])  # fp32 runs 32-row tiles
    assert kernels.bwd_hbm_bytes(p32, dq_method="atomic") == HbmTraffic(
        read=2 * R * row32 + kv32 + Tk32 * R * (2 * row32 + 8) + Tk32 * acc,
        write=4 * R + kv32 + acc + Tk32 * acc)
    assert kernels.train_workspace_bytes(p) == 8 * R
    assert kernels.train_workspace_bytes(p, dq_method="atomic") == 8 * R + acc
    assert kernels.train_workspace_bytes(p32, dq_method="atomic") == 8 * R


def test_registered_with_backward_models_and_the_atomic_variant():
    stage = STAGES["b"]
    assert stage.bwd_hbm_bytes is kernels.bwd_hbm_bytes
    assert stage.train_workspace_bytes is kernels.train_workspace_bytes
    assert stage.variants == {"dq-atomic": {"dq_method": "atomic"}}
    p = Problem(1, 4, 128, 64, Hkv=2)
    for kwargs in stage.variants.values():  # the harness calls hbm_bytes with a variant's keywords
        assert stage.hbm_bytes(p, **kwargs) == stage.hbm_bytes(p)
        assert stage.bwd_hbm_bytes(p, **kwargs) != stage.bwd_hbm_bytes(p)


# ---------------------------------------------------------------------------------- the CUDA twin

@pytest.mark.parametrize("q_shape,kv_shape,message", [
    ((1, 4, 8, 64), (1, 2, 8, 64), r"Hkv = 2 heads .* Hq = 4"),
    ((1, 2, 8, 64), (1, 2, 9, 64), r"Nk = 9 rows .* Nq = 8"),
    ((1, 2, 8, 80), (1, 2, 8, 80), r"head dim D .* one of \[64, 128\], got 80"),
])
def test_cuda_twin_refuses_extended_shapes_before_compiling(q_shape, kv_shape, message):
    """A ValueError, not nvcc's or the GPU's complaint: on this CPU-only machine the shape check
    must come before the 'needs a CUDA GPU' error."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.zeros(q_shape, dtype=torch.float16, device=device)
    k = v = torch.zeros(kv_shape, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match=message):
        cuda_twin.attention(q, k, v)


# ---------------------------------------------------------------------------------- compiled code

@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_backward_kernels_compile(arch):
    """The backward kernels compile for real GPUs (the interpreter accepts more than the compiler);
    only the atomic method's PTX has the fp32 atomic reduction, and nothing is pipelined."""
    p = Problem(1, 4, 200, 80, "fp16", True, Hkv=2, Nk=300)
    names = {}
    for method in kernels.DQ_METHODS:
        compiled = STAGES["b"].compile(p, arch, dq_method=method)
        names[method] = [k.name for k in compiled]
        # fp32 atomic adds to global memory: red.global.add.f32, or atom.global.*.add(.v4).f32
        atomics = sum(len(re.findall(r"\b(?:red|atom)\.global\.[\w.]*add[\w.]*f32", k.asm["ptx"]))
                      for k in compiled)
        assert (atomics > 0) == (method == "atomic")
        assert all(k.num_stages == 1 and "cp.async" not in k.asm["ptx"] for k in compiled)
    assert names["separate"] == list(STAGES["b"].kernel_names)
    assert names["atomic"] == list(STAGES["b"].kernel_names[:3])
