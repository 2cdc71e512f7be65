"""Stage C's split-KV backward: the gradients of a decoding-shaped call, the keys shared out as in the forward.

The backward's ordinary kernels give each program one tile of keys (dK and dV of those rows) and walk
the query rows against it. Where the query rows are few, that walk is one tile long: a program loads
its K/V tile, runs the five products once, writes its dK/dV tile, and ends. Its time is then the
latency of those steps in a row, not the bytes: a decode-shaped backward (B 4, 32 heads, one query row
against 32k cached keys, D 128) is 32,768 such programs, and on the H200 it ran at 0.61 of cuDNN's
speed, moving 2 of the 4.3 GB it must read and write per millisecond.

The forward met the same shape with the split-KV path (``decode.py``), and the backward takes the same
way out. When every query row of a KV head's group fits one tile (``decode.is_decoding``: group · Nq
<= 64 rows, Nq < Nk), a program holds *all* those rows, with their dO, log-sum-exp and Δ = rowsum(dO ∘ O),
and walks a chunk of the keys tile by tile, pipelined like the forward's split kernel. For each K/V tile:

    P  = 2^(Q Kᵀ · scale · log2 e − L)          (the forward's probabilities, recomputed)
    dV = Pᵀ dO                                   written at once: every query row is in this program,
    dS = P ∘ (dO Vᵀ − Δ)                         so the tile's dK and dV are complete here
    dK = scale · dSᵀ Q                           written at once
    dQ += dS K                                   kept in registers over the chunk

Grouped-query attention needs nothing more: the rows of the tile are the group's query heads, so the
products sum their contributions to the shared K/V head on chip. dK and dV need no accumulator across
programs, because no other program sees these keys. Only dQ is a sum over the keys, and so over the
splits: each program writes its chunk's dQ (fp32) and a small second kernel adds the splits in a fixed
order (``reduce_dq_kernel``). No atomics anywhere: the result is the same bit for bit from run to run,
so ``deterministic=True`` costs nothing on this path. With one split, the kernel writes dQ itself.

The traffic is the least a backward can move: K and V read once, dK and dV written once, the query
rows' Q, dO, O read once per split (a few KB), the fp32 partials of dQ written and read back once.

The split count follows the forward's rule for decoding (:data:`BACKWARD_WAVES` programs per SM, at
least ``decode.MIN_TILES_PER_SPLIT`` tiles each): the choice of path depends on the batch, heads and
the group's rows, never on Nk, and Nk reaches the kernel as a runtime value, so a cache that grows by a
key per step compiles nothing new.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..contract import HbmTraffic, Problem, cdiv, padded_head_dim
from ..launch import Launch
from . import decode
from .aligned import aligned_strides, row_alignment
from .decode import key_range

#: ``LAB_BWD_SPLIT_KV=0`` sends decoding-shaped backwards to the ordinary kernels (the A/B switch of
#: ``experiments/decode_backward.py``).
_SWITCH = os.environ.get("LAB_BWD_SPLIT_KV", "1")
if _SWITCH not in ("0", "1"):
    raise ValueError(f"LAB_BWD_SPLIT_KV must be 0 (off) or 1 (on), got {_SWITCH!r}")
ENABLED = _SWITCH == "1"

#: Programs per SM the split count aims at: the forward's decode rule (``decode.DECODE_WAVES``).
BACKWARD_WAVES = decode.DECODE_WAVES
#: splits the reduction adds per step: one row per program, so a B 1 call's few rows with many splits
#: are many short programs, not a few long chains of dependent loads (the forward's "wide" merge)
REDUCE_SPLITS_PER_STEP = 32
#: the kernels exponentiate in base 2, so the scores' scale carries log2(e)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class SplitBwdTiles:
    """The split backward's tiles: ``block_m`` query rows (the group's rows, flattened), ``block_n``
    keys per step, ``num_warps``, ``num_stages`` (K/V tiles in the software pipeline)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def split_backward_tiles(group: int, Nq: int, D: int, element_bytes: int = 2) -> SplitBwdTiles:
    """The one place the split backward's tiles are decided (``experiments/decode_backward.py`` sweeps
    through it): the group's rows padded to ``tl.dot``'s smallest tile (16) or more; 64 keys per step,
    32 where a row is wider than 256 bytes (an fp32 dK or dV tile of 64 such keys would take a program's
    registers). A 16-row tile of 16-bit data up to 128 columns gets 8 warps and a third K/V buffer:
    on an H100 that was 13 % faster at D 64 and level elsewhere; 64 rows keep 4 warps and two
    buffers (the third was 20 % slower there)."""
    block_m = decode.split_tiles(group, Nq, D).block_m  # (the forward's rows: the same tile of the group)
    row_bytes = padded_head_dim(D) * element_bytes
    block_n = 64 if row_bytes <= 256 else 32
    if block_m == 16 and element_bytes == 2 and row_bytes <= 256:
        return SplitBwdTiles(block_m, block_n, num_warps=8, num_stages=3)
    return SplitBwdTiles(block_m, block_n)


def shared_bytes(tiles: SplitBwdTiles, D: int, element_bytes: int) -> int:
    """An upper estimate of the split kernel's shared memory: its K and V buffers (the compiler stages
    the loads through them), up to four row tiles (Q, dO and the transposed P and dS as matmul operands:
    on sm_90 a 64-row tile's wgmma reads them from shared memory) and one fp32 score tile. Triton's
    own figure was under it for D 16-256, fp16 and fp32, every row count, on sm_80 and sm_90."""
    D_pad = padded_head_dim(D)
    return (tiles.num_stages * 2 * tiles.block_n + 4 * tiles.block_m) * D_pad * element_bytes \
        + tiles.block_m * tiles.block_n * 4


def takes_split_backward(Hq: int, Hkv: int, Nq: int, Nk: int, D: int, element_bytes: int, arch: int) -> bool:
    """Whether a backward of these shapes is decoding-shaped (``decode.is_decoding``: the group's query
    rows fit one tile, after a cache), the class the split backward is for, its tiles fit this GPU's
    shared memory, and the switch is on."""
    from .configs import SHARED_MEMORY_LIMIT

    if not (ENABLED and decode.is_decoding(Hq // Hkv, Nq, Nk)):
        return False
    tiles = split_backward_tiles(Hq // Hkv, Nq, D, element_bytes)
    return shared_bytes(tiles, D, element_bytes) + 1024 <= SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)


def backward_splits(B: int, Hkv: int, group: int, Nq: int, Nk: int, D: int, sms: int,
                    element_bytes: int = 2) -> tuple[int, int]:
    """(splits, keys per split): about :data:`BACKWARD_WAVES` programs per SM, each at least
    ``decode.MIN_TILES_PER_SPLIT`` tiles long, at most ``decode.MAX_SPLITS``; whole tiles per chunk."""
    block_n = split_backward_tiles(group, Nq, D, element_bytes).block_n
    wanted = round(BACKWARD_WAVES * sms / (B * Hkv))
    wanted = max(1, min(wanted, cdiv(Nk, block_n) // decode.MIN_TILES_PER_SPLIT, decode.MAX_SPLITS))
    return decode.split_counts(block_n, Nk, wanted)


def workspace_shape(B: int, Hq: int, Nq: int, D: int, splits: int) -> tuple | None:
    """The fp32 partials of dQ, ``[splits, B·Hq·Nq, D]``; None for one split (dQ written directly)."""
    return (splits, B * Hq * Nq, D) if splits > 1 else None


#: Sizes are runtime values: a cache that grows by a key per call changes N_K and CHUNK every call.
@triton.jit(do_not_specialize=["Hq", "Hkv", "N_Q", "N_K", "CHUNK", "ROWS_TOTAL"])
def split_kv_backward_kernel(
    Q, K, V, O, DO, LSE, DK, DV, DQ, DQ_PART, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, N_Q, N_K, CHUNK, ROWS_TOTAL,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, KEY_STARTS, KEY_LENGTHS,
):
    """Program (split, b·Hkv + kv head): dK and dV of the keys of chunk ``split``, and that chunk's
    share of dQ for every query row of the group (module docstring). ``DQ_PART`` None: one chunk, dQ
    goes to ``DQ`` scaled and in its dtype; else to ``DQ_PART[split]`` in fp32, unscaled."""
    stride_qb, stride_qh, stride_qn = aligned_strides(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_strides(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_strides(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_ob, stride_oh, stride_on = aligned_strides(stride_ob, stride_oh, stride_on, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_strides(stride_dob, stride_doh, stride_don, ALIGN)
    stride_dkb, stride_dkh, stride_dkn = aligned_strides(stride_dkb, stride_dkh, stride_dkn, ALIGN)
    stride_dvb, stride_dvh, stride_dvn = aligned_strides(stride_dvb, stride_dvh, stride_dvn, ALIGN)
    split = tl.program_id(0)
    b = tl.program_id(1) // Hkv
    kv_h = tl.program_id(1) % Hkv
    r = tl.arange(0, BLOCK_M)  # the group's rows, flattened (head, row) as in the forward's split kernel
    row_ok = r < GROUP * N_Q
    h = kv_h * GROUP + r // N_Q
    i = r % N_Q
    ds = tl.arange(0, BLOCK_D)
    rows_mask = row_ok[:, None] & (ds[None, :] < D)
    b64, h64, i64 = b.to(tl.int64), h.to(tl.int64)[:, None], i.to(tl.int64)[:, None]
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + i64 * stride_qn + ds[None, :], mask=rows_mask, other=0.0)
    do = tl.load(DO + b64 * stride_dob + h64 * stride_doh + i64 * stride_don + ds[None, :], mask=rows_mask,
                 other=0.0)
    o = tl.load(O + b64 * stride_ob + h64 * stride_oh + i64 * stride_on + ds[None, :], mask=rows_mask, other=0.0)
    # Δ here, not in a pre-pass: the rows are few, and every program that needs them holds them.
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    row = (b * Hq + h).to(tl.int64) * N_Q + i  # rows in (b, h, i) order, as lse and a contiguous dQ hold them
    # Padding rows and rows that see no key: lse = +inf, so their P is exactly 0 everywhere.
    lse = tl.load(LSE + row, mask=row_ok, other=float("inf"))

    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, N_K)
    first = 0
    end = N_K
    if KEY_STARTS is not None or KEY_LENGTHS is not None:
        # A key range per batch entry (the forward's): keys outside it are never loaded (they may hold
        # anything) and get zero gradients; the causal diagonal is aligned to its end.
        first, end = key_range(KEY_STARTS, KEY_LENGTHS, b, N_K)
    causal_offset = end - N_Q
    K_bh = K + b64 * stride_kb + kv_h.to(tl.int64) * stride_kh
    V_bh = V + b64 * stride_vb + kv_h.to(tl.int64) * stride_vh
    DK_bh = DK + b64 * stride_dkb + kv_h.to(tl.int64) * stride_dkh
    DV_bh = DV + b64 * stride_dvb + kv_h.to(tl.int64) * stride_dvh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        in_chunk = cols < hi
        seen = in_chunk & (cols >= first) & (cols < end)
        kv_mask = seen[:, None] & (ds[None, :] < D)
        k = tl.load(K_bh + cols[:, None] * stride_kn + ds[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_bh + cols[:, None] * stride_vn + ds[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        valid = seen[None, :]
        if CAUSAL:
            valid = valid & (cols[None, :] <= i[:, None] + causal_offset)
        # After the exponential: a masked score never enters an arithmetic, so no inf − inf.
        p = tl.where(valid, p, 0.0)
        store_mask = in_chunk[:, None] & (ds[None, :] < D)
        dv = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT_PRECISION)
        tl.store(DV_bh + cols[:, None] * stride_dvn + ds[None, :], dv.to(DV.dtype.element_ty), mask=store_mask)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        dscore = p * (dp - delta[:, None])
        dk = tl.dot(tl.trans(dscore.to(q.dtype)), q, input_precision=DOT_PRECISION) * sm_scale
        tl.store(DK_bh + cols[:, None] * stride_dkn + ds[None, :], dk.to(DK.dtype.element_ty), mask=store_mask)
        dq = tl.dot(dscore.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    if DQ_PART is None:
        tl.store(DQ + row[:, None] * D + ds[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows_mask)
    else:
        part = split.to(tl.int64) * ROWS_TOTAL + row
        tl.store(DQ_PART + part[:, None] * D + ds[None, :], dq, mask=rows_mask)


@triton.jit(do_not_specialize=["ROWS_TOTAL", "SPLITS"])
def reduce_dq_kernel(DQ_PART, DQ, sm_scale, ROWS_TOTAL, SPLITS,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PER_STEP: tl.constexpr):
    """dQ = scale · Σ_s DQ_PART[s] for one row, ``SPLITS_PER_STEP`` splits loaded at a time and summed
    by the same reduction tree every run (deterministic)."""
    row = tl.program_id(0).to(tl.int64)
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, SPLITS, SPLITS_PER_STEP):
        s = s0 + tl.arange(0, SPLITS_PER_STEP)
        parts = DQ_PART + (s.to(tl.int64)[:, None] * ROWS_TOTAL + row) * D + ds[None, :]
        acc += tl.sum(tl.load(parts, mask=(s < SPLITS)[:, None] & d_ok[None, :], other=0.0), axis=0)
    tl.store(DQ + row * D + ds, (acc * sm_scale).to(DQ.dtype.element_ty), mask=d_ok)


def plan(do, q, k, v, o, lse, dq, dk, dv, dq_part, *, causal: bool, scale: float, splits: int, chunk: int,
         pipelining: bool = True, key_starts=None, key_lengths=None) -> list[Launch]:
    """The split backward's launches: the split kernel over ``splits`` chunks of ``chunk`` keys, and the
    reduction of dQ's partials (``dq_part``: :func:`workspace_shape`, None for one split). ``dq`` is
    contiguous [B, Hq, Nq, D]; ``pipelining=False``: one stage (the ablation's switch)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    tiles = split_backward_tiles(group, Nq, D, q.element_size())
    rows = B * Hq * Nq
    launches = [Launch(
        split_kv_backward_kernel, (splits, B * Hkv),
        dict(Q=q, K=k, V=v, O=o, DO=do, LSE=lse, DK=dk, DV=dv, DQ=dq, DQ_PART=dq_part,
             qk_scale=scale * LOG2E, sm_scale=scale,
             stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
             stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
             stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
             stride_ob=o.stride(0), stride_oh=o.stride(1), stride_on=o.stride(2),
             stride_dob=do.stride(0), stride_doh=do.stride(1), stride_don=do.stride(2),
             stride_dkb=dk.stride(0), stride_dkh=dk.stride(1), stride_dkn=dk.stride(2),
             stride_dvb=dv.stride(0), stride_dvh=dv.stride(1), stride_dvn=dv.stride(2),
             Hq=Hq, Hkv=Hkv, N_Q=Nq, N_K=Nk, CHUNK=chunk, ROWS_TOTAL=rows,
             GROUP=group, D=D, BLOCK_D=padded_head_dim(D), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
             CAUSAL=causal, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             ALIGN=row_alignment(q, k, v, o, do, dk, dv), KEY_STARTS=key_starts, KEY_LENGTHS=key_lengths),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages if pipelining else 1)]
    if dq_part is not None:
        launches.append(Launch(
            reduce_dq_kernel, (rows,),
            dict(DQ_PART=dq_part, DQ=dq, sm_scale=scale, ROWS_TOTAL=rows, SPLITS=splits, D=D,
                 BLOCK_D=padded_head_dim(D), SPLITS_PER_STEP=min(REDUCE_SPLITS_PER_STEP, triton.next_power_of_2(splits))),
            num_warps=4, num_stages=1))
    return launches


def hbm_bytes(p: Problem, sms: int) -> HbmTraffic:
    """Bytes the split backward moves (no cache assumed): K and V read once, dK and dV written once; per
    split, the group's Q, dO, O rows and their log-sum-exps read; dQ's fp32 partials written and read
    back by the reduction, which writes dQ (one split: dQ written directly)."""
    e, D = p.element_bytes, p.D
    splits, _ = backward_splits(p.B, p.Hkv, p.H // p.Hkv, p.N, p.Nk, D, sms, e)
    rows = p.B * p.H * p.N
    read = 2 * p.kv_bytes + splits * rows * (3 * D * e + 4)
    write = 2 * p.kv_bytes + rows * D * e
    if splits > 1:
        write += splits * rows * D * 4
        read += splits * rows * D * 4
    return HbmTraffic(read=read, write=write)
