"""Every Triton stage is differentiable through its own backward kernels: gradients against float64
autograd of the textbook formula, on the shapes the forward tests use.

Each gradient must be within 3× PyTorch's same-precision autograd error (or under the rounding
floor). GQA: dK and dV of a KV head sum over its query heads. Rows that see no key (causal,
Nq > Nk) get zero gradients.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from harness.reference import reference_gradients
from stages import STAGES

from .helpers import DTYPES, check_gradients, fp32_rounding_floors, make_qkv

TRITON_STAGES = ["a", "b", "c"]

# (B, Hq, Hkv, Nq, Nk, D, dtype, causal)
CASES = [
    (2, 3, 3, 33, 33, 64, "fp16", True),     # ragged self-attention, B and H hold different data
    (1, 4, 2, 17, 40, 32, "bf16", True),     # GQA, Nq < Nk (bottom-right causal)
    (2, 2, 1, 30, 12, 16, "fp32", True),     # MQA, Nq > Nk: rows that see no key
    (1, 2, 2, 1, 1, 16, "fp16", False),      # N = 1
    (1, 2, 1, 20, 29, 80, "fp16", False),    # head dim 80 (padded), MQA
    (1, 2, 2, 70, 70, 32, "fp32", False),    # more than one tile, fp32 (IEEE dots)
]


def _case_id(c):
    B, Hq, Hkv, Nq, Nk, D, dtype, causal = c
    return f"B{B}-Hq{Hq}-Hkv{Hkv}-Nq{Nq}-Nk{Nk}-D{D}-{dtype}-{'causal' if causal else 'full'}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gradients_match_float64(stage, case, device):
    B, Hq, Hkv, Nq, Nk, D, dtype, causal = case
    q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype], device, Hkv=Hkv, Nk=Nk)
    check_gradients(STAGES[stage].attention, q, k, v, causal=causal, dtype_name=dtype)


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gradients_of_strided_inputs(stage, device):
    q, k, v = make_qkv(1, 4, 24, 64, torch.float16, device, layout="bnhd", Hkv=2, Nk=24)
    check_gradients(STAGES[stage].attention, q, k, v, causal=True, dtype_name="fp16")


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_gradients_with_large_logits(stage, dtype, device):
    """Scores around 1e3: the backward recomputes P from the saved row statistics (B, C) or reads
    the saved P (A); either way exp must not overflow.

    Two roundings dominate at such logits, and PyTorch's same-precision autograd has neither as the
    kernels do, so its error is no measure of them (3× it failed a correct kernel a few times in a
    hundred draws):

    * stage A stores S in the inputs' dtype (as PyTorch's eager ``q @ kᵀ`` would, but PyTorch rounds
      ``q·scale`` first): in fp16 at |S| ~ 500 the spacing is 0.25, every P carries it, and stage A
      is held to the float64 gradients of attention with S rounded as it stores it;
    * in fp32 stages B and C rebuild P = 2^(s·log2e − lse) from a saved log-sum-exp about as large
      as the largest logit, with fp32's spacing there: the floor is the error that rounding causes in
      each gradient (``fp32_rounding_floors``), 3× over.

    A wrong gradient is off by orders of magnitude more than either."""
    q, k, v = make_qkv(1, 2, 40, 32, DTYPES[dtype], device, scale=12.0)
    kw = {}
    if stage == "a" and dtype != "fp32":
        kw["reference"] = partial(reference_gradients, scores_dtype=DTYPES[dtype])
    if dtype == "fp32":
        kw["abs_floor"] = partial(fp32_rounding_floors, causal=True)
    check_gradients(STAGES[stage].attention, q, k, v, causal=True, dtype_name=dtype, **kw)


@pytest.mark.parametrize("stage", TRITON_STAGES)
def test_backward_uses_the_stage_models(stage):
    """A stage with a backward publishes its traffic and training-memory models."""
    from stages.contract import Problem

    s = STAGES[stage]
    assert s.bwd_hbm_bytes is not None and s.train_workspace_bytes is not None
    small, large = Problem(1, 4, 1024, 64, "fp16", True), Problem(1, 4, 4096, 64, "fp16", True)
    assert s.bwd_hbm_bytes(small).total > 0
    ratio = s.train_workspace_bytes(large) / max(1, s.train_workspace_bytes(small))
    if stage == "a":
        assert ratio > 10, "stage A saves P: its training memory grows as N²"
    else:
        assert ratio < 6, "stages B and C save O(N) row statistics only"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_stage_b_lse_entry_points(causal, device):
    """Stage B's public (O, lse) forward and its backward from a given O and lse (what ring attention
    calls): lse is the float64 log-sum-exp of the scaled scores, +inf where a row sees no key, and the
    backward equals the stage's own autograd."""
    from stages.b_tiled import attention_backward, attention_with_lse

    q, k, v = make_qkv(1, 4, 30, 32, torch.float16, device, Hkv=2, Nk=20, seed=3)
    o, lse = attention_with_lse(q, k, v, causal=causal)
    scale = 32 ** -0.5
    s = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-2, -1)) * scale
    if causal:  # bottom-right: row i sees key j iff j <= i + Nk - Nq; rows 0..9 see none
        i, j = torch.arange(30, device=q.device)[:, None], torch.arange(20, device=q.device)[None, :]
        s = s.masked_fill(j > i - 10, float("-inf"))
    want = torch.logsumexp(s, dim=-1)
    want = torch.where(torch.isinf(want), torch.inf, want)
    assert torch.allclose(lse.double(), want, atol=1e-2, rtol=1e-3, equal_nan=False)
    do = torch.randn_like(o)
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(STAGES["b"].attention(qg, kg, vg, causal=causal), (qg, kg, vg), do)
    for got, exp in zip((dq, dk, dv), ref):
        assert torch.equal(got, exp)
    with pytest.raises(ValueError, match="lse must be a contiguous float32"):
        attention_backward(do, q, k, v, o, lse.double(), causal=causal, scale=scale)
