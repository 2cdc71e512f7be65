"""Stage C: the algorithm of stage B, with every optimization that makes it fast.

Same recurrence as stage B (running max m, running sum l, rescaled accumulator), same one program
per (Q tile, batch·head). What changes, each behind a switch so the harness can measure its share:

``tuned_tiles``  Tile shape, warps and pipeline depth chosen per head dim and GPU (``configs.py``),
                 checked against the shared-memory budget, instead of B's fixed 64×64 / 4 warps.
                 Bigger Q tiles mean fewer re-reads of K and V (the N²·D/BLOCK_M term) and bigger
                 tensor-core tiles held in registers (register tiling: a 128×64 fp32 accumulator is
                 64 registers per thread at 4 warps), at the price of registers and occupancy.
``pipelining``   ``num_stages`` > 1: Triton software-pipelines the K/V loop. On sm_80+ it issues the
                 next tiles' loads as ``cp.async`` (global → shared, bypassing registers) and waits
                 with ``cp.async.wait_group`` only right before the data is used, so memory latency
                 hides behind the current tile's math. With TMA (below) the copies are bulk tensor
                 copies completing on an ``mbarrier``.
``tma``          Hopper (sm_90) tensor-memory-accelerator descriptors: one thread issues a whole
                 tile copy, the copy engine computes addresses and zero-fills out-of-bounds rows
                 (ragged N needs no load masks). Elsewhere, and in the CPU interpreter where the
                 hardware does not exist, the portable pointer path runs instead (the interpreter
                 *can* run descriptor loads, so the tests exercise both paths' logic on a CPU).
``exp2``         ``exp(x) = exp2(x·log2 e)``: log2(e) is folded into the softmax scale once, so each
                 score costs one FMA and one ``ex2.approx`` (the hardware's native instruction) instead
                 of a multiply, a multiply by log2(e) inside ``exp`` and the ex2.
``causal_skip``  Causal attention visits only K/V tiles at or below the diagonal: tiles wholly below
                 run mask-free, only the diagonal tiles pay for the mask, tiles above are never
                 loaded. Halves the work and the K/V traffic. Programs with the most work start first.
``warp_specialization``  Hopper only (fp16/bf16, D 64/128): the kernel of ``hopper_ws.py``, written in
                 Gluon. A producer warp feeds a ring of K/V buffers; two or three consumer
                 warpgroups share each tile, take turns on the tensor cores (ping-pong), and each
                 overlaps its softmax with its own previous P·V wgmma; optionally a persistent
                 grid. It builds on every switch above, so it runs only when they are all on and the
                 tuner found it faster for the problem's shape (``configs.WS_SHAPES``).

Always on (no switch, because Triton gives no way to turn them off): tensor-core MMA (``mma.sync``
+ ``ldmatrix`` on sm_80, ``wgmma`` on sm_90) with fp32 accumulators resident in registers and the
P·V product accumulated in place (``tl.dot(p, v, acc)``); swizzled shared-memory layouts, which
Triton picks so that ``ldmatrix``/``wgmma`` reads are bank-conflict free (the padding trick of the
seed article, done by XOR-ing addresses instead of wasting bytes; ``harness inspect`` prints them);
16-byte vectorized global accesses (pointer alignment is specialized at launch); masks compiled
out when N is a multiple of the tile (``EVEN_N``).

With every switch off, stage C does what stage B does; the ablation (``python -m harness compare
--ablation``) walks from there to all-on one switch at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..contract import DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, validate_inputs
from ..launch import Launch, compiles_without_interpreter, meta_inputs
from . import hopper_ws
from .configs import BASELINE, Config, choose_config, device_arch, num_sms, shared_memory_bytes

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q,
    K, V, k_desc, v_desc, b, h,
    stride_kn, stride_vn,
    rows, lo, hi, N, qk_scale,
    D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr, MASK_N: tl.constexpr,
    USE_TMA: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold K/V tiles [lo, hi) into (acc, l_i, m_i). Masks are compile-time: the loop over tiles
    below the diagonal is generated without them."""
    ds = tl.arange(0, D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            # Out-of-bounds rows (ragged N) arrive as zeros from the copy engine; no load mask.
            k = k_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, D)
            v = v_desc.load([b, h, start_n, 0]).reshape(BLOCK_N, D)
        elif MASK_N:
            k = tl.load(K + cols[:, None] * stride_kn + ds[None, :], mask=cols[:, None] < N, other=0.0)
            v = tl.load(V + cols[:, None] * stride_vn + ds[None, :], mask=cols[:, None] < N, other=0.0)
        else:
            k = tl.load(K + cols[:, None] * stride_kn + ds[None, :])
            v = tl.load(V + cols[:, None] * stride_vn + ds[None, :])

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_CAUSAL or MASK_N:
            valid = cols[None, :] < N
            if MASK_CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None])
            qk = tl.where(valid, qk, float("-inf"))
        # qk_scale > 0, so max(qk)·scale = max(qk·scale): one multiply per row, not per score, and
        # the scale is applied with the subtraction below in one FMA per score.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        s = qk * qk_scale - m_new[:, None]
        if EXP2:
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_new)
        else:
            p = tl.exp(s)
            alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # accumulate in place
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def optimized_attention_kernel(
    Q, K, V, O, q_desc, k_desc, v_desc, o_desc, qk_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    bh = tl.program_id(1)
    if CAUSAL and CAUSAL_SKIP:
        # Under causal skipping, Q tile i has i+1 tiles of work: launch the longest first so the
        # short ones fill the gaps at the end of the grid instead of leaving SMs idle.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    b, h = bh // H, bh % H
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D)
    K_bh = K + b.to(tl.int64) * stride_kb + h.to(tl.int64) * stride_kh
    V_bh = V + b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh

    if USE_TMA:
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, D)
    else:
        q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qn + ds[None, :]
        if EVEN_N:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=rows[:, None] < N, other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)

    if CAUSAL and CAUSAL_SKIP:
        # 1) tiles wholly left of the diagonal block: every score valid, no masks at all
        #    (their columns are < start_m < N, so not even the ragged-N mask applies).
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, h, stride_kn, stride_vn,
                                      rows, 0, start_m, N, qk_scale, D, BLOCK_N,
                                      False, False, USE_TMA, EXP2, DOT_PRECISION)
        # 2) the diagonal block: causal mask (and the ragged-N mask on the last one). Tiles above
        #    it are never visited.
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, h, stride_kn, stride_vn,
                                      rows, start_m, tl.minimum(start_m + BLOCK_M, N), N, qk_scale, D, BLOCK_N,
                                      True, not EVEN_N, USE_TMA, EXP2, DOT_PRECISION)
    else:
        # Whole tiles mask-free (unless causal without skipping, which masks everything like stage
        # B), then the ragged last tile with the N mask.
        n_full = (N // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, h, stride_kn, stride_vn,
                                      rows, 0, n_full, N, qk_scale, D, BLOCK_N,
                                      CAUSAL, False, USE_TMA, EXP2, DOT_PRECISION)
        if not EVEN_N:
            acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, h, stride_kn,
                                          stride_vn, rows, n_full, N, N, qk_scale, D, BLOCK_N,
                                          CAUSAL, True, USE_TMA, EXP2, DOT_PRECISION)

    out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    if USE_TMA:
        # The copy engine clips rows past N on the way out: no store mask.
        o_desc.store([b, h, start_m, 0], out.reshape(1, 1, BLOCK_M, D))
    else:
        o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on + ds[None, :]
        if EVEN_N:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=rows[:, None] < N)


def _tma_supported(arch: int, *tensors: torch.Tensor) -> bool:
    """TMA needs sm_90+, 16-byte aligned base pointers and 16-byte aligned strides (all but the last)."""
    if arch < 90:
        return False
    for t in tensors:
        if t.device.type != "meta" and t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _ws_switches_on(causal: bool, *, tuned_tiles: bool, pipelining: bool, tma: bool, exp2: bool,
                    causal_skip: bool, warp_specialization: bool) -> bool:
    """Whether the switches let the warp-specialized kernel run: it has pipelining, TMA, exp2 and
    causal skipping built in (causal skipping only matters, and so only rules it out, for causal
    problems) and is one of the tuned configurations."""
    return (warp_specialization and tuned_tiles and pipelining and tma and exp2
            and (causal_skip or not causal))


def plan(q, k, v, o, *, causal: bool, scale: float, arch: int, config: Config | None = None,
         tuned_tiles: bool = True, pipelining: bool = True, tma: bool = True, exp2: bool = True,
         causal_skip: bool = True, warp_specialization: bool = True) -> list[Launch]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, N, D = q.shape
    ws_allowed = (_ws_switches_on(causal, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                                  causal_skip=causal_skip, warp_specialization=warp_specialization)
                  and hopper_ws.supported(q.dtype, D, arch) and _tma_supported(arch, q, k, v, o))
    if config is None:
        config = choose_config(D, q.dtype, causal, arch, N, ws_allowed) if tuned_tiles else BASELINE
    if config.ws:
        if not ws_allowed:
            raise ValueError(f"config {config} needs the warp-specialized kernel: sm_90, fp16/bf16, D 64 or 128, "
                             f"16-byte aligned strides and every switch on (got arch={arch}, dtype={q.dtype}, D={D})")
        return [hopper_ws.plan(q, k, v, o, causal=causal, qk_scale=scale * LOG2E, **config.ws_options(),
                               num_sms=num_sms(q.device) if q.is_cuda else 132)]
    if not pipelining:
        config = config.with_stages(1)
    use_tma = tma and _tma_supported(arch, q, k, v, o)
    BM, BN = config.block_m, config.block_n
    if use_tma:
        # 4-D descriptors over [B, H, N, D] with the tensors' own strides: strided views work, and
        # the N bound is per head, so a ragged last tile never reads the next head's rows.
        q_desc, o_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BM, D]) for t in (q, o))
        k_desc, v_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BN, D]) for t in (k, v))
    else:
        q_desc = k_desc = v_desc = o_desc = None  # unused: the pointer path is compiled instead
    # exp2 folds log2(e) into the scale once; exp keeps the natural scale.
    qk_scale = scale * LOG2E if exp2 else scale
    return [Launch(
        optimized_attention_kernel, (cdiv(N, BM), B * H),
        dict(Q=q, K=k, V=v, O=o, q_desc=q_desc, k_desc=k_desc, v_desc=v_desc, o_desc=o_desc, qk_scale=qk_scale,
             stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
             stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
             stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
             stride_ob=o.stride(0), stride_oh=o.stride(1), stride_on=o.stride(2),
             H=H, N=N, D=D, BLOCK_M=BM, BLOCK_N=BN,
             CAUSAL=causal, CAUSAL_SKIP=causal_skip, EVEN_N=(N % BM == 0 and N % BN == 0),
             USE_TMA=use_tma, EXP2=exp2,
             DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32"),
        num_warps=config.num_warps, num_stages=config.num_stages)]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, config: Config | None = None, tuned_tiles: bool = True,
              pipelining: bool = True, tma: bool = True, exp2: bool = True,
              causal_skip: bool = True, warp_specialization: bool = True) -> torch.Tensor:
    """Optimized fused attention. Returns O [B, H, N, D].

    ``config`` forces a tile configuration (the tests run every candidate); the six switches turn
    single optimizations off for the ablation (see the module docstring).
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    o = new_output(q)
    for launch in plan(q, k, v, o, causal=causal, scale=scale, arch=device_arch(q.device), config=config,
                       tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                       causal_skip=causal_skip, warp_specialization=warp_specialization):
        launch.run()
    return o


@compiles_without_interpreter
def compile(problem: Problem, arch: int, **switches) -> list[CompiledKernel]:
    """Compile for ``problem`` on an sm_``arch`` GPU without one; ``switches`` as for ``attention``."""
    q, k, v = meta_inputs(problem.B, problem.H, problem.N, problem.D, DTYPES[problem.dtype])
    launches = plan(q, k, v, torch.empty_like(q), causal=problem.causal, scale=problem.D ** -0.5, arch=arch,
                    **switches)
    return [launch.compile(arch) for launch in launches]


def hbm_bytes(p: Problem, config: Config | None = None, causal_skip: bool = True, tuned_tiles: bool = True,
              warp_specialization: bool = True, pipelining: bool = True, tma: bool = True, exp2: bool = True,
              **_other) -> HbmTraffic:
    """Bytes requested from device memory by one call with the tile config the stage would choose.

    Non-causal: Q read once, K and V read once per Q tile (⌈N/BLOCK_M⌉ times), O written once, as in
    stage B but with a larger BLOCK_M. Causal with skipping: Q tile i reads only K/V rows
    [0, min((i+1)·BLOCK_M, N)), so K and V are read Σ_i min((i+1)·BLOCK_M, N) rows: about half.
    The config is the one ``choose_config`` picks for this problem on the current device (the
    default table when there is no GPU); the ablation switches are accepted like ``attention``'s,
    and change the bytes only through BLOCK_M (``tuned_tiles``, ``warp_specialization``: the
    warp-specialized kernel's work item is its consumers' rows together) and ``causal_skip``.
    """
    if config is None:
        dtype, arch = DTYPES[p.dtype], device_arch(None)
        ws = (_ws_switches_on(p.causal, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                              causal_skip=causal_skip, warp_specialization=warp_specialization)
              and hopper_ws.supported(dtype, p.D, arch))
        config = choose_config(p.D, dtype, p.causal, arch, p.N, ws) if tuned_tiles else BASELINE
    BM = config.block_m
    row = p.D * p.element_bytes
    tiles = cdiv(p.N, BM)
    if p.causal and causal_skip:
        kv_rows = sum(min((i + 1) * BM, p.N) for i in range(tiles))
    else:
        kv_rows = tiles * p.N
    read = p.heads * row * (p.N + 2 * kv_rows)
    return HbmTraffic(read=read, write=p.heads * p.N * row)


def workspace_bytes(p: Problem) -> int:
    """No device memory besides the output (TMA descriptors are passed by value as kernel params)."""
    return 0


__all__ = ["attention", "compile", "hbm_bytes", "workspace_bytes", "shared_memory_bytes", "Config"]
