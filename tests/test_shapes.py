"""The shapes real models run, through every Triton stage, against the float64 reference.

Grouped-query attention (query head h reads KV head h // (Hq / Hkv)), query and key lengths that
differ (causal aligned to the bottom right: query i sees key j iff j <= i + Nk - Nq, and a row that
sees no key is zero), every head dim that is a multiple of 8, single-query decode, strided views, and
inputs that push the softmax to its edges (scores that overflow to -inf, infinite keys).
CPU: the Triton interpreter at small sizes; on a GPU the same cases run compiled.
"""

from __future__ import annotations

import pytest
import torch

from harness.reference import torch_same_precision
from stages import STAGES

from .helpers import DTYPES, check_against_reference, make_qkv

TRITON_STAGES = ["a", "b", "c"]

# (B, Hq, Hkv, Nq, Nk, D, dtype): GQA groups of 2 and 3, MQA, Nq < Nk, Nq > Nk (causal rows that see
# nothing), a single query against a longer cache, Nq = Nk = 1; dtypes spread over the cases.
SHAPES = [
    (2, 4, 2, 17, 33, 64, "fp16"),
    (1, 6, 2, 40, 40, 32, "bf16"),
    (2, 3, 1, 40, 9, 16, "fp16"),
    (1, 4, 1, 1, 70, 64, "bf16"),
    (2, 2, 2, 65, 130, 32, "fp32"),
    (1, 2, 1, 1, 1, 16, "fp16"),
]


def _shape_id(s):
    B, Hq, Hkv, Nq, Nk, D, dtype = s
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-D{D}-{dtype}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gqa_and_cross_lengths(stage, shape, causal, device):
    B, Hq, Hkv, Nq, Nk, D, dtype = shape
    q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype], device, Hkv=Hkv, Nk=Nk)
    o = STAGES[stage].attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)
    if causal and Nq > Nk:
        # rows i < Nq - Nk see no key under the bottom-right mask: exactly zero, not NaN
        assert not o[:, :, : Nq - Nk].any()


@pytest.mark.parametrize("D", [8, 24, 72, 80, 96, 112, 200])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_head_dims_that_are_not_powers_of_two(stage, D, device):
    """Padded to the next power of two inside the kernel; the padding must not leak into O."""
    dtype = "fp16" if D != 72 else "bf16"
    q, k, v = make_qkv(2, 2, 21, D, DTYPES[dtype], device, Hkv=1, Nk=37)
    for causal in (False, True):
        o = STAGES[stage].attention(q, k, v, causal=causal)
        check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_strided_gqa_views(stage, device):
    """[B, N, H, D] tensors transposed to [B, H, N, D] with fewer K/V heads than query heads."""
    q, k, v = make_qkv(2, 4, 30, 80, torch.float16, device, layout="bnhd", Hkv=2, Nk=50)
    assert not q.is_contiguous() and not k.is_contiguous()
    for causal in (False, True):
        o = STAGES[stage].attention(q, k, v, causal=causal)
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_a_score_that_overflows_to_minus_inf(stage, device):
    """fp16, one query of 200s against one key of -200s: the score (-2e5·scale... stored or
    accumulated in fp16 by a textbook kernel) is -inf. Textbook attention gives that key weight 0 and
    a finite row; so must every stage."""
    q, k, v = make_qkv(1, 2, 8, 64, torch.float16, device)
    q[0, 0, 0, :] = 200.0
    k[0, 0, 3, :] = -200.0
    o = STAGES[stage].attention(q, k, v)
    assert torch.isfinite(o).all()
    check_against_reference(o, q, k, v, causal=False, dtype_name="fp16")


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_infinite_keys_behave_like_textbook_attention(stage, device):
    """A key with an infinite component. With every query's matching component positive, -inf
    makes that key's score -inf (it gets weight 0, the row stays finite), and +inf makes it +inf
    (softmax is inf/inf: textbook attention gives NaN for those rows, and so may a stage, but only
    there)."""
    q, k, v = make_qkv(1, 2, 12, 32, torch.float16, device, Nk=20)
    q[..., 0] = q[..., 0].abs() + 0.1
    k_minus = k.clone()
    k_minus[0, 0, 5, 0] = float("-inf")
    o = STAGES[stage].attention(q, k_minus, v)
    assert torch.isfinite(o).all()
    check_against_reference(o, q, k_minus, v, causal=False, dtype_name="fp16")

    k_plus = k.clone()
    k_plus[0, 1, 7, 0] = float("inf")
    o = STAGES[stage].attention(q, k_plus, v)
    textbook = torch_same_precision(q, k_plus, v)
    # head (0, 0) does not meet the infinite key: finite and correct
    assert torch.isfinite(o[0, 0]).all()
    check_against_reference(o[:, :1], q[:, :1], k_plus[:, :1], v[:, :1], causal=False, dtype_name="fp16")
    # head (0, 1): NaN only where the textbook formula is NaN
    assert not (torch.isnan(o[0, 1]) & ~torch.isnan(textbook[0, 1])).any()


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_errors_name_the_argument(stage, device):
    q, k, v = make_qkv(1, 4, 8, 64, torch.float16, device, Hkv=2)
    attention = STAGES[stage].attention
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        attention(q, k[:, :1].expand(1, 3, 8, 64).contiguous(), v[:, :1].expand(1, 3, 8, 64).contiguous())
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="head dim"):
        q81, k81, v81 = make_qkv(1, 1, 4, 81, torch.float16, device)
        attention(q81, k81, v81)
    with pytest.raises(ValueError, match="batch size"):
        attention(q, k[:0], v[:0])
    with pytest.raises(ValueError, match="meta device"):
        attention(*(torch.empty((1, 2, 4, 64), dtype=torch.float16, device="meta") for _ in range(3)))


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    """With the interpreter off (a GPU machine), CPU tensors would reach a compiled kernel as bad
    pointers: a clear error instead."""
    from stages.contract import validate_inputs

    q, k, v = make_qkv(1, 2, 8, 64, torch.float16, "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="on the CPU"):
        validate_inputs(q, k, v)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert validate_inputs(q, k, v) == pytest.approx(64 ** -0.5)


def test_a_remembered_layout_still_refuses_every_wrong_input(monkeypatch):
    """``validate_inputs`` remembers the layouts that passed (on a GPU; here switched on for CPU
    tensors): the same layout passes again with the same scale, and an input that differs from it in
    any checked fact is still refused with its message, never waved through by the memory."""
    from stages import contract
    from stages.contract import validate_inputs

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # (CPU tensors are refused where the kernels are compiled)
    monkeypatch.setattr(contract, "remember_cpu_layouts", True)
    monkeypatch.setattr(contract, "_PASSED", {})
    q, k, v = make_qkv(2, 4, 8, 64, torch.float16, "cpu", Hkv=2)
    assert validate_inputs(q, k, v, causal=True) == pytest.approx(64 ** -0.5)
    assert validate_inputs(q, k, v, causal=True, sm_scale=0.5) == 0.5
    assert len(contract._PASSED) == 2
    assert validate_inputs(q, k, v, causal=True) == pytest.approx(64 ** -0.5)  # remembered
    assert validate_inputs(q, k, v, causal=True, sm_scale=0.5) == 0.5
    assert len(contract._PASSED) == 2
    wrong = {
        "multiple of the key/value heads": lambda: validate_inputs(q[:, :3], k, v),
        "same shape": lambda: validate_inputs(q, k, v[:, :, :5]),
        "one dtype": lambda: validate_inputs(q, k.float(), v),
        "contiguous in its last": lambda: validate_inputs(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v),
        "causal must be a bool": lambda: validate_inputs(q, k, v, causal=1),
        "sm_scale must be a finite": lambda: validate_inputs(q, k, v, causal=True, sm_scale=float("nan")),
        "sm_scale must be a finite positive": lambda: validate_inputs(q, k, v, causal=True, sm_scale=-0.5),
        "meta device": lambda: validate_inputs(q.to("meta"), k.to("meta"), v.to("meta"), causal=True),
    }
    for message, call in wrong.items():
        with pytest.raises((ValueError, TypeError), match=message):
            call()
    assert len(contract._PASSED) == 2  # nothing wrong was remembered
