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

from dataclasses import dataclass, field
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import contract
from ..contract import DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, padded_head_dim, validate_inputs
from ..launch import FastLaunch, Launch, compiles_without_interpreter
from . import decode, hopper_ws
from .configs import (BASELINE, WS_SHAPES, Config, choose_config, device_arch, shape_aware_config, shared_memory_bytes,
                      sm_count, ws_rung_config)

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


@triton.jit
def optimized_attention_kernel(
    Q, K, V, O, LSE, q_desc, k_desc, v_desc, o_desc, qk_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    H, N_Q, N_K, CAUSAL_OFFSET,
    D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr,
):
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
    MASK_D: tl.constexpr = D != BLOCK_D

    if USE_TMA:
        q = q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q_ptrs = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qn + ds[None, :]
        if EVEN_M and not MASK_D:
            q = tl.load(q_ptrs)
        else:
            q = tl.load(q_ptrs, mask=(rows[:, None] < N_Q) & (ds[None, :] < D), other=0.0)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    if CAUSAL and CAUSAL_SKIP:
        # Row i sees keys j <= i + CAUSAL_OFFSET (Nk - Nq). This tile's last row sees up to
        # `hi`; its first row sees every key below `mid`, so the whole tiles below it need no mask.
        hi = tl.maximum(tl.minimum(start_m + BLOCK_M + CAUSAL_OFFSET, N_K), 0)
        mid = (tl.maximum(tl.minimum(start_m + CAUSAL_OFFSET + 1, N_K), 0) // BLOCK_N) * BLOCK_N
        # 1) tiles wholly left of the diagonal: every score valid, no masks at all.
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, 0, mid, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      False, False, USE_TMA, EXP2, DOT_PRECISION)
        # 2) the diagonal band: causal mask (and the ragged-Nk mask on the last one). Tiles past it
        #    are never visited.
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, mid, hi, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      True, not EVEN_N, USE_TMA, EXP2, DOT_PRECISION)
    else:
        # Whole tiles mask-free (unless causal without skipping, which masks everything like stage
        # B), then the ragged last tile with the Nk mask.
        n_full = (N_K // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn, stride_vn,
                                      rows, 0, n_full, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D, BLOCK_N,
                                      CAUSAL, False, USE_TMA, EXP2, DOT_PRECISION)
        if not EVEN_N:
            acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, K_bh, V_bh, k_desc, v_desc, b, kv_h, stride_kn,
                                          stride_vn, rows, n_full, N_K, N_K, CAUSAL_OFFSET, qk_scale, D, BLOCK_D,
                                          BLOCK_N, CAUSAL, True, USE_TMA, EXP2, DOT_PRECISION)

    if CAUSAL:
        # A row that saw no key (causal, Nq > Nk) has l = 0 and acc = 0: output 0, not 0/0.
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
        if EVEN_M and not MASK_D:
            tl.store(o_ptrs, out)
        else:
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


def _tma_supported(arch: int, *tensors: torch.Tensor) -> bool:
    """TMA needs sm_90+, 16-byte aligned base pointers and 16-byte aligned strides (all but the last)."""
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
           ws_rung: int | None = None) -> Choice:
    """The path and config for a problem, from its shapes only (the plan and the traffic model share it).

    1. ``split_kv`` >= 2 forces the split-KV path with that many splits; ``split_kv=1`` rules it
       out; ``None`` lets the work decide: with tuned tiles (and exp2, which the split kernel always
       uses) and no forced ``config``, split when ``decode.choose_splits`` finds too few programs
       for the SMs and keys enough to share out.
    2. Otherwise the tuned config for (dtype, D, causal, Nq), adjusted to the work
       (``configs.shape_aware_config``). The warp-specialized kernel is eligible when every switch
       is on, on sm_90, fp16/bf16, D 64/128, TMA-able strides, Nq = Nk (its causal mask assumes the
       square), and no log-sum-exp is wanted (it is forward-only; training runs the ``tl`` kernel).
    3. ``ws_rung`` k forces the warp-specialized kernel with rungs 1..k of its ladder on
       (``hopper_ws.LADDER``), built on the config step 2 would choose; a ValueError where that
       kernel cannot run.
    """
    group = Hq // Hkv
    if ws_rung is not None:
        return _ws_rung_choice(B, Hq, Nq, Nk, D, dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse,
                               ws_rung, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                               causal_skip=causal_skip, warp_specialization=warp_specialization)
    if split_kv is not None and split_kv >= 2:
        return Choice("split", decode.forced_splits(group, Nq, Nk, D, split_kv))
    if split_kv is None and config is None and tuned_tiles and exp2:
        split = decode.choose_splits(B, Hkv, group, Nq, Nk, D, sms)
        if split is not None:
            return Choice("split", split)
    ws_allowed = (_ws_switches_on(causal, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma, exp2=exp2,
                                  causal_skip=causal_skip, warp_specialization=warp_specialization)
                  and hopper_ws.supported(dtype, D, arch) and tma_ok and Nq == Nk and not store_lse)
    if config is None:
        if tuned_tiles:
            config = choose_config(D, dtype, causal, arch, Nq, ws_allowed)
            config = shape_aware_config(config, B, Hq, Nq, D, dtype, arch, sms)
        else:
            config = BASELINE
    if config.ws:
        if not ws_allowed:
            raise ValueError(f"config {config} needs the warp-specialized kernel: sm_90, fp16/bf16, D 64 or 128, "
                             f"Nq == Nk, 16-byte aligned strides, every switch on and no gradient (it is "
                             f"forward-only) (got arch={arch}, dtype={dtype}, D={D}, Nq={Nq}, Nk={Nk}, "
                             f"store_lse={store_lse})")
        return Choice("ws", config)
    if not pipelining:
        config = config.with_stages(1)
    return Choice("tl", config)


def _ws_rung_choice(B, Hq, Nq, Nk, D, dtype, causal, arch, sms, tma_ok, config, split_kv, store_lse, ws_rung,
                    **switches) -> Choice:
    """``select`` for a rung of the warp-specialization ladder: the warp-specialized kernel, or a
    ValueError naming ``ws_rung`` (the harness records that as ``unsupported``)."""
    if not (hopper_ws.supported(dtype, D, arch) and Nq == Nk):
        raise ValueError(f"ws_rung={ws_rung} needs the warp-specialized kernel: sm_90, fp16/bf16, D 64 or 128 and "
                         f"Nq == Nk (got arch={arch}, dtype={dtype}, D={D}, Nq={Nq}, Nk={Nk})")
    if not (_ws_switches_on(causal, **switches) and tma_ok and not store_lse
            and (split_kv is None or split_kv == 1) and (config is None or config.ws)):
        raise ValueError(f"ws_rung={ws_rung} needs every switch on, TMA-able strides, no split_kv, no gradient (the "
                         f"kernel is forward-only) and no tl config (got switches={switches}, tma_ok={tma_ok}, "
                         f"split_kv={split_kv}, store_lse={store_lse}, config={config})")
    if config is None:
        config = shape_aware_config(choose_config(D, dtype, causal, arch, Nq, True), B, Hq, Nq, D, dtype, arch, sms)
        if not config.ws:  # a tuned table whose winner here is a tl config: the ladder builds on the first ws one
            config = WS_SHAPES[D][0]
    return Choice("ws", ws_rung_config(config, ws_rung), ws_rung)


@dataclass(frozen=True)
class _LaunchRecipe:
    """One launch with its tensors left out: ``static`` holds every argument that is not a tensor or
    descriptor; ``tensors`` maps argument names to the call's tensors by role (``"q"``, ``"o"``,
    ``"lse"``, ``"o_part"``, ...); ``descs`` lists the TMA descriptors to build as (argument, role,
    block shape, gluon)."""

    kernel: object
    grid: tuple
    static: tuple
    tensors: tuple
    descs: tuple
    num_warps: int
    num_stages: int
    extra: tuple = ()
    scale_factor: float | None = LOG2E  # qk_scale = scale · scale_factor (None: no qk_scale argument)
    #: per entry of ``descs``: (descriptor class, its fields but ``base``), from the shapes and strides
    #: of the key; filled in by ``_recipe`` (``_desc_templates``)
    desc_templates: tuple = ()
    launcher: FastLaunch = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        # The per-call values, in the order `launch` passes them: tensors (the pointer arguments),
        # descriptors, the scale. Everything else is fixed for the recipe's key.
        dynamic = tuple(name for name, _ in self.tensors) + tuple(name for name, *_ in self.descs)
        if self.scale_factor is not None:
            dynamic += ("qk_scale",)
        static = {name: value for name, value in self.static if name not in dynamic}
        object.__setattr__(self, "launcher", FastLaunch(
            self.kernel, self.grid, static, dynamic, pointers=len(self.tensors), num_warps=self.num_warps,
            num_stages=self.num_stages, extra=dict(self.extra)))

    def launch(self, tensors: dict, scale: float) -> None:
        """Launch with this call's tensors (by role), descriptors built over them, and ``scale``."""
        values = [tensors[role] for _, role in self.tensors]
        for (_, role, _, _), (cls, fields) in zip(self.descs, self.desc_templates):
            # A descriptor without its class's checks (the recipe checked strides and block for this
            # key; the key holds the pointers' alignment), its lists shared between calls: Triton's
            # launcher only reads them.
            desc = object.__new__(cls)
            desc.__dict__.update(fields)
            desc.base = tensors[role]
            values.append(desc)
        if self.scale_factor is not None:
            values.append(scale * self.scale_factor)
        self.launcher(*values)


@dataclass(frozen=True)
class _Recipe:
    choice: Choice
    launches: tuple
    workspace: tuple = ()  # (role, shape) of the fp32 buffers the split-KV path allocates


def _strides(role: str, shape: tuple, strides: tuple) -> dict:
    return {f"stride_{role}b": strides[0], f"stride_{role}h": strides[1], f"stride_{role}n": strides[2]}


@lru_cache(maxsize=1024)
def _recipe(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_stride: tuple, o_stride: tuple,
            dtype: torch.dtype, arch: int, sms: int, aligned: bool, causal: bool, config: Config | None,
            switches: tuple, split_kv: int | None, store_lse: bool, ws_rung: int | None = None) -> _Recipe:
    """Everything about a call's launches that does not depend on the data pointers (cached)."""
    on = dict(zip(SWITCH_NAMES, switches))
    B, Hq, Nq, D = q_shape
    _, Hkv, Nk, _ = k_shape
    e = torch.tensor([], dtype=dtype).element_size()
    tma_ok = arch >= 90 and aligned and all(_strides_tma_ok(s, e) for s in (q_stride, k_stride, v_stride, o_stride))
    choice = select(B, Hq, Hkv, Nq, Nk, D, dtype, causal, arch, sms, tma_ok=tma_ok, config=config,
                    split_kv=split_kv, store_lse=store_lse, ws_rung=ws_rung, **on)
    dot_precision = "ieee" if dtype == torch.float32 else "tf32"  # fp32 inputs get exact fp32 products
    layouts = {"q": (q_shape, q_stride), "k": (k_shape, k_stride), "v": (k_shape, v_stride), "o": (q_shape, o_stride)}
    if choice.path == "split":
        return _split_recipe(choice, q_shape, q_stride, k_shape, k_stride, v_stride, causal, dot_precision,
                             store_lse)
    config = choice.config
    if choice.path == "ws":
        grid, static, extra = hopper_ws.static_plan(B, Hq, Nq, D, q_stride, causal=causal, num_sms=sms,
                                                    group=Hq // Hkv, **config.ws_options(choice.ws_rung))
        block_n = config.block_n
        descs = (("q_desc", "q", (1, 1, hopper_ws.ROWS_PER_CONSUMER, D), True),
                 ("k_desc", "k", (1, 1, block_n, D), True), ("v_desc", "v", (1, 1, block_n, D), True),
                 ("o_desc", "o", (1, 1, hopper_ws.ROWS_PER_CONSUMER, D), True))
        launch = _LaunchRecipe(hopper_ws.ws_attention_kernel, grid, tuple(static.items()), (("Q", "q"),), descs,
                               num_warps=4, num_stages=1, extra=tuple(extra.items()),
                               desc_templates=_desc_templates(descs, layouts, dtype))
        return _Recipe(choice, (launch,))
    BM, BN, BD = config.block_m, config.block_n, padded_head_dim(D)
    use_tma = on["tma"] and tma_ok
    static = dict(H=Hq, N_Q=Nq, N_K=Nk, CAUSAL_OFFSET=Nk - Nq, D=D, BLOCK_D=BD, GROUP=Hq // Hkv,
                  BLOCK_M=BM, BLOCK_N=BN, CAUSAL=causal, CAUSAL_SKIP=on["causal_skip"],
                  EVEN_M=Nq % BM == 0, EVEN_N=Nk % BN == 0, USE_TMA=use_tma, EXP2=on["exp2"],
                  DOT_PRECISION=dot_precision, STORE_LSE=store_lse,
                  **_strides("q", q_shape, q_stride), **_strides("k", k_shape, k_stride),
                  **_strides("v", k_shape, v_stride), **_strides("o", q_shape, o_stride))
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
    tensors = (("Q", "q"), ("K", "k"), ("V", "v"), ("O", "o"))
    if store_lse:
        tensors += (("LSE", "lse"),)
    else:
        static["LSE"] = None
    launch = _LaunchRecipe(optimized_attention_kernel, (cdiv(Nq, BM), B * Hq), tuple(static.items()), tensors,
                           descs, config.num_warps, config.num_stages,
                           # exp2 folds log2(e) into the scale once; exp keeps the natural scale.
                           scale_factor=LOG2E if on["exp2"] else 1.0,
                           desc_templates=_desc_templates(descs, layouts, dtype))
    return _Recipe(choice, (launch,))


def _split_recipe(choice, q_shape, q_stride, k_shape, k_stride, v_stride, causal, dot_precision, store_lse):
    split = choice.config
    B, Hq, Nq, D = q_shape
    _, Hkv, Nk, _ = k_shape
    group = Hq // Hkv
    rows_total = B * Hq * Nq
    BD = padded_head_dim(D)
    first = _LaunchRecipe(
        decode.split_kv_attention_kernel, (split.splits, B * Hkv, cdiv(group * Nq, split.block_m)),
        tuple(dict(Hq=Hq, Hkv=Hkv, N_Q=Nq, N_K=Nk, CAUSAL_OFFSET=Nk - Nq, CHUNK=split.chunk, ROWS_TOTAL=rows_total,
                   GROUP=group, D=D, BLOCK_D=BD, BLOCK_M=split.block_m, BLOCK_N=split.block_n, CAUSAL=causal,
                   DOT_PRECISION=dot_precision, **_strides("q", q_shape, q_stride),
                   **_strides("k", k_shape, k_stride), **_strides("v", k_shape, v_stride)).items()),
        (("Q", "q"), ("K", "k"), ("V", "v"), ("O_PART", "o_part"), ("LSE_PART", "lse_part")), (),
        split.num_warps, split.num_stages)
    merge_static = dict(ROWS_TOTAL=rows_total, SPLITS=split.splits, D=D, BLOCK_D=BD, BLOCK_R=decode.MERGE_ROWS,
                        STORE_LSE=store_lse)
    merge_tensors = (("O_PART", "o_part"), ("LSE_PART", "lse_part"), ("O", "o"))
    if store_lse:
        merge_tensors += (("LSE", "lse"),)
    else:
        merge_static["LSE"] = None
    merge = _LaunchRecipe(decode.merge_splits_kernel, (cdiv(rows_total, decode.MERGE_ROWS),),
                          tuple(merge_static.items()), merge_tensors, (), 4, 1, scale_factor=None)
    o_shape, lse_shape = decode.workspace_shapes(B, Hq, Nq, D, split.splits)
    return _Recipe(choice, (first, merge), (("o_part", o_shape), ("lse_part", lse_shape)))


def _desc_template(shape: tuple, strides: tuple, dtype: torch.dtype, block: tuple, gluon: bool) -> tuple:
    """(descriptor class, every field but ``base``) of a TMA descriptor over a tensor of this shape,
    strides and dtype with tile ``block``: Triton's host ``TensorDescriptor``, or Gluon's (which
    also carries the shared-memory layout) for the warp-specialized kernel."""
    if gluon:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        extra = {"layout": hopper_ws.smem_layout(block, dtype)}
    else:
        from triton.tools.tensor_descriptor import TensorDescriptor
        extra = {}
    return TensorDescriptor, dict(shape=list(shape), strides=list(strides), block_shape=list(block), padding="zero",
                                  **extra)


def _desc_templates(descs: tuple, layouts: dict, dtype: torch.dtype) -> tuple:
    """``_desc_template`` for each (argument, role, block, gluon) of ``descs``; ``layouts`` maps a
    role to its tensor's (shape, strides)."""
    return tuple(_desc_template(*layouts[role], dtype, block, gluon) for _, role, block, gluon in descs)


def _descriptor(t: torch.Tensor, block: tuple, gluon: bool):
    """A TMA descriptor of ``t`` with tile ``block``, built without the descriptor classes' own
    checks: the recipe already checked the strides and block shape for this key, and the key holds
    the pointers' 16-byte alignment. Those checks were ~3/4 of the host path's time at sm_90."""
    cls, fields = _desc_template(t.shape, t.stride(), t.dtype, block, gluon)
    desc = object.__new__(cls)
    desc.__dict__.update(base=t, **fields)
    return desc


def _bind(recipe: _Recipe, tensors: dict, scale: float) -> list[Launch]:
    """The recipe's launches with this call's tensors, descriptors and scale filled in."""
    launches = []
    for r in recipe.launches:
        args = dict(r.static)
        for name, role in r.tensors:
            args[name] = tensors[role]
        for name, role, block, gluon in r.descs:
            args[name] = _descriptor(tensors[role], block, gluon)
        if r.scale_factor is not None:
            args["qk_scale"] = scale * r.scale_factor
        launches.append(Launch(r.kernel, r.grid, args, num_warps=r.num_warps, num_stages=r.num_stages,
                               extra=dict(r.extra)))
    return launches


def plan(q, k, v, o, *, causal: bool, scale: float, arch: int, config: Config | None = None, lse=None,
         split_kv: int | None = None, sms: int | None = None, tuned_tiles: bool = True, pipelining: bool = True,
         tma: bool = True, exp2: bool = True, causal_skip: bool = True,
         warp_specialization: bool = True, ws_rung: int | None = None) -> list[Launch]:
    """The launches that compute ``o`` (and, given an fp32 ``lse`` [B, Hq, Nq], the row
    log-sum-exps) for these tensors on an sm_``arch`` GPU with ``sms`` SMs (default: the device's,
    ``configs.DEFAULT_SMS`` off a GPU). The split-KV path allocates its fp32 partials here."""
    if sms is None:
        sms = sm_count(q.device)
    recipe = _recipe_for(q, k, v, o, lse, causal, arch, sms, config=config, split_kv=split_kv, tuned_tiles=tuned_tiles,
                         pipelining=pipelining, tma=tma, exp2=exp2, causal_skip=causal_skip,
                         warp_specialization=warp_specialization, ws_rung=ws_rung)
    return _bind(recipe, _call_tensors(recipe, q, k, v, o, lse), scale)


def _recipe_for(q, k, v, o, lse, causal: bool, arch: int, sms: int, config: Config | None = None,
                split_kv: int | None = None, tuned_tiles: bool = True, pipelining: bool = True, tma: bool = True,
                exp2: bool = True, causal_skip: bool = True, warp_specialization: bool = True,
                ws_rung: int | None = None) -> _Recipe:
    """The cached recipe for these tensors' shapes, strides, dtype and pointer alignment and these
    options (``plan``'s keywords)."""
    switches = (tuned_tiles, pipelining, tma, exp2, causal_skip, warp_specialization)
    # All four base pointers 16-byte aligned, in one test: their OR is then a multiple of 16 too
    # (a meta tensor's data_ptr() is 0).
    aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | o.data_ptr()) % 16 == 0
    return _recipe(tuple(q.shape), q.stride(), tuple(k.shape), k.stride(), v.stride(), o.stride(), q.dtype,
                   arch, sms, aligned, causal, config, switches, split_kv, lse is not None, ws_rung)


def _call_tensors(recipe: _Recipe, q, k, v, o, lse) -> dict:
    """The call's tensors by role, with the fp32 workspace the recipe asks for (split-KV) allocated."""
    tensors = {"q": q, "k": k, "v": v, "o": o, "lse": lse}
    for role, shape in recipe.workspace:
        tensors[role] = torch.empty(shape, dtype=torch.float32, device=q.device)
    return tensors


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
# The public entry point: a torch.autograd.Function when a gradient is wanted.
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


def _forward(q, k, v, causal: bool, scale: float, options: dict, store_lse: bool):
    """Run the forward: O, and the fp32 row log-sum-exp [B, Hq, Nq] (base 2) when ``store_lse``."""
    o = new_output(q)
    lse = None
    if store_lse:
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        if contract.poison_outputs:
            lse.fill_(float("nan"))
    # The lean path: the cached recipe's launches, each a FastLaunch that, after its first call,
    # hands the arguments straight to the compiled kernel's launcher (stages/launch.py).
    arch, sms = _arch_and_sms(q)
    recipe = _recipe_for(q, k, v, o, lse, causal, arch, sms, **options)
    tensors = _call_tensors(recipe, q, k, v, o, lse)
    for launch in recipe.launches:
        launch.launch(tensors, scale)
    return o, lse


class _Attention(torch.autograd.Function):
    """Stage C as an autograd op: the forward saves q, k, v, o and the row log-sum-exp; the
    backward recomputes P from them in the stage's own kernels (``backward.py``)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, options, deterministic):
        o, lse = _forward(q, k, v, causal, scale, options, store_lse=True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.deterministic, ctx.options = causal, scale, deterministic, options
        return o

    @staticmethod
    def backward(ctx, do):
        from .backward import attention_backward  # imported here: the forward does not need it

        q, k, v, o, lse = ctx.saved_tensors
        # The ablation switches that the backward has too (the forward's tiles and TMA do not carry
        # over: the backward has its own configs and reads through pointers).
        switches = {name: ctx.options[name] for name in ("tuned_tiles", "pipelining", "exp2", "causal_skip")}
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, causal=ctx.causal, scale=ctx.scale,
                                        deterministic=ctx.deterministic, **switches)
        return dq, dk, dv, None, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
              sm_scale: float | None = None, config: Config | None = None, tuned_tiles: bool = True,
              pipelining: bool = True, tma: bool = True, exp2: bool = True,
              causal_skip: bool = True, warp_specialization: bool = True, split_kv: int | None = None,
              deterministic: bool = False, ws_rung: int | None = None) -> torch.Tensor:
    """Optimized fused attention. q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]``; returns O
    ``[B, Hq, Nq, D]``, differentiable (``o.backward(do)`` runs ``backward.py``'s kernels).

    ``config`` forces a tile configuration (the tests run every candidate); the six switches turn
    single optimizations off for the ablation (see the module docstring); ``split_kv`` forces
    (n >= 2) or forbids (1) the split-KV path of ``decode.py`` (None: chosen from the work);
    ``deterministic`` asks the backward for a fixed summation order; ``ws_rung`` k (1..6) runs the
    warp-specialized kernel with rungs 1..k of its ladder on (``hopper_ws.LADDER``; sm_90, fp16/bf16,
    D 64/128, Nq == Nk, forward only: a ValueError elsewhere).
    """
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_options(split_kv, deterministic, ws_rung)
    options = dict(config=config, split_kv=split_kv, tuned_tiles=tuned_tiles, pipelining=pipelining, tma=tma,
                   exp2=exp2, causal_skip=causal_skip, warp_specialization=warp_specialization, ws_rung=ws_rung)
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        return _Attention.apply(q, k, v, causal, scale, options, deterministic)
    return _forward(q, k, v, causal, scale, options, store_lse=False)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                       sm_scale: float | None = None, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with its row log-sum-exp: (O, lse), lse fp32 ``[B, Hq, Nq]`` in base 2 of the
    scaled scores, ``lse_i = log2 Σ_j 2^(q_i·k_j · scale · log2 e)``; +inf for a row that sees no key.
    No autograd (this is what the training forward saves). ``options`` as for ``attention``."""
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    _check_options(options.get("split_kv"), False, options.get("ws_rung"))
    with torch.no_grad():
        return _forward(q, k, v, causal, scale, options, store_lse=True)


@compiles_without_interpreter
def compile(problem: Problem, arch: int, **switches) -> list[CompiledKernel]:
    """Compile for ``problem`` on an sm_``arch`` GPU without one; ``switches`` as for ``attention``
    (plus ``store_lse=True`` for the training forward)."""
    store_lse = switches.pop("store_lse", False)
    dtype = DTYPES[problem.dtype]
    q = torch.empty((problem.B, problem.H, problem.N, problem.D), dtype=dtype, device="meta")
    k, v = (torch.empty((problem.B, problem.Hkv, problem.Nk, problem.D), dtype=dtype, device="meta")
            for _ in range(2))
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device="meta") if store_lse else None
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
    e, row = p.element_bytes, p.D * p.element_bytes
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
