"""What each stage claims, read from the PTX Triton generates for sm_80 and sm_90 (no GPU needed)."""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import pytest
import torch

from harness.inspect_code import count_instructions, first_mma_loop, run_ptxas, sass
from stages import STAGES
from stages.c_optimized import configs, hopper_ws
from stages.contract import Problem

PROBLEM = Problem(B=4, H=32, N=4096, D=64, dtype="fp16")


def ops(ptx: str) -> dict[str, int]:
    """The instruction counts `harness inspect` prints, under short names."""
    c = count_instructions(ptx)
    return {"cp_async": c["cp.async.cg.shared.global"], "commit": c["cp.async.commit_group"],
            "wait": c["cp.async.wait_group"], "tma": c["cp.async.bulk.tensor"], "mbarrier": c["mbarrier"],
            "mma_sync": c["mma.sync"], "ldmatrix": c["ldmatrix"], "wgmma": c["wgmma.mma_async"],
            "ex2": c["ex2.approx"], "ld_v4": c["ld.global.v4"]}


@pytest.fixture(scope="module")
def compiled():
    """Every (stage, arch, causal) compiled once for the whole module."""
    out = {}
    for name in ("a", "b", "c"):
        for arch in (80, 90):
            for causal in (False, True):
                p = Problem(PROBLEM.B, PROBLEM.H, PROBLEM.N, PROBLEM.D, PROBLEM.dtype, causal)
                out[name, arch, causal] = STAGES[name].compile(p, arch)
    return out


@pytest.mark.parametrize("arch", [80, 90])
def test_stage_a_is_three_kernels_b_and_c_one(compiled, arch):
    assert [k.name for k in compiled["a", arch, False]] == list(STAGES["a"].kernel_names)
    assert len(compiled["b", arch, False]) == 1 and len(compiled["c", arch, False]) == 1


@pytest.mark.parametrize("arch", [80, 90])
def test_stage_b_has_no_async_copies(compiled, arch):
    (kernel,) = compiled["b", arch, True]
    c = ops(kernel.asm["ptx"])
    assert c["cp_async"] == c["commit"] == c["wait"] == c["tma"] == 0, c
    assert kernel.num_stages == 1
    assert c["ld_v4"] > 0, "K/V tiles should still be loaded with 16-byte vector loads"


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm80_pipelines_with_cp_async_and_mma_sync(compiled, causal):
    (kernel,) = compiled["c", 80, causal]
    c = ops(kernel.asm["ptx"])
    assert c["cp_async"] > 0 and c["commit"] > 0 and c["wait"] > 0, c
    assert c["mma_sync"] > 0 and c["ldmatrix"] > 0, c
    assert c["tma"] == 0 and c["wgmma"] == 0
    assert c["ex2"] > 0


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm90_uses_tma_mbarriers_and_wgmma(compiled, causal):
    (kernel,) = compiled["c", 90, causal]
    c = ops(kernel.asm["ptx"])
    assert c["tma"] > 0 and c["mbarrier"] > 0, c
    assert c["wgmma"] > 0 and c["mma_sync"] == 0, c


def test_stage_c_switches_really_switch():
    """The ablation is only honest if turning a switch off changes the code."""
    no_pipe = ops(STAGES["c"].compile(PROBLEM, 80, pipelining=False)[0].asm["ptx"])
    assert no_pipe["cp_async"] == 0 and no_pipe["commit"] == 0
    no_tma = ops(STAGES["c"].compile(PROBLEM, 90, tma=False)[0].asm["ptx"])
    assert no_tma["tma"] == 0 and no_tma["cp_async"] > 0
    causal = Problem(4, 32, 4096, 64, "fp16", causal=True)
    skip = STAGES["c"].compile(causal, 80)[0].asm["ttgir"]
    no_skip = STAGES["c"].compile(causal, 80, causal_skip=False)[0].asm["ttgir"]
    # Both split the K/V loop (whole tiles, then a ragged tail); causal skipping bounds it by the
    # program's diagonal (the min/max of its rows' last keys) and runs the tiles left of the diagonal
    # mask-free: fewer selects than the loop that masks every tile.
    assert skip.count("arith.minsi") > no_skip.count("arith.minsi"), "causal skipping bounds the loop"
    assert skip.count("arith.select") < no_skip.count("arith.select"), "causal skipping drops masks"


def test_stage_c_shared_memory_fits_the_budget(compiled):
    for arch in (80, 90):
        (kernel,) = compiled["c", arch, False]
        limit = {80: 163 * 1024, 90: 227 * 1024}[arch]
        assert 0 < kernel.shared_bytes <= limit


def test_stage_c_sm90_is_warp_specialized_with_softmax_overlapped(compiled):
    """Untuned on Hopper, stage C runs the Gluon kernel. Its PTX shows the three ideas: partitions
    that re-balance registers (setmaxnreg), bulk TMA copies on mbarriers, and asynchronous wgmma
    (a wait that leaves the P·V product in flight while the K slot is released)."""
    (kernel,) = compiled["c", 90, False]
    assert kernel.name == "ws_attention_kernel"
    ptx = kernel.asm["ptx"]
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    c = ops(ptx)
    assert c["tma"] > 0 and c["mbarrier"] > 0 and c["wgmma"] > 0 and c["ex2"] > 0, c
    no_ws = STAGES["c"].compile(PROBLEM, 90, warp_specialization=False)[0]
    assert no_ws.name == "optimized_attention_kernel"
    assert "wgmma.wait_group.sync.aligned 1;" not in no_ws.asm["ptx"], "tl's loop waits for every QKᵀ at once"


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm90_consumers_signal_without_a_warpgroup_barrier(compiled, causal):
    """A consumer releases a K/V slot and passes its ping-pong turn with one thread's zero-byte
    ``mbarrier.arrive.expect_tx``. Triton 3.6 puts a ``bar.sync`` of the warpgroup in front of every
    plain ``mbarrier.arrive``; the kernel avoids it, and no such barrier precedes its arrivals."""
    (kernel,) = compiled["c", 90, causal]
    lines = [ln.strip() for ln in kernel.asm["ptx"].splitlines()]
    instructions = [ln for ln in lines if ln and not ln.startswith(("$L", "//", "{", "}"))]
    assert not any("mbarrier.arrive.shared" in ln for ln in instructions), "a plain mbarrier.arrive is back"
    signals = [i for i, ln in enumerate(instructions) if "mbarrier.arrive.expect_tx" in ln and ln.endswith(", 0;")]
    assert signals, "no zero-byte arrivals: the consumers' signals are gone"
    after_barrier = [instructions[i] for i in signals if instructions[i - 1].startswith("bar.sync")]
    assert not after_barrier, after_barrier


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm90_stores_o_with_one_tma_copy_through_the_q_buffer(compiled, causal):
    """The epilogue writes O into shared memory (``stmatrix``), into the Q buffer of its item, and
    one thread stores it with a TMA copy; that buffer takes a later item's Q only after the copy
    engine has read O out of it (``cp.async.bulk.wait_group.read``). No per-thread global stores
    are left: from the wgmma accumulator layout they wrote 4 bytes into each of 8 rows per warp
    instruction."""
    (kernel,) = compiled["c", 90, causal]
    lines = [ln.strip() for ln in kernel.asm["ptx"].splitlines()]
    assert not any(ln.startswith("st.global") for ln in lines), "O is stored from registers again"
    assert any(ln.startswith("stmatrix") for ln in lines)
    tma_store = [i for i, ln in enumerate(lines) if "cp.async.bulk.tensor.4d.global.shared" in ln]
    assert tma_store, "no TMA store of O"
    for i in tma_store:
        rest = lines[i:]
        read_done = next((j for j, ln in enumerate(rest) if ln.split() == ["cp.async.bulk.wait_group.read", "0;"]),
                         None)
        assert read_done is not None, "O's buffer is never waited for"
        q_load = next((j for j, ln in enumerate(rest) if "cp.async.bulk.tensor.4d.shared::cluster.global" in ln),
                      len(rest))
        assert read_done < q_load, "the next Q would land in the buffer before O has left it"
    assert any(ln.startswith("prefetch.global.L2") for ln in lines), "no L2 prefetch of the next item's Q"


def test_stage_c_sm90_runs_items_into_each_other(compiled):
    """In the persistent kernel each consumer has two Q buffers and one tile loop per item whose
    first turn also finishes the previous item: the loop holds both products of a tile, the store
    of the previous item's O (a TMA copy issued inside the loop) and the fetch of the next item's Q.
    Read from the compiled IR, where the loop structure is explicit."""
    (kernel,) = compiled["c", 90, False]
    config = configs.candidate_configs(PROBLEM.D, torch.float16, 90)[0]
    assert kernel.name == "ws_attention_kernel" and config.persistent
    ttgir = kernel.asm["ttgir"]
    q_bufs = re.search(r"%q_bufs = ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x1x1x64x64xf16", ttgir)
    assert q_bufs and int(q_bufs.group(1)) == 2 * config.consumers, "not two Q buffers per consumer"
    loops = [_region(ttgir, m.start()) for m in re.finditer(r"scf\.for %", ttgir)]
    tile_loops = [body for body in loops if "ttng.warp_group_dot" in body]
    assert len(tile_loops) == config.consumers, "one tile loop per consumer"
    for body in tile_loops:
        assert body.count("ttng.warp_group_dot ") == 2, "S = Q·Kᵀ and O += P·V in every turn"
        for op in ("ttng.async_tma_copy_local_to_global", "ttng.async_tma_store_wait",
                   "ttng.async_tma_copy_global_to_local"):
            assert op in body, op


def test_deep_q_kernel_has_three_q_buffers_per_consumer_and_no_spills():
    """With ``deep_q`` (``-Q3``) each consumer of the persistent kernel has three Q buffers, at D 64
    and at D 128 (where it leaves a 2-slot K/V ring), and the kernel still spills nothing."""
    for D, name in ((64, "WS-M128-N128-s3-P-Q3"), (128, "WS-M128-N128-s2-P-Q3")):
        config = configs.Config.parse(name)
        (kernel,) = STAGES["c"].compile(Problem(2, 4, 300, D, "fp16", True), 90, config=config)
        q_bufs = re.search(rf"%q_bufs = ttg.local_alloc : \(\) -> !ttg.memdesc<(\d+)x1x1x64x{D}xf16",
                           kernel.asm["ttgir"])
        assert q_bufs and int(q_bufs.group(1)) == 3 * config.consumers, name
        assert kernel.shared_bytes == pytest.approx(configs.shared_memory_bytes(config, D, 2), abs=1024), name
        usage = run_ptxas(kernel.asm["ptx"], "sm_90a")
        assert "ptxas_error" not in usage, usage
        assert usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)


def test_two_programs_per_sm_halve_the_register_pool_and_fit_twice():
    """A ``-P2`` config (one consumer warpgroup, a persistent grid of two programs per SM): the kernel
    is the one-consumer kernel with its register pool halved (``maxnreg`` 128, the consumer 232 a
    thread when the producer takes its minimum), so two programs' registers and shared memory fit
    one SM; the grid is two programs per SM; it compiles without spills. Only one consumer may share
    an SM this way, and only a persistent grid asks for it."""
    assert hopper_ws.register_budget(1, programs_per_sm=2) == (232, hopper_ws.PRODUCER_REGS, 128)
    assert hopper_ws.register_budget(1) == (256, 256, 256)
    with pytest.raises(ValueError, match="consumers"):
        hopper_ws.register_budget(2, programs_per_sm=2)
    with pytest.raises(ValueError, match="programs_per_sm"):
        configs.ws_config(128, 128, 3, True, programs_per_sm=2)
    with pytest.raises(ValueError, match="programs_per_sm"):
        configs.ws_config(64, 128, 3, False, programs_per_sm=2)
    grid, _ = hopper_ws.runtime_args(128, 16, 128, (1, 1, 1), causal=False, consumers=1, persistent=True,
                                     num_sms=132, programs_per_sm=2)
    assert grid == (264,)
    for name, D in (("WS-M64-N128-s3-P2", 64), ("WS-M64-N64-s2-P2", 128)):
        config = configs.Config.parse(name)
        assert str(config) == name and config.programs_per_sm == 2 and config.consumers == 1
        assert configs.fits(config, D, 2, 90)
        (kernel,) = STAGES["c"].compile(Problem(2, 4, 300, D, "bf16", True), 90, config=config)
        assert 2 * (kernel.shared_bytes + 1024) <= 228 * 1024, name  # (1 KB of each block is the system's)
        assert re.search(r"\.maxnreg 128\b", kernel.asm["ptx"]), name
        usage = run_ptxas(kernel.asm["ptx"], "sm_90a")
        assert "ptxas_error" not in usage, usage
        assert usage["registers"] <= 128 and usage["spill_stores"] == 0 and usage["spill_loads"] == 0, (name, usage)
    # twice the shared memory of a 3-slot ring of 128-row K/V tiles at D 128 does not fit
    assert not configs.fits(configs.Config.parse("WS-M64-N128-s3-P2"), 128, 2, 90)


def _region(text: str, start: int) -> str:
    """The MLIR region opened on the line holding ``start``: up to the closing brace at that line's
    indentation (MLIR prints nested regions indented)."""
    begin = text.rfind("\n", 0, start) + 1
    line = text[begin:start]
    indent = line[:len(line) - len(line.lstrip())]
    end = text.find("\n" + indent + "}", start)
    return text[begin:end if end >= 0 else len(text)]


def _instruction_lines(sass_text: str) -> list[str]:
    """The instruction lines of cuobjdump's SASS listing (an address comment, then the opcode),
    without the encoding lines and labels around them."""
    return [ln for ln in sass_text.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/\s+[@A-Z]", ln)]


def _address(line: str) -> int:
    """The address of one of ``_instruction_lines``."""
    return int(re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1), 16)


def _sass_spans(sass_text: str, start: str, end: str, count: dict[str, str]) -> list[dict[str, int]]:
    """For each stretch of the SASS from a line matching ``start`` to the next line matching ``end``:
    how many of its lines (the first one included) match each pattern of ``count``."""
    spans, current = [], None
    for line in sass_text.splitlines():
        if current is None:
            if not re.search(start, line):
                continue
            current = dict.fromkeys(count, 0)
        elif re.search(end, line):
            spans.append(current)
            current = None
            continue
        for name, pattern in count.items():
            current[name] += bool(re.search(pattern, line))
    return spans


def _softmax_blocks(sass_text: str) -> list[dict[str, int]]:
    """For each run of exponentials in the SASS: from one ``MUFU.EX2`` to the next branch, how many
    exponentials and fp32-to-16-bit conversions (``F2FP``) it holds."""
    return _sass_spans(sass_text, "MUFU.EX2", r"\bBRA\b", {"ex2": "MUFU.EX2", "f2fp": "F2FP"})


@pytest.mark.parametrize("causal", [False, True])
def test_stage_c_sm90_softmax_is_one_basic_block(compiled, causal):
    """The softmax and the conversion of P for the next ``P·V`` (and the eager rescale of O) are one
    stretch of code with no branch in it, so ptxas interleaves the conversions with the exponentials (their unit
    is as loaded as the tensor cores at D = 64). When the item boundary's store of O sat between the
    softmax and the conversions, all of them ran after the last exponential (docs/performance-log/softmax.md,
    entry 23)."""
    (kernel,) = compiled["c", 90, causal]
    config = configs.choose_config(PROBLEM.D, torch.float16, causal, 90, PROBLEM.N)
    machine_code = sass(kernel.asm["ptx"], "sm_90a")
    if not machine_code:
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    per_thread = 64 * config.block_n // 128  # one consumer's scores per thread and tile
    tiles = [b for b in _softmax_blocks(machine_code) if b["ex2"] >= per_thread]
    assert len(tiles) == config.consumers, (config, _softmax_blocks(machine_code))
    for block in tiles:
        assert block["f2fp"] == per_thread // 2, block  # two scores per packed register


def _exp_turns(sass_text: str) -> list[dict[str, int]]:
    """For each wait on a 256-thread named barrier (``BAR.SYNC id, 0x100``) in the SASS: the
    exponentials and branches up to the next arrival on one (``BAR.ARV id, 0x100``)."""
    return _sass_spans(sass_text, r"BAR\.SYNC\S*\s+0x[0-9a-f]+, 0x100\b", r"BAR\.ARV\s+0x[0-9a-f]+, 0x100\b",
                       {"ex2": "MUFU.EX2", "branches": r"\bBRA\b"})


@functools.lru_cache(maxsize=None)
def _persistent_d64_causal_sass(consumers: int, lazy_rescale: bool = True) -> tuple[configs.Config, str]:
    """The persistent warp-specialized config with ``consumers`` consumers, compiled for a ragged
    D = 64 causal problem, and its SASS ("" where ptxas or cuobjdump is missing): the machine code
    the exponential-turn tests read, assembled and disassembled once for all of them."""
    config = replace(next(c for c in configs.WS_SHAPES[64] if c.consumers == consumers and c.persistent),
                     lazy_rescale=lazy_rescale)
    (kernel,) = STAGES["c"].compile(Problem(2, 4, 1000, 64, "fp16", True), 90, config=config)
    return config, sass(kernel.asm["ptx"], "sm_90a")


@pytest.mark.parametrize("consumers", [2, 3])
def test_stage_c_sm90_two_consumers_take_turns_at_the_exponentials(consumers):
    """With two consumers the ping-pong turn is the block of exponentials, as in cuDNN's loop: a
    named barrier (``bar.sync``, 256 threads) in front of each tile's exponentials and the arrival on
    the other consumer's barrier behind the last of them, with no branch in between. ptxas moved an
    unpredicated ``bar.arrive`` up among the exponentials, which would end the turn early; this
    test fails then. Three consumers take turns at wgmma issue instead (mbarriers), with no named
    barrier of 256 threads."""
    config, machine_code = _persistent_d64_causal_sass(consumers)
    if not machine_code:
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    turns = _exp_turns(machine_code)
    if consumers == 3:
        assert turns == [] and "0x100" not in " ".join(ln for ln in machine_code.splitlines() if "BAR." in ln)
        return
    per_thread = 64 * config.block_n // 128
    assert len(turns) == consumers, turns
    for turn in turns:
        assert turn["ex2"] >= per_thread and turn["branches"] == 0, turn


def _shuffles_per_softmax(sass_text: str) -> list[int]:
    """For each exponential turn's arrival (``BAR.ARV id, 0x100``): the lane shuffles (``SHFL``) from
    the last branch before that turn's ``BAR.SYNC`` up to the arrival, i.e. in the basic block that
    holds a tile's mask, row maximum, exponentials and row sums."""
    counts, block_start, turn_start = [], 0, None
    lines = _instruction_lines(sass_text)
    for i, line in enumerate(lines):
        if re.search(r"BAR\.SYNC\S*\s+0x[0-9a-f]+, 0x100\b", line):
            turn_start = block_start
        elif re.search(r"BAR\.ARV\s+0x[0-9a-f]+, 0x100\b", line) and turn_start is not None:
            counts.append(sum("SHFL" in ln for ln in lines[turn_start:i]))
            turn_start = None
        elif re.search(r"\bBRA\b", line):
            block_start = i
    return counts


def test_stage_c_sm90_row_sums_need_no_shuffles_per_tile():
    """A tile's softmax shuffles between lanes only for the row maximum, which every lane must share:
    2 rows per thread × 2 rounds over the 4 lanes of a row. Each thread keeps its own part of its
    rows' sums, added across lanes once per item (``_thread_row_sums``); with ``gl.sum(p, axis=1)``
    this count read 7 and 8 (the sums' shuffles too), and every turn's end waited for the sums
    (docs/performance-log/softmax.md, entry 33)."""
    config, machine_code = _persistent_d64_causal_sass(2)
    if not machine_code:
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    assert _shuffles_per_softmax(machine_code) == [4] * config.consumers


def _rescale_jumps(sass_text: str) -> list[int]:
    """For each warp vote (``VOTE.ANY``) followed by a branch (``BRA`` to a higher address): the fp32
    multiplies (``FMUL``) it jumps over."""
    lines = _instruction_lines(sass_text)
    address = [_address(ln) for ln in lines]
    jumps = []
    for i, line in enumerate(lines):
        if not re.search(r"\bVOTE\.ANY\b", line):
            continue
        branch = next((j for j in range(i + 1, min(i + 4, len(lines))) if re.search(r"\bBRA\b", lines[j])), None)
        target = branch is not None and re.search(r"\bBRA\S*\s+0x([0-9a-f]+)", lines[branch])
        if target and int(target.group(1), 16) > address[branch]:
            end = int(target.group(1), 16)
            jumps.append(sum("FMUL" in ln for ln, a in zip(lines, address) if address[branch] < a < end))
    return jumps


@pytest.mark.parametrize("lazy_rescale", [True, False])
def test_stage_c_sm90_lazy_rescale_jumps_over_the_multiplies(lazy_rescale):
    """With the lazy rescale a warp skips the rescale of O (D / 2 multiplies per thread) unless one of
    its rows raised its maximum by more than 2^8: one vote and one jump per tile, after the
    exponential turn (``hopper_ws._rescale_if_needed``). The eager form (``-E``) has no such jump."""
    config, machine_code = _persistent_d64_causal_sass(2, lazy_rescale)
    if not machine_code:
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    jumps = _rescale_jumps(machine_code)
    assert jumps == ([64 // 2] * config.consumers if lazy_rescale else []), jumps


def test_stage_c_sm90_exponential_turns_have_named_barriers_of_their_own():
    """The exponential turns use hardware named barriers ``EXP_TURN_BARRIER`` + consumer (ids are
    hard-coded, there are 16). Triton's warp specialization takes named barriers of its own (the
    whole CTA, the default partition, each worker partition's warpgroup): if a Triton version took
    one of ours, the turns would wait on the wrong arrivals and the kernel would hang or race on the
    GPU. Here the clash shows on the CPU: every other barrier in the machine code has a lower id."""
    config, machine_code = _persistent_d64_causal_sass(2)
    if not machine_code:
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    first = int(hopper_ws.EXP_TURN_BARRIER.value)
    ours, theirs = set(), set()
    for ident, threads in re.findall(r"\bBAR\.(?:SYNC|ARV|RED)[A-Z_.]* (0x[0-9a-f]+)(?:, (0x[0-9a-f]+))?", machine_code):
        (ours if threads == "0x100" else theirs).add(int(ident, 16))
    assert ours == {first, first + 1}, ours
    assert theirs and max(theirs) < first, theirs


def _spills_in_tile_loops(sass_text: str) -> list[str]:
    """Local-memory loads and stores (register spills) inside a tile loop of the SASS: the innermost
    loops (a backward branch and its target) that issue wgmma (``HGMMA``). Outer loops do not count:
    the warp-specialized kernel's partitions sit in one, which Triton's dispatch branches back to."""
    lines = _instruction_lines(sass_text)
    address = {_address(ln): i for i, ln in enumerate(lines)}
    loops = []
    for i, ln in enumerate(lines):
        target = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", ln)
        if target and address.get(int(target.group(1), 16), i) < i:
            loops.append((address[int(target.group(1), 16)], i))
    mma = [(a, b) for a, b in loops if any("HGMMA" in lines[k] for k in range(a, b + 1))]
    tile_loops = [(a, b) for a, b in mma if not any((c, d) != (a, b) and a <= c and d <= b for c, d in mma)]
    return [lines[i].strip() for i, ln in enumerate(lines) if re.search(r"\b(LDL|STL)", ln)
            and any(a <= i <= b for a, b in tile_loops)]


def test_spills_in_tile_loops_are_found():
    fake = """
        /*0000*/                   STL [R1], R3 ;
        /*0010*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;
        /*0020*/                   LDL R4, [R1] ;
        /*0030*/               @P0 BRA 0x10 ;
        /*0040*/                   LDL R5, [R1] ;
        /*0050*/                   BRA 0x0 ;
    """
    assert _spills_in_tile_loops(fake) == ["/*0020*/                   LDL R4, [R1] ;"]


@pytest.mark.parametrize("D", sorted(configs.WS_SHAPES) + [96, 136, 152, 192])
def test_every_warp_specialized_config_compiles_without_spills(D):
    """Every candidate of the warp-specialized kernel assembles for sm_90 within the shared-memory
    budget, for a ragged N and for N a multiple of the tiles (masks compiled out), with no register
    spill inside a tile loop. ptxas may keep a value or two on the stack outside them: at D = 128
    with a 2-slot ring it stores 4 bytes once at the start and loads them back once per partition.
    (Three consumers at D = 128 spill ~1 KB, which is why they are not candidates.) The head dims
    that run as a main part and a tail (96 = 64 + 32; 136, 152, 192 = 128 + 16, 32, 64) too, for
    the ragged N only (compile time)."""
    for config in configs.ws_shapes(D):
        for causal in (False, True):
            for N in (1000, 1024) if D in configs.WS_SHAPES else (1000, ):
                (kernel,) = STAGES["c"].compile(Problem(2, 4, N, D, "fp16", causal), 90, config=config)
                assert kernel.name == "ws_attention_kernel"
                assert kernel.shared_bytes <= 227 * 1024
                facts = run_ptxas(kernel.asm["ptx"], "sm_90a")
                assert "ptxas_error" not in facts, facts
                where = (str(config), causal, N, facts)
                assert facts["spill_stores"] <= 16 and facts["spill_loads"] <= 16, where
                machine_code = sass(kernel.asm["ptx"], "sm_90a")
                if machine_code:
                    assert not _spills_in_tile_loops(machine_code), where


def test_a_96_key_tile_runs_as_64_and_32_keys():
    """``hopper_ws.key_widths``: a K/V tile of 96 keys is two tiles, 64 rows and 32, each with its own
    TMA boxes (and, at 192 columns, their head-dim tails: four boxes per K tile) and its own scores:
    the consumers' tile loop issues the 32-key products (``n32``) beside the 64-key ones, 36 wgmma per
    tile against the 64-key config's 20 (half again the keys for less than twice the instructions),
    with no local memory in the loop."""
    assert hopper_ws.key_widths(96) == (64, 32) and hopper_ws.key_widths(128) == (128, 0)
    for bad in (8, 72, 112):  # a tail of 8 rows (under wgmma's 16), a tail not a power of two
        with pytest.raises(ValueError, match="block_n"):
            hopper_ws.key_widths(bad)
    boxes = hopper_ws.descriptor_boxes(192, 96)
    assert boxes["k_desc"] == ("k", (1, 1, 64, 128)) and boxes["k_keys_desc"] == ("k", (1, 1, 32, 128))
    assert boxes["v_keys_tail_desc"] == ("v", (1, 1, 32, 64)) and boxes["q_desc"] == ("q", (1, 1, 64, 128))
    assert hopper_ws.descriptor_boxes(128, 128)["k_keys_desc"] is None
    assert hopper_ws.descriptor_boxes(160, 96)["k_keys_tail_desc"] == ("k", (1, 1, 32, 32))
    loops = {}
    for block_n in (64, 96):
        config = next(c for c in configs.ws_shapes(192) if c.block_n == block_n)
        (kernel,) = STAGES["c"].compile(Problem(2, 4, 1000, 192, "bf16", True), 90, config=config)
        assert kernel.shared_bytes <= 227 * 1024
        ptx = kernel.asm["ptx"]
        assert ("m64n32k16" in ptx) == (block_n == 96)
        machine_code = sass(ptx, "sm_90a")
        if machine_code:
            loops[block_n] = first_mma_loop(machine_code)
    if loops:
        assert loops[64].wgmma == 20 and loops[96].wgmma == 36, loops
        assert loops[96].local_loads + loops[96].local_stores == 0, loops
        assert loops[96].instructions < 2 * loops[64].instructions, loops


# A head dim of 8 mod 16 leaves a contiguous tensor's row stride without Triton's divisible-by-16
# fact; the host checks the strides instead (stages/c_optimized/aligned.py). Without that, every
# element was a load of its own and no cp.async was issued (D 72: 192 two-byte loads per thread).
@pytest.mark.parametrize("D", [40, 72, 200])
def test_stage_c_loads_16_byte_rows_at_head_dims_of_8_mod_16(D):
    from stages.c_optimized import backward

    p = Problem(B=2, H=8, N=1000, D=D, dtype="fp16", causal=True)
    decode = Problem(B=4, H=8, N=1, Hkv=2, Nk=8192, D=D, dtype="bf16")
    kernels = (STAGES["c"].compile(p, 80) + STAGES["c"].compile(decode, 90) + backward.compile_backward(p, 80)
               + backward.compile_backward(p, 80, deterministic=True))
    for kernel in kernels:
        # (two-byte accesses: single fp16/bf16 elements; the fp32 row statistics are scalars anyway)
        element_loads = re.findall(r"\b(?:ld|st)\.global(?:\.[\w:]+)*\.b16\b", kernel.asm["ptx"])
        assert len(element_loads) <= 2, f"{kernel.name}: {len(element_loads)} single-element loads and stores"
    (forward,) = STAGES["c"].compile(p, 80)
    assert ops(forward.asm["ptx"])["cp_async"] > 0
    assert (run_ptxas(forward.asm["ptx"]).get("spill_stores") or 0) <= 128  # (D 200 spilled 1.9 KB per thread)


def test_strides_off_16_bytes_compile_without_the_alignment():
    from stages.c_optimized.aligned import row_alignment

    t = torch.empty(2, 3, 10, 72, dtype=torch.float16, device="meta")
    assert row_alignment(t, t) == 8
    assert row_alignment(t.float()) == 4
    sliced = torch.empty(2, 3, 10, 76, dtype=torch.float16, device="meta")[..., :72]  # rows 152 bytes apart
    assert row_alignment(t, sliced) == 1
    assert row_alignment(t.transpose(1, 2)) == 8
    # Strides Triton itself finds divisible by 16 need no telling (no instructions spent on it):
    expanded = torch.empty(1, dtype=torch.float16, device="meta").expand(2, 3, 10, 72)  # the gradient of .sum()
    assert row_alignment(expanded) == 1
    assert row_alignment(torch.empty(2, 3, 10, 64, dtype=torch.float16, device="meta")) == 1
    assert row_alignment(t, expanded) == 8


def test_early_merge_launches_the_merge_before_the_split_kernel_ends(monkeypatch):
    """The merge of split-KV decoding launched early (decode.EARLY_MERGE): the split kernel lets its
    dependents launch, the merge waits for it before reading a partial, and only on sm_90."""
    from stages.c_optimized import decode, kernels

    p = Problem(B=1, H=32, N=1, Hkv=8, Nk=32768, D=128, dtype="bf16")
    for early in (False, True):
        monkeypatch.setattr(decode, "EARLY_MERGE", early)
        monkeypatch.setenv("LAB_DECODE_EARLY_MERGE", str(int(early)))  # (an interpreting process compiles in a child)
        kernels._recipe.cache_clear()
        split, merge = STAGES["c"].compile(p, 90)
        assert (split.name, merge.name) == ("split_kv_attention_kernel", "merge_splits_kernel")
        assert ("griddepcontrol.launch_dependents" in split.asm["ptx"]) == early
        wait = merge.asm["ptx"].find("griddepcontrol.wait")
        assert (wait >= 0) == early
        if early:  # no partial is read before the wait
            assert "ld.global" not in merge.asm["ptx"][:wait]
        assert not any("griddepcontrol" in k.asm["ptx"] for k in STAGES["c"].compile(p, 80))
    kernels._recipe.cache_clear()


def _pv_chains(ptx: str, block_n: int) -> list[list[tuple[int, str]]]:
    """The P·V products of a warp-specialized forward's PTX, each as its chain of ``block_n / 16``
    wgmma k-steps (N: a part of the head dim, told from the Q·Kᵀ products by N = ``block_n``), each
    step as (N, its scale-d operand: the predicate that says whether it adds to the accumulator)."""
    steps = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.[^;]*\}, %rd\d+, (%p\d+|\d), 1, 1, 1;", ptx)
    steps = [(int(n), operand) for n, operand in steps if int(n) != block_n]
    k_steps = block_n // 16
    return [steps[i:i + k_steps] for i in range(0, len(steps), k_steps)]


@pytest.mark.parametrize("D", [64, 80])
def test_ws_forward_fresh_pv_starts_each_item_in_its_product(monkeypatch, D):
    """``hopper_ws.FRESH_PV``: a work item's first ``P·V`` starts the accumulator afresh (wgmma's
    scale-d false) instead of the softmax scaling the previous item's O by 0. Off, each P·V chain's
    k-steps all add to the accumulator (one predicate, always true); on, each chain's first step
    takes a runtime predicate of its own and the rest still add, in the loop's product and the
    program's last one, the head-dim tail's chain too (D 80: 64 + 16 columns). No tile loop spills, and
    at D 64 the lazy rescale's jump over the multiplies stays."""
    from stages.c_optimized import kernels

    config = next(c for c in configs.ws_shapes(D) if c.persistent and c.consumers == 2 and c.block_n == 128)
    chains = {}
    try:
        for fresh in (False, True):
            monkeypatch.setattr(hopper_ws, "FRESH_PV", fresh)
            monkeypatch.setenv("LAB_WS_FRESH_PV", str(int(fresh)))  # (an interpreting process compiles in a child)
            kernels._recipe.cache_clear()
            (kernel,) = STAGES["c"].compile(Problem(B=128, H=16, N=128, D=D, dtype="bf16"), 90, config=config)
            assert kernel.name == "ws_attention_kernel"
            chains[fresh] = _pv_chains(kernel.asm["ptx"], config.block_n)
            if fresh:
                machine_code = sass(kernel.asm["ptx"], "sm_90a")
                if machine_code:
                    assert _spills_in_tile_loops(machine_code) == []
                    if D == 64:  # (with a tail ptxas moves the jump further from its vote than the helper looks)
                        assert _rescale_jumps(machine_code) == [D // 2] * config.consumers
    finally:
        kernels._recipe.cache_clear()
    parts = 2 if D % 64 else 1  # (a head-dim tail has a P·V of its own)
    for fresh, found in chains.items():
        assert len(found) == 2 * config.consumers * parts, (fresh, found)  # the loop's product and the last one
        for chain in found:
            assert len({n for n, _ in chain}) == 1 and len({op for _, op in chain[1:]}) == 1, chain
            assert (chain[0][1] != chain[1][1]) == fresh, (fresh, chain)
    constants, _ = hopper_ws.kernel_constants(causal=False, block_n=128, stages=3, fresh_pv=True)
    assert constants["FRESH_PV"] is True


def test_ws_forward_as_a_programmatic_dependent_launch_waits_before_any_memory_access(monkeypatch):
    """The warp-specialized forward launched as a programmatic dependent launch (hopper_ws.PDL): its
    programs wait in ``griddepcontrol.wait`` before their first copy, load or store (the kernel ahead of
    it may still be writing Q, K, V or reading what becomes O), and the launch asks for the attribute;
    without the switch, neither."""
    from stages.c_optimized import kernels

    p = Problem(B=128, H=16, N=128, D=64, dtype="fp16")
    for pdl in (False, True):
        monkeypatch.setattr(hopper_ws, "PDL", pdl)
        monkeypatch.setenv("LAB_WS_PDL", str(int(pdl)))  # (an interpreting process compiles in a child)
        kernels._recipe.cache_clear()
        (kernel,) = STAGES["c"].compile(p, 90)
        assert kernel.name == "ws_attention_kernel"
        ptx = kernel.asm["ptx"]
        wait = ptx.find("griddepcontrol.wait")
        assert (wait >= 0) == pdl
        if pdl:
            before = ptx[:wait]
            for access in ("cp.async.bulk", "prefetch.", "ld.global", "st.global", "red.global", "atom.global"):
                assert access not in before, f"{access} before the wait"
        constants, options = hopper_ws.kernel_constants(causal=False, block_n=128, stages=3)
        assert constants["PDL"] == options["launch_pdl"] == pdl
    kernels._recipe.cache_clear()


def test_fused_merge_releases_after_a_barrier_and_reads_past_l1(monkeypatch):
    """The merge fused into the split kernel (decode.MERGE "fused"): one kernel; the block's threads
    meet at a barrier before the one atomic add that releases their partials (acq_rel, gpu scope),
    and the merging program reads the partials past the SM's L1 (ld.global.cg), on sm_80 and sm_90,
    without spills."""
    from stages.c_optimized import decode, kernels

    p = Problem(B=1, H=32, N=1, Hkv=8, Nk=32768, D=128, dtype="bf16")
    monkeypatch.setattr(decode, "MERGE", "fused")
    monkeypatch.setenv("LAB_DECODE_MERGE", "fused")  # (an interpreting process compiles in a child)
    kernels._recipe.cache_clear()
    try:
        for arch in (80, 90):
            (split,) = STAGES["c"].compile(p, arch)
            ptx = split.asm["ptx"]
            atoms = re.findall(r"atom\.global\.(\S+)", ptx)
            assert atoms == ["gpu.acq_rel.add.u32"]
            before = ptx[:ptx.find("atom.global")]
            assert before.rfind("bar.sync") > before.rfind("st.global")  # every partial stored, then the barrier
            after = ptx[ptx.find("atom.global"):]
            assert "ld.global.cg" in after and "ld.global.cg" not in before
            assert run_ptxas(ptx, f"sm_{arch}a" if arch == 90 else f"sm_{arch}").get("spill_stores") == 0
    finally:
        kernels._recipe.cache_clear()
