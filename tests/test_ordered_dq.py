"""Ordered dQ: fused dQ added in a fixed order, so the Hopper backward is deterministic with five products.

Each Q tile's adds wait their turn at a semaphore (``hopper_bwd._ordered_dq_turn``). On the CPU: the
order itself (every adder of a tile takes one turn, waits only for programs started before it, and,
causal, for ones that reached the tile earlier in their own loops), the compiled code, and the plan.
On an sm_90 GPU: the gradients against float64 and the bits of repeated runs."""

from __future__ import annotations

import random

import pytest
import torch

from stages.c_optimized import backward as bwd
from stages.c_optimized.configs import SHARED_MEMORY_LIMIT
from stages.contract import Problem

from .helpers import DTYPES, check_gradients, make_qkv
from .test_stage_c_backward import WS_SHAPES, _bits, attention, saved_forward

hopper_bwd = pytest.importorskip("stages.c_optimized.hopper_bwd")


def _adders(Nq, Nk, block_m, block_n, causal):
    """{first row of a Q tile: [(K/V program j, step in its own loop, rank)]} of the host-side order."""
    tiles = {}
    for j in range(-(-Nk // block_n)):
        for step, row0 in enumerate(hopper_bwd.visited_q_rows(j * block_n, Nq, Nk, block_m, causal)):
            rank = hopper_bwd.ordered_dq_rank(j * block_n, row0, Nq, Nk, block_m, block_n, causal)
            tiles.setdefault(row0, []).append((j, step, rank))
    return tiles


SIZES = [(1, 1), (64, 64), (300, 300), (4096, 4096), (200, 450), (450, 200), (70, 1100), (1100, 70), (129, 257)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("block_m", [32, 64])
def test_each_adder_of_a_tile_takes_one_turn_and_waits_only_for_programs_started_before_it(block_m, causal):
    """Per Q tile the ranks of the programs that add to it are 0, 1, ..., n − 1, each once (no turn is
    skipped: a skipped one would hang the GPU; none is shared: the sum's order would be left to chance).
    The program a turn waits for (the rank before) starts earlier in the grid: without a mask the grid
    runs a head's K/V tiles first to last and ranks go up with the tile; causal, the kernel runs the grid
    backwards and ranks go down with the tile. So a waiting program never holds the SM its predecessor
    needs. Causal, the one before has also met the tile earlier in its own loop (it starts on an earlier
    Q tile), so no program waits at its start for a chain of others to get there (but where Nk > Nq, for
the K/V tiles that all start on the first Q tile)."""
    for Nq, Nk in SIZES + [(random.Random(n).randrange(1, 3000), random.Random(n + 1).randrange(1, 3000))
                           for n in range(8)]:
        for row0, adders in _adders(Nq, Nk, block_m, 128, causal).items():
            ranks = sorted(rank for _, _, rank in adders)
            assert ranks == list(range(len(adders))), (Nq, Nk, row0, adders)
            by_rank = {rank: (j, step) for j, step, rank in adders}
            for rank in range(1, len(adders)):
                (j_before, step_before), (j, step) = by_rank[rank - 1], by_rank[rank]
                launched_before = j_before > j if causal else j_before < j
                assert launched_before, (Nq, Nk, row0, adders)
                if causal:  # (where Nk > Nq the first K/V tiles all start on Q tile 0, side by side)
                    assert step_before < step or step_before == step == row0 // block_m, (Nq, Nk, row0, adders)


@pytest.mark.parametrize("q_tiles,heads,turn", [(16, 256, 2), (64, 128, 2), (64, 64, 1), (256, 64, 2),
                                                 (16, 4, 2), (1, 1, 2)])
def test_without_a_mask_a_heads_k_v_tiles_start_turns_apart(q_tiles, heads, turn):
    """The grid order of ordered dQ without a mask (chunks of one K/V tile over groups of heads,
    ``ordered_dq_heads``): K/V tile j of a head launches at least 2 × ``turn`` Q tiles' worth of programs
    (``sms`` programs per program length) after tile j − 1, unless every head is in one group already."""
    sms, n_tiles = 132, 8
    group = hopper_bwd.ordered_dq_heads(q_tiles, heads, sms, turn)
    order = hopper_bwd.program_order(n_tiles, heads, 1, group)
    at = {item: pid for pid, item in enumerate(order)}
    for h in range(heads):
        for j in range(1, n_tiles):
            gap = at[j, h] - at[j - 1, h]
            assert gap > 0
            assert gap * q_tiles >= 2 * turn * sms or group == heads, (group, gap)


@pytest.mark.parametrize("N,turn", [(1024, 2), (4096, 2), (4096, 1), (16384, 2)])
def test_the_model_says_head_by_head_waits_and_the_spread_order_does_not(N, turn):
    """``ordered_dq_makespan`` on the FA grid's D 64 cells (B·N = 16384 tokens, 32 heads of 128-key
    K/V tiles, 64-row Q tiles, 132 SMs): with a head's K/V tiles spread apart (``ordered_dq_heads``)
    the grid ends within 1 % of where it would with no turns to wait for; head by head, where a head's
    tiles start side by side, later; at N 1024 and 4096 by over a quarter. Causal, the grid run
    backwards head by head (the kernel's order) waits for nothing either."""
    heads, J, q_tiles, sms = 16384 // N * 32, N // 128, N // 64, 132
    free = hopper_bwd.makespan([q_tiles] * (J * heads), sms)
    group = hopper_bwd.ordered_dq_heads(q_tiles, heads, sms, turn)

    def model(order, causal=False):
        return hopper_bwd.ordered_dq_makespan(order, N, N, 64, 128, causal, sms, turn)

    spread = model(hopper_bwd.program_order(J, heads, 1, group))
    by_head = model(hopper_bwd.program_order(J, heads, J, heads))
    assert free <= spread <= 1.01 * free < by_head
    if N <= 4096 and turn == 2:
        assert by_head > 1.25 * free
    backwards = hopper_bwd.program_order(J, heads, J, heads)[::-1]
    work = hopper_bwd.causal_dkdv_work(N, N)
    assert model(backwards, causal=True) <= 1.01 * hopper_bwd.makespan([work[j] for j, _ in backwards], sms)


def test_the_semaphores_cover_every_tile_of_every_config():
    """One int32 per batch·query head, column slice (2 at most) and Q tile (32 rows at least)."""
    for Nq in (1, 31, 32, 33, 1000):
        sem = hopper_bwd.ordered_dq_semaphores(2, 3, Nq, "cpu")
        assert sem.dtype == torch.int32 and (sem == 0).all()
        assert sem.numel() >= 2 * 3 * 2 * -(-Nq // 32)


@pytest.mark.parametrize("D,causal", [(64, False), (64, True), (128, True), (80, False)])
def test_ordered_dq_compiles_for_sm90_with_a_turn_per_add(D, causal, monkeypatch):
    """The dK/dV kernel with ordered dQ, the consumers taking their own turns (the rung below the writer),
    compiles for sm_90a: it waits with acquire loads, releases with a release atomic after waiting for its
    bulk reduces to complete (not only to have read their source), and runs the grid backwards when causal;
    D 64 spills nothing."""
    from harness.inspect_code import run_ptxas

    monkeypatch.setenv("LAB_ORDERED_DQ_WRITER", "0")  # (the child process that compiles under the interpreter)
    monkeypatch.setattr(hopper_bwd, "ORDERED_DQ_WRITER", False)
    p = Problem(2, 4, 300, D, "bf16", causal, Hkv=2)
    kernels = bwd.compile_backward(p, 90, ws_config="ws-M64-c2-s2", ws_dq_config=bwd.ORDERED_DQ)
    assert [k.name for k in kernels] == ["attention_bwd_delta_kernel", "ws_bwd_dkdv_kernel"]
    ptx = kernels[1].asm["ptx"]
    assert "ld.acquire.gpu.global" in ptx and "atom.global.gpu.release.add" in ptx
    assert "cp.async.bulk.wait_group 0" in ptx
    assert ("nctaid" in ptx.split("ld.acquire.gpu.global")[0]) == causal  # (the reversed grid asks its size)
    # (no writer warp: a warpgroup meets at a barrier of 128 threads before one of them releases)
    assert "bar.sync" in ptx.split("cp.async.bulk.wait_group 0;")[1].split("atom.global.gpu.release")[0]
    fused = bwd.compile_backward(p, 90, ws_config="ws-M64-c2-s2", ws_dq_config=bwd.FUSED_DQ)[1].asm["ptx"]
    assert "ld.acquire.gpu.global" not in fused and "atom.global.gpu.release" not in fused
    if D == 64:
        assert run_ptxas(ptx, "sm_90a")["spill_stores"] == 0


@pytest.mark.parametrize("D,causal,buffers,per_slice", [(64, False, 2, False), (128, True, 2, False),
                                                       (128, False, 1, False), (80, False, 2, False),
                                                       (128, False, 1, True)])
def test_a_dq_writer_warp_takes_the_turns_where_its_switch_is_on(D, causal, buffers, per_slice, monkeypatch):
    """``ORDERED_DQ_WRITER``: the same kernel with a third partition of one warp, which waits for the turns
    (acquire loads), adds by bulk reduce and releases; the consumers keep no semaphore of their own. D 64
    spills nothing, and the kernel still fits the register pool of three warpgroups. With
    ``DQ_WRITER_BUFFERS`` stage buffers per consumer (and a "full" and an "empty" barrier each), its shared
    memory is what ``dkdv_shared_bytes`` counts, within the limit. With a writer warp per column slice
    (``DQ_WRITER_PER_SLICE``, D 128) each writer has only its own add in flight when it hands a turn on."""
    from harness.inspect_code import run_ptxas

    for name, value in (("ORDERED_DQ_WRITER", True), ("DQ_WRITER_BUFFERS", buffers), ("DQ_WRITER_PER_SLICE", per_slice)):
        monkeypatch.setattr(hopper_bwd, name, value)
    # (the child process that compiles under the interpreter reads the switches from the environment)
    monkeypatch.setenv("LAB_ORDERED_DQ_WRITER", "1")
    monkeypatch.setenv("LAB_DQ_WRITER_BUFFERS", str(buffers))
    monkeypatch.setenv("LAB_DQ_WRITER_PER_SLICE", "1" if per_slice else "0")
    p = Problem(2, 4, 300, D, "bf16", causal, Hkv=2)
    kernel = bwd.compile_backward(p, 90, ws_config="ws-M64-c2-s2", ws_dq_config=bwd.ORDERED_DQ)[1]
    ptx = kernel.asm["ptx"]
    assert ".reqntid 384" in ptx  # (consumers 4 + 4 warps, producer and writer one each: three warpgroups)
    main, tail = hopper_bwd.tile_widths(D, False)
    assert hopper_bwd.dq_writer_buffers(64, main, tail, 2, 2, 2) == buffers
    modelled = hopper_bwd.dkdv_shared_bytes(64, main, tail, 2, 2, 2, fused_dq=True, dq_buffers=buffers)
    assert modelled <= kernel.shared_bytes <= min(modelled + 1024, SHARED_MEMORY_LIMIT[90])
    assert "ld.acquire.gpu.global" in ptx and "atom.global.gpu.release.add" in ptx
    # One warp waits for the reduces before it releases: a warp's barrier, not a warpgroup's.
    assert "bar.warp.sync" in ptx.split("cp.async.bulk.wait_group 0;")[1].split("atom.global.gpu.release")[0]
    # (at D 128 with one writer, the other slice's add may fly on; a writer per slice has only its own)
    assert ("cp.async.bulk.wait_group 1;" in ptx) == (D == 128 and not per_slice)
    if D == 64:
        assert run_ptxas(ptx, "sm_90a")["spill_stores"] == 0


@pytest.mark.parametrize("D,causal", [(64, False), (128, True)])
def test_with_first_stores_the_writer_stores_turn_0_and_the_pre_pass_zeroes_the_semaphores(D, causal, monkeypatch):
    """``ORDERED_DQ_FIRST_STORES``: the writer issues TMA stores beside its bulk reduces (a tile's first add
    stores), with no more spills than without; the Δ pre-pass takes the semaphores and, where every row has
    an add (Nq = Nk), no accumulator to zero; the semaphores it zeroes cover every one the dK/dV kernel uses."""
    from harness.inspect_code import run_ptxas

    def compiled(on: bool):
        with monkeypatch.context() as m:
            m.setenv("LAB_ORDERED_DQ_FIRST_STORES", "1" if on else "0")
            m.setattr(hopper_bwd, "ORDERED_DQ_FIRST_STORES", on)
            return bwd.compile_backward(Problem(2, 4, 300, D, "bf16", causal, Hkv=2), 90, ws_config="ws-M64-c2-s2",
                                        ws_dq_config=bwd.ORDERED_DQ)

    def stores_and_reduces(ptx: str) -> tuple[int, int]:
        body = ptx.split(".section")[0]
        return body.count("cp.async.bulk.tensor.4d.global.shared::cta"), body.count("cp.reduce.async.bulk.tensor")

    (delta_off, dkdv_off), (delta_on, dkdv_on) = compiled(False), compiled(True)
    stores_off, reduces_off = stores_and_reduces(dkdv_off.asm["ptx"])
    stores_on, reduces_on = stores_and_reduces(dkdv_on.asm["ptx"])
    assert reduces_on == reduces_off and stores_on > stores_off
    spills = [run_ptxas(k.asm["ptx"], "sm_90a")["spill_stores"] for k in (dkdv_off, dkdv_on)]
    assert spills[1] <= spills[0]
    # Off, the pre-pass zeroes the accumulator (stores of a D-wide row); on, it stores Δ and the semaphores only.
    assert delta_on.asm["ptx"].count("st.global") < delta_off.asm["ptx"].count("st.global")
    for Nq in (1, 31, 64, 65, 1000, 4097):
        assert bwd.ordered_dq_semaphore_count(2, 3, Nq) >= 2 * 3 * 2 * -(-Nq // 32)


@pytest.mark.parametrize("causal,N,Nk", [(False, 4096, 4096), (True, 1000, 300), (True, 300, 1000)])
def test_the_traffic_model_drops_the_zeroing_and_the_first_reads_where_the_first_adds_store(causal, N, Nk,
                                                                                          monkeypatch):
    """``bwd_hbm_bytes`` of a deterministic backward on ordered dQ: with the first adds storing, the pre-pass
    writes zeros only for the rows no K/V tile sees (causal, N > Nk) and each visited row's first add reads
    nothing, so the model's reads and writes each fall by about a zeroed accumulator's bytes."""
    entry = {"dkdv": "M64-N64-w4-s2", "dq_method": "atomic", "ws": "ws-M64-c2-s2", "ws_dq": "fused",
             "deterministic": {"ws": "ws-M64-c2-s2", "ws_dq": "ordered"}}
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: {"arch": 90, f"bf16/D64/causal{int(causal)}": entry})
    monkeypatch.setattr(bwd.hopper_ws, "supported", lambda *a: True)
    monkeypatch.setattr(bwd, "device_arch", lambda *a: 90)
    bwd.backward_plan.cache_clear()
    try:
        p = Problem(2, 8, N, 64, "bf16", causal, Nk=Nk)
        assert bwd.backward_plan(64, torch.bfloat16, 90, causal, deterministic=True).ws_dq == bwd.ORDERED_DQ
        bytes_ = {}
        for on in (False, True):
            monkeypatch.setattr(hopper_bwd, "ORDERED_DQ_FIRST_STORES", on)
            bytes_[on] = bwd.bwd_hbm_bytes(p, deterministic=True)
        zeroed = p.heads * N * 64 * 4
        unseen = p.heads * max(N - Nk, 0) * 64 * 4 if causal else 0
        assert bytes_[False].write - bytes_[True].write == zeroed - unseen
        visited = N - (max(N - Nk, 0) // 64 * 64 if causal else 0)
        assert bytes_[False].read - bytes_[True].read == p.heads * visited * 64 * 4
    finally:
        bwd.backward_plan.cache_clear()


def test_the_writer_takes_a_second_buffer_only_where_it_fits(monkeypatch):
    """Two stage buffers per consumer where the program's shared memory still fits an sm_90 block (D 128 with
    64-row Q tiles in two ring slots: 224 KB), one where it would not (three slots: 256 KB) or where the
    switch asks for one."""
    monkeypatch.setattr(hopper_bwd, "DQ_WRITER_BUFFERS", 2)
    limit = SHARED_MEMORY_LIMIT[90]
    for block_m, main, tail, stages in ((64, 128, 0, 2), (64, 128, 0, 3), (32, 128, 0, 3), (64, 64, 16, 3),
                                        (64, 64, 0, 4), (64, 64, 32, 3)):
        two = hopper_bwd.dkdv_shared_bytes(block_m, main, tail, stages, 2, 2, fused_dq=True, dq_buffers=2)
        one = hopper_bwd.dkdv_shared_bytes(block_m, main, tail, stages, 2, 2, fused_dq=True, dq_buffers=1)
        assert two - one == 2 * block_m * (min(main, 64) + tail) * 4  # (a 64-column fp32 slice and the tail's, each)
        assert hopper_bwd.dq_writer_buffers(block_m, main, tail, stages, 2, 2) == (2 if two + 1024 <= limit else 1)
    assert hopper_bwd.dq_writer_buffers(64, 128, 0, 2, 2, 2) == 2
    assert hopper_bwd.dq_writer_buffers(64, 128, 0, 3, 2, 2) == 1
    monkeypatch.setattr(hopper_bwd, "DQ_WRITER_BUFFERS", 1)
    assert hopper_bwd.dq_writer_buffers(64, 64, 0, 2, 2, 2) == 1


def test_ordered_dq_is_refused_where_it_cannot_add_in_order(monkeypatch):
    """One consumer, a way of adding other than once per pair, or a tile's add moved into the next
    tile's turn: a clear error naming what ordered dQ needs (compiled in a child process where this one
    interprets: the switches go by environment too)."""
    p = Problem(1, 2, 128, 64, "bf16", False)
    with pytest.raises((ValueError, RuntimeError), match="'ordered'.*two consumers"):
        bwd.compile_backward(p, 90, ws_config="ws-M64-c1-s2", ws_dq_config=bwd.ORDERED_DQ)
    for env, name, value, text in (("LAB_FUSED_DQ_LAG", "FUSED_DQ_LAG", True, "1"),
                                   ("LAB_FUSED_DQ_ATOMICS", "FUSED_DQ_ATOMICS", "tma", "tma")):
        with monkeypatch.context() as m:
            m.setenv(env, text)
            m.setattr(hopper_bwd, name, value)
            with pytest.raises((ValueError, RuntimeError), match="'ordered'.*adding once per pair"):
                bwd.compile_backward(p, 90, ws_config="ws-M64-c2-s2", ws_dq_config=bwd.ORDERED_DQ)


def test_a_deterministic_backward_takes_ordered_dq_where_fused_dq_won_and_the_switch_is_on(monkeypatch):
    """``ORDERED_DQ_DEFAULT``: where the tuned plan adds dQ inside the Hopper kernel, ``deterministic=True``
    runs the same tiles in order (a '-r' config in its plain order) instead of the tuner's plan without
    fused dQ; off, the tuner's. A tuned ``deterministic`` entry may name ordered dQ itself."""
    entry = {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3", "dq_method": "separate", "ws": "ws-M64-c2-s2-r",
             "ws_dq": "fused", "deterministic": {"ws": "ws-M64-c2-s3"}}
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: {"arch": 90, "bf16/D64/causal0": entry})
    monkeypatch.setattr(bwd.hopper_ws, "supported", lambda *a: True)
    for on, expect in ((False, "dkdv:ws-M64-c2-s3+dq:M64-N128-w8-s3"), (True, "dkdv:ws-M64-c2-s2+ordered-dq")):
        monkeypatch.setattr(bwd, "ORDERED_DQ_DEFAULT", on)
        bwd.backward_plan.cache_clear()
        plan = bwd.backward_plan(64, torch.bfloat16, 90, False, deterministic=True)
        assert str(plan) == expect and plan.atomic_dq == on
        assert plan.separate_dq  # (where the Hopper kernel cannot run, e.g. misaligned rows: the tl dQ kernel)
        assert str(bwd.backward_plan(64, torch.bfloat16, 90, False)) == "dkdv:ws-M64-c2-s2-r+fused-dq"
    entry["deterministic"] = {"ws": "ws-M64-c2-s2", "ws_dq": "ordered"}
    monkeypatch.setattr(bwd, "ORDERED_DQ_DEFAULT", False)
    bwd.backward_plan.cache_clear()
    assert str(bwd.backward_plan(64, torch.bfloat16, 90, False, deterministic=True)) == "dkdv:ws-M64-c2-s2+ordered-dq"
    bwd.backward_plan.cache_clear()


def test_ordered_dq_stands_as_the_default_plan_only_on_a_grid_that_hides_its_order(monkeypatch):
    """Where the tuner made ordered dQ the default plan, a grid of fewer (query head, Q tile) pairs per SM
    than ``ORDERED_DQ_MIN_PAIRS_PER_SM`` runs fused dQ with the same tiles (its first adds store nothing, the
    pre-pass zeroes the accumulator); at the threshold and above, ordered dQ. A deterministic backward keeps
    the order on any grid. Planned over storage-free tensors for an sm_90 GPU of 4 SMs, one pair either side."""
    entry = {"dkdv": "M64-N64-w4-s2", "dq": "M64-N128-w8-s3", "dq_method": "separate", "ws": "ws-M64-c2-s3",
             "ws_dq": "ordered"}
    monkeypatch.setattr(bwd, "tuned_backward_table", lambda slug: {"arch": 90, "bf16/D64/causal0": entry})
    monkeypatch.setattr(bwd.hopper_ws, "supported", lambda *a: True)
    monkeypatch.setattr(bwd, "device_arch", lambda device: 90)
    monkeypatch.setattr(bwd, "sm_count", lambda device: 4)
    bwd.backward_plan.cache_clear()
    least = bwd.ORDERED_DQ_MIN_PAIRS_PER_SM * 4  # pairs; B 1, H 2: a Q tile of 64 rows per pair and head

    def kept(N, deterministic):
        q, o, do, k, v = (torch.empty(1, 2, N, 64, dtype=torch.bfloat16, device="meta") for _ in range(5))
        lse = torch.empty(1, 2, N, dtype=torch.float32, device="meta")
        return bwd._plan_layout(do, q, k, v, o, lse, causal=False, scale=0.125, deterministic=deterministic,
                                tuned_tiles=True, pipelining=True, exp2=True, causal_skip=True, tma=True,
                                warp_specialization=True, config=None, dq_config=None, ws_config=None,
                                ws_dq_config=None)

    try:
        for N, ordered in ((least // 2 * 64, True), (least // 2 * 64 - 64, False), (least // 2 * 64 - 63, True)):
            assert bwd.ordered_dq_hides_its_order(1, 2, N, 64, 4) == ordered
            layout = kept(N, False)
            assert (layout.ordered, layout.first_stores, layout.separate) == (ordered, ordered, False), N
            assert kept(N, True).ordered  # (deterministic: the order on any grid)
        # The traffic model follows: on the small grid the fused plan's bytes, deterministic the order's.
        small = Problem(1, 2, least // 2 * 64 - 64, 64, "bf16", False)
        ordered_bytes, deterministic_bytes = bwd.bwd_hbm_bytes(small), bwd.bwd_hbm_bytes(small, deterministic=True)
        entry["ws_dq"] = "fused"
        bwd.backward_plan.cache_clear()
        assert ordered_bytes == bwd.bwd_hbm_bytes(small) != deterministic_bytes
    finally:
        bwd.backward_plan.cache_clear()


def _sm90(device):
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("ordered dQ runs in the Hopper dK/dV kernel: it needs sm_90")


@pytest.fixture(params=["own-turns", "writer-1-buffer", "writer-2-buffers", "writer-per-slice",
                        "writer-first-stores"])
def writer(request, monkeypatch):
    """Ordered dQ's turns taken by the consumers, or by a dQ-writer warp (``ORDERED_DQ_WRITER``) with one or
    two stage buffers per consumer (``DQ_WRITER_BUFFERS``; two where they fit), or by a writer warp per
    column slice (``DQ_WRITER_PER_SLICE``, above 64 columns), or so and each tile's first add storing into an
    accumulator nothing zeroed (``ORDERED_DQ_FIRST_STORES``; NaN-filled here, so a row it misses fails)."""
    way = request.param
    monkeypatch.setattr(hopper_bwd, "ORDERED_DQ_WRITER", way != "own-turns")
    monkeypatch.setattr(hopper_bwd, "DQ_WRITER_BUFFERS", 2 if way == "writer-2-buffers" else 1)
    monkeypatch.setattr(hopper_bwd, "DQ_WRITER_PER_SLICE", way in ("writer-per-slice", "writer-first-stores"))
    monkeypatch.setattr(hopper_bwd, "ORDERED_DQ_FIRST_STORES", way == "writer-first-stores")
    monkeypatch.setattr(bwd, "_KEPT", {})  # (launches bound under the other setting)
    return way


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["ws-M64-c2-s2", "ws-M32-c2-s3"])
@pytest.mark.parametrize("shape", WS_SHAPES + [(1, 4, 2, 1000, 700, 80), (2, 2, 1, 130, 1100, 96)],
                         ids=lambda s: "B{}-Hq{}-Hkv{}-Nq{}-Nk{}-D{}".format(*s))
def test_ordered_dq_matches_float64(shape, config, device, writer):
    """Ordered dQ against float64, causal and not, bf16 and fp16: GQA, Nq ≠ Nk both ways, ragged N, one
    query row, rows that see no key, a head-dim tail (64-row Q tiles only)."""
    _sm90(device)
    B, Hq, Hkv, Nq, Nk, D = shape
    if D % 64 and not config.startswith("ws-M64"):
        pytest.skip("fused dQ takes a head-dim tail with 64-row Q tiles only")
    for causal, dtype_name in ((False, "bf16"), (True, "bf16"), (True, "fp16")):
        q, k, v = make_qkv(B, Hq, Nq, D, DTYPES[dtype_name], device, Hkv=Hkv, Nk=Nk, seed=31)
        check_gradients(attention, q, k, v, causal=causal, dtype_name=dtype_name, ws_config=config,
                        ws_dq_config=bwd.ORDERED_DQ)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("D", [64, 128])
def test_ordered_dq_gives_the_same_bits_every_run(D, causal, device, writer):
    """A problem with many more programs than SMs (so programs of one head run in different waves and
    their adds meet in different orders each run with atomics): ordered dQ's bits are the same in five
    runs, and its dQ is within rounding of fused dQ's."""
    _sm90(device)
    B, H, N = 2, 8, 2048 + 37
    q, k, v = make_qkv(B, H, N, D, torch.bfloat16, device, Hkv=4, seed=32)
    scale = D ** -0.5
    o, lse = saved_forward(q, k, v, causal, scale)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(33)).to(q.dtype).to(device)
    runs = [bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, ws_config="ws-M64-c2-s2",
                                   ws_dq_config=bwd.ORDERED_DQ) for _ in range(5)]
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(_bits(a), _bits(b))
    fused = bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, ws_config="ws-M64-c2-s2",
                                   ws_dq_config=bwd.FUSED_DQ)
    torch.testing.assert_close(runs[0][0].float(), fused[0].float(), atol=2e-2, rtol=2e-2)
    for a, b in zip(runs[0][1:], fused[1:]):  # (dK and dV do not depend on how dQ adds)
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.gpu
def test_a_deterministic_backward_with_the_switch_on_is_correct_and_reproducible(monkeypatch, device):
    """``deterministic=True`` with ``ORDERED_DQ_DEFAULT`` on, the plan as tuned: against float64 and bit
    for bit twice (on a GPU whose tuned D 64 plan fuses dQ it runs ordered dQ; elsewhere what it did)."""
    _sm90(device)
    monkeypatch.setattr(bwd, "ORDERED_DQ_DEFAULT", True)
    monkeypatch.setattr(bwd, "_KEPT", {})
    bwd.backward_plan.cache_clear()
    try:
        q, k, v = make_qkv(2, 4, 700, 64, torch.bfloat16, device, Hkv=2, Nk=900, seed=34)
        check_gradients(attention, q, k, v, causal=True, dtype_name="bf16", deterministic=True)
        o, lse = saved_forward(q, k, v, True, 0.125)
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(35)).to(q.dtype).to(device)
        first, second = (bwd.attention_backward(do, q, k, v, o, lse, causal=True, scale=0.125, deterministic=True)
                         for _ in range(2))
        for a, b in zip(first, second):
            assert torch.equal(_bits(a), _bits(b))
    finally:
        bwd.backward_plan.cache_clear()
