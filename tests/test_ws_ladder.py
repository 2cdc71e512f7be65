"""The warp-specialization ladder of stage C's Hopper kernel (``hopper_ws.LADDER``): each rung is
registered as an ablation variant, turns on one more mechanism of the one kernel, compiles for
sm_90 (no GPU needed) and, on the GPU, matches the float64 reference."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import pytest
import torch

from harness.inspect_code import sass
from stages import STAGES
from stages.c_optimized import SWITCHES, VARIANTS, WS_LADDER, hbm_bytes, hopper_ws, kernels
from stages.c_optimized.configs import DEFAULT_SMS, WS_SHAPES, ws_config
from stages.contract import Problem

sys.path.insert(0, str(Path(__file__).parent))
from helpers import check_against_reference, make_qkv  # noqa: E402

RUNGS = range(1, len(hopper_ws.LADDER) + 1)
#: A config on which every rung changes something: two consumers (ping-pong at the exponentials),
#: persistent, lazy rescale.
FULL = ws_config(128, 128, 3, persistent=True, lazy_rescale=True)


def _select(N=4096, D=64, causal=False, dtype=torch.float16, arch=90, Nk=None, **kw):
    return kernels.select(4, 32, 32, N, N if Nk is None else Nk, D, dtype, causal, arch, DEFAULT_SMS, **kw)


def _static_args(choice, N=4096, D=64, causal=False):
    """The kernel's arguments (constexprs included) and launch options that ``_recipe`` would use."""
    _, args, extra = hopper_ws.static_plan(4, 32, N, D, (32 * N * D, N * D, D, 1), causal=causal,
                                           **choice.config.ws_options(choice.ws_rung))
    return {**args, **extra}


def test_the_rungs_are_steps_of_the_ablation_chain():
    """The "+" chain climbs the ladder between the tl kernel and the full Hopper kernel: the
    waterfall shows each rung's share; the last rung is "+warp_specialization" itself."""
    names = list(VARIANTS)
    ladder = [n for n in names if n in WS_LADDER]
    assert ladder == [f"+ws{k}-{name}" for k, (name, _) in zip(RUNGS, hopper_ws.LADDER[:-1])]
    chain = [n for n in names if n.startswith("+")]
    assert chain.index(ladder[0]) == chain.index("+causal_skip") + 1
    assert chain.index("+warp_specialization") == chain.index(ladder[-1]) + 1
    assert [VARIANTS[n] for n in ladder] == [{"ws_rung": k} for k in RUNGS[:-1]]


@pytest.mark.parametrize("bad, error", [(0, ValueError), (len(hopper_ws.LADDER) + 1, ValueError),
                                        (True, TypeError), ("3", TypeError), (2.0, TypeError)])
def test_ws_rung_is_validated(bad, error, device):
    q, k, v = make_qkv(1, 2, 64, 64, torch.float16, device)
    with pytest.raises(error, match="ws_rung"):
        STAGES["c"].attention(q, k, v, ws_rung=bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without sm_90 (a GPU may run the rung)")
def test_a_rung_where_the_kernel_cannot_run_is_a_value_error_naming_ws_rung():
    """The harness records a ValueError from the first call as ``unsupported``."""
    q, k, v = make_qkv(1, 2, 64, 64, torch.float16, "cpu")
    with pytest.raises(ValueError, match="ws_rung"):  # no sm_90 here
        STAGES["c"].attention(q, k, v, ws_rung=1)
    with pytest.raises(ValueError, match="ws_rung"):  # the traffic model says the same
        hbm_bytes(Problem(1, 2, 64, 64, "fp16"), ws_rung=1)
    for where in (dict(D=32), dict(dtype=torch.float32), dict(Nk=2048), dict(arch=80),
                  dict(warp_specialization=False), dict(split_kv=2)):
        with pytest.raises(ValueError, match="ws_rung"):
            _select(ws_rung=3, **where)
    # the training forward (log-sum-exp stored) and D 136 (padded to 256) do run the rungs
    for where in (dict(store_lse=True), dict(D=136)):
        assert _select(ws_rung=3, **where).path == "ws"


@pytest.mark.parametrize("D", sorted(WS_SHAPES))
def test_top_rung_is_the_default_kernel(D):
    """The last rung is the kernel stage C runs with no keyword: same config, same arguments."""
    for causal in (False, True):
        for N in (1000, 4096):
            default, top = _select(N, D, causal), _select(N, D, causal, ws_rung=len(hopper_ws.LADDER))
            assert default.path == top.path == "ws" and default.config == top.config
            assert _static_args(default, N, D, causal) == _static_args(top, N, D, causal)


def test_each_rung_changes_the_kernel_and_only_adds():
    """On a config that uses every mechanism, each rung's arguments differ from the one below, and
    switches that a rung turns on stay on above it."""
    steps = [_static_args(_select(config=FULL, ws_rung=k)) for k in RUNGS]
    for below, above in zip(steps, steps[1:]):
        assert below != above
    first = steps[0]
    assert first["CONSUMERS"] == 1 and first["CONSUMER_REGS"] == first["PRODUCER_REGS"] == first["maxnreg"]
    assert not (first["EXP_TURNS"] or first["ISSUE_TURNS"] or first["ZIGZAG"] or first["LANE_ROW_SUMS"]
                or first["LAZY_RESCALE"]) and first["Q_BUFS"] == 1
    top = steps[-1]
    assert top["CONSUMERS"] == 2 and top["EXP_TURNS"] and top["Q_BUFS"] == 2 and top["LANE_ROW_SUMS"]
    assert top["PRODUCER_REGS"] < top["maxnreg"] < top["CONSUMER_REGS"]
    for name in ("EXP_TURNS", "ZIGZAG", "LANE_ROW_SUMS", "LAZY_RESCALE"):
        on = [s[name] for s in steps]
        assert on == sorted(on), (name, on)  # False ... False True ... True


def test_rung_one_has_one_consumer_so_twice_the_items():
    """64 query rows per item on rung 1: the traffic model re-reads K/V per item, twice as often as
    with two consumers (128 rows)."""
    one, two = _select(config=FULL, ws_rung=1).config, _select(config=FULL, ws_rung=2).config
    assert (one.block_m, one.consumers, two.block_m, two.consumers) == (64, 1, 128, 2)


@functools.lru_cache(maxsize=None)
def _compiled(rung: int):
    """Rung ``rung`` on the two-consumer persistent config, compiled for a ragged D = 64 causal
    problem with meta tensors."""
    (kernel,) = STAGES["c"].compile(Problem(2, 4, 1000, 64, "fp16", True), 90, config=FULL, ws_rung=rung)
    return kernel


def _setmaxnreg(ptx: str) -> set[str]:
    return set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx))


@pytest.mark.parametrize("rung", [1, 2])
def test_the_first_rungs_compile_for_sm90(rung):
    """Rung 1 is one consumer warpgroup and the producer warp, with no register reallocation (no
    partition lowers its registers); rung 2 adds a consumer (twice the wgmma) and the producer's
    registers go to the consumers."""
    kernel = _compiled(rung)
    assert kernel.name == "ws_attention_kernel" and kernel.shared_bytes <= 227 * 1024
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    lowered = {int(n) for way, n in _setmaxnreg(ptx) if way == "dec"}
    if rung == 1:
        assert not lowered, _setmaxnreg(ptx)
    else:
        assert hopper_ws.PRODUCER_REGS in lowered and 240 in {int(n) for _, n in _setmaxnreg(ptx)}
        assert ptx.count("wgmma.mma_async") == 2 * _compiled(1).asm["ptx"].count("wgmma.mma_async")


@pytest.mark.slow
def test_every_rung_compiles_and_its_machine_code_shows_its_mechanism():
    """Read in the SASS: named-barrier exponential turns appear at rung 3; two Q buffers per
    consumer (more shared memory) at rung 4; fewer shuffles inside a turn at rung 5; the lazy
    rescale's vote-and-jump at rung 6."""
    from test_compiled_code import _exp_turns, _rescale_jumps, _shuffles_per_softmax

    codes = {k: sass(_compiled(k).asm["ptx"], "sm_90a") for k in RUNGS}
    if not all(codes.values()):
        pytest.skip("ptxas or cuobjdump not available in this triton install")
    turns = {k: _exp_turns(codes[k]) for k in RUNGS}
    assert [bool(turns[k]) for k in RUNGS] == [k >= 3 for k in RUNGS], turns
    assert _compiled(4).shared_bytes > _compiled(3).shared_bytes  # the second Q buffer
    shuffles = {k: _shuffles_per_softmax(codes[k]) for k in (4, 5)}
    assert max(shuffles[5]) < min(shuffles[4]), shuffles
    jumps = {k: _rescale_jumps(codes[k]) for k in RUNGS}
    assert [bool(jumps[k]) for k in RUNGS] == [k >= 6 for k in RUNGS], jumps


@pytest.mark.gpu
@pytest.mark.parametrize("rung", RUNGS)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_rung_matches_the_reference_on_the_gpu(rung, D, causal):
    """Every rung against float64, on a ragged N (masks on the last tile) and on a multiple of the
    tiles, with the config stage C would choose and with the two-consumer persistent one."""
    two_consumers = FULL if D == 64 else ws_config(128, 128, 2, persistent=True)  # D = 128: a 2-slot ring fits
    for N, config in ((1000, None), (1000, two_consumers), (384, None)):
        q, k, v = make_qkv(2, 4, N, D, torch.float16, "cuda", seed=rung)
        o = STAGES["c"].attention(q, k, v, causal=causal, config=config, ws_rung=rung)
        check_against_reference(o, q, k, v, causal=causal, dtype_name="fp16")
