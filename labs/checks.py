"""The graders: one ``check_<lab>(lab)`` per lab, given the lab's module (the learner's template or
the reference solution). Each returns a one-line summary when the lab is solved and raises
``AssertionError`` (with what was expected) when it is not; a gap still open raises the template's
``NotImplementedError``. Inputs are tiny so that every check runs in seconds in the Triton
interpreter on a CPU.
"""

from __future__ import annotations

import math

import torch


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """float64 reference for one head: q [Nq, D], k, v [Nk, D]; causal is bottom-right aligned."""
    q, k, v = q.double(), k.double(), v.double()
    s = q @ k.T / math.sqrt(q.shape[-1])
    if causal:
        Nq, Nk = q.shape[0], k.shape[0]
        i = torch.arange(Nq)[:, None]
        j = torch.arange(Nk)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err < tol, f"{what}: relative error {err:.2e} (want < {tol:.0e})"


def _qkv(Nq: int, Nk: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, D, generator=g) for n in (Nq, Nk, Nk))


def check_online_softmax(lab) -> str:
    # Nk not a multiple of the tile (a ragged last tile) and rows whose max moves late: scale
    # some late keys up so the rescale of the old state matters.
    q, k, v = _qkv(37, 45, 16)
    k[40:] *= 4
    _close(lab.attention(q, k, v), _softmax_attention(q, k, v), "output")
    return "output matches softmax(QKᵀ/√D)V with a ragged last tile and late maxima"


def check_causal_skip(lab) -> str:
    for Nq, Nk in ((48, 48), (40, 70), (33, 33)):
        q, k, v = _qkv(Nq, Nk, 16, seed=Nq + Nk)
        o, tiles = lab.attention(q, k, v, block_m=16, block_n=16)
        _close(o, _softmax_attention(q, k, v, causal=True), f"output (Nq={Nq}, Nk={Nk})")
        # the fewest tiles: up to and including the one holding the last row's last visible key
        want = [math.ceil(min(min((p + 1) * 16, Nq) + Nk - Nq, Nk) / 16) for p in range(len(tiles))]
        assert tiles.tolist() == want, (f"K/V tiles visited per program (Nq={Nq}, Nk={Nk}): {tiles.tolist()}, "
                                        f"the fewest that are enough: {want}")
    return "causal output right, and each program visits only the tiles its rows can see"


def check_pipeline_stages(lab) -> str:
    assert isinstance(lab.NUM_STAGES, int) and lab.NUM_STAGES >= 1, \
        f"NUM_STAGES must be an int >= 1, got {lab.NUM_STAGES!r}"
    assert lab.NUM_STAGES == 2, (f"NUM_STAGES = {lab.NUM_STAGES}: double buffering is one tile in use and "
                                 "one being copied")
    for stages in (1, 2, 3):
        predicted = lab.predict_ptx_counts(stages)  # raises NotImplementedError before compiling
        counted = lab.ptx_counts(stages)
        assert predicted == counted, f"num_stages={stages}: predicted {predicted}, the PTX has {counted}"
    return "NUM_STAGES = 2, and the cp.async / commit / wait / ld.global counts predicted for 1, 2 and 3 stages"


def check_bank_padding(lab) -> str:
    from stages.bank_model import wavefronts

    for row in range(2, 258, 2):
        counted = wavefronts(lab.column_read_addresses(row), 4)
        predicted = lab.predict_column_wavefronts(row)
        assert predicted == counted, f"rows of {row} halves: predicted {predicted} wavefronts, bank model {counted}"
    for D in range(8, 257, 8):
        row = lab.padded_row_halves(D)
        assert row >= D and row % 2 == 0, f"D={D}: padded row {row} must be even and >= D"
        assert wavefronts(lab.column_read_addresses(row), 4) == 1, f"D={D}: rows of {row} halves still conflict"
        shorter = [r for r in range(D + (D % 2), row, 2) if wavefronts(lab.column_read_addresses(r), 4) == 1]
        assert not shorter, f"D={D}: {shorter[0]} halves is shorter than {row} and conflict-free too"
    return "wavefront predictions match the bank model for every even row length; padding minimal for D = 8 … 256"


def check_lazy_rescale(lab) -> str:
    Nq, Nk, D = 24, 80, 16
    q, k, v = _qkv(Nq, Nk, D, seed=3)
    # Late keys aligned with some rows' queries raise those rows' maxima by a lot, late in the loop.
    k[70:72] = q[:2] * 3
    o, rescales = lab.attention(q, k, v, block_m=16, block_n=16)
    _close(o, _softmax_attention(q, k, v), "output")
    # The rule, tile by tile, in float64 (scores in log2 units, as in the kernel).
    s = (q.double() @ k.double().T) / math.sqrt(D) / math.log(2)
    want = []
    for row in s:
        used, count = -math.inf, 0
        for n0 in range(0, Nk, 16):
            tile_max = row[n0:n0 + 16].max().item()
            if tile_max > used + lab.TAU:
                used, count = tile_max, count + 1
        want.append(count)
    assert rescales.tolist() == want, f"rescales per row: {rescales.tolist()}, the rule gives {want}"
    assert max(want) > 1 and min(want) == 1, "the test data should make some rows rescale late"
    return "exact output; rescales happen only where a tile raises the maximum by more than TAU"


def check_delta_prepass(lab) -> str:
    g = torch.Generator().manual_seed(5)
    for dtype, D in ((torch.float32, 40), (torch.float16, 64), (torch.bfloat16, 24)):
        o = torch.randn(2, 3, 37, D, generator=g).to(dtype)
        do = torch.randn(2, 3, 37, D, generator=g).to(dtype)
        got = lab.delta(o, do)
        want = (do.double() * o.double()).sum(-1)
        assert got.shape == want.shape, f"shape {tuple(got.shape)}, want {tuple(want.shape)}"
        _close(got, want, f"delta ({dtype}, D={D})", tol=1e-5)
    return "rowsum(dO·O) matches for fp32, fp16 and bf16, D not a power of two"


def check_gqa_indexing(lab) -> str:
    g = torch.Generator().manual_seed(7)
    for Hq, Hkv in ((6, 2), (4, 1), (6, 3), (2, 2)):
        q = torch.randn(2, Hq, 20, 16, generator=g)
        k, v = (torch.randn(2, Hkv, 20, 16, generator=g) for _ in range(2))
        o = lab.attention(q, k, v)
        group = Hq // Hkv
        for b in range(2):
            for h in range(Hq):
                _close(o[b, h], _softmax_attention(q[b, h], k[b, h // group], v[b, h // group]),
                       f"output of batch {b}, query head {h} (Hq={Hq}, Hkv={Hkv})")
    return "every query head reads its group's K/V head (Hq/Hkv = 3, 4, 2, 1)"
