"""The split-KV forward's merge fused into the split kernel (``LAB_DECODE_MERGE=fused``,
stages/c_optimized/decode.py): the last program of a row block to arrive merges every split's
partials and sets its counter back to zero.

Checked against float64: one launch instead of two, every split count a growing cache passes
through (the counters must be zero again after every call, or the next call merges too early or
never), causal rows with no key, key ranges whose later splits find no key, the log-sum-exp, bf16
and fp32. On a GPU, where programs really race: many calls of a full grid, each bitwise equal to the
first (the merging program adds the splits in a fixed order), CUDA-graph replay, and two streams.
"""

from __future__ import annotations

import pytest
import torch

from stages.c_optimized import decode
from stages.c_optimized import kernels as ck

from .helpers import DTYPES, check_against_reference, make_qkv
from .test_stage_c_shapes import _reference_lse


@pytest.fixture
def fused(monkeypatch):
    """The fused merge on, chunks of one K/V tile (interpreter-sized caches split many ways), every
    plan made under the default forgotten, before and after."""
    def clear():
        ck._recipe.cache_clear()
        ck._select.cache_clear()
        ck._LAYOUT_PLANS.clear()

    monkeypatch.setattr(decode, "MERGE", "fused")
    monkeypatch.setattr(decode, "MIN_TILES_PER_SPLIT", 1)
    clear()
    yield
    monkeypatch.undo()
    clear()


def counters_zero() -> bool:
    return all(int(c.abs().sum()) == 0 for c in decode._MERGE_COUNTERS.values())


def test_one_launch_and_counters_zero_after_every_split_count(fused, device):
    """A cache growing through 1, 2, ... chunks: one kernel per call, the output the contract's at
    every length, and no counter left standing (a stale count would merge early or never)."""
    q, k, v = make_qkv(2, 8, 1, 32, torch.float16, device, Hkv=2, Nk=64 * 9)
    for Nk in (40, 64, 65, 200, 64 * 6 + 1, 64 * 9):
        kn, vn = k[:, :, :Nk], v[:, :, :Nk]
        launches = ck.plan(q, kn, vn, torch.empty_like(q), causal=False, scale=0.2, arch=80)
        assert [launch.kernel for launch in launches] == [decode.split_kv_attention_kernel]
        o = ck.attention(q, kn, vn)
        check_against_reference(o, q, kn, vn, causal=False, dtype_name="fp16")
        assert counters_zero(), f"Nk={Nk}: a counter was left non-zero"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_and_rows_with_no_key(fused, device, dtype, causal):
    """Grouped rows with a few new tokens, causal both, and Nq > Nk causal (rows that see no key:
    O = 0, lse = +inf), forced to many splits; O and the log-sum-exp against float64."""
    for B, Hq, Hkv, Nq, Nk in ((2, 4, 2, 3, 333), (1, 2, 1, 40, 30)):
        q, k, v = make_qkv(B, Hq, Nq, 40, DTYPES[dtype], device, Hkv=Hkv, Nk=Nk)
        o, lse = ck.attention_with_lse(q, k, v, causal=causal or Nq > Nk, split_kv=5)
        check_against_reference(o, q, k, v, causal=causal or Nq > Nk, dtype_name=dtype)
        ref = _reference_lse(q.cpu(), k.cpu(), causal=causal or Nq > Nk)
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isinf(lse.cpu()), ~finite)
        assert torch.allclose(lse.cpu().double()[finite], ref[finite], atol=1e-3, rtol=1e-4)
        assert counters_zero()


def test_key_ranges_leave_later_splits_empty(fused, device):
    """Key lengths far below the cache's size: the splits share out each sequence's range, and a
    split past its end finds no key; it still counts itself in, so its row block merges."""
    q, k, v = make_qkv(3, 4, 1, 32, torch.float16, device, Hkv=1, Nk=64 * 12)
    lengths = torch.tensor([1, 130, 64 * 12], dtype=torch.int32, device=device)
    o = ck.attention(q, k, v, key_lengths=lengths, split_kv=8)
    for b, n in enumerate(lengths.tolist()):
        check_against_reference(o[b:b + 1], q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal=False,
                                dtype_name="fp16")
    assert counters_zero()


def test_fused_step_keeps_a_step_within_its_registers():
    assert decode.fused_step(16, 128, 4) == 4
    assert decode.fused_step(64, 256, 4) == 1
    assert decode.fused_step(16, 16, 4) == 32
    for block_m in (16, 32, 64):
        for block_d in (16, 32, 64, 128, 256):
            step = decode.fused_step(block_m, block_d, 4)
            assert step & (step - 1) == 0 and (step == 1 or step * block_m * block_d <= 64 * 32 * 4)


@pytest.mark.gpu
def test_gpu_full_grid_races_to_the_same_bits(fused):
    """A grid of 512 programs on a real GPU (128 row blocks, 4 splits each), called 50 times: every
    output bitwise equal to the first (the merging program adds the splits in one order, whoever
    arrives last) and to the reference."""
    q, k, v = make_qkv(16, 32, 1, 128, torch.bfloat16, "cuda", Hkv=8, Nk=8192)
    first = ck.attention(q, k, v, split_kv=4)
    check_against_reference(first, q, k, v, causal=False, dtype_name="bf16")
    for _ in range(50):
        assert torch.equal(ck.attention(q, k, v, split_kv=4), first)
    torch.cuda.synchronize()
    assert counters_zero()


@pytest.mark.gpu
def test_gpu_graph_replay_and_two_streams(fused):
    """Captured in a CUDA graph and replayed while the cache's contents change; and calls on two
    streams at once, each counting into its own stream's counters."""
    q, k, v = make_qkv(4, 32, 1, 128, torch.float16, "cuda", Hkv=8, Nk=4096)
    ck.attention(q, k, v)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        ck.attention(q, k, v)
        with torch.cuda.graph(graph, stream=stream):
            out = ck.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        k.normal_()
        graph.replay()
        torch.cuda.synchronize()
        check_against_reference(out, q, k, v, causal=False, dtype_name="fp16")
    other = torch.cuda.Stream()
    q2, k2, v2 = make_qkv(8, 32, 1, 128, torch.float16, "cuda", Hkv=8, Nk=8192)
    other.wait_stream(torch.cuda.current_stream())
    outs = []
    for _ in range(10):
        outs.append(ck.attention(q, k, v))
        with torch.cuda.stream(other):
            outs.append(ck.attention(q2, k2, v2))
    torch.cuda.synchronize()
    for i, o in enumerate(outs):
        a, b, c = (q, k, v) if i % 2 == 0 else (q2, k2, v2)
        check_against_reference(o, a, b, c, causal=False, dtype_name="fp16")
    assert counters_zero()
