"""Problems drawn at random from the stage contract, each held to float64: the shapes, layouts and
options no other test names.

The other tests pick their cells: a head dim per path, a few odd lengths, one GQA ratio at a time.
A user's model picks its own, and so does anyone re-checking the lab on shapes it was never shown.
So each draw here takes every free choice of the contract (DESIGN.md's stage contract) at random at
once: the batch, the K/V heads and the group size, any head dim that is a multiple of 8 up to 256,
Nq and Nk from 1 up (equal, a decode step's few rows, a chunk after a cache, or more queries than
keys, whose first rows see nothing when causal), causal or not, the dtype, the heads interleaved or
not in memory, logits from mild to huge; and for the backward the gradient's layout (dense, a
transposed view, or the single value ``o.sum()`` expands) and, for stage C, the deterministic order.
The draw's forward and its gradients are held to float64 as every stage test holds them
(``helpers.check_against_reference``, ``helpers.check_gradients``), with every output poisoned first;
a deterministic backward must also repeat its bits.

Each draw is its own test, named by its index and problem, and drawn from ``(seed, index)`` alone, so
a failure reproduces by itself with the same seed::

    LAB_CONTRACT_SEED=3 pytest tests/test_contract_draws.py -k "draw-7"

``LAB_CONTRACT_SEED`` (default 0) picks the draws and ``LAB_CONTRACT_DRAWS`` how many (default 24 on
a GPU, where the problems reach about 2,000 rows; 4 on the CPU, whose interpreter is held to 100 rows
and the head dims its tiles run quickly).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from functools import partial

import pytest
import torch

import stages
from stages.contract import HEAD_DIMS

from .conftest import HAS_CUDA
from .helpers import (DTYPES, check_against_reference, check_gradients, fp32_rounding_floors, half_rounding_floors,
                      make_qkv)
from .test_key_ranges import embedded

SEED = int(os.environ.get("LAB_CONTRACT_SEED", "0"))
DRAWS = int(os.environ.get("LAB_CONTRACT_DRAWS", "24" if HAS_CUDA else "4"))
#: the most query or key rows a draw takes: real sizes on a GPU, interpreter sizes on the CPU
MAX_ROWS = 2048 if HAS_CUDA else 100
#: the most score elements (B·Hq·Nq·Nk) a draw's float64 references hold at once (the backward's
#: reference keeps several such tensors for autograd): a draw over it is shrunk along its lengths
MAX_SCORES = 4 * 10**7 if HAS_CUDA else 6 * 10**4
#: head dims the CPU draws from: every width class of the tl kernels (16, 32, 64 padded) with a
#: non-power-of-two among them, small enough for the interpreter
CPU_HEAD_DIMS = (8, 16, 24, 40, 64)


@dataclass(frozen=True)
class Draw:
    index: int
    stage: str
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    causal: bool
    dtype: str
    layout: str          # "bhnd" (contiguous heads) or "bnhd" (heads interleaved: a transposed view)
    logit_scale: float   # q, k and v scaled by it: 1 is unit-variance inputs, 6 makes the softmax one-hot
    backward: bool
    grad_layout: str     # "dense", "transposed" (a non-contiguous view) or "expanded" (o.sum()'s gradient)
    deterministic: bool
    cache: tuple[int, int] | None = None  # stage C: the keys sit in a longer cache, (keys before, keys after)

    def __str__(self) -> str:
        extra = f"-bwd-{self.grad_layout}{'-det' if self.deterministic else ''}" if self.backward else ""
        extra += f"-range-{self.cache[0]}-{self.cache[1]}" if self.cache else ""
        return (f"draw-{self.index}-{self.stage}-B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-Nq{self.Nq}-Nk{self.Nk}"
                f"-D{self.D}-{'causal' if self.causal else 'full'}-{self.dtype}-{self.layout}-x{self.logit_scale:g}"
                f"{extra}")


def _length(rng: random.Random, most: int) -> int:
    """A length from 1 to ``most``, log-uniform: a 1, a 7 and a 1500 are all likely."""
    return max(1, min(most, int(round(math.exp(rng.uniform(0.0, math.log(most)))))))


def draw(index: int, seed: int = SEED) -> Draw:
    """Draw ``index`` of ``seed``: every choice from one generator seeded by both, so it repeats alone."""
    rng = random.Random(f"contract-{seed}-{index}")
    stage = rng.choices(["c", "b", "a"], weights=[6, 2, 2])[0]
    Hkv = rng.randint(1, 3)
    group = rng.choice([1, 1, 2, 3, 4, 8])
    regime = rng.choice(["prefill", "decode", "chunk", "more-queries"])
    n = _length(rng, MAX_ROWS)
    m = _length(rng, MAX_ROWS)
    if regime == "prefill":
        Nq = Nk = n
    elif regime == "decode":
        Nq, Nk = rng.randint(1, 4), n
    elif regime == "chunk":
        Nq, Nk = min(n, m), max(n, m)
    else:
        Nq, Nk = max(n, m), min(n, m)
    D = rng.choice(HEAD_DIMS if HAS_CUDA else CPU_HEAD_DIMS)
    dtype = rng.choices(["fp16", "bf16", "fp32"], weights=[2, 2, 1])[0]
    B = rng.randint(1, 3)
    backward = rng.random() < 0.7
    # Shrink the lengths together until the float64 references fit (the draw keeps its shape's kind).
    while B * Hkv * group * Nq * Nk > MAX_SCORES // (4 if backward else 1):
        Nq, Nk = max(1, Nq * 3 // 4), max(1, Nk * 3 // 4)
    causal, layout = rng.random() < 0.5, rng.choice(["bhnd", "bnhd"])
    logit_scale, grad_layout = rng.choice([1.0, 1.0, 2.0, 6.0]), rng.choice(["dense", "transposed", "expanded"])
    deterministic = stage == "c" and rng.random() < 0.5
    # Stage C takes a key range (a static cache's filled slots, a left-padded batch's real keys): the
    # draw's keys then sit inside a longer cache whose other slots are NaN.
    cache = (_length(rng, MAX_ROWS) - 1, _length(rng, MAX_ROWS) - 1) if stage == "c" and rng.random() < 0.25 else None
    return Draw(index=index, stage=stage, B=B, Hq=Hkv * group, Hkv=Hkv, Nq=Nq, Nk=Nk, D=D, causal=causal,
                dtype=dtype, layout=layout, logit_scale=logit_scale, backward=backward, grad_layout=grad_layout,
                deterministic=deterministic, cache=cache)


DRAWN = [draw(i) for i in range(DRAWS)]


def test_draws_repeat_and_cover_the_contract():
    """The same (seed, index) gives the same problem, and across many draws every free choice of the
    contract comes up: so the GPU's few dozen draws are a sample of all of it, not of one corner."""
    assert [draw(i, 5) for i in range(8)] == [draw(i, 5) for i in range(8)]
    many = [draw(i, 5) for i in range(400)]
    assert {d.stage for d in many} == {"a", "b", "c"}
    assert {d.dtype for d in many} == {"fp16", "bf16", "fp32"}
    assert {d.grad_layout for d in many} == {"dense", "transposed", "expanded"}
    assert {d.layout for d in many} == {"bhnd", "bnhd"}
    assert any(d.Nq == 1 for d in many) and any(d.Nk == 1 for d in many)
    assert any(d.Nq > d.Nk and d.causal for d in many)  # rows that see no key
    assert any(d.Hq > d.Hkv for d in many) and any(d.Hq == d.Hkv for d in many)
    assert any(d.deterministic for d in many) and not any(d.deterministic and d.stage != "c" for d in many)
    assert {d.D for d in many} == set(HEAD_DIMS if HAS_CUDA else CPU_HEAD_DIMS)
    assert any(d.cache for d in many) and not any(d.cache and d.stage != "c" for d in many)
    assert all(d.B * d.Hq * d.Nq * d.Nk <= MAX_SCORES for d in many)


def _floors(dtype: str, causal: bool):
    """The gradients' error floors a correct FlashAttention backward of ``dtype`` cannot go under at these
    inputs: its float32 dot products for dP and Δ (``helpers.fp32_rounding_floors``, which is what huge
    logits make large: P nearly one-hot, dP − Δ cancelling to rounding noise) and, for fp16 and bf16,
    the roundings to that dtype of O, P and dS (``helpers.half_rounding_floors``), whichever is larger."""
    def floors(q, k, v, do):
        f32 = fp32_rounding_floors(q, k, v, do, causal=causal)
        if dtype == "fp32":
            return f32
        half = half_rounding_floors(q, k, v, do, causal=causal)
        return {name: max(f32[name], half[name]) for name in f32}
    return floors


def _gradient(o: torch.Tensor, layout: str, seed: int) -> torch.Tensor:
    """dO for ``o`` in ``layout``: dense; a transposed view of a [B, N, H, D] tensor; or one value
    expanded to o's shape (every stride 0), which is what ``o.sum().backward()`` hands the backward."""
    g = torch.Generator().manual_seed(seed)
    if layout == "expanded":
        return torch.randn((), generator=g).to(o.dtype).to(o.device).expand(o.shape)
    if layout == "transposed":
        B, H, N, D = o.shape
        return torch.randn((B, N, H, D), generator=g).to(o.dtype).to(o.device).transpose(1, 2)
    return torch.randn(o.shape, generator=g).to(o.dtype).to(o.device)


@pytest.mark.parametrize("d", DRAWN, ids=str)
def test_a_drawn_problem_matches_float64(d: Draw, device):
    options = {"deterministic": True} if d.deterministic else {}
    if d.cache:
        # (the call as a function of the range's keys alone: the reference is the contract on them)
        before, after = d.cache
        attention = embedded(before, before + d.Nk, before + d.Nk + after, **options)
    else:
        attention = partial(stages.get_stage(d.stage).attention, **options)
    q, k, v = make_qkv(d.B, d.Hq, d.Nq, d.D, DTYPES[d.dtype], device, layout=d.layout, scale=d.logit_scale,
                       seed=SEED * 100_003 + d.index, Hkv=d.Hkv, Nk=d.Nk)
    with torch.no_grad():
        o = attention(q, k, v, causal=d.causal)
    check_against_reference(o, q, k, v, causal=d.causal, dtype_name=d.dtype)
    if not d.backward:
        return
    do = _gradient(o, d.grad_layout, seed=SEED * 100_003 + d.index + 1)
    check_gradients(attention, q, k, v, causal=d.causal, dtype_name=d.dtype, do=do,
                    abs_floor=_floors(d.dtype, d.causal))
    if d.deterministic and device == "cuda":
        # A fixed summation order: the same inputs give the same bits, run after run.
        runs = []
        for _ in range(2):
            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
            attention(qg, kg, vg, causal=d.causal).backward(do)
            runs.append((qg.grad, kg.grad, vg.grad))
        for name, a, b in zip(("dq", "dk", "dv"), *runs):
            assert torch.equal(a, b), f"deterministic backward: {name} differs between two runs"
