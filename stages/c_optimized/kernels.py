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
``warp_specialization``  Hopper only (fp16/bf16, D 40-256): the kernel of ``hopper_ws.py``, written in
                 Gluon. A producer warp feeds a ring of K/V buffers; two or three consumer
                 warpgroups share each tile and take turns (ping-pong), so one warpgroup's softmax
                 overlaps another's wgmma; optionally a persistent grid. It builds on every switch
                 above, so it runs only when they are all on and the tuner found it faster for the
                 problem's shape (``configs.WS_SHAPES``).

Always on (no switch, because Triton gives no way to turn them off): tensor-core MMA (``mma.sync``
+ ``ldmatrix`` on sm_80, ``wgmma`` on sm_90) with fp32 accumulators resident in registers and the
P·V product accumulated in place (``tl.dot(p, v, acc)``); swizzled shared-memory layouts, which
Triton picks so that ``ldmatrix``/``wgmma`` reads are bank-conflict free (the padding trick of the
classic CUDA kernels, done by XOR-ing addresses instead of wasting bytes; ``harness inspect`` prints them);
16-byte vectorized global accesses (pointer alignment is specialized at launch); the K/V loop split
into mask-free whole tiles and a masked ragged tail at run time (no kernel per sequence length).

With every switch off, stage C does what stage B does; the ablation (``python -m harness compare
--ablation``) walks from there to all-on one switch at a time.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import contract, ops
from ..contract import (DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, key_ranges_alignment, new_output,
                        padded_head_dim, validate_inputs, validate_key_ranges)
from ..launch import FastLaunch, Launch, compiles_without_interpreter, descriptor_over
from . import decode, hopper_ws
from .aligned import aligned_strides, row_alignment
from .decode import key_range
from .configs import (BASELINE, SHARED_MEMORY_LIMIT, Config, choose_config, device_arch, shape_aware_config,
                      shared_memory_bytes, sm_count, with_deep_q, ws_rung_config, ws_shapes)

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(
    acc, l_i, m_i, q,
    K, V, k_desc, v_desc, b, kv_h,
    stride_kn, stride_vn,
    rows, lo, hi, N_K, CAUSAL_OFFSET, qk_scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr, MASK_N: tl.constexpr,
    USE_TMA: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold K/V tiles [lo, hi) of KV head ``kv_h`` into (acc, l_i, m_i). Masks are compile-time: the
    loop over tiles left of the diagonal is generated without them."""
    ds = tl.arange(0, BLOCK_D)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            # Out-of-bounds rows (ragged Nk) and columns (D < BLOCK_D) arrive as zeros from the copy
            # engine; no load mask.
            k = k_desc.load([b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = v_desc.load([b, kv_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        elif MASK_N or D != BLOCK_D:
            kv_mask = (cols[:, None] < N_K) & (ds[None, :] < D)
            k = tl.load(K + cols[:, None] * stride_kn + ds[None, :], mask=kv_mask, other=0.0)
            v = tl.load(V + cols[:, None] * stride_vn + ds[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(K + cols[:, None] * stride_kn + ds[None, :])
            v = tl.load(V + cols[:, None] * stride_vn + ds[None, :])

        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if MASK_CAUSAL or MASK_N:
            valid = cols[None, :] < N_K
            if MASK_CAUSAL:
                # Bottom-right alignment: row i sees key j iff j <= i + Nk - Nq.
                valid = valid & (cols[None, :] <= rows[:, None] + CAUSAL_OFFSET)
            qk = tl.where(valid, qk, float("-inf"))
        # qk_scale > 0, so max(qk)·scale = max(qk·scale): one multiply per row, not per score, and
        # the scale is applied with the subtraction below in one FMA per score.
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        if MASK_CAUSAL:
            # Under the causal mask a row may have seen no key yet (Nq > Nk, or a tile past its
            # diagonal): m stays -inf, and -inf - -inf would be NaN. Subtract 0 instead: its p and
            # alpha are then exp(-inf) = 0. (Unmasked tiles always hold a valid key for every row.)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        s = qk * qk_scale - m_use[:, None]
        if EXP2:
            p = tl.math.exp2(s)
            alpha = tl.math.exp2(m_i - m_use)
        else:
            p = tl.exp(s)
            alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)  # accumulate in place
        m_i = m_new
    return acc, l_i, m_i


#: The sizes reach the kernel as runtime values: Triton would otherwise compile a new kernel whenever
#: one of them turns 1 or a multiple of 16, so a decode loop whose KV cache grows by a key per call
#: would keep compiling. Strides keep their divisibility-by-16 facts (they are the layout, and they
#: license 16-byte vector loads); only a K/V head's stride changes as a cache grows, and it takes
#: at most two values of that fact.
@triton.jit(do_not_specialize=["H", "N_Q", "N_K", "CAUSAL_OFFSET"])
def optimized_attention_kernel(
    Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, qk_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_K, CAUSAL_OFFSET,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr, USE_TMA: tl.constexpr, EXP2: tl.constexpr,
    DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr, ALIGN: tl.constexpr, KEY_STARTS, KEY_LENGTHS,
):
    if ALIGN > 1:
        # Every row starts on a 16-byte boundary, which the host checked and Triton cannot see (a head
        # dim of 8 mod 16, aligned.py): said so, the loads are 16-byte vectors and cp.async copies.
        stride_qb, stride_qh, stride_qn = aligned_strides(stride_qb, stride_qh, stride_qn, ALIGN)
        stride_kb, stride_kh, stride_kn = aligned_strides(stride_kb, stride_kh, stride_kn, ALIGN)
        stride_vb, stride_vh, stride_vn = aligned_strides(stride_vb, stride_vh, stride_vn, ALIGN)
        stride_ob, stride_oh, stride_on = aligned_strides(stride_ob, stride_oh, stride_on, ALIGN)
    bh = tl.program_id(1)
    if CAUSAL and CAUSAL_SKIP:
        # Under causal skipping, later Q tiles have more work: launch the longest first so the
        # short ones fill the gaps at the end of the grid instead of leaving SMs idle.
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    b, h = bh // H, bh % H
    kv_h = h // GROUP  # grouped-query attention: GROUP query heads share one K/V head
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, BLOCK_D)  # the head dim padded to a power of two; columns >= D are masked
    K_bh = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    V_bh = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    if USE_TMA:
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        # Masked once per program (the row mask is constant along the head dim, so the loads stay
        # 16-byte vectors); it is the K/V loop that must run mask-free.
        q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qn + ds[None, :]
        q = tl.load(q_ptrs, mask=(rows[:, None] < N_Q) & (ds[None, :] < D), other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    if KEY_STARTS is not None or KEY_LENGTHS is not None:
        # A key range per batch entry (a static KV cache's filled slots, a left-padded prompt): keys
        # [first, end) of this entry's Nk, the causal diagonal aligned to its end. The tiles start
        # at the range's first key (where it falls: no tile reads a key before it) and are all
        # masked, against the range's end and the diagonal; only ranged calls compile this branch.
        first, end = key_range(KEY_STARTS, KEY_LENGTHS, b, N_K)
        offset = end - N_Q
        if CAUSAL:
            hi = tl.maximum(tl.minimum(start_m + BLOCK_M + offset, end), 0)
        else:
            hi = end
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, first, hi, end, offset, qk_scale, D, BLOCK_D, BLOCK_N,
                                      CAUSAL, True, USE_TMA, EXP2, DOT_PRECISION)
    elif CAUSAL and CAUSAL_SKIP:
        # Row i sees keys j <= i + CAUSAL_OFFSET (Nk - Nq). This tile's last row sees up to
        # `hi`; its first row sees every key below `mid`, so the whole tiles below it need no mask.
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + CAUSAL_OFFSET, N_K), 0)
        mid = (tl.maximum(tl.minimum(start_m + CAUSAL_OFFSET + 1, N_K), 0) // BLOCK_N) * BLOCK_N
        # 1) tiles wholly left of the diagonal: every score valid, no masks at all.
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, 0, mid, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      False, False, USE_TMA, EXP2, DOT_PRECISION)
        # 2) the diagonal band: causal mask and the ragged-Nk mask (which only the last tile needs;
        #    on the others it is one more compare per score of a diagonal tile). Tiles past it are
        #    never visited.
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, mid, hi, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      True, True, USE_TMA, EXP2, DOT_PRECISION)
    else:
        # Whole tiles mask-free (unless causal without skipping, which masks everything like stage
        # B), then the ragged last tile with the Nk mask: a loop that runs zero times when Nk is a
        # multiple of BLOCK_N, decided at run time, so no kernel is compiled per Nk.
        n_full = (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, 0, n_full, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      CAUSAL, False, USE_TMA, EXP2, DOT_PRECISION)
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn,
                                      stride_vn, rows, n_full, N_K, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D,
                                      BLOCK_N, CAUSAL, True, USE_TMA, EXP2, DOT_PRECISION)

    if CAUSAL or KEY_STARTS is not None or KEY_LENGTHS is not None:
        # A row that saw no key (causal, Nq > Nk; an empty key range) has l = 0 and acc = 0: output 0, not 0/0.
        out = (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(O.dtype.element_ty)
    else:
        out = (acc / l_i[:, None]).to(O.dtype.element_ty)
    if STORE_LSE:
        # The row's log-sum-exp in base 2 of the scaled scores (what the backward recomputes P
        # from): m + log2(l), m in log2 units under EXP2, in natural units otherwise.
        l_pos = tl.where(l_i == 0.0, 1.0, l_i)
        if EXP2:
            lse = m_i + tl.math.log2(l_pos)
        else:
            lse = (m_i + tl.log(l_pos)) * 1.4426950408889634
        lse = tl.where(l_i == 0.0, float("inf"), lse)  # no key: +inf, so P = 2^(x - lse) = 0
        tl.store(LSE + bh.to(tl.int64) * N_Q + rows, lse, mask=rows < N_Q)
    if USE_TMA:
        # The copy engine clips rows past Nq and columns past D on the way out: no store mask.
        o_desc.store([b, h, start_m, 0], out.reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        o_ptrs = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on + ds[None, :]
        tl.store(o_ptrs, out, mask=(rows[:, None] < N_Q) & (ds[None, :] < D))


# --------------------------------------------------------------------------------------------------
# The host path. Everything that depends only on the shapes, strides, dtype, device and switches
# (which kernel, its config, grid and constexpr arguments, descriptor block shapes) is decided once
# per distinct key by `_recipe` (lru-cached); a call only looks the recipe up and binds its tensors.
# Each launch of a recipe is a `launch.FastLaunch`: after its first call it skips Triton's
# general-purpose dispatch (binding ~30 keyword arguments, specializing and hashing them, tens of
# µs) and calls the compiled kernel's launcher directly. On a tiny problem the GPU work takes a
# few µs, so this host path, not the kernel, sets the pace of a call.
# --------------------------------------------------------------------------------------------------

SWITCH_NAMES = ("tuned_tiles", "pipelining", "tma", "exp2", "causal_skip", "warp_specialization")


def _ws_switches_on(causal: bool, *, tuned_tiles: bool, pipelining: bool, tma: bool, exp2: bool,
                    causal_skip: bool, warp_specialization: bool) -> bool:
    """Whether the switches let the warp-specialized kernel run: it has pipelining, TMA, exp2 and
    causal skipping built in (causal skipping only matters, and so only rules it out, for causal
    problems) and is one of the tuned configurations."""
    return (warp_specialization and tuned_tiles and pipelining and tma and exp2
            and (causal_skip or not causal))


def _strides_tma_ok(strides: tuple, element_bytes: int) -> bool:
    """TMA needs every stride but the last to be a multiple of 16 bytes."""
    return all((s * element_bytes) % 16 == 0 for s in strides[:-1])


def tma_supported(arch: int, *tensors: torch.Tensor) -> bool:
    """TMA needs sm_90+, 16-byte aligned base pointers and 16-byte aligned strides (all but the last,
    which the stage contract makes 1). The forward checks its four tensors inline, on its hot path;
    the backward's Hopper kernels ask this."""
    if arch < 90:
        return False
    return all(_aligned(t) and _strides_tma_ok(t.stride(), t.element_size()) for t in tensors)


def _aligned(t: torch.Tensor) -> bool:
    return t.is_meta or t.data_ptr() % 16 == 0


@dataclass(frozen=True)
class Choice:
    """Which kernel runs a problem: ``path`` "tl" (``optimized_attention_kernel``), "ws"
    (``hopper_ws``) or "split" (``decode.py``), with its ``config`` (a ``Config``, or a
    ``decode.SplitConfig`` for "split"); ``ws_rung``: the rung of the warp-specialization ladder
    ("ws" only; None: every mechanism, as the config says)."""

    path: str
    config: object
    ws_rung: int | None = None


def select(B: int, Hq: int, Hkv: int, Nq: int, Nk: int, D: int, dtype: torch.dtype, causal: bool, arch: int,
           sms: int, *, tma_ok: bool = True, config: Config | None = None, split_kv: int | None = None,
           store_lse: bool = False, tuned_tiles: bool = True, pipelining: bool = True, tma: bool = True,
           exp2: bool = True, causal_skip: bool = True, warp_specialization: bool = True,
           ws_rung: int | None = None, key_range: bool = False) -> Choice:
    """The path and config for a problem, from its shapes only (the plan and the traffic model share it).

    1. ``split_kv`` >= 2 forces the split-KV path with that many splits; ``split_kv=1`` rules it
       out; ``None`` lets the work decide: with tuned tiles (and exp2, which the split kernel always
       uses) and no forced ``config``, split when ``decode.choose_splits`` finds too few programs
       for the SMs and keys enough to share out.
    2. Otherwise the tuned config for (dtype, D, causal, Nq), adjusted to the work
       (``configs.shape_aware_config``; a persistent warp-specialized one whose items are one or
       two K/V tiles long also takes a third Q buffer, ``configs.with_deep_q``). The
       warp-specialized kernel is eligible when every switch
       is on, on sm_90, fp16/bf16, D 40-256 (``hopper_ws.supported``), TMA-able strides and Nq = Nk
       (its causal mask assumes the square); the training forward's log-sum-exp comes from it too.
    3. ``ws_rung`` k forces the warp-specialized kernel with rungs 1..k of its ladder on
       (``hopper_ws.LADDER``), built on the config step 2 would choose; a ValueError where that
       kernel cannot run.

    ``Nk=None``: a decoding call (``decode.is_decoding``) of any cache length. Its choice
    does not depend on Nk, so the host path caches one choice for the whole of a decode loop; the
    split path's config then leaves the count of chunks to each call (``splits = 0``).

    ``key_range``: the call attends to a key range per batch entry (``key_starts``/``key_lengths``),
    which the ``tl`` and split kernels take and the warp-specialized one does not.
    """
    group = Hq // Hkv
    if key_range and (ws_rung is not None or (config is not None and config.ws)):
        raise ValueError(f"key_starts/key_lengths run on the tl and split-KV kernels, not the warp-specialized one "
                         f"(got ws_rung={ws_rung}, config={config}); leave both None")
    if ws_rung is not None:
        return _ws_rung_choice(B, Hq, Nq, Nk, D, dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse,
                               ws_rung, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                               causal_skip=causal_skip, warp_specialization=warp_specialization)
    # The split kernel's tiles: a decoding call's follow the plan (decode.DECODE_PLAN), its dtype and the
    # GPU's shared memory; other calls' their dtype.
    tiles = decode.call_tiles(group, Nq, Nk, D, dtype.itemsize, SHARED_MEMORY_LIMIT.get(arch, 99 * 1024))
    if split_kv is not None and split_kv >= 2:
        if Nk is None:
            return Choice("split", decode.per_call_config(group, Nq, D, forced=split_kv, tiles=tiles))
        return Choice("split", decode.forced_splits(group, Nq, Nk, D, split_kv, tiles))
    if split_kv is None and config is None and tuned_tiles and exp2:
        if Nk is None:
            if decode.decoding_splits_keys(B, Hkv, group, Nq, D, sms):
                return Choice("split", decode.per_call_config(group, Nq, D, tiles=tiles))
        else:
            split = decode.choose_splits(B, Hkv, group, Nq, Nk, D, sms, tiles)
            if split is not None:
                return Choice("split", split)
    ws_allowed = (_ws_switches_on(causal, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                                  causal_skip=causal_skip, warp_specialization=warp_specialization)
                  and hopper_ws.supported(dtype, D, arch) and tma_ok and Nq == Nk and not key_range)
    if config is None:
        if tuned_tiles:
            config = choose_config(D, dtype, causal, arch, Nq, ws_allowed)
            config = shape_aware_config(config, B, Hq, Nq, D, dtype, arch, sms)
            config = with_deep_q(config, Nq, causal, D, torch.empty((), dtype=dtype).element_size(), arch)
        else:
            config = BASELINE
    if config.ws:
        if not ws_allowed:
            raise ValueError(f"config {config} needs the warp-specialized kernel: sm_90, fp16/bf16, "
                             f"{hopper_ws.supported_head_dims()}, Nq == Nk, 16-byte aligned strides and every "
                             f"switch on (got arch={arch}, dtype={dtype}, D={D}, Nq={Nq}, Nk={Nk})")
        return Choice("ws", config)
    if not pipelining:
        config = config.with_stages(1)
    return Choice("tl", config)


def _ws_rung_choice(B, Hq, Nq, Nk, D, dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse, ws_rung,
                    **switches) -> Choice:
    """``select`` for a rung of the warp-specialization ladder: the warp-specialized kernel, or a
    ValueError naming ``ws_rung`` (the harness records that as ``unsupported``)."""
    if not (hopper_ws.supported(dtype, D, arch) and Nq == Nk):
        raise ValueError(f"ws_rung={ws_rung} needs the warp-specialized kernel: sm_90, fp16/bf16, "
                         f"{hopper_ws.supported_head_dims()} and Nq == Nk (got arch={arch}, dtype={dtype}, D={D}, "
                         f"Nq={Nq}, Nk={Nk})")
    if not (_ws_switches_on(causal, **switches) and tma_ok and (split_kv is None or split_kv == 1)
            and (config is None or config.ws)):
        raise ValueError(f"ws_rung={ws_rung} needs every switch on, TMA-able strides, no split_kv and no tl config "
                         f"(got switches={switches}, tma_ok={tma_ok}, split_kv={split_kv}, config={config})")
    if config is None:
        config = shape_aware_config(choose_config(D, dtype, causal, arch, Nq, True), B, Hq, Nq, D, dtype, arch, sms)
        if not config.ws:  # a tuned table whose winner here is a tl config: the ladder builds on the first ws one
            config = ws_shapes(D)[0]
    return Choice("ws", ws_rung_config(config, ws_rung), ws_rung)


@dataclass(frozen=True)
class _LaunchRecipe:
    """One launch with everything a call's sizes do not change: the kernel, its constexpr and fixed
    arguments (``static``), which arguments are the call's tensors (``tensors``: argument name and
    role, ``"q"``, ``"o"``, ``"lse"``, ``"o_part"``, ...), the TMA descriptors to build over them
    (``descs``: argument, role, block shape, gluon) and ``ints``, the names of the integer arguments
    (sizes and strides) each call supplies, in the order its recipe's ``runtime`` gives them."""

    kernel: object
    static: tuple
    tensors: tuple
    descs: tuple
    ints: tuple
    num_warps: int
    num_stages: int
    extra: tuple = ()
    scale_factor: float | None = LOG2E  # qk_scale = scale · scale_factor (None: no qk_scale argument)
    dtype: torch.dtype | None = None    # the inputs' (the warp-specialized kernel's descriptors carry a layout of it)
    launcher: FastLaunch = field(init=False, compare=False, repr=False)
    #: per entry of ``descs``: (descriptor class, its fields but ``base``, ``shape`` and ``strides``)
    desc_templates: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # The per-call values, in the order `values` returns them: tensors (the pointer arguments),
        # descriptors, the sizes and strides, the scale. Everything else is fixed for the recipe.
        static = {name: value for name, value in self.static}
        object.__setattr__(self, "launcher", FastLaunch(
            self.kernel, static, self.dynamic, pointers=len(self.tensors), num_warps=self.num_warps,
            num_stages=self.num_stages, extra=dict(self.extra)))
        object.__setattr__(self, "desc_templates", tuple(_desc_template(block, gluon, self.dtype)
                                                         for _, _, block, gluon in self.descs))

    @property
    def dynamic(self) -> tuple:
        names = tuple(name for name, _ in self.tensors) + tuple(name for name, *_ in self.descs) + self.ints
        return names + ("qk_scale",) if self.scale_factor is not None else names

    def values(self, tensors: dict, ints: tuple, scale: float) -> list:
        """The dynamic arguments of one call: its tensors (by role), descriptors built over them, its
        sizes and strides, and the scale."""
        values = [tensors[role] for _, role in self.tensors]
        # (the recipe checked strides and block for this key: launch.descriptor_over skips the checks)
        values.extend(descriptor_over(cls, fields, tensors[role])
                      for (_, role, _, _), (cls, fields) in zip(self.descs, self.desc_templates))
        values.extend(ints)
        if self.scale_factor is not None:
            values.append(scale * self.scale_factor)
        return values

    def launch(self, grid: tuple, tensors: dict, ints: tuple, scale: float, facts=None) -> None:
        """Launch with this call's tensors, sizes and scale (``facts``: ``integer_facts(ints)``, when
        the caller kept them)."""
        self.launcher(grid, *self.values(tensors, ints, scale), facts=facts)

    def integer_facts(self, ints: tuple):
        """What Triton's specialization reads off these integer arguments (``FastLaunch``)."""
        before = len(self.tensors) + len(self.descs)
        after = 1 if self.scale_factor is not None else 0
        return self.launcher._integer_facts([None] * before + list(ints) + [0.0] * after)

    def bound_launch(self, grid: tuple, tensors: dict, ints: tuple, scale: float, facts=None):
        """This launch as it just ran with these tensors, sizes and scale, bound for the next calls of
        the layout (``launch.BoundLaunch``: per call the pointers' addresses in ``self.tensors``' order,
        then the descriptors and the scale), or None where it cannot be bound."""
        values = self.values(tensors, ints, scale)
        first = len(self.tensors)
        varying = tuple(range(first, first + len(self.descs)))
        if self.scale_factor is not None:
            varying += (len(values) - 1,)
        return self.launcher.bound(grid, values, varying, facts)

    def prepare(self, grid: tuple, tensors: dict, ints: tuple, scale: float) -> None:
        """Compile the kernel this launch would run for such a call, without running it."""
        self.launcher.prepare(grid, *self.values(tensors, ints, scale))

    def bind(self, grid: tuple, tensors: dict, ints: tuple, scale: float) -> Launch:
        """The same launch as data (every argument by name), for ``compile`` and the tests."""
        args = dict(self.static)
        args.update(zip(self.dynamic, self.values(tensors, ints, scale)))
        return Launch(self.kernel, grid, args, num_warps=self.num_warps, num_stages=self.num_stages,
                      extra=dict(self.extra))


@dataclass(frozen=True)
class _Recipe:
    """The launches of one kernel key, and ``runtime(q, k, v, o, choice) -> (workspace, runs)``: what
    a call computes from its sizes, the fp32 buffers to allocate as (role, shape) and per launch
    its (grid, integer arguments)."""

    path: str
    launches: tuple
    runtime: object
    #: what the host path has done once for this recipe (``_prepare_merge``)
    done: set = field(default_factory=set, compare=False, repr=False)
    #: whether the first launch counts its programs in (the fused merge, ``decode.merge_counters``)
    counters: bool = False

    def counter_slots(self, runs: tuple) -> int:
        """Counters a call with these runs needs: one per (b·Hkv + kv head, row block) of the split
        kernel's grid (0: none)."""
        if not self.counters:
            return 0
        grid = runs[0][0]
        return grid[1] * grid[2]


def _strides(role: str) -> tuple:
    return (f"stride_{role}b", f"stride_{role}h", f"stride_{role}n")


#: The tl kernel's integer arguments, in the order ``_tl_runtime`` gives them.
_TL_INTS = (*_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"), "H", "N_Q", "N_K", "CAUSAL_OFFSET")


def _tl_runtime(q, k, v, o, choice: Choice) -> tuple:
    B, Hq, Nq, _ = q.shape
    Nk = k.shape[2]
    grid = (cdiv(Nq, choice.config.block_m), B * Hq)
    ints = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], Hq, Nq, Nk, Nk - Nq)
    return (), ((grid, ints),)


def _ws_runtime(q, k, v, o, choice: Choice, sms: int, causal: bool) -> tuple:
    B, Hq, Nq, _ = q.shape
    options = choice.config.ws_options(choice.ws_rung)
    grid, ints = hopper_ws.runtime_args(B, Hq, Nq, q.stride(), causal=causal, consumers=options["consumers"],
                                        persistent=options["persistent"], num_sms=sms,
                                        programs_per_sm=options["programs_per_sm"])
    return (), ((grid, ints),)


_SPLIT_INTS = (*_strides("q"), *_strides("k"), *_strides("v"), "Hq", "Hkv", "N_Q", "N_K", "CAUSAL_OFFSET", "CHUNK",
               "ROWS_TOTAL")


def _split_runtime(q, k, v, o, choice: Choice, sms: int, merge_rows: int | None) -> tuple:
    split = choice.config
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    splits, chunk = split.splits, split.chunk
    if splits == 0:  # a decoding call's kernel config: the count follows this call's cache length
        wanted = split.forced or decode.decode_splits(B, Hkv, group, Nq, Nk, D, sms, split.block_n)
        splits, chunk = decode.split_counts(split.block_n, Nk, wanted)
    rows_total = B * Hq * Nq
    first = ((splits, B * Hkv, cdiv(group * Nq, split.block_m)),
             (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], Hq, Hkv, Nq, Nk, Nk - Nq, chunk, rows_total))
    if splits == 1:  # one chunk: the split kernel writes O itself, no partials, no merge
        return (("o_part", None), ("lse_part", None)), (first,)
    partials = (("o_part", (splits, rows_total, D)), ("lse_part", (splits, rows_total)))
    if merge_rows is None:  # the merge fused into the split kernel
        return partials, (first,)
    return partials, (first, ((cdiv(rows_total, merge_rows),), (rows_total, splits)))


def _kernel_config(choice: Choice):
    """The part of a choice that the compiled kernels depend on: the split path's count and chunk of
    keys are runtime values (they follow Nk), the rest of every config is compiled in."""
    config = choice.config
    if choice.path == "split" and (config.splits or config.forced is not None):
        return replace(config, splits=0, chunk=0, forced=None)
    return config


@lru_cache(maxsize=1024)
def _recipe(path: str, config, dtype: torch.dtype, D: int, group: int, causal: bool, arch: int, sms: int,
            use_tma: bool, store_lse: bool, switches: tuple, ws_rung: int | None, even_n: bool,
            ranges: tuple = (False, False), align: int = 1) -> _Recipe:
    """The launches for one kernel key: what changes the compiled kernels (path and config, dtype,
    head dim, GQA group, causal, the GPU, TMA or pointers (pointers also where each program walks one
    K/V tile, :func:`one_key_tile`), whether the log-sum-exp is stored, the
    ablation switches; for the warp-specialized kernel whether N is a whole number of K/V tiles;
    ``ranges``: whether the call passes key starts and key lengths; ``align``: the pointer kernels'
    row alignment, ``aligned.row_alignment``), never the sizes themselves.
    Cached: a call looks its recipe up and computes only its runtime arguments."""
    on = dict(zip(SWITCH_NAMES, switches))
    dot_precision = "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs get exact fp32 products
    if path == "split":
        return _split_recipe(config, dtype, D, group, causal, dot_precision, store_lse, sms, ranges, align,
                             decode.early_merge(arch), decode.fused_merge())
    if path == "ws":
        options = config.ws_options(ws_rung)
        # Tiles as wide as the padded head dim, or its main part and a narrow tail (tile_widths): TMA
        # zero-fills the columns past D on load and leaves them out on store.
        if hopper_ws.tile_width(D, config.pad_head_dim) != D:
            options["prefetch_l2"] = False  # its lines cover the tile's columns: past the end of the last row
        constants, extra = hopper_ws.kernel_constants(causal=causal, group=group, even_n=even_n, **options)
        boxes = hopper_ws.descriptor_boxes(D, config.block_n, config.pad_head_dim)
        descs = tuple((name, box[0], box[1], True) for name, box in boxes.items() if box is not None)
        constants.update({name: None for name, box in boxes.items() if box is None})
        tensors = _lse_argument((("Q", "q"),), constants, store_lse)
        launch = _LaunchRecipe(hopper_ws.ws_attention_kernel, tuple(constants.items()), tensors, descs,
                               hopper_ws.RUNTIME_ARGS, num_warps=4, num_stages=1, extra=tuple(extra.items()),
                               dtype=dtype)
        return _Recipe(path, (launch,), functools.partial(_ws_runtime, sms=sms, causal=causal))
    BM, BN, BD = config.block_m, config.block_n, padded_head_dim(D)
    static = dict(D=D, BLOCK_D=BD, GROUP=group, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=causal,
                  CAUSAL_SKIP=on["causal_skip"], USE_TMA=use_tma, EXP2=on["exp2"],
                  DOT_PRECISION=dot_precision, STORE_LSE=store_lse, ALIGN=align)
    if use_tma:
        # 4-D descriptors over each tensor's own [B, H, N, D] with its own strides: strided views
        # work, K/V descriptors span the Hkv heads (the kernel asks for head h // GROUP), the N bound
        # is per head, so a ragged last tile never reads the next head's rows, and the block is
        # BLOCK_D wide: columns past D are zero-filled on load and clipped on store.
        descs = (("q_desc", "q", (1, 1, BM, BD), False), ("k_desc", "k", (1, 1, BN, BD), False),
                 ("v_desc", "v", (1, 1, BN, BD), False), ("o_desc", "o", (1, 1, BM, BD), False))
    else:
        descs = ()
        static.update(q_desc=None, k_desc=None, v_desc=None, o_desc=None)  # the pointer path is compiled
    tensors = _lse_argument((("Q", "q"), ("K", "k"), ("V", "v"), ("O", "o")), static, store_lse)
    tensors += _range_arguments(ranges, static)
    launch = _LaunchRecipe(optimized_attention_kernel, tuple(static.items()), tensors, descs, _TL_INTS,
                           config.num_warps, config.num_stages,
                           # exp2 folds log2(e) into the scale once; exp keeps the natural scale.
                           scale_factor=LOG2E if on["exp2"] else 1.0, dtype=dtype)
    return _Recipe(path, (launch,), _tl_runtime)


def _lse_argument(tensors: tuple, static: dict, store_lse: bool) -> tuple:
    """A kernel's ``LSE`` argument: the call's lse tensor when the training forward stores the rows'
    log-sum-exps (appended to ``tensors``), else None in ``static`` (compiled out)."""
    if store_lse:
        return tensors + (("LSE", "lse"),)
    static["LSE"] = None
    return tensors


def _range_arguments(ranges: tuple, static: dict) -> tuple:
    """The key-range pointer arguments a call passes (appended to a recipe's tensors); those it does
    not pass are None in ``static`` (compiled out)."""
    passed = []
    for name, role, given in (("KEY_STARTS", "key_starts", ranges[0]), ("KEY_LENGTHS", "key_lengths", ranges[1])):
        if given:
            passed.append((name, role))
        else:
            static[name] = None
    return tuple(passed)


def _split_recipe(split, dtype, D, group, causal, dot_precision, store_lse, sms, ranges=(False, False),
                  align=1, early_merge=False, fused=False) -> _Recipe:
    BD = padded_head_dim(D)
    tensors = (("Q", "q"), ("K", "k"), ("V", "v"), ("O_PART", "o_part"), ("LSE_PART", "lse_part"), ("O", "o"))
    static = dict(GROUP=group, D=D, BLOCK_D=BD, BLOCK_M=split.block_m, BLOCK_N=split.block_n, CAUSAL=causal,
                  DOT_PRECISION=dot_precision, STORE_LSE=store_lse, ALIGN=align,
                  EARLY_MERGE=early_merge and not fused)
    tensors = _lse_argument(tensors, static, store_lse) + _range_arguments(ranges, static)
    if fused:  # no merge kernel: the split kernel's last program of each row block merges (decode.MERGE)
        static["FUSED_STEP"] = decode.fused_step(split.block_m, BD, split.num_warps)
        tensors += (("COUNTERS", "merge_counters"),)
    else:
        static.update(COUNTERS=None, FUSED_STEP=0)
    first = _LaunchRecipe(decode.split_kv_attention_kernel, tuple(static.items()), tensors, (), _SPLIT_INTS,
                          split.num_warps, split.num_stages)
    if fused:
        return _Recipe("split", (first,), functools.partial(_split_runtime, sms=sms, merge_rows=None), counters=True)
    merge_rows, splits_per_step = decode.merge_shape()
    merge_static = dict(D=D, BLOCK_D=BD, BLOCK_R=merge_rows, SPLITS_PER_STEP=splits_per_step, STORE_LSE=store_lse,
                        EARLY_MERGE=early_merge)
    merge_tensors = _lse_argument((("O_PART", "o_part"), ("LSE_PART", "lse_part"), ("O", "o")), merge_static,
                                  store_lse)
    # (launch_pdl: the merge may start before the split kernel ends, decode.EARLY_MERGE)
    merge = _LaunchRecipe(decode.merge_splits_kernel, tuple(merge_static.items()), merge_tensors, (),
                          ("ROWS_TOTAL", "SPLITS"), 4, 1, extra=(("launch_pdl", True),) if early_merge else (),
                          scale_factor=None)
    return _Recipe("split", (first, merge), functools.partial(_split_runtime, sms=sms, merge_rows=merge_rows))


def _desc_template(block: tuple, gluon: bool, dtype: torch.dtype) -> tuple:
    """(descriptor class, its fields but ``base``, ``shape`` and ``strides``) of a TMA descriptor with
    tile ``block``: Triton's host ``TensorDescriptor``, or Gluon's (which also carries the
    shared-memory layout) for the warp-specialized kernel."""
    if gluon:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        extra = {"layout": hopper_ws.smem_layout(block, dtype)}
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor
        extra = {}
    return TensorDescriptor, dict(block_shape=list(block), padding="zero", **extra)


def _plan_call(q, k, v, o, lse, causal: bool, arch: int, sms: int, config: Config | None = None,
               split_kv: int | None = None, tuned_tiles: bool = True, pipelining: bool = True, tma: bool = True,
               exp2: bool = True, causal_skip: bool = True, warp_specialization: bool = True,
               ws_rung: int | None = None, ranges: tuple = (False, False)) -> tuple[Choice, _Recipe]:
    """The choice for this call (path and config, from its sizes) and the cached recipe of its kernel
    key (``plan``'s keywords). The sizes pick a config; only the config picks the compiled kernel, but
    for two yes-or-no facts of the sizes: ``even_n`` (the warp-specialized kernel) and
    :func:`one_key_tile` (the ``tl`` kernel's TMA)."""
    switches = (tuned_tiles, pipelining, tma, exp2, causal_skip, warp_specialization)
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    tma_ok = False
    if arch >= 90:
        # All four base pointers 16-byte aligned, in one test: their OR is then a multiple of 16 too
        # (a meta tensor's data_ptr() is 0); and every stride but the last a multiple of 16 bytes.
        qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), o.stride()
        tma_ok = ((q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) % 16 == 0
                  and _strides_tma_ok((qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], os_[0], os_[1],
                                       os_[2], 1), q.element_size()))
    store_lse = lse is not None
    # A decoding call's choice does not depend on the cache length (select, Nk=None): one cached
    # choice serves every step of a decode loop, where the exact Nk would miss the cache every call.
    nk_key = None if decode.is_decoding(Hq // Hkv, Nq, Nk) else Nk
    choice = _select(B, Hq, Hkv, Nq, nk_key, D, q.dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse,
                     switches, ws_rung, any(ranges))
    even_n = choice.path == "ws" and Nq % choice.config.block_n == 0
    # A ranged call loads K and V by pointers: a TMA box would bring in the rows past a range's end
    # (a static cache's unfilled slots may hold anything, and a NaN there survives P = 0 in P·V).
    # (the warp-specialized kernel reads by TMA, whose descriptors carry the strides: no alignment key)
    align = 1 if choice.path == "ws" else row_alignment(q, k, v, o)
    recipe = _recipe(choice.path, _kernel_config(choice), q.dtype, D, Hq // Hkv, causal, arch, sms,
                     tma and tma_ok and not any(ranges) and not one_key_tile(choice, Nk), store_lse, switches,
                     choice.ws_rung, even_n, ranges, align)
    return choice, recipe


def one_key_tile(choice: Choice, Nk: int) -> bool:
    """Whether every program of a ``tl`` call walks a single K/V tile (Nk at most its BLOCK_N). Such a
    call reads by pointers even where TMA could: the copies have nothing to pipeline, and the four
    descriptors the kernel takes cost it about 0.35 µs per call on an H100 (the suite's ``tiny`` cell,
    B 1 · H 1 · N 64, two runs: 7.4-7.6 µs of GPU time with them, 7.1-7.2 without, stage B's kernel
    7.2-7.4; performance-log entry 83).
    Like ``even_n`` for the warp-specialized kernel, a size that picks between two compiled kernels: a
    growing key length compiles the second once, when it first passes BLOCK_N."""
    return choice.path == "tl" and Nk <= choice.config.block_n


@lru_cache(maxsize=4096)
def _select(B, Hq, Hkv, Nq, Nk, D, dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse, switches,
            ws_rung, key_range=False) -> Choice:
    """``select`` with the call's arguments, cached (a fixed-shape loop asks it the same question)."""
    return select(B, Hq, Hkv, Nq, Nk, D, dtype, causal, arch, sms, tma_ok=tma_ok, config=config,
                  split_kv=split_kv, store_lse=store_lse, ws_rung=ws_rung, key_range=key_range,
                  **dict(zip(SWITCH_NAMES, switches)))


def _call_tensors(workspace: tuple, q, k, v, o, lse, key_starts=None, key_lengths=None, counters: int = 0) -> dict:
    """The call's tensors by role, with the fp32 workspace the recipe asks for (the split path's
    partials: one allocation, cut into the buffers; a shape of None: an unused fp32 argument) and
    ``counters`` zeroed counters of the fused merge (``decode.merge_counters``; 0: none)."""
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "key_starts": key_starts, "key_lengths": key_lengths}
    if counters:
        tensors["merge_counters"] = decode.merge_counters(q, counters)
    sizes = [math.prod(shape) for _, shape in workspace if shape is not None]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=q.device) if sizes else None
    offset = 0
    for role, shape in workspace:
        if shape is None:
            tensors[role] = _stand_in_fp32(o)
            continue
        n = math.prod(shape)
        tensors[role] = flat[offset:offset + n].view(shape)
        offset += n
    return tensors


def _stand_in_fp32(o: torch.Tensor) -> torch.Tensor:
    """What a kernel's unused fp32 pointer argument gets (the split kernel's partials when one chunk
    writes O itself): the call's output seen as fp32. The kernel never touches it; the output is a
    fresh allocation, so 16-byte aligned like the buffers it stands in for (the same compiled
    kernel). Not an allocation of its own, kept between calls: made inside a CUDA-graph pool (a
    ``torch.compile(mode="reduce-overhead")`` warm-up), that would outlive the graph's outputs,
    which PyTorch refuses."""
    return o if o.dtype == torch.float32 else o.view(torch.float32)


def plan(q, k, v, o, *, causal: bool, scale: float, arch: int, config: Config | None = None, lse=None,
         split_kv: int | None = None, sms: int | None = None, tuned_tiles: bool = True, pipelining: bool = True,
         tma: bool = True, exp2: bool = True, causal_skip: bool = True,
         warp_specialization: bool = True, ws_rung: int | None = None, key_starts=None,
         key_lengths=None) -> list[Launch]:
    """The launches that compute ``o`` (and, given an fp32 ``lse`` [B, Hq, Nq], the row
    log-sum-exps) for these tensors on an sm_``arch`` GPU with ``sms`` SMs (default: the device's,
    ``configs.DEFAULT_SMS`` off a GPU), as data: what a call runs, for ``compile`` and the tests.
    The split-KV path allocates its fp32 partials here."""
    if sms is None:
        sms = sm_count(q.device)
    choice, recipe = _plan_call(q, k, v, o, lse, causal, arch, sms, config=config, split_kv=split_kv,
                                tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                                causal_skip=causal_skip, warp_specialization=warp_specialization, ws_rung=ws_rung,
                                ranges=(key_starts is not None, key_lengths is not None))
    workspace, runs = recipe.runtime(q, k, v, o, choice)
    tensors = _call_tensors(workspace, q, k, v, o, lse, key_starts, key_lengths, recipe.counter_slots(runs))
    return [r.bind(grid, tensors, ints, scale) for r, (grid, ints) in zip(recipe.launches, runs)]


#: device index (``Tensor.get_device()``: -1 for the CPU) -> (compute capability, SMs): asked once,
#: because building ``q.device`` and asking the driver on every call costs microseconds
_DEVICE_FACTS: dict = {}


def _arch_and_sms(q: torch.Tensor) -> tuple[int, int]:
    index = q.get_device()
    facts = _DEVICE_FACTS.get(index)
    if facts is None:
        facts = _DEVICE_FACTS[index] = (device_arch(q.device), sm_count(q.device))
    return facts


# --------------------------------------------------------------------------------------------------
# The public entry point, the custom ops and the autograd formula.
# --------------------------------------------------------------------------------------------------

def _check_options(split_kv, deterministic, ws_rung=None) -> None:
    if split_kv is not None and (isinstance(split_kv, bool) or not isinstance(split_kv, int)):
        raise TypeError(f"split_kv must be None or an int, got {type(split_kv).__name__} {split_kv!r}")
    if split_kv is not None and split_kv < 1:
        raise ValueError(f"split_kv must be >= 1 (1: never split the keys, n >= 2: n splits), got {split_kv}")
    if ws_rung is not None and (isinstance(ws_rung, bool) or not isinstance(ws_rung, int)):
        raise TypeError(f"ws_rung must be None or an int, got {type(ws_rung).__name__} {ws_rung!r}")
    if ws_rung is not None and not 1 <= ws_rung <= len(hopper_ws.LADDER):
        raise ValueError(f"ws_rung must be None (every mechanism) or 1..{len(hopper_ws.LADDER)} (rungs 1..k of "
                         f"{', '.join(name for name, _ in hopper_ws.LADDER)}), got {ws_rung}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")


def _check_config(config) -> None:
    if config is not None and not isinstance(config, (Config, str)):
        raise TypeError(f"config must be None, a Config or its name (e.g. 'M128-N64-w4-s3'), got "
                        f"{type(config).__name__} {config!r}")
    if isinstance(config, str):
        Config.parse(config)  # a ValueError naming the allowed forms


@lru_cache(maxsize=256)
def _parse_config(text: str) -> Config:
    return Config.parse(text)


def _forward(q, k, v, causal: bool, scale: float, store_lse: bool, config, split_kv, ws_rung, tuned_tiles,
             pipelining, tma, exp2, causal_skip, warp_specialization, deterministic, key_starts=None,
             key_lengths=None):
    """The forward: O and the fp32 row log-sum-exp [B, Hq, Nq] (base 2) when ``store_lse`` (None
    otherwise). The custom op's implementation and the eager path alike; ``deterministic``
    is the backward's, carried here so the autograd formula sees it among the inputs;
    ``key_starts``/``key_lengths``: int32 [B] key ranges, checked by ``attention``."""
    if isinstance(config, str):
        config = _parse_config(config)
    o = new_output(q)
    lse = None
    if store_lse:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        if contract.poison_outputs:
            lse.fill_(float("nan"))
    # The lean path: the recipe of this call's kernel key, each launch a FastLaunch that, after its
    # first call, hands the arguments straight to the compiled kernel's launcher (stages/launch.py).
    # Every layer of a model calls attention with the same layout in one step (in a decode step, one
    # cache length), so what this layout needs (choice, recipe, grids, integer arguments and their
    # specialization facts) is kept for the next call; a new layout costs the plan once.
    switches = (tuned_tiles, pipelining, tma, exp2, causal_skip, warp_specialization)
    # Each input's 16-byte alignment (o and lse are fresh, so aligned): the choice of TMA and Triton's
    # specialization of every pointer follow from these, so the layout's bound launches can too.
    qa, ka, va = q.data_ptr(), k.data_ptr(), v.data_ptr()
    arch, sms = _arch_and_sms(q)
    range_key = key_ranges_alignment(key_starts, key_lengths)
    ranges = _NO_RANGES if range_key is None else (key_starts is not None, key_lengths is not None)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.stride(), qa % 16 == 0, ka % 16 == 0, va % 16 == 0, q.dtype,
           arch, sms, causal, store_lse, config, split_kv, switches, ws_rung, range_key)
    planned = _LAYOUT_PLANS.get(key)
    if planned is None:
        planned = _plan_layout(q, k, v, o, lse, causal, arch, sms, config, split_kv, switches, ws_rung, ranges)
        if len(_LAYOUT_PLANS) >= _LAYOUT_PLANS_MAX:
            _LAYOUT_PLANS.clear()  # a model's layouts come back within a step; a cleared table refills
        _LAYOUT_PLANS[key] = planned
    bound = planned.bound
    if bound and bound.open():
        bound.launch(q, k, v, o, lse, qa, ka, va, scale, key_starts, key_lengths)
        return o, lse
    tensors = _call_tensors(planned.workspace, q, k, v, o, lse, key_starts, key_lengths,
                            planned.recipe.counter_slots(planned.runs))
    for launch, (grid, ints), f in zip(planned.recipe.launches, planned.runs, planned.facts):
        launch.launch(grid, tensors, ints, scale, facts=f)
    if len(planned.runs) < len(planned.recipe.launches):
        _prepare_merge(planned.recipe, planned.runs, tensors, scale)
    if bound is None:  # (False: this layout cannot be bound; tried once)
        planned.bound = _BoundLayout.of(planned, tensors, scale)
    return o, lse


_NO_RANGES = (False, False)  # (neither key_starts nor key_lengths)
#: layout -> its :class:`_LayoutPlan`: ``_forward``'s memo of the last layouts seen
_LAYOUT_PLANS: dict = {}
_LAYOUT_PLANS_MAX = 1024


@dataclass
class _LayoutPlan:
    """What ``_forward`` keeps of one layout: the recipe, the workspace to allocate, per launch its
    (grid, integer arguments) and their specialization facts; and, once a call has run it through
    the lean path, its launches bound (:class:`_BoundLayout`; False where they cannot be)."""

    recipe: _Recipe
    workspace: tuple
    runs: tuple
    facts: tuple
    bound: object = None


def _plan_layout(q, k, v, o, lse, causal, arch, sms, config, split_kv, switches, ws_rung,
                 ranges=(False, False)) -> _LayoutPlan:
    choice, recipe = _plan_call(q, k, v, o, lse, causal, arch, sms, config, split_kv, *switches, ws_rung=ws_rung,
                                ranges=ranges)
    workspace, runs = recipe.runtime(q, k, v, o, choice)
    facts = tuple(launch.integer_facts(ints) for launch, (_, ints) in zip(recipe.launches, runs))
    return _LayoutPlan(recipe, workspace, tuple(runs), facts)


@dataclass(frozen=True)
class _BoundLayout:
    """A layout's launches bound once (``launch.BoundLaunch``): a call hands each its pointers'
    addresses (by role: the inputs', the fresh output's and log-sum-exp's, the fp32 workspace cut at
    fixed offsets of one allocation) and, where it has them, the tensors its descriptors are over (the
    bound launch finds their tensor maps by address) and the scale. Nothing is checked, keyed or bound per call but whether the lean path is open."""

    launches: tuple    # per launch: (BoundLaunch, its pointers' roles, its descriptors' roles, the scale
                       # factor or None)
    workspace: tuple   # (role, offset in fp32 elements into the workspace, or None: unused, _stand_in_fp32)
    floats: int        # fp32 elements of the workspace (0: none)
    descriptors: bool  # whether a launch takes TMA descriptors (built over the call's tensors)
    counters: int = 0  # the fused merge's counters (0: none), looked up per call: they are per stream

    @classmethod
    def of(cls, planned: _LayoutPlan, tensors: dict, scale: float):
        """The layout's launches bound after a call that ran them with ``tensors``, or False."""
        launches = []
        for recipe, (grid, ints), facts in zip(planned.recipe.launches, planned.runs, planned.facts):
            bound = recipe.bound_launch(grid, tensors, ints, scale, facts)
            if bound is None:
                return False
            # A descriptor's shape and strides are the layout's (its key holds them; o is contiguous,
            # shaped like q): per call only its base, the tensor, is new, and the bound launch takes it.
            descs = tuple(role for _, role, _, _ in recipe.descs)
            launches.append((bound, tuple(role for _, role in recipe.tensors), descs, recipe.scale_factor))
        workspace, offset = [], 0
        for role, shape in planned.workspace:
            if shape is not None and math.prod(shape) == 0:
                return False  # (an empty buffer has no address to hand over: such calls take the full path)
            workspace.append((role, None if shape is None else offset))
            offset += 0 if shape is None else math.prod(shape)
        return cls(tuple(launches), tuple(workspace), offset, any(descs for _, _, descs, _ in launches),
                   planned.recipe.counter_slots(planned.runs))

    def open(self) -> bool:
        """Whether the bound launches may run now (one check for all: they were bound on one device)."""
        return self.launches[0][0].open()

    def launch(self, q, k, v, o, lse, qa: int, ka: int, va: int, scale: float, key_starts=None,
               key_lengths=None) -> None:
        addresses = {"q": qa, "k": ka, "v": va, "o": o.data_ptr()}
        if lse is not None:
            addresses["lse"] = lse.data_ptr()
        if key_starts is not None:
            addresses["key_starts"] = key_starts.data_ptr()
        if key_lengths is not None:
            addresses["key_lengths"] = key_lengths.data_ptr()
        # The counters and the workspace are held until the launches are queued: freed before them, their
        # memory could go to the next allocation of this call (a CUDA graph's fresh counters to the
        # workspace, so the partials would overwrite the counts).
        counters = decode.merge_counters(q, self.counters) if self.counters else None
        if counters is not None:
            addresses["merge_counters"] = counters.data_ptr()
        flat = torch.empty(self.floats, dtype=torch.float32, device=q.device) if self.floats else None
        for role, offset in self.workspace:
            # (an unused fp32 pointer: the output's address, as _stand_in_fp32 hands it over)
            addresses[role] = addresses["o"] if offset is None else flat.data_ptr() + 4 * offset
        tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse} if self.descriptors else None
        for bound, roles, descs, factor in self.launches:
            varying = [tensors[role] for role in descs]
            if factor is not None:
                varying.append(scale * factor)
            bound.launch([addresses[role] for role in roles], varying)
        del flat, counters



def _prepare_merge(recipe: _Recipe, runs: tuple, tensors: dict, scale: float) -> None:
    """A decoding call short enough for one chunk runs no merge; the loop's later, longer calls will.
    Compile the merge now (once per recipe), so a decode loop compiles all its kernels at its first
    call instead of stalling at the step whose cache first splits."""
    if recipe.path != "split" or "merge prepared" in recipe.done:
        return
    recipe.done.add("merge prepared")
    rows_total = runs[0][1][-1]
    unused = _stand_in_fp32(tensors["o"])
    recipe.launches[1].prepare((1,), {**tensors, "o_part": unused, "lse_part": unused}, (rows_total, 2), scale)


def _forward_op_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                     store_lse: bool, config: str | None, split_kv: int | None, ws_rung: int | None,
                     tuned_tiles: bool, pipelining: bool, tma: bool, exp2: bool, causal_skip: bool,
                     warp_specialization: bool, deterministic: bool, key_starts: torch.Tensor | None = None,
                     key_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _forward(q, k, v, causal, scale, store_lse, config, split_kv, ws_rung, tuned_tiles, pipelining, tma,
                      exp2, causal_skip, warp_specialization, deterministic, key_starts, key_lengths)
    return o, (lse if lse is not None else q.new_empty(0, dtype=torch.float32))  # an op returns tensors


def _forward_fake(q, k, v, causal, scale, store_lse, *options):
    lse_shape = q.shape[:3] if store_lse else (0,)
    return ops.empty_output(q), q.new_empty(lse_shape, dtype=torch.float32)


def _backward(do, q, k, v, o, lse, causal: bool, scale: float, deterministic: bool, tuned_tiles: bool,
              pipelining: bool, exp2: bool, causal_skip: bool, warp_specialization: bool, key_starts=None,
              key_lengths=None):
    from .backward import attention_backward  # imported here: the forward does not need it

    return attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                              deterministic=deterministic, tuned_tiles=tuned_tiles, pipelining=pipelining,
                              exp2=exp2, causal_skip=causal_skip, warp_specialization=warp_specialization,
                              key_starts=key_starts, key_lengths=key_lengths)


def _backward_op_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                      lse: torch.Tensor, causal: bool, scale: float, deterministic: bool, tuned_tiles: bool,
                      pipelining: bool, exp2: bool, causal_skip: bool, warp_specialization: bool,
                      key_starts: torch.Tensor | None = None,
                      key_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal, scale, deterministic, tuned_tiles, pipelining, exp2, causal_skip,
                     warp_specialization, key_starts, key_lengths)


def _backward_fake(do, q, k, v, o, lse, *options):
    return ops.empty_output(q), ops.empty_output(k), ops.empty_output(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, scale, store_lse, config, split_kv, ws_rung, tuned_tiles, pipelining, tma, exp2, causal_skip, \
        warp_specialization, deterministic, *key_ranges = inputs
    o, lse = output
    ctx.inputs = len(inputs)
    key_starts, key_lengths = key_ranges or (None, None)  # (a caller that passes the op no ranges)
    ctx.save_for_backward(q, k, v, o, lse, key_starts, key_lengths)
    ctx.mark_non_differentiable(lse)
    # The ablation switches that the backward has too (the forward's tiles and TMA do not carry
    # over: the backward has its own configs; warp_specialization=False keeps it to the tl kernels).
    ctx.args = (causal, scale, deterministic, tuned_tiles, pipelining, exp2, causal_skip, warp_specialization)


def _grad(ctx, do, dlse):
    q, k, v, o, lse, key_starts, key_lengths = ctx.saved_tensors
    if lse.numel() == 0 and q.numel():
        raise RuntimeError("attention_lab::c_forward ran with store_lse=False, so it kept no row log-sum-exp for "
                           "the backward to rebuild P from: call it with store_lse=True when gradients are wanted")
    if ops.traced(do, q):
        dq, dk, dv = _backward_op(do, q, k, v, o, lse, *ctx.args, key_starts, key_lengths)
    else:
        # (the backward's positional entry: fewer Python calls; a gradient may come in any layout)
        from .backward import run_backward  # (imported here: the forward does not need it)

        dq, dk, dv = run_backward(ops.maybe_contiguous(do), q, k, v, o, lse, *ctx.args, key_starts, key_lengths)
    return dq, dk, dv, *(None,) * (ctx.inputs - 3)


#: the custom ops (stages/ops.py): ``torch.ops.attention_lab.c_forward`` and ``c_backward``
_forward_op = ops.define("c_forward", _forward_op_impl, _forward_fake, setup_context=_setup_context, backward=_grad)
_backward_op = ops.define("c_backward", _backward_op_impl, _backward_fake)
#: the eager path's autograd node: the same forward, saved tensors and backward as the op's
_Attention = ops.autograd_function("StageCAttention", _forward, _setup_context, _grad)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, config: Config | str | None = None, tuned_tiles: bool = True,
              pipelining: bool = True, tma: bool = True, exp2: bool = True,
              causal_skip: bool = True, warp_specialization: bool = True, split_kv: int | None = None,
              deterministic: bool = False, ws_rung: int | None = None, key_starts: torch.Tensor | None = None,
              key_lengths: torch.Tensor | None = None) -> torch.Tensor:
    """Optimized fused attention. q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]``; returns O
    ``[B, Hq, Nq, D]``, differentiable (``o.backward(do)`` runs ``backward.py``'s kernels).

    ``config`` forces a tile configuration (a ``Config`` or its name; the tests run every
    candidate); the six switches turn single optimizations off for the ablation (see the module
    docstring); ``split_kv`` forces (n >= 2) or forbids (1) the split-KV path of ``decode.py``
    (None: chosen from the work); ``deterministic`` asks the backward for a fixed summation order;
    ``ws_rung`` k (1..6) runs the warp-specialized kernel with rungs 1..k of its ladder on
    (``hopper_ws.LADDER``; sm_90, fp16/bf16, D 40-256, Nq == Nk: a ValueError elsewhere).

    ``key_starts``, ``key_lengths`` (int32 [B] on q's device, each optional): batch entry b attends
    to keys ``key_starts[b] <= j < key_lengths[b]`` only, causal aligned to the range's end. This
    is what a static KV cache needs (its tensors are as long as the longest sequence it will hold;
    the lengths say how many slots are filled) and a left-padded batch (the starts skip the pads).
    The values stay on the GPU, so a loop whose lengths grow per step neither waits for the GPU
    nor compiles or plans anything new, and CUDA graphs can replay it. Runs on the ``tl`` and
    split-KV kernels, and the ``tl`` backward kernels (keys outside a range get zero gradients).

    Traced (``torch.compile``, ``torch.export``) the call is the custom op
    ``torch.ops.attention_lab.c_forward``; eager, the same implementation without the dispatcher
    (``stages/ops.py`` says why).
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_options(split_kv, deterministic, ws_rung)
    _check_config(config)
    store_lse = ops.needs_grad(q, k, v)
    ranges = ()
    if key_starts is not None or key_lengths is not None:
        key_starts, key_lengths = validate_key_ranges(q, k, key_starts, key_lengths)
        ranges = tuple(t for t in (key_starts, key_lengths) if t is not None)
    args = (q, k, v, causal, scale, store_lse, config, split_kv, ws_rung, tuned_tiles, pipelining, tma, exp2,
            causal_skip, warp_specialization, deterministic, key_starts, key_lengths)
    if ops.traced(q, k, v, *ranges):
        return _forward_op(*args[:6], None if config is None else str(config), *args[7:])[0]
    if store_lse:
        return _Attention.apply(*args)[0]
    return _forward(*args)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       sm_scale: float | None = None, config: Config | str | None = None, split_kv: int | None = None,
                       ws_rung: int | None = None, tuned_tiles: bool = True, pipelining: bool = True,
                       tma: bool = True, exp2: bool = True, causal_skip: bool = True,
                       warp_specialization: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with its row log-sum-exp: (O, lse), lse fp32 ``[B, Hq, Nq]`` in base 2 of the
    scaled scores, ``lse_i = log2 Σ_j 2^(q_i·k_j · scale · log2 e)``; +inf for a row that sees no key.
    No autograd (this is what the training forward saves). Options as for ``attention``."""
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_options(split_kv, False, ws_rung)
    _check_config(config)
    args = (q, k, v, causal, scale, True, config, split_kv, ws_rung, tuned_tiles, pipelining, tma, exp2,
            causal_skip, warp_specialization, False)
    with torch.no_grad():
        if ops.traced(q, k, v):
            return _forward_op(*args[:6], None if config is None else str(config), *args[7:])
        return _forward(*args)


@compiles_without_interpreter
def compile(problem: Problem, arch: int, **switches) -> list[CompiledKernel]:
    """Compile for ``problem`` on an sm_``arch`` GPU without one; ``switches`` as for ``attention``
    (plus ``store_lse=True`` for the training forward, ``key_ranges=True`` for a call with key
    starts and lengths)."""
    store_lse = switches.pop("store_lse", False)
    key_ranges = switches.pop("key_ranges", False)
    switches.pop("deterministic", None)  # (the backward's summation order: the forward is the same kernel)
    dtype = DTYPES[problem.dtype]
    q = torch.empty((problem.B, problem.H, problem.N, problem.D), dtype=dtype, device="meta")
    k, v = (torch.empty((problem.B, problem.Hkv, problem.Nk, problem.D), dtype=dtype, device="meta")
            for _ in range(2))
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="meta") if store_lse else None
    if key_ranges:
        switches["key_starts"], switches["key_lengths"] = (
            torch.empty(problem.B, dtype=torch.int32, device="meta") for _ in range(2))
    launches = plan(q, k, v, torch.empty_like(q), causal=problem.causal, scale=problem.D ** -0.5, arch=arch,
                    lse=lse, **switches)
    return [launch.compile(arch) for launch in launches]


def _choice_for(p: Problem, config, split_kv, switches, ws_rung=None) -> Choice:
    dtype = DTYPES[p.dtype]
    return select(p.B, p.H, p.Hkv, p.N, p.Nk, p.D, dtype, p.causal, device_arch(None), sm_count(None),
                  config=config, split_kv=split_kv, ws_rung=ws_rung, **switches)


def _kv_rows_per_tile(p: Problem, block_m: int, causal_skip: bool) -> int:
    """K (= V) rows one query head's programs request, summed over its BLOCK_M-row tiles: all Nk,
    or under causal skipping the keys its last row sees, min(Nk, start + BLOCK_M + Nk - Nq)."""
    tiles = cdiv(p.N, block_m)
    if not (p.causal and causal_skip):
        return tiles * p.Nk
    off = p.Nk - p.N
    return sum(max(0, min(p.Nk, (t + 1) * block_m + off)) for t in range(tiles))


def hbm_bytes(p: Problem, config: Config | None = None, causal_skip: bool = True, tuned_tiles: bool = True,
              warp_specialization: bool = True, pipelining: bool = True, tma: bool = True, exp2: bool = True,
              split_kv: int | None = None, ws_rung: int | None = None, **_other) -> HbmTraffic:
    """Bytes requested from device memory by one call with the path and tiles the stage would choose
    (on the current GPU; off a GPU, sm_80's table and ``configs.DEFAULT_SMS`` SMs).

    One-pass kernels: Q read once, O written once, and each query head's K and V rows once per Q
    tile (⌈Nq/BLOCK_M⌉ times Nk, as in stage B with a larger BLOCK_M); under causal skipping a tile
    reads only the keys its last row sees (about half). Grouped heads count separately: the query
    heads of a group each request their K/V head's rows (L2 serves the repeats).
    Split-KV: K and V once per (batch, KV head, row block), and the fp32 partials (O and the
    log-sum-exp per split and row) written once and read once by the merge. ``ws_rung``: the
    rung's rows per item (64 on rung 1); a ValueError where the rung cannot run, as for ``attention``.
    """
    switches = dict(tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2, causal_skip=causal_skip,
                    warp_specialization=warp_specialization)
    choice = _choice_for(p, config, split_kv, switches, ws_rung)
    row = p.D * p.element_bytes
    q_bytes = p.heads * p.N * row
    if choice.path == "split":
        s = choice.config
        rows = p.group * p.N
        kv_rows = 0
        for r0 in range(0, rows, s.block_m):
            last_i = max(r % p.N for r in range(r0, min(rows, r0 + s.block_m)))
            kv_rows += min(p.Nk, last_i + p.Nk - p.N + 1) if p.causal else p.Nk
        partials = 4 * s.splits * p.heads * p.N * (p.D + 1)
        return HbmTraffic(read=q_bytes + p.kv_heads * 2 * kv_rows * row + partials,
                          write=q_bytes + partials)
    kv_rows = _kv_rows_per_tile(p, choice.config.block_m, causal_skip)
    return HbmTraffic(read=q_bytes + p.heads * 2 * kv_rows * row, write=q_bytes)


def workspace_bytes(p: Problem, config: Config | None = None, split_kv: int | None = None, **switches) -> int:
    """Device memory one call allocates besides the output: none on the one-pass paths (TMA
    descriptors are passed by value as kernel parameters); the fp32 partials on the split-KV path."""
    choice = _choice_for(p, config, split_kv, {k: switches[k] for k in SWITCH_NAMES if k in switches})
    if choice.path == "split":
        return decode.workspace_bytes(p.B, p.H, p.N, p.D, choice.config.splits)
    return 0


__all__ = ["attention", "attention_with_lse", "compile", "hbm_bytes", "workspace_bytes", "shared_memory_bytes",
           "Config", "select", "plan"]
