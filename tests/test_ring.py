"""Ring attention (stages/ring.py) and ``python -m harness ring`` (harness/ring.py), on a CPU.

The pure parts (the merge, the balanced layout, which blocks each step computes, the FLOP and
overlap accounting) are checked directly; the ring itself by the check command in 4 and 2 gloo
processes (each process imports torch and triton: most of this file's time is those imports).
"""

from __future__ import annotations

import csv
import math

import pytest
import torch

from harness import ring as harness_ring
from harness.reference import reference_attention, reference_gradients, rel_err
from stages import ring
from stages.contract import Problem

from .helpers import run_cli

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------- the merge

def _block_partials(q, k, v, scale):
    """Normalized output and natural-log LSE of q against one block of keys, float64."""
    s = (q @ k.transpose(-2, -1)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v, lse


def test_merging_blocks_one_at_a_time_equals_one_softmax():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g, dtype=torch.float64) for n in (5, 12, 12))
    k = k * 4  # large logits: the running maximum must keep exp from overflowing
    o = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:3], NEG_INF)
    for block in ((0, 3), (3, 10), (10, 12)):
        o_b, lse_b = _block_partials(q, k[:, :, slice(*block)], v[:, :, slice(*block)], 0.5)
        o, lse = ring.merge_partials(o, lse, o_b.float(), lse_b.float())
    o_full, lse_full = _block_partials(q, k, v, 0.5)
    assert torch.allclose(o.double(), o_full, atol=1e-5)
    assert torch.allclose(lse.double(), lse_full, atol=1e-5)


def test_merge_of_rows_that_saw_no_key_gives_zero_and_no_nan():
    o = torch.zeros(1, 1, 3, 4)
    lse = torch.tensor([[[NEG_INF, NEG_INF, 1.0]]])          # rows 0, 1: nothing seen yet; row 2: one block
    o[0, 0, 2] = 2.0
    o_b = torch.ones(1, 1, 3, 4)
    o_b[0, 0, 0] = 0.0                                        # a row with no key in the block outputs 0
    lse_b = torch.tensor([[[NEG_INF, 0.5, NEG_INF]]])
    o_new, lse_new = ring.merge_partials(o, lse, o_b, lse_b)
    assert not torch.isnan(o_new).any() and not torch.isnan(lse_new).any()
    assert torch.equal(o_new[0, 0, 0], torch.zeros(4)) and lse_new[0, 0, 0] == NEG_INF  # empty on both sides
    assert torch.equal(o_new[0, 0, 1], torch.ones(4)) and lse_new[0, 0, 1] == 0.5        # only the block
    assert torch.equal(o_new[0, 0, 2], torch.full((4,), 2.0)) and lse_new[0, 0, 2] == 1.0  # only the old


@pytest.mark.parametrize("stage", ["b", "c"])
def test_local_kernels_return_natural_lse_and_minus_inf_for_rows_without_keys(stage):
    # Nq = 6 > Nk = 4, causal (bottom-right): rows 0 and 1 see no key
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 6, 16, generator=g)
    k, v = (torch.randn(1, 1, 4, 16, generator=g) for _ in range(2))
    o, lse = ring.lse_kernel(stage).forward(q, k, v, True, 0.25)
    assert torch.isneginf(lse[:, :, :2]).all() and not o[:, :, :2].any()
    s = (q @ k.transpose(-2, -1)) * 0.25
    mask = torch.arange(4)[None, :] > torch.arange(6)[:, None] - 2
    expected = torch.logsumexp(s.masked_fill(mask, NEG_INF), dim=-1)
    assert torch.allclose(lse[:, :, 2:], expected[:, :, 2:], atol=1e-5)


def test_only_stages_that_return_the_lse_are_accepted():
    assert set(ring.LSE_STAGES) == {"b", "c"}
    with pytest.raises(ValueError, match=r"'a' does not return the row log-sum-exp.*b, c"):
        ring.lse_kernel("a")
    with pytest.raises(ValueError, match=r"'nope' is not a registered stage"):
        ring.lse_kernel("nope")


# ----------------------------------------------------------------------------------- the layout

def test_balanced_layout_gives_each_rank_a_chunk_and_its_mirror():
    assert [ring.chunk_ids(r, 4, True) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [ring.chunk_ids(r, 4, False) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    x = torch.arange(16).view(1, 1, 16, 1)
    shards = [ring.shard(x, r, 4, True) for r in range(4)]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]
    assert torch.equal(ring.unshard(shards, True), x)
    assert torch.equal(ring.unshard([ring.shard(x, r, 4, False) for r in range(4)], False), x)
    with pytest.raises(ValueError, match="8 equal chunks"):
        ring.shard(torch.zeros(1, 1, 12, 1), 0, 4, True)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("causal", [False, True])
def test_block_calls_compute_every_pair_of_the_global_mask_exactly_once(world, causal):
    """Every rank's call at every step, mapped back to global positions (with the call's own
    bottom-right causal mask), must cover exactly the global mask, each pair once, and (causal)
    give every rank the same work."""
    c = 3
    n = 2 * c if causal else c
    N = n * world
    positions = [ring.shard(torch.arange(N).view(1, 1, N, 1), r, world, causal).flatten() for r in range(world)]
    covered = torch.zeros(N, N, dtype=torch.int64)
    work = []
    for rank in range(world):
        pairs = 0
        for step in range(world):
            source = (rank - step) % world
            call = ring.block_call(rank, source, world, causal, n)
            rows, keys = positions[rank][call.q_rows], positions[source][call.kv_rows]
            visible = torch.ones(len(rows), len(keys), dtype=torch.int64)
            if call.causal:  # the stage contract: query i sees key j iff j <= i + Nk - Nq
                visible = torch.tril(visible, diagonal=len(keys) - len(rows))
            covered[rows[:, None], keys[None, :]] += visible
            pairs += int(visible.sum())
        work.append(pairs)
    expected = torch.tril(torch.ones(N, N, dtype=torch.int64)) if causal else torch.ones(N, N, dtype=torch.int64)
    assert torch.equal(covered, expected)
    assert len(set(work)) == 1, f"work per rank {work}"


@pytest.mark.parametrize("causal", [False, True])
def test_step_flops_of_all_ranks_add_up_to_the_whole_problem(causal):
    job = harness_ring.RingJob(stage="c", B=2, Hq=4, Hkv=2, Ns=(24,), D=16, dtype="bf16", causals=(causal,),
                               check=False, time=True, reps=1, link_gbps=None)
    for world in (1, 2, 3):
        n = 24 // world
        for pass_ in ("fwd", "bwd"):
            total = sum(sum(harness_ring.step_flops(job, n, r, world, causal, pass_)) for r in range(world))
            assert total == Problem(2, 4, 24, 16, "bf16", causal, 2, 24).pass_flops(pass_)


def test_overlap_model():
    # enough compute: every transfer hidden; too little: the excess is exposed
    assert harness_ring.overlap_model([2.0, 2.0, 2.0], [1.0, 1.0, 0.0], 0.0) == (6.0, 1.0)
    total, hidden = harness_ring.overlap_model([2.0, 2.0, 2.0], [3.0, 3.0, 0.0], 0.0)
    assert total == 8.0 and hidden == pytest.approx(2 / 3)
    # the backward: dK/dV ride along from step 1, and the last hop home is exposed
    assert harness_ring.step_transfers(3, "bwd", 10, 20) == ([10, 30, 20], 20)
    assert harness_ring.step_transfers(3, "fwd", 10, 20) == ([10, 10, 0], 0)
    total, hidden = harness_ring.overlap_model([5.0, 5.0, 5.0], [1.0, 3.0, 2.0], 2.0)
    assert total == 17.0 and hidden == pytest.approx(1 - 2 / 8)
    assert math.isnan(harness_ring.overlap_model([4.0], [0.0], 0.0)[1])  # world size 1: nothing to hide


# ----------------------------------------------------------------------------------- the ring, in one process

def test_ring_of_one_process_is_the_stage():
    """Without a process group the ring is a world of one: one causal call, the stage's own answer."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 16, generator=g).half()
    k, v = (torch.randn(1, 2, 8, 16, generator=g).half() for _ in range(2))
    do = torch.randn(1, 4, 8, 16, generator=g).half()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = ring.ring_attention(*leaves, causal=True)
    o.backward(do)
    assert rel_err(o, reference_attention(q, k, v, causal=True)) < 2e-3
    for leaf, ref in zip(leaves, reference_gradients(q, k, v, do, causal=True)):
        assert rel_err(leaf.grad, ref) < 3e-3
    with pytest.raises(ValueError, match="length must be even"):
        ring.ring_attention(q[:, :, :7], k[:, :, :7], v[:, :, :7], causal=True)
    with pytest.raises(ValueError, match="Nq = Nk"):
        ring.ring_attention(q[:, :, :6], k, v)
    with pytest.raises(ValueError, match="does not return the row log-sum-exp"):
        ring.ring_attention(q, k, v, stage="a")


# ----------------------------------------------------------------------------------- the command

def test_check_in_four_processes_passes_causal_and_not(capsys):
    code, out, err = run_cli(["ring", "--world-size", "4", "--check"], capsys)
    assert code == 0, out + err
    assert "4 ranks (gloo" in out and "Hq=4 Hkv=2" in out  # grouped-query heads
    lines = [line for line in out.splitlines() if "ring " in line and "bound" in line]
    assert len(lines) == 8 and all(line.rstrip().endswith("PASS") for line in lines)
    for causal in ("no", "yes"):
        for tensor in ("o", "dq", "dk", "dv"):
            assert any(f"causal={causal}" in line and f" {tensor} " in line for line in lines), (causal, tensor)
    assert "8 of 8 comparisons PASS" in out


def test_check_and_timing_in_two_processes_with_stage_b(tmp_path, capsys):
    code, out, err = run_cli(["ring", "--world-size", "2", "--check", "--time", "--stage", "b", "--causal", "yes",
                              "--reps", "1", "--out", str(tmp_path)], capsys)
    assert code == 0, out + err
    assert "stage b, 2 ranks" in out and "4 of 4 comparisons PASS" in out
    assert "not GPU times" in out
    with open(tmp_path / harness_ring.RING_CSV, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == harness_ring.COLUMNS
    assert [(r["pass"], r["world_size"], r["causal"]) for r in rows] == [("fwd", "2", "1"), ("bwd", "2", "1")]
    fwd, bwd = rows
    # 2·B·Hkv·n·D elements of K and V in fp16 (B 1, Hkv 2, n 16, D 16); the backward's dK/dV in fp32
    assert int(fwd["bytes_per_step"]) == 2 * 2 * 16 * 16 * 2 and int(bwd["bytes_per_step"]) == 2 * 2 * 16 * 16 * 4
    for r in rows:
        assert r["status"] == "ok" and r["device"] == "interpreter" and float(r["ms_total"]) > 0
        assert float(r["ms_comm"]) > 0 and float(r["link_gbps"]) > 0 and r["link_source"] == "measured"
        assert 0 <= float(r["hidden_measured"]) <= 1 and 0 <= float(r["hidden_model"]) <= 1
    assert (tmp_path / "env.json").exists()


def test_timing_a_world_of_one_runs_in_this_process(tmp_path, capsys):
    code, out, err = run_cli(["ring", "--world-size", "1", "--time", "--causal", "no", "--reps", "1",
                              "--out", str(tmp_path)], capsys)
    assert code == 0, out + err
    rows = list(csv.DictReader(open(tmp_path / harness_ring.RING_CSV, newline="")))
    assert [r["pass"] for r in rows] == ["fwd", "bwd"]
    for r in rows:
        assert r["world_size"] == "1" and r["bytes_per_step"] == "0" and r["hidden_measured"] == ""
        assert "one local call" in r["note"] and float(r["ms_total"]) > 0


def test_a_mismatch_fails_the_check(monkeypatch, capsys):
    real = ring.LSE_STAGES["c"]

    def off_by_ten_percent():
        kernel = real()
        return ring.LseKernel("c", lambda *a: (lambda o, lse: (o * 1.1, lse))(*kernel.forward(*a)), kernel.backward)

    monkeypatch.setitem(ring.LSE_STAGES, "c", off_by_ten_percent)
    code, out, _ = run_cli(["ring", "--world-size", "1", "--check", "--causal", "no"], capsys)
    assert code == 1 and "FAIL" in out


@pytest.mark.parametrize("argv, flag, words", [
    (["--world-size", "0"], "--world-size", ">= 1"),
    (["--world-size", "4", "--N", "36"], "--N", "multiple of 2 x world size = 8"),
    (["--world-size", "4", "--N", "30", "--causal", "no"], "--N", "multiple of the world size 4"),
    (["--stage", "zz"], "--stage", "unknown stage 'zz'; allowed: b, c"),
    (["--stage", "a"], "--stage", "does not return the row log-sum-exp; allowed: b, c"),
    (["--H", "6", "--Hkv", "4"], "--Hkv", "multiple"),
])
def test_bad_arguments_give_one_line_naming_the_flag(argv, flag, words, capsys):
    code, out, err = run_cli(["ring", *argv], capsys)
    assert code == 2 and f"argument {flag}" in err and words in err, err
    assert "Traceback" not in err
