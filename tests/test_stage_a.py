"""Stage A's own tests: non-finite scores, its backward kernels, its models.

The cross-stage tests (shapes, backward of every stage) live in test_shapes.py and test_backward.py;
these cover what is particular to the naive stage: the softmax kernel that sees S with -inf and +inf
entries, the saved P, and the N² memory models of training. Sizes are small: everything runs in the
Triton interpreter on a CPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness.reference import reference_attention, rel_err, torch_same_precision
from stages import STAGES, contract
from stages.a_naive import kernels
from tests.helpers import ABS_FLOOR, DTYPES, check_against_reference, check_gradients, make_qkv

attention = STAGES["a"].attention


def _fp16_score(q_row, k_row):
    """The score PyTorch's fp16 textbook formula computes for one (query, key) pair."""
    scale = 1.0 / math.sqrt(q_row.shape[-1])
    return (q_row * scale) @ k_row


# ---------------------------------------------------------------------------------- non-finite scores

@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_issue_23_score_that_overflows_to_minus_inf_leaves_the_row_finite(device, causal):
    # A large query against an opposite key makes one fp16 score overflow to -inf.
    # Softmax gives that key probability 0 and the row stays finite; the old per-lane online
    # max/sum computed exp(-inf - (-inf)) = NaN in the lane that had seen only that score.
    q, k, v = make_qkv(1, 2, 8, 16, torch.float16, device, seed=1)
    q[0, 0, 0, :] = 200.0   # the issue's row
    q[0, 0, -1, :] = 200.0  # the last row, which sees key 3 under causal masking too
    k[0, 0, 3, :] = -200.0
    assert _fp16_score(q[0, 0, 0], k[0, 0, 3]) == float("-inf"), "the test needs an fp16 overflow"
    o = attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_overflowed_scores_in_two_chunks_of_a_long_row(device, causal):
    # A row longer than the softmax kernel's chunk: the -inf scores land in different chunks, so the
    # per-lane maxima and their final merge meet -inf too.
    Nk = kernels.SOFTMAX_BLOCK + 40
    q, k, v = make_qkv(1, 1, 4, 16, torch.float16, device, Nk=Nk, seed=1)
    q[0, 0, -1, :] = 200.0  # the last row sees every key under bottom-right causal masking
    for j in (3, Nk - 2):
        k[0, 0, j, :] = -200.0
        assert _fp16_score(q[0, 0, -1], k[0, 0, j]) == float("-inf"), "the test needs an fp16 overflow"
    o = attention(q, k, v, causal=causal)
    check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype_name", ["fp16", "fp32"])
def test_a_minus_inf_key_entry_is_a_key_of_probability_zero(device, dtype_name, causal):
    # A -inf in K, met by positive query entries: that key scores -inf for every row, as in PyTorch,
    # and the rows are the softmax over the other keys.
    q, k, v = make_qkv(1, 2, 9, 16, DTYPES[dtype_name], device, seed=2)
    q[..., 0] = q[..., 0].abs() + 0.5
    k[0, 1, 5, 0] = float("-inf")
    o = attention(q, k, v, causal=causal)
    assert torch.isfinite(torch_same_precision(q, k, v, causal=causal)).all()
    check_against_reference(o, q, k, v, causal=causal, dtype_name=dtype_name)


def _eager(q, k, v, causal):
    """Eager PyTorch in the inputs' precision, NaNs left as softmax makes them (torch_same_precision
    turns the NaN rows of a causal problem into zeros, since it gives rows that see no key 0)."""
    s = (q * (1.0 / math.sqrt(q.shape[-1]))) @ k.transpose(-2, -1)
    if causal:
        Nq, Nk = s.shape[-2:]
        i, j = torch.arange(Nq, device=q.device)[:, None], torch.arange(Nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + Nk - Nq, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype_name", ["fp16", "fp32"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf")], ids=["+inf", "-inf"])
def test_a_inf_key_entry_gives_nan_exactly_where_pytorch_does(device, dtype_name, causal, bad):
    # With query entries of both signs, the bad key scores +inf for some rows (softmax: inf - inf =
    # NaN, the whole row NaN in PyTorch too) and -inf for others (probability 0, finite row).
    # Nq = Nk, so that every row sees a key even under causal masking.
    N = 8
    q, k, v = make_qkv(1, 2, N, 16, DTYPES[dtype_name], device, seed=3)
    q[..., 0] = torch.where(torch.arange(N, device=device) % 2 == 0, 1.0, -1.0).to(q.dtype)
    k[0, 0, 4, 0] = bad
    o = attention(q, k, v, causal=causal)
    textbook = _eager(q, k, v, causal)
    nan_rows = textbook.isnan().any(dim=-1)
    assert nan_rows.any() and not nan_rows.all(), "the test needs both kinds of row"
    assert torch.equal(o.isnan(), textbook.isnan())
    ref = reference_attention(q, k, v, causal=causal)
    finite = ~nan_rows
    torch_err = rel_err(textbook[finite], ref[finite])
    assert rel_err(o[finite], ref[finite]) <= max(2 * torch_err, ABS_FLOOR[dtype_name])


def test_a_row_whose_every_visible_score_is_minus_inf_outputs_zero(device):
    # Documented choice: PyTorch's softmax gives NaN for an all -inf row; stage A gives it no mass,
    # like a row that sees no key, so it outputs exactly 0 (and the other rows are untouched).
    q, k, v = make_qkv(1, 1, 3, 16, torch.float16, device, Nk=3, seed=4)
    q[0, 0, 0, :] = 200.0
    k[0, 0, 0, :] = -200.0  # under bottom-right causal masking with Nq = Nk, row 0 sees key 0 only
    assert _fp16_score(q[0, 0, 0], k[0, 0, 0]) == float("-inf")
    o = attention(q, k, v, causal=True)
    assert not o[0, 0, 0].any()
    ref = reference_attention(q, k, v, causal=True)
    assert rel_err(o[0, 0, 1:], ref[0, 0, 1:]) < 2e-3


# ---------------------------------------------------------------------------------- backward

# (B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout): the odd corners of the contract, each once.
GRAD_CASES = [
    (1, 1, 1, 1, 1, 16, "fp32", False, "bhnd"),      # N = 1
    (1, 1, 1, 1, 1, 16, "fp16", True, "bhnd"),
    (1, 2, 2, 37, 37, 80, "fp16", True, "bhnd"),     # ragged N, padded head dim
    (2, 2, 1, 40, 17, 32, "fp32", True, "bhnd"),     # Nq > Nk: the first 23 rows see no key
    (1, 2, 2, 9, 70, 16, "bf16", True, "bhnd"),      # Nq < Nk
    (1, 3, 3, 21, 50, 16, "fp16", False, "bhnd"),    # Nq < Nk, no mask
    (1, 4, 2, 19, 23, 8, "fp16", False, "bhnd"),     # GQA group 2, D = 8
    (2, 3, 1, 20, 12, 16, "bf16", True, "bhnd"),     # MQA, Nq > Nk
    (2, 4, 2, 33, 33, 24, "fp32", False, "bnhd"),    # strided views
    (1, 2, 1, 17, 29, 80, "fp16", True, "bnhd"),     # strided, MQA, padded head dim
]


@pytest.mark.parametrize("B, Hq, Hkv, Nq, Nk, D, dtype_name, causal, layout", GRAD_CASES,
                         ids=[f"{c[0]}x{c[1]}/{c[2]}x{c[3]}/{c[4]}x{c[5]}-{c[6]}-{'causal' if c[7] else 'full'}-"
                              f"{c[8]}" for c in GRAD_CASES])
def test_a_gradients(device, B, Hq, Hkv, Nq, Nk, D, dtype_name, causal, layout):
    q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, layout=layout, seed=5)
    check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name)


def test_a_rows_that_see_no_key_get_zero_output_and_zero_gradient(device):
    Nq, Nk = 12, 5
    q, k, v = make_qkv(1, 2, Nq, 16, torch.float32, device, Nk=Nk, seed=6)
    q.requires_grad_(True)
    o = attention(q, k, v, causal=True)
    o.backward(torch.randn_like(o))
    blind = Nq - Nk  # bottom-right alignment: row i sees key j iff j <= i + Nk - Nq
    assert not o[:, :, :blind].any() and not q.grad[:, :, :blind].any()
    assert o[:, :, blind:].abs().sum(dim=-1).all(), "the other rows see at least one key"


def test_a_backward_accepts_an_expanded_gradient(device):
    # o.sum().backward() hands the backward a dO of stride 0 in every dim.
    q, k, v = make_qkv(1, 2, 11, 16, torch.float32, device, Hkv=1, Nk=13, seed=7)
    check_gradients(attention, q, k, v, causal=True, dtype_name="fp32",
                    do=torch.ones((), dtype=q.dtype, device=device).expand(q.shape))


def test_a_saves_p_for_the_backward(device):
    # The lesson of stage A's training step: the forward keeps the whole Nq x Nk probability matrix.
    B, Hq, Hkv, Nq, Nk = 2, 4, 2, 6, 10
    q, k, v = make_qkv(B, Hq, Nq, 16, torch.float16, device, Hkv=Hkv, Nk=Nk, seed=8)
    o = attention(q.requires_grad_(True), k, v)
    saved = [tuple(t.shape) for t in o.grad_fn.saved_tensors]
    assert (B * Hq, Nq, Nk) in saved


# ---------------------------------------------------------------------------------- models

def test_a_models_are_registered():
    stage = STAGES["a"]
    assert stage.bwd_hbm_bytes is kernels.bwd_hbm_bytes
    assert stage.train_workspace_bytes is kernels.train_workspace_bytes


def test_a_train_workspace_grows_as_n_squared_and_exceeds_the_forward():
    small = contract.Problem(2, 8, 1024, 64, "fp16", Hkv=2)
    large = contract.Problem(2, 8, 2048, 64, "fp16", Hkv=2)
    train, fwd = STAGES["a"].train_workspace_bytes, STAGES["a"].workspace_bytes
    assert train(large) == 4 * train(small) and fwd(large) == 4 * fwd(small)
    assert train(small) > fwd(small)
    # The N² buffers are per query head: sharing K/V heads (GQA) does not shrink them.
    assert train(small) == train(contract.Problem(2, 8, 1024, 64, "fp16"))
    # Nq x Nk, not N²: doubling only the keys doubles them.
    assert train(contract.Problem(2, 8, 1024, 64, "fp16", Nk=2048)) == 2 * train(small)


def test_a_traffic_counts_the_real_head_dim_not_the_padded_tile():
    # Masked columns past D are never requested, so the bytes are affine in D: equal steps between
    # D = 64 (tile 64), 72 and 80 (tile 128). Counting the padded tile would break the steps.
    for model in (STAGES["a"].hbm_bytes, STAGES["a"].bwd_hbm_bytes):
        read = [model(contract.Problem(1, 4, 300, D, "fp16", Hkv=2, Nk=500)).read for D in (64, 72, 80)]
        assert read[2] - read[1] == read[1] - read[0] > 0


def test_a_traffic_models_nq_nk_gqa_and_causal():
    p = contract.Problem(2, 4, 300, 80, "fp16", Hkv=2, Nk=500)
    e, nn = p.element_bytes, p.heads * p.N * p.Nk * p.element_bytes
    fwd, bwd = STAGES["a"].hbm_bytes(p), STAGES["a"].bwd_hbm_bytes(p)
    assert fwd.write == 2 * nn + p.q_bytes                     # S, P, O
    assert bwd.write == 2 * nn + p.q_bytes + 2 * p.kv_bytes    # dP, dS, dQ, dK, dV
    assert fwd.read > 3 * nn        # S read twice, P once, plus the Q/K/V tiles
    assert bwd.read > 7 * nn        # P thrice (dV, two dS passes), dP twice, dS twice (dQ, dK), plus the tiles
    # Causal: the softmax skips the masked entries of S (two reads each), nothing else changes.
    causal = STAGES["a"].hbm_bytes(contract.Problem(2, 4, 300, 80, "fp16", True, Hkv=2, Nk=500))
    assert fwd.read - causal.read == 2 * p.heads * (p.N * p.Nk - contract.visible_pairs(p.N, p.Nk, True)) * e
    assert causal.write == fwd.write
    # GQA: each query head requests its K/V head's rows itself (the L2 may share them, the model does not).
    mha = STAGES["a"].hbm_bytes(contract.Problem(2, 4, 300, 80, "fp16", Nk=500))
    assert mha.read == fwd.read


@pytest.mark.slow
@pytest.mark.parametrize("arch", [80, 90])
def test_a_backward_compiles_for_real_gpus(arch):
    p = contract.Problem(1, 4, 100, 80, "bf16", True, Hkv=2, Nk=200)
    names = [k.name for k in STAGES["a"].compile(p, arch, backward=True)]
    assert names == ["naive_grad_kv_kernel", "naive_scores_kernel", "naive_softmax_bwd_kernel", "naive_pv_kernel",
                     "naive_grad_kv_kernel"]
