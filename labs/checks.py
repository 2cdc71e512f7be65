"""The graders: one ``check_<lab>(lab)`` per lab, given the lab's module (the learner's template, the
reference solution, or a copy). Each returns a one-line summary when the lab is solved and raises
``AssertionError`` (with what was expected) when it is not; a gap still open raises the template's
``NotImplementedError``. Inputs are tiny so that every check runs in seconds in the Triton
interpreter on a CPU.

How the checks stay honest:

* a kernel lab is graded by launching the learner's *kernel* from here, into buffers filled with NaN,
  never through the template's host wrapper (which a learner could rewrite to call PyTorch), so a row
  the kernel never writes shows up as NaN;
* a prediction lab asks for every prediction first, inside :func:`labs.guard.forbid_calls` (the tool
  the answer is checked against may not run), on inputs drawn at random at check time (no table
  written at import can hold them all), and only then computes the truth;
* the checks build their own inputs to the tools (the bank model's addresses, the kernel lab 3
  compiles) instead of trusting the lab module's helpers.

``LABS_SEED=<int>`` fixes the random draws (a failure message names the inputs it failed on anyway).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import subprocess
from pathlib import Path

import stages  # noqa: F401  (before triton: turns the interpreter on when there is no GPU)
import torch
import triton

from . import NeedsGPU, guard

INF = float("inf")
LOG2E = 1.4426950408889634


def _rng() -> random.Random:
    seed = os.environ.get("LABS_SEED")
    return random.Random(int(seed)) if seed else random.Random()


def _no_peeking(lab, *extra: Path | str):
    """The guard every prediction runs under: no checks, no solutions (but the file graded), no
    process, nothing in ``extra``."""
    forbidden, allowed = guard.answer_sources(getattr(lab, "__file__", None))
    return guard.forbid_calls([*forbidden, *extra], allow=allowed)


def _launch(kernel, grid, *args, **constexprs) -> None:
    """Run ``kernel[grid](*args)`` where kernels run: in the interpreter on the CPU tensors given, or,
    compiled for a GPU, on CUDA copies whose results are copied back into the CPU tensors."""
    if stages.interpreted():
        kernel[grid](*args, **constexprs)
        return
    moved = [a.to("cuda") if isinstance(a, torch.Tensor) else a for a in args]  # strides kept
    kernel[grid](*moved, **constexprs)
    for a, m in zip(args, moved):
        if isinstance(a, torch.Tensor):
            a.copy_(m.cpu())


def _nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=torch.float32)


def _rows(idx) -> str:
    """[3, 4, 5, 9] -> '3-5, 9'."""
    idx = sorted(int(i) for i in idx)
    runs, start = [], None
    for a, b in zip([None] + idx, idx + [None]):
        if start is None:
            start = b
        elif b is None or b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(runs[:6]) + (" ..." if len(runs) > 6 else "")


# -------------------------------------------------------------------------------------------------
# references

def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """float64 reference for one head: q [Nq, D], k, v [Nk, D]; causal is bottom-right aligned."""
    o, _ = _reference(q[None, None], k[None, None], v[None, None], causal=causal, scale=q.shape[-1] ** -0.5)
    return o[0, 0]


def _reference(q, k, v, *, causal: bool, scale: float):
    """float64 (O, LSE) for [B, H, Nq, D] q and [B, H, Nk, D] k, v (differentiable). Causal is
    bottom-right aligned; a row that sees no key has O = 0 and LSE = +inf."""
    q, k, v = q.double(), k.double(), v.double()
    Nq, Nk = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) * scale
    i = torch.arange(Nq)[:, None]
    j = torch.arange(Nk)[None, :]
    visible = (j <= i + (Nk - Nq)) if causal else torch.ones(Nq, Nk, dtype=torch.bool)
    empty = ~visible.any(-1)                                  # [Nq]
    s = s.masked_fill(~visible, -INF).masked_fill(empty[:, None], 0.0)
    p = torch.softmax(s, dim=-1) * (~empty)[:, None]
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty, INF)
    return p @ v, lse


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    got = got.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    assert not torch.isnan(got).any(), f"{what}: NaN at {torch.isnan(got).nonzero()[0].tolist()}"
    err = ((got - want).norm() / want.norm()).item()
    assert err < tol, f"{what}: relative error {err:.2e} (want < {tol:.0e})"


def _close_heads(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-4) -> None:
    """Compare [B, H, N, D] tensors and say *where* they differ: which (batch, head), which rows
    (a NaN row was never written, or divided 0 by 0)."""
    got = got.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    scale = want.norm() / math.sqrt(max(1, want[..., 0].numel())) + 1e-30  # a typical row's norm
    row_err = (got - want).norm(dim=-1) / scale
    bad = torch.isnan(row_err) | (row_err > 10 * tol)
    err = ((got - want).norm() / (want.norm() + 1e-30)).item()
    if not bad.any() and err < tol:
        return
    b, h = bad.nonzero()[0, :2].tolist() if bad.any() else (0, 0)
    rows = bad[b, h].nonzero()[:, 0].tolist()
    nan_rows = torch.isnan(row_err[b, h]).nonzero()[:, 0].tolist()
    where = f"batch {b}, head {h}, rows {_rows(rows)} of {want.shape[2]}" if rows else "spread thinly"
    extra = f"; NaN in rows {_rows(nan_rows)} (never written, or 0/0)" if nan_rows else ""
    raise AssertionError(f"{what}: relative error {err:.2e} (want < {tol:.0e}), wrong at {where}{extra}")


def _close_lse(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """LSE: +inf exactly where a row sees no key, within 1e-4 (relative to max(1, |LSE|)) elsewhere."""
    got = got.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, want {tuple(want.shape)}"
    inf = torch.isinf(want)
    wrong_inf = inf & (got != want)
    if wrong_inf.any():
        idx = wrong_inf.nonzero()[0].tolist()
        raise AssertionError(f"{what}: the row at {idx} sees no key, so its LSE must be +inf, "
                             f"got {got[tuple(idx)].item()}")
    diff = ((got - want).abs() / want.abs().clamp_min(1.0)).masked_fill(inf, 0.0)
    diff = diff.masked_fill(torch.isnan(got), INF)
    if (diff > 1e-4).any():
        idx = (diff > 1e-4).nonzero()[0].tolist()
        raise AssertionError(f"{what}: at {idx} LSE {got[tuple(idx)].item():.6g}, want {want[tuple(idx)].item():.6g}"
                             f" ({int((diff > 1e-4).sum())} entries wrong)")


def _qkv(Nq: int, Nk: int, D: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, D, generator=g) for n in (Nq, Nk, Nk))


# -------------------------------------------------------------------------------------------------
# labs 1, 2, 5, 6, 7: one gap in a kernel; the check launches the kernel itself

def check_online_softmax(lab) -> str:
    # Nk not a multiple of the tile (a ragged last tile) and rows whose max moves late: scale
    # some late keys up so the rescale of the old state matters.
    Nq, Nk, D = 37, 45, 16
    q, k, v = _qkv(Nq, Nk, D)
    k[40:] *= 4
    o = _nan(Nq, D)
    _launch(lab.attention_kernel, (triton.cdiv(Nq, 16),), q, k, v, o, D ** -0.5, Nq, Nk,
            D=D, BLOCK_M=16, BLOCK_N=16)
    _close(o, _softmax_attention(q, k, v), "output")
    return "output matches softmax(QKᵀ/√D)V with a ragged last tile and late maxima"


def check_causal_skip(lab) -> str:
    for Nq, Nk in ((48, 48), (40, 70), (33, 33)):
        q, k, v = _qkv(Nq, Nk, 16, seed=Nq + Nk)
        grid = triton.cdiv(Nq, 16)
        o, tiles = _nan(Nq, 16), torch.full((grid,), -1, dtype=torch.int32)
        _launch(lab.causal_attention_kernel, (grid,), q, k, v, o, tiles, 16 ** -0.5, Nq, Nk,
                D=16, BLOCK_M=16, BLOCK_N=16)
        _close(o, _softmax_attention(q, k, v, causal=True), f"output (Nq={Nq}, Nk={Nk})")
        # the fewest tiles: up to and including the one holding the last row's last visible key
        want = [math.ceil(min(min((p + 1) * 16, Nq) + Nk - Nq, Nk) / 16) for p in range(grid)]
        assert tiles.tolist() == want, (f"K/V tiles visited per program (Nq={Nq}, Nk={Nk}): {tiles.tolist()}, "
                                        f"the fewest that are enough: {want}")
    return "causal output right, and each program visits only the tiles its rows can see"


def check_lazy_rescale(lab) -> str:
    Nq, Nk, D = 24, 80, 16
    q, k, v = _qkv(Nq, Nk, D, seed=3)
    # Late keys aligned with some rows' queries raise those rows' maxima by a lot, late in the loop.
    k[70:72] = q[:2] * 3
    o, rescales = _nan(Nq, D), torch.full((Nq,), -1, dtype=torch.int32)
    assert lab.TAU == 8.0, f"TAU must stay 8.0 (the rule the check counts), got {lab.TAU}"
    _launch(lab.lazy_attention_kernel, (triton.cdiv(Nq, 16),), q, k, v, o, rescales, D ** -0.5 * LOG2E, Nq, Nk,
            D=D, BLOCK_M=16, BLOCK_N=16, TAU=8.0)
    _close(o, _softmax_attention(q, k, v), "output")
    # The rule, tile by tile, in float64 (scores in log2 units, as in the kernel).
    s = (q.double() @ k.double().T) / math.sqrt(D) / math.log(2)
    want = []
    for row in s:
        used, count = -math.inf, 0
        for n0 in range(0, Nk, 16):
            tile_max = row[n0:n0 + 16].max().item()
            if tile_max > used + 8.0:
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
        o2, do2 = o.reshape(-1, D), do.reshape(-1, D)
        n_rows = o2.shape[0]
        got = _nan(n_rows)
        d_pad = max(16, triton.next_power_of_2(D))
        _launch(lab.delta_kernel, (triton.cdiv(n_rows, 16),), o2, do2, got, n_rows, o2.stride(0), do2.stride(0),
                D, D_PAD=d_pad, BLOCK_ROWS=16)
        want = (do.double() * o.double()).sum(-1).reshape(-1)
        _close(got, want, f"delta ({dtype}, D={D})", tol=1e-5)
    return "rowsum(dO·O) matches for fp32, fp16 and bf16, D not a power of two"


def check_gqa_indexing(lab) -> str:
    g = torch.Generator().manual_seed(7)
    for Hq, Hkv in ((6, 2), (4, 1), (6, 3), (2, 2)):
        B, N, D = 2, 20, 16
        q = torch.randn(B, Hq, N, D, generator=g)
        k, v = (torch.randn(B, Hkv, N, D, generator=g) for _ in range(2))
        o = torch.full_like(q, float("nan"))
        _launch(lab.gqa_attention_kernel, (B * Hq,), q, k, v, o, D ** -0.5, Hq, Hkv, N,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                o.stride(0), o.stride(1), D=D, BLOCK=32)
        group = Hq // Hkv
        for b in range(B):
            for h in range(Hq):
                _close(o[b, h], _softmax_attention(q[b, h], k[b, h // group], v[b, h // group]),
                       f"output of batch {b}, query head {h} (Hq={Hq}, Hkv={Hkv})")
    return "every query head reads its group's K/V head (Hq/Hkv = 3, 4, 2, 1)"


# -------------------------------------------------------------------------------------------------
# lab 3: PTX counts, predicted without the compiler

_TILES = (32, 64, 128)


def _reference_ptx_counts(num_stages: int, block_m: int, block_n: int, d: int) -> dict[str, int]:
    """The counts Triton 3.6 gives for lab 3's kernel, for every num_stages 1-4 and tile 32/64/128
    (each of those 108 configurations was compiled and counted once when the lab was written). The
    check re-compiles a random few each run, so a Triton that counts differently is noticed."""
    q, kv = block_m * d * 2 // 2048, block_n * d * 2 // 2048
    if num_stages == 1:
        return {"cp.async.cg.shared.global": 0, "cp.async.commit_group": 0, "cp.async.wait_group": 0,
                "ld.global": q + 2 * kv}
    return {"cp.async.cg.shared.global": 2 * kv * num_stages, "cp.async.commit_group": 2 * num_stages,
            "cp.async.wait_group": 2, "ld.global": q}


def check_pipeline_stages(lab) -> str:
    from . import compile_helper

    if lab.NUM_STAGES is None:
        raise NotImplementedError("TODO(lab): NUM_STAGES is still None")
    assert isinstance(lab.NUM_STAGES, int) and lab.NUM_STAGES >= 1, \
        f"NUM_STAGES must be an int >= 1, got {lab.NUM_STAGES!r}"
    assert lab.NUM_STAGES == 2, (f"NUM_STAGES = {lab.NUM_STAGES}: double buffering is one tile in use and "
                                 "one being copied")
    configs = [(s, bm, bn, d) for s in (1, 2, 3, 4) for bm, bn, d in itertools.product(_TILES, repeat=3)]
    rng = _rng()
    # Compiled this run: one unpipelined and two pipelined depths, on tiles other than the default.
    shapes = rng.sample([t for t in itertools.product(_TILES, repeat=3) if t != (64, 64, 64)], 3)
    compiled = [(s, *t) for s, t in zip([1] + rng.sample((2, 3, 4), 2), shapes)]

    compiler_files = [compile_helper.__file__, Path(triton.__file__).parent / "compiler",
                      Path(triton.__file__).parent / "backends", subprocess.__file__]
    with _no_peeking(lab, *compiler_files):
        # The compiled configurations first, among all the others, so a shortcut is caught at once.
        predicted = {c: lab.predict_ptx_counts(*c) for c in compiled + [c for c in configs if c not in compiled]}
    for c, p in predicted.items():
        assert isinstance(p, dict) and set(p) == set(compile_helper.COUNTED), \
            f"predict_ptx_counts{c} must return a dict with the keys {compile_helper.COUNTED}, got {p!r}"
    label = "num_stages={}, block_m={}, block_n={}, d={}".format
    # The check compiles its own copy of the kernel: editing the lab's kernel cannot change the counts.
    from .solutions import pipeline_stages as reference

    for c in compiled:
        s, bm, bn, d = c
        ptx = compile_helper.compile_ptx(reference.__name__, "attention_kernel", num_stages=s,
                                         constexprs={"D": d, "BLOCK_M": bm, "BLOCK_N": bn})
        counted = compile_helper.count_instructions(ptx)
        if counted != _reference_ptx_counts(*c):
            raise RuntimeError(f"the check is out of date, not your answer: Triton {triton.__version__} gives "
                               f"{counted} for {label(*c)}, the check's table {_reference_ptx_counts(*c)}")
        assert predicted[c] == counted, f"{label(*c)}: predicted {predicted[c]}, the PTX has {counted}"
    for c in configs:
        want = _reference_ptx_counts(*c)
        assert predicted[c] == want, f"{label(*c)}: predicted {predicted[c]}, the PTX has {want}"
    short = "; ".join(f"{s} stage(s), {bm}x{bn} tiles, d={d}" for s, bm, bn, d in compiled)
    return (f"NUM_STAGES = 2, and the cp.async / commit / wait / ld.global counts predicted for all 108 "
            f"depths and tiles (compiled this run: {short})")


# -------------------------------------------------------------------------------------------------
# lab 4: bank conflicts, predicted without the bank model

def _column_addresses(row_halves: int) -> list[int]:
    """Lab 4's access, built here: lane l reads the 4 bytes at the start of row l (2-byte halves)."""
    return [lane * row_halves * 2 for lane in range(32)]


def check_bank_padding(lab) -> str:
    from stages import bank_model

    rng = _rng()
    rows = list(range(2, 258, 2)) + [2 * rng.randrange(129, 1 << 19) for _ in range(300)]
    dims = list(range(8, 257, 8)) + [rng.randrange(2, 4097) for _ in range(100)]
    with _no_peeking(lab, bank_model.__file__):
        predicted = {r: lab.predict_column_wavefronts(r) for r in rows}
        padded = {D: lab.padded_row_halves(D) for D in dims}
    for r in rows:
        counted = bank_model.wavefronts(_column_addresses(r), 4)
        assert predicted[r] == counted, f"rows of {r} halves: predicted {predicted[r]} wavefronts, bank model {counted}"

    def conflict_free(row: int) -> bool:
        return bank_model.wavefronts(_column_addresses(row), 4) == 1

    for D in dims:
        row = padded[D]
        assert isinstance(row, int) and row >= D and row % 2 == 0, f"D={D}: padded row {row!r} must be an even int >= D"
        assert conflict_free(row), f"D={D}: rows of {row} halves still conflict"
        shorter = [r for r in range(D + (D % 2), row, 2) if conflict_free(r)]
        assert not shorter, f"D={D}: {shorter[0]} halves is shorter than {row} and conflict-free too"
    return ("wavefront predictions match the bank model for every even row up to 256 halves and 300 random "
            "ones up to 2^20; padding minimal for D = 8 … 256 and 100 random D")


# -------------------------------------------------------------------------------------------------
# lab 8: the fused forward

def _bnhd(B: int, H: int, N: int, D: int, g: torch.Generator) -> torch.Tensor:
    """A [B, H, N, D] view of a [B, N, H, D] tensor: strided as a model's projections are."""
    return torch.randn(B, N, H, D, generator=g).transpose(1, 2)


def check_fused_forward(lab) -> str:
    g = torch.Generator().manual_seed(8)
    # (B, H, Nq, Nk, D, causal, scale, BLOCK_M, BLOCK_N): ragged tiles everywhere, Nq != Nk both ways,
    # rows that see no key (causal, Nq > Nk), a scale that is not 1/sqrt(D), unequal tiles.
    cases = [(2, 3, 37, 45, 16, False, 16 ** -0.5, 16, 16),
             (2, 3, 37, 45, 16, True, 16 ** -0.5, 16, 16),
             (1, 2, 45, 29, 32, True, 0.3, 32, 16),
             (2, 1, 3, 50, 16, True, 0.25, 16, 32)]
    for B, H, Nq, Nk, D, causal, scale, bm, bn in cases:
        q, k, v = _bnhd(B, H, Nq, D, g), _bnhd(B, H, Nk, D, g), _bnhd(B, H, Nk, D, g)
        k[:, :, -7:] *= 3  # maxima that arrive in the last, ragged tile
        o = _nan(B, Nq, H, D).transpose(1, 2)
        lse = _nan(B, H, Nq)
        _launch(
            lab.fused_attention_kernel, (triton.cdiv(Nq, bm), B * H), q, k, v, o, lse, scale,
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, Nq, Nk,
            D=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal)
        want_o, want_lse = _reference(q, k, v, causal=causal, scale=scale)
        what = f"(B={B}, H={H}, Nq={Nq}, Nk={Nk}, D={D}, causal={causal}, scale={scale:.3g})"
        _close_heads(o, want_o, f"O {what}")
        _close_lse(lse, want_lse, f"LSE {what}")
    return ("O and LSE match float64 for ragged tiles, Nq ≠ Nk, causal rows with no key, strided "
            "inputs and several batches and heads")


# -------------------------------------------------------------------------------------------------
# lab 9: dK and dV

def _backward_case(g: torch.Generator, B: int, H: int, Nq: int, Nk: int, D: int, causal: bool, scale: float):
    """Random float32 q, k, v, dO of one backward case, the forward's saved LSE and the pre-pass's δ
    (float32, [B, H, Nq]), and autograd's (dq, dk, dv) of the float64 reference."""
    q, do = (torch.randn(B, H, Nq, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, H, Nk, D, generator=g) for _ in range(2))
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64, lse64 = _reference(q64, k64, v64, causal=causal, scale=scale)
    o64.backward(do.double())
    delta = (do.double() * o64.detach()).sum(-1).float()
    return q, k, v, do, lse64.detach().float(), delta, (q64.grad, k64.grad, v64.grad)


def check_backward_dkdv(lab) -> str:
    g = torch.Generator().manual_seed(9)
    cases = [(2, 2, 37, 45, 16, False, 16 ** -0.5, 16, 16),
             (2, 2, 37, 45, 16, True, 16 ** -0.5, 16, 16),
             (1, 2, 45, 29, 32, True, 0.3, 32, 16)]
    for B, H, Nq, Nk, D, causal, scale, bm, bn in cases:
        q, k, v, do, lse, delta, grads = _backward_case(g, B, H, Nq, Nk, D, causal, scale)
        dk, dv = _nan(B, H, Nk, D), _nan(B, H, Nk, D)
        _launch(lab.dkdv_kernel, (triton.cdiv(Nk, bn), B * H), q, k, v, do, lse, delta, dk, dv, scale, Nq, Nk,
                D=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal)
        what = f"(B={B}, H={H}, Nq={Nq}, Nk={Nk}, D={D}, causal={causal}, scale={scale:.3g})"
        _close_heads(dv, grads[2], f"dV {what}")
        _close_heads(dk, grads[1], f"dK {what}")
    return "dK and dV match autograd of float64 attention, causal and not, Nq ≠ Nk, ragged tiles"


# -------------------------------------------------------------------------------------------------
# lab 13: dQ in a second pass

def check_backward_dq(lab) -> str:
    g = torch.Generator().manual_seed(13)
    cases = [(2, 2, 37, 45, 16, False, 16 ** -0.5, 16, 16),
             (2, 2, 37, 45, 16, True, 16 ** -0.5, 16, 16),
             (1, 2, 45, 29, 32, True, 0.3, 16, 16)]   # Nq > Nk, causal: the first 16 rows see no key
    for B, H, Nq, Nk, D, causal, scale, bm, bn in cases:
        q, k, v, do, lse, delta, grads = _backward_case(g, B, H, Nq, Nk, D, causal, scale)
        grid = (triton.cdiv(Nq, bm), B * H)
        what = f"(B={B}, H={H}, Nq={Nq}, Nk={Nk}, D={D}, causal={causal}, scale={scale:.3g})"
        runs = []
        for _ in range(2):
            dq, tiles = _nan(B, H, Nq, D), torch.full((grid[0] * grid[1],), -1, dtype=torch.int32)
            _launch(lab.dq_kernel, grid, q, k, v, do, lse, delta, dq, tiles, scale, Nq, Nk,
                    D=D, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal)
            runs.append(dq)
        _close_heads(runs[0], grads[0], f"dQ {what}")
        if not torch.equal(runs[0].view(torch.int32), runs[1].view(torch.int32)):
            raise AssertionError(f"dQ {what}: two runs gave different bits; a second pass sums in one order")
        # The fewest key tiles: every tile up to the one holding the last key the tile's last row sees.
        for pid_m in range(grid[0]):
            last = min(Nq, (pid_m + 1) * bm) - 1 + (Nk - Nq) if causal else Nk - 1
            want = 0 if last < 0 else min(last // bn + 1, triton.cdiv(Nk, bn))
            got = int(tiles[pid_m])
            if got != want:
                raise AssertionError(f"dQ {what}: query tile {pid_m} visited {got} key tiles, the fewest that "
                                     f"cover its rows' keys is {want}" + (" (-1: TILES never written)" if got < 0
                                                                          else ""))
    return ("dQ matches autograd of float64 attention (causal and not, Nq ≠ Nk, ragged tiles, rows that see no "
            "key), bit for bit the same on a second run, visiting the fewest key tiles")


# -------------------------------------------------------------------------------------------------
# lab 10: the split-KV merge

def _split_partials(g: torch.Generator):
    """Partials of a split-KV run, built in float64 from real scores: per-row key counts (causal-like
    prefixes, two rows with none), five splits of different lengths (one empty), logits scaled so
    the split LSEs lie far apart on some rows (exp overflows float32) and close on others."""
    rows, D = 37, 24
    bounds = [0, 7, 7, 26, 27, 40]           # split 1 has no key at all; split 3 has one
    Nk = bounds[-1]
    s = torch.randn(rows, Nk, generator=g, dtype=torch.float64)
    s *= torch.tensor([1.0, 30.0, 300.0])[torch.arange(rows) % 3][:, None]
    s += torch.tensor([0.0, 900.0, -900.0, 0.0])[torch.arange(rows) % 4][:, None]
    seen = torch.randint(1, Nk + 1, (rows,), generator=g)
    seen[[0, 5]] = 0                         # rows with no key in any split
    seen[[1, 2, 3]] = Nk
    visible = torch.arange(Nk)[None, :] < seen[:, None]
    v = torch.randn(Nk, D, generator=g, dtype=torch.float64)
    splits = len(bounds) - 1
    o_part = torch.zeros(splits, rows, D, dtype=torch.float64)
    lse_part = torch.full((splits, rows), -INF, dtype=torch.float64)
    for i in range(splits):
        lo, hi = bounds[i], bounds[i + 1]
        chunk = s[:, lo:hi].masked_fill(~visible[:, lo:hi], -INF)
        any_key = visible[:, lo:hi].any(-1)
        if hi > lo:
            lse_part[i] = torch.where(any_key, torch.logsumexp(chunk, -1), -INF)
            p = torch.softmax(chunk.masked_fill(~any_key[:, None], 0.0), -1) * any_key[:, None]
            o_part[i] = p @ v[lo:hi]
    full = s.masked_fill(~visible, -INF)
    none = seen == 0
    want_lse = torch.logsumexp(full.masked_fill(none[:, None], 0.0), -1).masked_fill(none, INF)
    want_o = (torch.softmax(full.masked_fill(none[:, None], 0.0), -1) * (~none)[:, None]) @ v
    return o_part.float(), lse_part.float(), want_o, want_lse


def check_splitkv_merge(lab) -> str:
    g = torch.Generator().manual_seed(10)
    o_part, lse_part, want_o, want_lse = _split_partials(g)
    splits, rows, D = o_part.shape
    o, lse = _nan(rows, D), _nan(rows)
    _launch(lab.merge_kernel, (triton.cdiv(rows, 16),), o_part, lse_part, o, lse, rows, splits,
            D=D, BLOCK_D=32, BLOCK_R=16)
    _close_heads(o[None, None], want_o[None, None], "merged O", tol=1e-5)
    _close_lse(lse, want_lse, "merged LSE")
    return ("exact merge of 5 splits of different lengths (one empty), LSEs from -1000 to +1000, rows "
            "with no key (O = 0, LSE = +inf)")


# -------------------------------------------------------------------------------------------------
# lab 11: traffic models, predicted without the stages

def _problems(rng: random.Random) -> list[tuple]:
    """(B, Hq, Hkv, Nq, Nk, D, dtype, causal): the corners first, then random ones."""
    fixed = [(1, 1, 1, 1, 1, 8, "fp16", False), (1, 1, 1, 1, 1, 8, "fp16", True),
             (2, 8, 2, 1, 4096, 128, "bf16", True), (1, 4, 4, 100, 30, 64, "fp32", True),
             (4, 16, 16, 4096, 4096, 64, "fp16", True), (3, 6, 3, 65, 129, 40, "fp32", False)]
    drawn = []
    for _ in range(300):
        Hkv = rng.randint(1, 8)
        Nq = rng.choice((rng.randint(1, 200), rng.randint(1, 40000)))
        Nk = rng.choice((Nq, rng.randint(1, 200), rng.randint(1, 40000)))
        drawn.append((rng.randint(1, 8), Hkv * rng.randint(1, 8), Hkv, Nq, Nk, 8 * rng.randint(1, 32),
                      rng.choice(("fp16", "bf16", "fp32")), rng.random() < 0.5))
    return fixed + drawn


def check_traffic_prediction(lab) -> str:
    from stages import STAGES, Problem

    problems = _problems(_rng())
    with _no_peeking(lab, Path(stages.__file__).parent):
        predicted = {(name, p): fn(*p) for p in problems
                     for name, fn in (("a", lab.stage_a_bytes), ("b", lab.stage_b_bytes))}
    for (name, p), got in predicted.items():
        B, Hq, Hkv, Nq, Nk, D, dtype, causal = p
        model = STAGES[name].hbm_bytes(Problem(B, Hq, Nq, D, dtype, causal, Hkv, Nk))
        what = (f"stage {name.upper()} (B={B}, Hq={Hq}, Hkv={Hkv}, Nq={Nq}, Nk={Nk}, D={D}, {dtype}, "
                f"causal={causal})")
        assert isinstance(got, tuple) and len(got) == 2, f"{what}: return (read, write), got {got!r}"
        assert all(isinstance(x, int) and not isinstance(x, bool) for x in got), \
            f"{what}: bytes are whole numbers: return ints (use // and cdiv, not /), got {got!r}"
        for part, g_, m_ in (("read", got[0], model.read), ("write", got[1], model.write)):
            assert g_ == m_, f"{what}: {part} {g_:,} bytes, the stage's model says {m_:,} (off by {g_ - m_:+,})"
    return f"stage A and stage B bytes (read and write) exact on {len(problems)} problems drawn at random"


# -------------------------------------------------------------------------------------------------
# lab 12: a GPU-timed target

#: The learner's kernel may take at most this many times SDPA's time (the check's number, not the lab's).
GPU_TARGET = 2.0


def _flash(lab, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: dict, poison: bool = True) -> torch.Tensor:
    """Launch the lab's kernel the way its host function does, but from here: a host function
    rewritten to call SDPA (or anything else) is never what gets timed."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    kernel = lab.flash_kernel
    assert isinstance(kernel, (JITFunction, InterpretedFunction)), "flash_kernel must stay a @triton.jit kernel"
    B, H, N, D = q.shape
    o = torch.full_like(q, float("nan")) if poison else torch.empty_like(q)  # no fill inside the timing
    kernel[(triton.cdiv(N, config["BLOCK_M"]), B * H)](
        q, k, v, o, D ** -0.5 * LOG2E, N, D=D, BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    return o


def check_gpu_timed(lab) -> str:
    config = lab.tuned_config()
    assert isinstance(config, dict) and set(config) == {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, \
        f"tuned_config() must return a dict of BLOCK_M, BLOCK_N, num_warps, num_stages; got {config!r}"
    # Correctness first, wherever we are: tiny, ragged, fp16, in the interpreter on a CPU.
    g = torch.Generator().manual_seed(12)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    B, H, N, D = 1, 2, 100, 64
    q, k, v = (torch.randn(B, H, N, D, generator=g).half().to(device) for _ in range(3))
    o = _flash(lab, q, k, v, config)
    want, _ = _reference(q.cpu(), k.cpu(), v.cpu(), causal=False, scale=D ** -0.5)
    _close_heads(o.cpu(), want, f"output with {config}", tol=2e-3)
    if not torch.cuda.is_available():
        raise NeedsGPU("correct in the Triton interpreter, but the timed target needs a CUDA GPU and "
                       "this machine has none; run it where `python -c 'import torch; print("
                       "torch.cuda.is_available())'` prints True")
    from triton.testing import do_bench

    B, H, N, D = 4, 16, 4096, 64
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    o = _flash(lab, q, k, v, config)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, f"output at B={B}, H={H}, N={N}, D={D}: relative error {err:.2e} against SDPA"
    mine = do_bench(lambda: _flash(lab, q, k, v, config, poison=False))
    sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    flops = 4 * B * H * N * N * D
    ratio = mine / sdpa
    line = (f"{mine:.3f} ms ({flops / mine / 1e9:.0f} TFLOPS) vs SDPA {sdpa:.3f} ms "
            f"({flops / sdpa / 1e9:.0f} TFLOPS) on {torch.cuda.get_device_name()}")
    assert ratio <= GPU_TARGET, f"{line}: {ratio:.2f}x SDPA's time, the target is <= {GPU_TARGET}x"
    return f"{line}: {ratio:.2f}x SDPA's time (target <= {GPU_TARGET}x)"


# -------------------------------------------------------------------------------------------------
# lab 14: the order a causal backward's programs start in

def _longest_first(work) -> list[tuple[int, int]]:
    return sorted(((t, h) for h in range(len(work)) for t in range(len(work[h]))), key=lambda p: -work[p[1]][p[0]])


#: How far after the check's longest-first order the learner's may end.
ORDER_SLACK = 1.02


def check_program_order(lab) -> str:
    # (the truth from the kernels' own model, asked only outside the guard)
    from stages.c_optimized.hopper_bwd import causal_dkdv_work, makespan as _makespan

    rng = _rng()
    # makespan: random durations and SM counts, a few by hand (one SM; more SMs than programs; none)
    cases = [([3.0, 1.0, 2.0], 1), ([5.0, 1.0, 1.0, 1.0], 2), ([], 4), ([2.0, 2.0], 8), ([1.0, 4.0, 1.0, 1.0, 1.0], 2)]
    cases += [([rng.choice((rng.random(), float(rng.randint(1, 64)))) for _ in range(rng.randint(1, 400))],
               rng.randint(1, 140)) for _ in range(40)]
    # launch_order: causal problems (heads, N, group, SMs), the grouped Llama 3 8B cell among them
    problems = [(8, 8192, 4, 132), (60, 1500, 1, 132), (256, 1024, 1, 132)]
    problems += [(rng.randint(1, 128), rng.choice((rng.randint(64, 2048), rng.randint(64, 16384))),
                  rng.choice((1, 2, 4, 8)), rng.choice((16, 66, 108, 114, 132))) for _ in range(30)]
    # (the kernels' durations, as the lab's causal_dkdv_work describes them: editing that helper
    # changes nothing here)
    works = [[causal_dkdv_work(N, N, group=group)] * heads for heads, N, group, _ in problems]
    with _no_peeking(lab, Path(stages.__file__).parent):
        ends = [lab.makespan(list(work), sms) for work, sms in cases]
        orders = [lab.launch_order([list(row) for row in work], sms) for work, (*_, sms) in zip(works, problems)]
    for (work, sms), got in zip(cases, ends):
        want = _makespan(work, sms) if work else 0.0
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9), \
            (f"makespan of {len(work)} programs on {sms} SMs: got {got!r}, want {want:g}"
             + (f" (programs {work})" if len(work) <= 6 else ""))
    for (heads, N, group, sms), work, order in zip(problems, works, orders):
        what = f"{heads} batch·heads, N {N}, groups of {group}, {sms} SMs"
        every = sorted((t, h) for h in range(heads) for t in range(len(work[h])))
        assert sorted(map(tuple, order)) == every, \
            f"{what}: launch_order must give every (tile, batch·head) once; got {len(order)} of {len(every)}" + (
                "" if len(order) != len(every) else " (some twice, some missing)")
        mine = _makespan([work[h][t] for t, h in order], sms)
        good = _makespan([work[h][t] for t, h in _longest_first(work)], sms)
        assert mine <= ORDER_SLACK * good, \
            (f"{what}: your order ends at {mine:g}, {mine / good:.3f}x the check's order ({good:g}); the target is "
             f"<= {ORDER_SLACK}x; which programs are still running alone at the end?")
    return (f"makespan exact on {len(cases)} cases; launch orders within {ORDER_SLACK}x of longest-first "
            f"on {len(problems)} causal problems")
