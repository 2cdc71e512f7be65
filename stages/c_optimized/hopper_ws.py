"""Stage C's Hopper path: warp specialization and softmax overlapped with the tensor cores.

Written in Gluon (``triton.experimental.gluon``), Triton's lower-level dialect, because Triton 3.6
cannot get here from ``tl`` code: its automatic warp specialization does not compile this loop for
sm_90, and its pipeliner waits for every ``Q·Kᵀ`` wgmma right after issuing it, so in ``tl`` a
warpgroup's softmax and its tensor cores can only take turns. Gluon lets the kernel say explicitly
what FlashAttention-3 does on Hopper.

The mechanisms form a ladder (``LADDER``; stage C's ``attention(..., ws_rung=k)`` runs rungs 1..k and
leaves the rest off, the ablation variants ``ws1-...`` to ``ws6-...`` measure each). Every rung is a
constexpr or a launch option of the one kernel below, not a copy of it. Below rung 1 is stage C's
``tl`` kernel (``warp_specialization=False``).

1. **Producer warp and mbarrier ring** (``_producer``, ``_issue_tile``). One *producer* warp only
   issues TMA copies of K and V tiles into a ring of ``STAGES`` shared-memory buffers; a *consumer*
   warpgroup (4 warps, 64 query rows) only computes. They talk through mbarriers: ``ready`` (the
   copy engine signals bytes arrived) and ``empty`` (every consumer is done reading a buffer; K and
   V separately, so the next K tile can start on its way as soon as ``Q·Kᵀ`` is done). The
   consumer issues ``S_j = Q·K_jᵀ`` and ``O += P_{j-1}·V_{j-1}`` together as asynchronous wgmma.
2. **Consumers share K/V, with register reallocation** (``CONSUMERS``, ``CONSUMER_REGS``,
   ``PRODUCER_REGS``). A work item is 64 query rows per consumer (128 or 192) of one (batch, head);
   every K/V tile is loaded once for all of them. The producer gives its registers away
   (``setmaxnreg``: 24 per thread) so each consumer can hold a 64×128 score tile and a 64×D
   accumulator without spilling; without it every warpgroup gets the same share.
3. **Ping-pong** (``_exp_turn``, ``_my_turn``). The consumers take turns so that one warpgroup's
   softmax lines up with another's wgmma. Two consumers take turns at the exponentials, as cuDNN
   does: a hardware named barrier in front of each tile's block of exponentials and an arrival on
   the other consumer's behind it, so one softmax at a time has the exponential unit, which at
   D = 64 is as loaded as the tensor cores. Three consumers pass a token through mbarriers (one
   per consumer) before issuing their matrix products: for them, turns at the exponentials
   measured slower (performance log: docs/performance-log/softmax.md, entry 24).
4. **Persistent grid and item order** (``_first_item``, ``_next_item``, ``_tile_coords``). One
   program per SM walks work items; causal items are taken in zigzag pairs of equal total length,
   so every program gets the same work. Items run into each other: an item boundary is one more
   turn of the tile loop, in which the next item's first ``Q·Kᵀ`` goes out with this item's last
   ``P·V``, and this item's O is stored as soon as that ``P·V`` is done. Each consumer has two Q
   buffers: the next item's Q lands in one (an item ahead, its rows asked of L2 earlier still)
   while this item reads the other. Without this, a program that ends its item lets the tensor
   cores idle while O is stored and the next program's first tiles arrive.
5. **Per-lane row sums** (``_thread_row_sums``, ``LANE_ROW_SUMS``). A thread keeps its own part of
   its rows' sums, added across the four lanes of a row once per item, when O is normalized,
   instead of two rounds of shuffles per row and tile that the end of each exponential turn
   waits for.
6. **Lazy rescale** (``_rescale_if_needed``, ``LAZY_RESCALE``), as FlashAttention-4 does: a row's
   running maximum (the one P is computed against) moves only when a tile raises it by more than
   2^8, so P stays <= 2^8 (fp16 and bf16 hold it) and on most tiles no row of a warp needs its part
   of O rescaled; one warp vote and a jump then replace D / 2 multiplies per thread and tile. The
   tuner also keeps the two-consumer D = 64 config in the eager form, which measured faster on
   causal problems.

Choices that hold on every rung, each for a reason the compiled code showed:

* **Signals come from one thread** with no warpgroup barrier in front (``_signal``).
* **No intra-warpgroup overlap.** A consumer waits for both of its products before its softmax; the
  softmax overlaps the *other* consumers' products (ping-pong). FlashAttention-3 also overlaps a
  warpgroup's softmax with its own ``P·V``; this kernel once asked for that (wait for ``S_j`` only,
  for ``P·V`` just before the rescale), but ptxas put the second wait among the first instructions
  of the softmax all the same, and forcing the overlap measured slower. The kernel writes what ran.
* **The softmax is one stretch of code.** From the mask to the conversion of P there is no branch
  (the lazy rescale's jump comes after it): the exponentials and the conversion of P for the next
  ``P·V`` (and the eager rescale of O) share one basic block, so ptxas slots the conversions in
  between the exponentials, whose unit (16 per clock per SM) is as loaded as the tensor cores at
  D = 64. Behind a branch, the conversions and the rescale ran after the last exponential, on
  every tile. The item boundary's store of O comes before the softmax, right after the products.
* **P never leaves registers**: the probabilities are converted in registers to the A-operand
  layout of the second wgmma.
* **O leaves through shared memory**: normalized in registers, written (``stmatrix``) into the
  item's Q buffer, which no ``Q·Kᵀ`` reads any more, and stored by one TMA copy, which also clips
  the rows past N; stored from registers it cost about twice the cycles per item.

Head dims. The kernel is written once for any tile width D (64, 128 or 256); what changes with D is
what fits. A head dim between them (:data:`PADDED_HEAD_DIMS`) runs at the next power of two, or, where
that is narrower, as a main part of half that power of two and a **tail** of its own
(:func:`tile_widths`: D 136 = 128 + 16, D 80 = 64 + 16): the tail's columns get their own TMA tiles,
shared-memory buffers and fp32 accumulator, ``Q·Kᵀ`` adds the tail's product to the same scores and
``P·V`` runs once more into the tail's accumulator, so the multiply-adds follow D in steps of 16 to
64 columns instead of jumping to the next power of two (Triton's tensors have power-of-two shapes,
so one tile cannot be 144 wide; two can). A consumer's 64 × D
fp32 accumulator takes D / 2 of its registers per thread: at D = 256 that is 128 of its 240, so the
score tile shrinks to 64 keys (32 registers; 128 keys would spill), and two consumers' Q tiles plus a
2-slot ring of 64-key K and V tiles take 192 KB of the 227 KB of shared memory, which leaves no room
for the persistent kernel's second Q buffer: at D = 256 it runs one program per item (FlashAttention-3
also takes smaller tiles at 256). Between the two, at 192 columns (D 168-192), 128-key tiles spill and
64-key ones pay a tile's barriers and turns for half the keys; a **key tail** (:func:`key_widths`) splits
a 96-key tile the same way the head dim's tail splits columns: 64 rows and 32 more in tiles of their
own, scores ``S`` and ``S2`` with one softmax over both, and a ``P·V`` for each part
(FlashAttention-3 takes 112 keys there; here it measured 3-7 % slower than 64-key tiles, so it is a
candidate the tuner races, not a default). The training forward stores each row's log-sum-exp beside O
(``_store_o``), so a training step runs this kernel too.

Everything else is stage C's algorithm: online softmax in base 2 with the scale folded in, causal
tiles above the diagonal never loaded, masks only on the tiles that need them (a runtime branch in
the one tile loop rather than a second copy of the loop: each consumer warpgroup runs its own
inlined copy of the code, and at D = 64 with three consumers the instruction cache was a limit).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

from ..contract import padded_head_dim
from ..launch import Launch

#: Query rows per consumer warpgroup: wgmma's M is 64 per warpgroup.
ROWS_PER_CONSUMER = 64

#: Programmatic dependent launch (on; ``LAB_WS_PDL=0`` turns it off): the kernel is launched with CUDA's
#: programmatic stream serialization, so its programs may be scheduled, allocate their shared memory
#: and set up their barriers while the kernel before it in the stream is still finishing; each waits
#: (``griddepcontrol.wait``) for that kernel's memory before it reads or writes any. Without a kernel
#: in flight before it (or without the launch attribute) the wait returns at once. Measured on an H100
#: with a copy kernel writing Q right before each call, as a projection does in a model: 1.8-3.4 µs
#: less per call on five model-suite cells; with an event between the two (the harness's timing) no change
#: (docs/performance-log/model-shapes.md, entry 86; ``experiments/ws_launch.py``).
PDL = os.environ.get("LAB_WS_PDL", "1") == "1"

#: A work item's first K/V tile starts its accumulator in the ``P·V`` product itself (``FRESH_PV``:
#: wgmma with ``use_acc`` false) instead of scaling what the accumulator held, the previous item's O
#: already stored, by alpha = 0 (``LAB_WS_FRESH_PV=0`` turns it off). Why it is on: a persistent program
#: runs several items one after another in the same registers, and NaN · 0 is NaN, so a head whose
#: output is NaN (a key with an infinite component) used to hand its NaN to every item its program ran
#: next: other heads, other sequences of the batch. Seen on an H100
#: (``test_gpu_ws_nan_in_one_head_stays_in_that_head``); starting afresh stops it. Its cost, timed in
#: turns on six model-suite cells of an H100: -0.6 % to +1.4 %, within the runs' spread
#: (docs/performance-log/model-shapes.md, entry 104). The tile's alpha is 1, so the lazy rescale's vote
#: jumps over the D / 2 multiplies per thread that every warp ran at each item's start; that did not
#: make the one-tile items of ``short`` faster.
FRESH_PV = os.environ.get("LAB_WS_FRESH_PV", "1") == "1"


@gluon.jit
def _wait_for_prior_grids():
    """``griddepcontrol.wait``: until the grids this one depends on have finished and their writes are
    visible (a no-op for a kernel launched without programmatic stream serialization)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _tile_coords(t, n_m, H, ROWS_PER_PROGRAM: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr):
    """Work item t -> (batch, head, first query row).

    Head-major order: consecutive items share a head, so programs running at the same time read the
    same K/V from L2. Causal items differ in length (row block r visits r + 1 K/V tiles), so within a
    head they are ordered for balance. One program per item: longest first, so the hardware
    scheduler ends the grid on short items. ``ZIGZAG`` (persistent grid): r = n_m-1, 0, n_m-2, 1, ...,
    so items 2u and 2u+1 are a long and a short row block whose lengths add up to n_m + 1 tiles, the
    same for every pair; a persistent program takes whole pairs (see ``_next_item``)."""
    bh = t // n_m
    w = t % n_m
    r = w
    if CAUSAL:
        if ZIGZAG:
            if w % 2 == 0:
                r = n_m - 1 - w // 2
            else:
                r = w // 2
        else:
            r = n_m - 1 - w
    return bh // H, bh % H, r * ROWS_PER_PROGRAM


@gluon.jit
def _next_item(t, total, ZIGZAG: gl.constexpr):
    """The next work item of this program after item t (``total`` or more: none left). A persistent
    program deals items round-robin with the others; under ``ZIGZAG`` it deals whole pairs (2u, 2u+1)."""
    if ZIGZAG:
        if (t % 2 == 0) & (t + 1 < total):
            t_next = t + 1
        else:
            t_next = (t // 2 + gl.num_programs(0)) * 2
    else:
        t_next = t + gl.num_programs(0)
    return t_next


@gluon.jit
def _first_item(ZIGZAG: gl.constexpr):
    if ZIGZAG:
        t = gl.program_id(0) * 2
    else:
        t = gl.program_id(0)
    return t


@gluon.jit
def _kv_range(start_m, N, ROWS_PER_PROGRAM: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """How many K/V tiles a work item visits, and how many of the first ones need no mask."""
    if CAUSAL:
        hi = gl.minimum(start_m + ROWS_PER_PROGRAM, N)
        n_unmasked = gl.minimum(start_m, N) // BLOCK_N  # tiles wholly left of the diagonal
    else:
        hi = N
        n_unmasked = N // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), n_unmasked


@gluon.jit
def _tiles_like(desc, n: gl.constexpr, stand_in):
    """``n`` shared-memory tiles shaped, typed and laid out as ``desc``'s TMA box; where ``desc`` is
    None (no head-dim tail), ``stand_in``, never read, so the kernel's code has one shape either way."""
    if desc is not None:
        tiles = gl.allocate_shared_memory(desc.dtype, [n] + desc.block_type.shape, desc.layout)
    else:
        tiles = stand_in
    return tiles


@gluon.jit
def _copy_in(desc, tail_desc, bar, buf, tail_buf, b, h, row, pred=True):
    """Ask the copy engine for the tile of (``b``, ``h``) from ``row`` on into ``buf``, and with a
    head-dim tail (``tail_desc`` not None, :func:`tile_widths`) its tail columns, from the main tile's
    width on, into ``tail_buf``; both copies count on ``bar``."""
    if tail_desc is not None:
        mbarrier.expect(bar, desc.block_type.nbytes + tail_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(tail_desc, [b, h, row, desc.block_type.shape[3]], bar, tail_buf, pred=pred)
    else:
        mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc, [b, h, row, 0], bar, buf, pred=pred)


@gluon.constexpr_function
def _tile_bytes(desc, tail_desc):
    """Bytes of one copy of ``desc``'s box and, with a head-dim tail, of ``tail_desc``'s."""
    return desc.block_type.nbytes + (0 if tail_desc is None else tail_desc.block_type.nbytes)


@gluon.jit
def _copy_kv(desc, tail_desc, keys_desc, keys_tail_desc, bar, buf, tail_buf, keys_buf, keys_tail_buf, b, h, row):
    """A K or V tile from ``row`` on: its first rows into ``buf`` (a head-dim tail's columns into
    ``tail_buf``, as :func:`_copy_in`), and with a key tail (``keys_desc`` not None, :func:`key_widths`)
    its last rows into ``keys_buf`` (their tail columns into ``keys_tail_buf``); every copy counts on
    ``bar``."""
    if keys_desc is not None:
        mbarrier.expect(bar, _tile_bytes(desc, tail_desc) + _tile_bytes(keys_desc, keys_tail_desc))
        MAIN: gl.constexpr = desc.block_type.shape[2]
        COLS: gl.constexpr = desc.block_type.shape[3]
        tma.async_copy_global_to_shared(desc, [b, h, row, 0], bar, buf)
        tma.async_copy_global_to_shared(keys_desc, [b, h, row + MAIN, 0], bar, keys_buf)
        if tail_desc is not None:
            tma.async_copy_global_to_shared(tail_desc, [b, h, row, COLS], bar, tail_buf)
            tma.async_copy_global_to_shared(keys_tail_desc, [b, h, row + MAIN, COLS], bar, keys_tail_buf)
    else:
        _copy_in(desc, tail_desc, bar, buf, tail_buf, b, h, row)


@gluon.jit
def _producer(k_desc, v_desc, ring, tail, keys, H, N, n_m, total, ROWS_PER_PROGRAM: gl.constexpr,
              BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, GROUP: gl.constexpr):
    """One warp: keep the K/V ring full. Waits until every consumer released a buffer, then asks the
    copy engine for the next K or V tile; each copy signals its ``ready`` barrier on arrival. K and V
    slots are released separately (K once its ``Q·Kᵀ`` is done, V a tile later, once its ``P·V`` is
    done), so the next K tile can start on its way half a tile earlier. The producer runs ahead into
    the next work item while the consumers finish the current one. Grouped-query attention: query
    head h reads K/V head h // GROUP (the descriptors span K and V's own Hkv heads). With a head-dim
    tail (``tail``, :func:`tile_widths`) each K and V tile comes as two copies, the main columns and
    the tail's, counted on one ``ready`` barrier; with a key tail (``keys``, :func:`key_widths`) as two
    more, its last rows. ``BLOCK_N``: the keys of a whole tile, both parts."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    _, k_tail_desc, v_tail_desc, _, _, k_tail_bufs, v_tail_bufs = tail
    k_keys_desc, v_keys_desc, k_keys_tail_desc, v_keys_tail_desc, k_keys_bufs, v_keys_bufs, k_kt_bufs, v_kt_bufs = keys
    STAGES: gl.constexpr = k_bufs.shape[0]
    it = 0
    t = _first_item(ZIGZAG)
    while t < total:
        b, h, start_m = _tile_coords(t, n_m, H, ROWS_PER_PROGRAM, CAUSAL, ZIGZAG)
        kv_h = h // GROUP
        n_tiles, n_unmasked = _kv_range(start_m, N, ROWS_PER_PROGRAM, BLOCK_N, CAUSAL)
        for j in range(n_tiles):
            s = it % STAGES
            # A fresh mbarrier counts as "phase 1 completed", so the first lap does not wait.
            lap = ((it // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(s), lap)
            _copy_kv(k_desc, k_tail_desc, k_keys_desc, k_keys_tail_desc, k_ready.index(s), k_bufs.index(s),
                     k_tail_bufs.index(s), k_keys_bufs.index(s), k_kt_bufs.index(s), b, kv_h, j * BLOCK_N)
            mbarrier.wait(v_empty.index(s), lap)
            _copy_kv(v_desc, v_tail_desc, v_keys_desc, v_keys_tail_desc, v_ready.index(s), v_bufs.index(s),
                     v_tail_bufs.index(s), v_keys_bufs.index(s), v_kt_bufs.index(s), b, kv_h, j * BLOCK_N)
            it += 1
        t = _next_item(t, total, ZIGZAG)


@gluon.jit
def _mask(S, cols, rows, N, CAUSAL: gl.constexpr):
    """Scores of keys past N, and (causal) of keys after the query, to -inf. Causal: one compare
    per score, against min(row, N - 1). Written as two conditions, ptxas kept a select for each:
    64 more instructions per thread and masked tile, on the exponentials' critical path (every
    masked score waits for its select)."""
    if CAUSAL:
        valid = gl.expand_dims(cols, 0) <= gl.expand_dims(gl.minimum(rows, N - 1), 1)
    else:
        valid = gl.expand_dims(cols, 0) < N
    return gl.where(valid, S, float("-inf"))


#: Hardware named barriers of the exponential turns: consumer WG waits on EXP_TURN_BARRIER + WG.
#: Triton 3.6's warp specialization uses the low ids (0 and 1 for the whole CTA and the default
#: partition, 2 and up for worker partitions' own warpgroup barriers); there are 16. A compiled-code
#: test checks in the SASS that every barrier Triton takes has a lower id.
EXP_TURN_BARRIER = gl.constexpr(12)


@gluon.jit
def _exp_turn(x, barrier, ARRIVE: gl.constexpr):
    """A ping-pong turn at the exponential unit, as cuDNN's loop takes it: ``bar.sync`` on the
    consumer's own named barrier (256 threads: its 128 wait, the previous consumer's 128 arrive) in
    front of the exponentials, ``bar.arrive`` on the next consumer's behind them. At D = 64 the
    exponentials (16 per clock per SM) take as long as a tile's two products on the tensor cores;
    taking turns there, one consumer's exponentials run at the unit's full rate while the other's
    wgmma run, instead of two softmaxes sharing the unit at half rate while the tensor cores idle.

    ``x`` (two values per thread, one for each of its rows) passes through the barrier, so what uses
    it stays on its side: the exponentials use the row maximum that passed the ``bar.sync``; the
    ``bar.arrive`` waits for both rows' sums, which need every exponential. ptxas moves a plain
    ``bar.arrive`` up among the exponentials (it sees no dependence on them); predicated on the sums
    it cannot (on the first row's part alone, ptxas moved two of the second row's exponentials past
    it). A sum is never negative and a NaN compares false, so the arrival always happens. A named
    barrier is one instruction, unlike an mbarrier wait (a polling loop, a branch that would split
    the softmax)."""
    bar = gl.full(x.shape, barrier, gl.int32, x.type.layout)
    if ARRIVE:
        y = gl.inline_asm_elementwise(
            "{\n\t.reg .pred neg;\n\tsetp.lt.f32 neg, $2, 0f00000000;\n\tsetp.lt.or.f32 neg, $3, 0f00000000, neg;"
            "\n\t@!neg bar.arrive $4, 256;\n\tmov.b32 $0, $2;\n\tmov.b32 $1, $3;\n\t}", "=r,=r,r,r,r,r", [x, bar],
            dtype=gl.float32, is_pure=False, pack=2)
    else:
        y = gl.inline_asm_elementwise("bar.sync $4, 256;\n\tmov.b32 $0, $2;\n\tmov.b32 $1, $3;",
                                      "=r,=r,r,r,r,r", [x, bar], dtype=gl.float32, is_pure=False, pack=2)
    return y


@gluon.jit
def _thread_row_sums(p):
    """Each thread's part of the row sums of a tile in the wgmma accumulator layout, [R, 4]: column
    c = 8k + 2q + e of a row is held by lane q of the row's four lanes (register pair element e),
    so summing over k and e adds up one thread's registers, with no shuffle between lanes.

    Why not ``gl.sum(p, axis=1)`` (``LANE_ROW_SUMS`` off, ladder rungs 1-4): it also adds the four
    lanes' parts with two rounds of shuffles per row and tile, and the exponential turn's
    ``bar.arrive`` waits for the sums, so the shuffles lengthen every turn. Adding the lanes once
    per item, when O is normalized, takes them out of the turn. The row maximum still needs the
    shuffles: every lane's P must use the same maximum."""
    R: gl.constexpr = p.shape[0]
    C: gl.constexpr = p.shape[1]
    x = p.reshape([R, C // 8, 4, 2]).permute((0, 2, 1, 3)).reshape([R, 4, C // 4])
    return gl.sum(x, axis=2)


@gluon.jit
def _softmax_step(S, S2, m_i, l_i, qk_scale, WG: gl.constexpr, CONSUMERS: gl.constexpr, EXP_TURNS: gl.constexpr,
                  LAZY_RESCALE: gl.constexpr, LANE_ROW_SUMS: gl.constexpr, KEYS: gl.constexpr):
    """Online-softmax update for one score tile (base 2, scale folded in): returns P (fp32), the
    rescale factor alpha for the running output, the new running max and the new running sums:
    each thread's part (``_thread_row_sums``) with ``LANE_ROW_SUMS``, else whole rows. With
    ``EXP_TURNS`` the exponentials are this consumer's ping-pong turn (``_exp_turn``). With a key
    tail (``KEYS``) the tile's scores are two tensors, ``S`` and ``S2`` (its last keys), one softmax
    over both: P comes back as two too. The rows are the same in both tensors' layouts (the same
    threads and registers hold them), so the conversions between them move nothing
    (``assert_trivial``)."""
    m_tile = gl.max(S, axis=1)
    if KEYS:
        m_tile = gl.maximum(m_tile, gl.convert_layout(gl.max(S2, axis=1), m_tile.type.layout, assert_trivial=True))
    m_max = gl.maximum(m_i, m_tile * qk_scale)
    if LAZY_RESCALE:
        # Keep the old maximum unless the new one is more than 2^RESCALE_THRESHOLD times larger:
        # P may then reach 2^8, which fp16 and bf16 hold, and O needs no rescale on most tiles.
        m_new = gl.where(m_max > m_i + RESCALE_THRESHOLD, m_max, m_i)
    else:
        m_new = m_max
    if EXP_TURNS:
        m_new = _exp_turn(m_new, EXP_TURN_BARRIER + WG, False)  # wait for the previous consumer's exponentials
    p = gl.exp2(S * qk_scale - gl.expand_dims(m_new, 1))
    p2 = p  # (without a key tail: never used)
    if KEYS:
        m_new2 = gl.convert_layout(m_new, gl.SliceLayout(1, S2.type.layout), assert_trivial=True)
        p2 = gl.exp2(S2 * qk_scale - gl.expand_dims(m_new2, 1))
    alpha = gl.exp2(m_i - m_new)
    if LANE_ROW_SUMS:
        # Same rows in the same threads and registers: no data moves (assert_trivial checks it).
        alpha_parts = gl.convert_layout(alpha, gl.SliceLayout(1, l_i.type.layout), assert_trivial=True)
        sums = _thread_row_sums(p)
        if KEYS:
            sums = sums + gl.convert_layout(_thread_row_sums(p2), sums.type.layout, assert_trivial=True)
        l_i = l_i * gl.expand_dims(alpha_parts, 1) + sums
    else:
        sums = gl.sum(p, axis=1)  # the four lanes of a row add up here, on every tile
        if KEYS:
            sums = sums + gl.convert_layout(gl.sum(p2, axis=1), sums.type.layout, assert_trivial=True)
        l_i = l_i * alpha + sums
    if EXP_TURNS:
        l_i = _exp_turn(l_i, EXP_TURN_BARRIER + (WG + 1) % CONSUMERS, True)  # the next consumer's turn
    return p, p2, alpha, m_new, l_i


@gluon.jit
def _signal(bar, pred=True):
    """One arrival on ``bar`` for the whole warpgroup, from one thread, with no warpgroup barrier.

    Written as ``expect(bar, 0)``: ``mbarrier.arrive.expect_tx`` with zero bytes is exactly an
    arrive. Triton 3.6 puts a ``bar.sync`` of the warpgroup in front of every ``mbarrier.arrive``
    (and in front of a barrier op that follows another one on the same allocation), which made
    three warpgroup barriers per K/V tile. None of them is needed where this is called: a slot is
    released only after ``warpgroup_mma_wait`` returned for the wgmma that read it, and a wgmma is
    one operation of the whole warpgroup; a ping-pong turn only orders issue, not data. CUTLASS's
    consumer release arrives the same way (one elected thread per warpgroup)."""
    mbarrier.expect(bar, 0, pred=pred)


@gluon.jit
def _my_turn(turn, k, WG: gl.constexpr, ISSUE_TURNS: gl.constexpr):
    """Ping-pong at wgmma issue (three consumers): consumer WG issues its k-th batch of wgmma only
    after the previous consumer issued its own, so one warpgroup's softmax lines up with another's
    matrix products. Each consumer waits on its own barrier ``turn`` and signals the next
    consumer's; they are separate allocations because Triton orders barrier ops on one allocation
    with a ``bar.sync``."""
    if ISSUE_TURNS:
        if WG == 0:
            mbarrier.wait(turn, (k & 1) ^ 1)  # consumer 0 goes first
        else:
            mbarrier.wait(turn, k & 1)


@gluon.jit
def _pass_turn(next_turn, ISSUE_TURNS: gl.constexpr):
    if ISSUE_TURNS:
        _signal(next_turn)


@gluon.jit
def _issue_tile(cur, acc, acc_t, p_prev, p2_prev, q_tile, q_tail, ring, tail, keys, turns, s_layout: gl.constexpr,
                s2_layout: gl.constexpr, WG: gl.constexpr, ISSUE_TURNS: gl.constexpr, pv_acc=True):
    """K/V tile ``cur`` (ring slot / ping-pong batch): ``S = Q·K_jᵀ`` and ``acc += P_prev·V`` (the
    previous tile's, which at an item boundary is the previous item's last) issued together (with
    three consumers, as one ping-pong turn); returns both, done. Each slot is released as soon as
    its product is done. With a head-dim tail (``tail``), ``S`` adds the tail columns' product
    ``Q_tail·K_tailᵀ`` and the tail's accumulator ``acc_t`` its own ``P_prev·V_tail``: four
    products, the same two turns. With a key tail (``keys``, :func:`key_widths`) the tile's last keys
    have scores of their own, ``S2`` (returned beside ``S``; ``S`` itself without one), and their
    probabilities ``p2_prev`` a ``P·V`` of their own into the same accumulators: twice the products,
    the same turns. ``pv_acc``: whether ``P_prev·V`` adds to the accumulators (False, a runtime value with
    :data:`FRESH_PV`: ``P_prev`` is an item's first tile, and the product starts them afresh)."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    k_tail_desc = tail[1]
    k_tail_bufs, v_tail_bufs = tail[5], tail[6]
    KEYS: gl.constexpr = keys[0] is not None
    TAIL: gl.constexpr = k_tail_desc is not None
    k_keys_bufs, v_keys_bufs, k_kt_bufs, v_kt_bufs = keys[4], keys[5], keys[6], keys[7]
    KT: gl.constexpr = k_keys_bufs.shape[3]
    my_turn, next_turn = turns
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    D: gl.constexpr = k_bufs.shape[4]
    ROWS: gl.constexpr = q_tile.shape[0]
    s = cur % STAGES
    # The previous tile's V; at the program's first tile P is all zeros and V_0 stands in (any
    # finite tile would do), so that tile too is one batch of two products.
    vp = gl.maximum(cur - 1, 0)
    sp = vp % STAGES
    mbarrier.wait(k_ready.index(s), (cur // STAGES) & 1)
    _my_turn(my_turn, cur, WG, ISSUE_TURNS)
    DT: gl.constexpr = k_tail_bufs.shape[4]
    S = warpgroup_mma(q_tile, k_bufs.index(s).reshape([BLOCK_N, D]).permute((1, 0)),
                      gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    if TAIL:
        S = warpgroup_mma(q_tail, k_tail_bufs.index(s).reshape([BLOCK_N, DT]).permute((1, 0)), S, is_async=True)
    S2 = S  # (without a key tail: never used)
    if KEYS:  # the tile's last keys
        S2 = warpgroup_mma(q_tile, k_keys_bufs.index(s).reshape([KT, D]).permute((1, 0)),
                           gl.zeros([ROWS, KT], gl.float32, s2_layout), use_acc=False, is_async=True)
        if TAIL:
            S2 = warpgroup_mma(q_tail, k_kt_bufs.index(s).reshape([KT, DT]).permute((1, 0)), S2, is_async=True)
    mbarrier.wait(v_ready.index(sp), (vp // STAGES) & 1)
    acc = warpgroup_mma(p_prev, v_bufs.index(sp).reshape([BLOCK_N, D]), acc, use_acc=pv_acc, is_async=True)
    if KEYS:
        acc = warpgroup_mma(p2_prev, v_keys_bufs.index(sp).reshape([KT, D]), acc, is_async=True)
    t_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_t.type.layout, k_width=2)
    p_tail = p_prev  # (without a head-dim tail: never used)
    p2_tail = p2_prev
    if TAIL:
        p_tail = gl.convert_layout(p_prev, t_op)
        acc_t = warpgroup_mma(p_tail, v_tail_bufs.index(sp).reshape([BLOCK_N, DT]), acc_t, use_acc=pv_acc,
                              is_async=True)
        if KEYS:
            p2_tail = gl.convert_layout(p2_prev, t_op)
            acc_t = warpgroup_mma(p2_tail, v_kt_bufs.index(sp).reshape([KT, DT]), acc_t, is_async=True)
    _pass_turn(next_turn, ISSUE_TURNS)
    # wgmma groups retire in order: with the P·V products (one per part of the tile, per head-dim part)
    # still allowed outstanding, every product of the scores is done; the P·V ones may not be.
    AFTER: gl.constexpr = _pv_products(KEYS, TAIL)
    if KEYS:
        S, S2 = warpgroup_mma_wait(AFTER, deps=(S, S2))
    else:
        S = warpgroup_mma_wait(AFTER, deps=(S, ))
    _signal(k_empty.index(s))  # this consumer is done with K in slot cur
    if TAIL:
        if KEYS:
            acc, acc_t, p_prev, p_tail, p2_prev, p2_tail = warpgroup_mma_wait(
                0, deps=(acc, acc_t, p_prev, p_tail, p2_prev, p2_tail))
        else:
            acc, acc_t, p_prev, p_tail = warpgroup_mma_wait(0, deps=(acc, acc_t, p_prev, p_tail))
    else:
        if KEYS:
            acc, p_prev, p2_prev = warpgroup_mma_wait(0, deps=(acc, p_prev, p2_prev))
        else:
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    _signal(v_empty.index(sp), cur > 0)  # ... and with V in slot cur-1 (predicated: no branch)
    return S, S2, acc, acc_t


@gluon.constexpr_function
def _pv_products(keys, tail):
    """The ``P·V`` wgmma a tile issues: one per part of its keys, per part of the head dim."""
    return (2 if keys else 1) * (2 if tail else 1)


@gluon.jit
def _softmax_tile(S, S2, j, n_unmasked, acc, acc_t, m_i, l_i, rows, N, qk_scale, dtype: gl.constexpr,
                  o_layout: gl.constexpr, p_layout: gl.constexpr, NEED_MASK: gl.constexpr, CAUSAL: gl.constexpr,
                  WG: gl.constexpr, CONSUMERS: gl.constexpr, EXP_TURNS: gl.constexpr, LAZY_RESCALE: gl.constexpr,
                  LANE_ROW_SUMS: gl.constexpr, TAIL: gl.constexpr, KEYS: gl.constexpr, TILE_N: gl.constexpr,
                  FRESH_PV: gl.constexpr = False):
    """The softmax of score tile j, P converted for the next turn's ``P·V``, and the accumulator
    rescaled: one stretch of code with no branch in it after the mask, so ptxas can slot the
    conversions (and the eager rescale) in between the exponentials, whose unit is the bottleneck at
    D = 64. The lazy rescale comes after that stretch, behind its warp vote and jump. With a key tail
    (``KEYS``) the tile's keys are ``S`` and then ``S2``, ``TILE_N`` in all, and both P come back.
    ``FRESH_PV``: at tile 0 the accumulator is left as it is (alpha 1), for the next ``P·V`` overwrites it."""
    if NEED_MASK:
        if j >= n_unmasked:  # a runtime branch, not a second copy of the loop: less code to fetch
            BLOCK_N: gl.constexpr = S.shape[1]
            cols = j * TILE_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S.type.layout))
            S = _mask(S, cols, rows, N, CAUSAL)
            if KEYS:
                KT: gl.constexpr = S2.shape[1]
                cols2 = j * TILE_N + BLOCK_N + gl.arange(0, KT, layout=gl.SliceLayout(0, S2.type.layout))
                rows2 = gl.convert_layout(rows, gl.SliceLayout(1, S2.type.layout), assert_trivial=True)
                S2 = _mask(S2, cols2, rows2, N, CAUSAL)
    p, p2, alpha, m_i, l_i = _softmax_step(S, S2, m_i, l_i, qk_scale, WG, CONSUMERS, EXP_TURNS, LAZY_RESCALE,
                                           LANE_ROW_SUMS, KEYS)
    if FRESH_PV:  # (the running sums started at 0, so alpha's value there changed nothing but O)
        alpha = gl.where(j == 0, 1.0, alpha)
    p_next = gl.convert_layout(p.to(dtype), p_layout)
    p2_next = p_next  # (without a key tail: never used)
    if KEYS:
        p2_next = gl.convert_layout(p2.to(dtype), p_layout)
    t_layout: gl.constexpr = acc_t.type.layout
    if LAZY_RESCALE:
        acc = _rescale_if_needed(acc, alpha, o_layout)
        if TAIL:
            acc_t = _rescale_if_needed(acc_t, alpha, t_layout)
    else:
        acc = _rescale(acc, alpha, o_layout)
        if TAIL:
            acc_t = _rescale(acc_t, alpha, t_layout)
    return acc, acc_t, p_next, p2_next, m_i, l_i


@gluon.jit
def _row_factor(alpha, o_layout: gl.constexpr):
    """Each row's alpha as a column that broadcasts over the accumulator's D values."""
    return gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)


@gluon.jit
def _rescale(acc, alpha, o_layout: gl.constexpr):
    return acc * _row_factor(alpha, o_layout)


#: The lazy rescale's threshold, log2 units: the running maximum used for P moves only when a tile's
#: maximum exceeds it by more than this (FlashAttention-4 uses 8.0), so P <= 2^8.
RESCALE_THRESHOLD = gl.constexpr(8.0)


@gluon.constexpr_function
def _rescale_if_needed_asm(n):
    """PTX for one thread's n accumulator values: if any of the warp's rows has alpha < 1, multiply
    every value by its row's alpha, else jump over the multiplies. Operands: $0..$n-1 the results,
    tied to the inputs $n..$2n-1 (so the jump leaves them as they were), $2n..$3n-1 each value's
    alpha. In the wgmma accumulator layout a thread's values go (row r: 2 columns, row r + 8:
    2 columns) per 8 columns, so values 0 and 2 carry the alphas of its two rows."""
    lines = ["{", ".reg .pred need;", f"setp.lt.f32 need, ${2 * n}, 0f3F800000;",
             f"setp.lt.or.f32 need, ${2 * n + 2}, 0f3F800000, need;", "vote.sync.any.pred need, need, 0xffffffff;",
             "@!need bra.uni SKIP_RESCALE;"]
    lines += [f"mul.f32 ${i}, ${n + i}, ${2 * n + i};" for i in range(n)]
    lines += ["SKIP_RESCALE:", "}"]
    return "\n\t".join(lines)


@gluon.constexpr_function
def _rescale_if_needed_constraints(n):
    return ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)


@gluon.jit
def _rescale_if_needed(acc, alpha, o_layout: gl.constexpr):
    """``_rescale``, skipped by every warp none of whose rows changed its maximum (the lazy rescale:
    most tiles). One warp-wide vote and a jump instead of D / 2 multiplies per thread and tile."""
    N_PER_THREAD: gl.constexpr = acc.shape[0] * acc.shape[1] // 128
    acc_b, a_b = gl.broadcast(acc, _row_factor(alpha, o_layout))
    return gl.inline_asm_elementwise(_rescale_if_needed_asm(N_PER_THREAD),
                                     _rescale_if_needed_constraints(N_PER_THREAD), [acc_b, a_b], dtype=gl.float32,
                                     is_pure=False, pack=N_PER_THREAD)


@gluon.jit
def _fetch_q(q_desc, q_bufs, q_bars, buf, b, h, row, pred, tail):
    """Ask the copy engine for one consumer's 64 Q rows into its Q buffer ``buf`` (with a head-dim
    tail, its columns too, into the same buffer index of the tail's Q buffers)."""
    _copy_in(q_desc, tail[0], q_bars.index(buf), q_bufs.index(buf), tail[4].index(buf), b, h, row, pred)


@gluon.jit
def _fetch_next_q(q_desc, q_bufs, q_bars, buf, b, h, row, more, tail):
    """Once the copy engine has read the previous item's O out of ``buf`` (stored at this item's
    tile 0), the buffer takes the next item's Q, an item ahead of its use. (With one Q buffer, one
    item per program, ``more`` is false and nothing is fetched.)"""
    tma.store_wait(0)
    _fetch_q(q_desc, q_bufs, q_bars, buf, b, h, row, more, tail)


@gluon.jit
def _store_o(acc, acc_t, m_i, l_i, o_desc, LSE, buf, tail, nb, t, n_m, H, N, o_layout: gl.constexpr, WG: gl.constexpr,
             CONSUMERS: gl.constexpr, CAUSAL: gl.constexpr, ZIGZAG: gl.constexpr, LANE_ROW_SUMS: gl.constexpr):
    """Normalize O of work item t and send it out through shared buffer ``buf``: ``stmatrix`` from the accumulator
    layout, then one TMA copy, which also clips rows past N. Stored from registers straight to
    global memory instead, each warp instruction writes 4 bytes into each of 8 rows: that took
    ~3,300 cycles per item at D = 128 against ~1,800 this way (clock64 trace on the H200).

    The training forward (``LSE`` not None, fp32 [B, H, N]) also stores each row's log-sum-exp in
    base 2 of the scaled scores, m + log2(l), what the backward recomputes P from. Under the lazy
    rescale m is the maximum P was computed against, not always the row's true maximum; l summed
    2^(s - m) against that same m, so m + log2(l) is the same number. Every row of a square
    problem sees at least one key (causal: its own), so l > 0."""
    ROWS: gl.constexpr = acc.shape[0]
    D: gl.constexpr = acc.shape[1]
    b, h, start_m = _tile_coords(t, n_m, H, ROWS * CONSUMERS, CAUSAL, ZIGZAG)
    if LANE_ROW_SUMS:
        l_row = gl.sum(l_i, axis=1)  # the four lanes' parts of each row sum (_thread_row_sums), added once per item
    else:
        l_row = l_i
    out = acc / gl.expand_dims(gl.convert_layout(l_row, gl.SliceLayout(1, o_layout)), 1)
    o_tail_desc = tail[3]
    if o_tail_desc is not None:  # the head-dim tail's columns, out through the tail's Q buffer nb
        DT: gl.constexpr = acc_t.shape[1]
        t_layout: gl.constexpr = acc_t.type.layout
        out_t = acc_t / gl.expand_dims(gl.convert_layout(l_row, gl.SliceLayout(1, t_layout)), 1)
        tail_buf = tail[4].index(nb)
        tail_buf.reshape([ROWS, DT]).store(out_t.to(o_tail_desc.dtype))
    if LSE is not None:
        lse = m_i + gl.log2(gl.convert_layout(l_row, m_i.type.layout))
        rows = start_m + WG * ROWS + gl.arange(0, ROWS, layout=m_i.type.layout)
        gl.store(LSE + (b * H + h).to(gl.int64) * N + rows, lse, mask=rows < N)
    buf.reshape([ROWS, D]).store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, start_m + WG * ROWS, 0], buf)
    if o_tail_desc is not None:
        tma.async_copy_shared_to_global(o_tail_desc, [b, h, start_m + WG * ROWS, D], tail_buf)


@gluon.jit
def _prefetch_q_to_l2(Q, stride_qb, stride_qh, stride_qn, b, h, row0, N, ROWS: gl.constexpr, D: gl.constexpr):
    """Ask L2 for one consumer's Q rows of the next item (one 128-byte line per thread), so the TMA
    copy of them, one tile into this item, hits L2."""
    LINES_PER_ROW: gl.constexpr = D * 2 // 128
    line = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0])) % (ROWS * LINES_PER_ROW)
    row = gl.minimum(row0 + line // LINES_PER_ROW, N - 1)
    ptrs = (Q + b.to(gl.int64) * stride_qb + h.to(gl.int64) * stride_qh + row.to(gl.int64) * stride_qn
            + (line % LINES_PER_ROW) * 64)
    gl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _consumer(args, tail, keys, turns, WG: gl.constexpr, CONSUMERS: gl.constexpr, ISSUE_TURNS: gl.constexpr,
              EXP_TURNS: gl.constexpr, CAUSAL: gl.constexpr, EVEN_N: gl.constexpr, ZIGZAG: gl.constexpr,
              PREFETCH_L2: gl.constexpr, LAZY_RESCALE: gl.constexpr, LANE_ROW_SUMS: gl.constexpr,
              FRESH_PV: gl.constexpr = False):
    """One warpgroup: for each work item of this program, the whole flash loop for its 64 rows.
    ``args`` is the same for every consumer; ``WG`` is this consumer's index (its Q buffers are
    ``q_bufs[WG·Q_BUFS ...]``), ``turns`` its ping-pong barrier and the next consumer's.

    Work items run into each other: the next item's first ``Q·Kᵀ`` is issued together with this
    item's last ``P·V`` (one more turn of the tile loop), and this item's O is normalized and stored
    as soon as that ``P·V`` is done, before the next item's first softmax. A persistent program
    therefore has two Q buffers per consumer: the next item's Q lands in one while this item reads
    the other, and this item's O leaves through its own buffer once its last ``Q·Kᵀ`` is done. Ring
    slot and ping-pong batch ``cur`` count the K/V tiles this consumer has started, over all its items.
    With three Q buffers (``deep_q``) the buffer an O leaves through takes the Q of the item after
    next, so each Q has a whole item's time to arrive. With a key tail (``keys``, :func:`key_widths`) a
    K/V tile is two parts, ``BLOCK_N`` keys and ``KT`` more, ``TILE_N`` in all. With ``FRESH_PV``
    (:data:`FRESH_PV`) ``pv_acc`` says whether the pending ``P·V`` adds to the accumulator: not when its
    P is an item's first tile."""
    q_desc, o_desc, Q, LSE, stride_qb, stride_qh, stride_qn, q_bufs, q_bars, ring, H, N, n_m, total, qk_scale = args
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    my_turn, next_turn = turns
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    D: gl.constexpr = k_bufs.shape[4]
    Q_BUFS: gl.constexpr = q_bufs.shape[0] // CONSUMERS
    ROWS: gl.constexpr = q_bufs.shape[3]
    Q0: gl.constexpr = WG * Q_BUFS  # this consumer's first Q buffer
    ROWS_PER_PROGRAM: gl.constexpr = ROWS * CONSUMERS
    NEED_MASK: gl.constexpr = CAUSAL or not EVEN_N
    KEYS: gl.constexpr = keys[0] is not None
    KT: gl.constexpr = keys[4].shape[3]  # (without a key tail, a stand-in's: never used)
    TILE_N: gl.constexpr = _tile_keys(BLOCK_N, KT, KEYS)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    s2_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, KT, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    # A head-dim tail (tile_widths): its columns' Q buffers and accumulator beside the main ones.
    TAIL: gl.constexpr = tail[0] is not None
    q_tail_bufs = tail[4]
    DT: gl.constexpr = q_tail_bufs.shape[4]
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DT, 16])

    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    if LANE_ROW_SUMS:
        l_i = _thread_row_sums(gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout))  # [ROWS, 4]: each lane's part
    else:
        l_i = gl.zeros([ROWS], gl.float32, row_layout)
    p_prev = gl.zeros([ROWS, BLOCK_N], q_desc.dtype, p_layout)
    p2_prev = gl.zeros([ROWS, KT], q_desc.dtype, p_layout)  # (without a key tail, never read: compiled away)
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    acc_t = gl.zeros([ROWS, DT], gl.float32, t_layout)  # (without a tail, never read: compiled away)
    if EXP_TURNS:
        if WG == CONSUMERS - 1:  # consumer 0 takes the first turn at the exponentials
            l_i = _exp_turn(l_i, EXP_TURN_BARRIER, True)

    # The program's first item (the grid gives every program at least one), and with three Q
    # buffers its second one too: from then on each item fetches the Q of the item Q_BUFS - 1 ahead.
    t = _first_item(ZIGZAG)
    b0, h0, start0 = _tile_coords(t, n_m, H, ROWS_PER_PROGRAM, CAUSAL, ZIGZAG)
    _fetch_q(q_desc, q_bufs, q_bars, Q0, b0, h0, start0 + WG * ROWS, True, tail)
    if Q_BUFS == 3:
        t1 = _next_item(t, total, ZIGZAG)
        b1, h1, start1 = _tile_coords(t1, n_m, H, ROWS_PER_PROGRAM, CAUSAL, ZIGZAG)
        _fetch_q(q_desc, q_bufs, q_bars, Q0 + 1, b1, h1, start1 + WG * ROWS, t1 < total, tail)
    # The previous item (none before the first). Not `t_prev = t`: Triton's front end decides which
    # names a loop carries by running the body once on the values from before the loop, and a name
    # that starts out as the same value as `t` and is set to `t` in the body looks unchanged; it
    # would silently stay the first item (every later O stored over the first item's).
    t_prev = -1
    pv_acc = True  # (with FRESH_PV, set to a runtime value per tile: the program's first P is all zeros anyway)
    it = 0    # K/V tiles of the earlier items
    item = 0  # items before this one: this item's Q is in buffer Q0 + item % Q_BUFS
    while t < total:
        start_m = _tile_coords(t, n_m, H, ROWS_PER_PROGRAM, CAUSAL, ZIGZAG)[2]
        t_next = _next_item(t, total, ZIGZAG)
        # The item whose Q this item fetches: the next one, or with three buffers the one after it.
        t_ahead = t_next
        if Q_BUFS == 3:
            t_ahead = _next_item(t_next, total, ZIGZAG)
        b_ahead, h_ahead, start_ahead = _tile_coords(t_ahead, n_m, H, ROWS_PER_PROGRAM, CAUSAL, ZIGZAG)
        more = t_ahead < total
        if PREFETCH_L2:
            if more:
                _prefetch_q_to_l2(Q, stride_qb, stride_qh, stride_qn, b_ahead, h_ahead, start_ahead + WG * ROWS, N,
                                  ROWS, D)
        row0 = start_m + WG * ROWS
        n_tiles, n_unmasked = _kv_range(start_m, N, ROWS_PER_PROGRAM, TILE_N, CAUSAL)
        rows = row0 + gl.arange(0, ROWS, layout=row_layout)
        cb = Q0 + item % Q_BUFS  # this item's Q buffer
        # The previous item's buffer: its O goes out through it, then it takes t_ahead's Q.
        nb = Q0 + (item + Q_BUFS - 1) % Q_BUFS
        q_tile = q_bufs.index(cb).reshape([ROWS, D])
        q_tail = q_tail_bufs.index(cb).reshape([ROWS, DT])
        mbarrier.wait(q_bars.index(cb), (item // Q_BUFS) & 1)
        for j in range(0, n_tiles):
            if j == 1:  # after tile 0's softmax; a one-tile item does this after the loop
                _fetch_next_q(q_desc, q_bufs, q_bars, nb, b_ahead, h_ahead, start_ahead + WG * ROWS, more, tail)
            S, S2, acc, acc_t = _issue_tile(it + j, acc, acc_t, p_prev, p2_prev, q_tile, q_tail, ring, tail, keys,
                                            turns, s_layout, s2_layout, WG, ISSUE_TURNS, pv_acc)
            if Q_BUFS > 1:  # (one item per program: nothing before it to store)
                if j == 0:
                    if it > 0:  # acc is the previous item's finished O: out through its Q buffer
                        _store_o(acc, acc_t, m_i, l_i, o_desc, LSE, q_bufs.index(nb), tail, nb, t_prev, n_m, H, N,
                                 o_layout, WG, CONSUMERS, CAUSAL, ZIGZAG, LANE_ROW_SUMS)
            # Tile 0 starts a fresh softmax. The accumulator starts over in its P·V (FRESH_PV), or else by alpha = 0.
            m_in = gl.where(j == 0, float("-inf"), m_i)
            l_in = gl.where(j == 0, 0.0, l_i)
            acc, acc_t, p_prev, p2_prev, m_i, l_i = _softmax_tile(
                S, S2, j, n_unmasked, acc, acc_t, m_in, l_in, rows, N, qk_scale, q_desc.dtype, o_layout, p_layout,
                NEED_MASK, CAUSAL, WG, CONSUMERS, EXP_TURNS, LAZY_RESCALE, LANE_ROW_SUMS, TAIL, KEYS, TILE_N,
                FRESH_PV)
            if FRESH_PV:
                pv_acc = j != 0  # (the P just formed: an item's first tile starts the accumulator afresh)
        if n_tiles == 1:
            _fetch_next_q(q_desc, q_bufs, q_bars, nb, b_ahead, h_ahead, start_ahead + WG * ROWS, more, tail)
        it += n_tiles
        item += 1
        t_prev = t
        t = t_next

    # The program's last P·V, alone, and the last O.
    sl = (it - 1) % STAGES
    mbarrier.wait(v_ready.index(sl), ((it - 1) // STAGES) & 1)
    _my_turn(my_turn, it, WG, ISSUE_TURNS)
    acc = warpgroup_mma(p_prev, v_bufs.index(sl).reshape([BLOCK_N, D]), acc, use_acc=pv_acc, is_async=True)
    if KEYS:
        acc = warpgroup_mma(p2_prev, keys[5].index(sl).reshape([KT, D]), acc, is_async=True)
    if TAIL:
        v_tail_bufs = tail[6]
        t_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=t_layout, k_width=2)
        p_tail = gl.convert_layout(p_prev, t_op)
        acc_t = warpgroup_mma(p_tail, v_tail_bufs.index(sl).reshape([BLOCK_N, DT]), acc_t, use_acc=pv_acc,
                              is_async=True)
        if KEYS:
            p2_tail = gl.convert_layout(p2_prev, t_op)
            acc_t = warpgroup_mma(p2_tail, keys[7].index(sl).reshape([KT, DT]), acc_t, is_async=True)
        _pass_turn(next_turn, ISSUE_TURNS)
        acc, acc_t = warpgroup_mma_wait(0, deps=(acc, acc_t))
    else:
        _pass_turn(next_turn, ISSUE_TURNS)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
    _signal(v_empty.index(sl))
    last = Q0 + (item - 1) % Q_BUFS
    _store_o(acc, acc_t, m_i, l_i, o_desc, LSE, q_bufs.index(last), tail, last, t_prev, n_m, H, N, o_layout, WG,
             CONSUMERS, CAUSAL, ZIGZAG, LANE_ROW_SUMS)
    tma.store_wait(0)


@gluon.constexpr_function
def _tile_keys(block_n, key_tail, keys):
    """The keys of a whole K/V tile: its first part's, and with a key tail that part's too."""
    return block_n + key_tail if keys else block_n


@gluon.jit(do_not_specialize=["H", "N", "n_m", "total"])
def ws_attention_kernel(q_desc, k_desc, v_desc, o_desc, q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc,
                        k_keys_desc, v_keys_desc, k_keys_tail_desc, v_keys_tail_desc, Q, LSE, stride_qb,
                        stride_qh, stride_qn, qk_scale, H, N, n_m, total,
                        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
                        ISSUE_TURNS: gl.constexpr, EXP_TURNS: gl.constexpr, CAUSAL: gl.constexpr,
                        EVEN_N: gl.constexpr, ZIGZAG: gl.constexpr, Q_BUFS: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PREFETCH_L2: gl.constexpr = True,
                        LAZY_RESCALE: gl.constexpr = True, GROUP: gl.constexpr = 1,
                        LANE_ROW_SUMS: gl.constexpr = True, PRODUCER_REGS: gl.constexpr = 24,
                        PDL: gl.constexpr = False, FRESH_PV: gl.constexpr = False):
    """Grid: one program per SM (persistent, ``Q_BUFS`` = 2) or per work item (``Q_BUFS`` = 1); work
    item t covers ``CONSUMERS × 64`` query rows of one (batch, query head), ``CONSUMERS`` 1, 2 or 3;
    ``GROUP`` query heads share a K/V head. Nq = Nk only (the causal mask and the tile ranges assume
    the square). ``CONSUMER_REGS`` and ``PRODUCER_REGS``: registers per thread each worker
    partition asks for (``setmaxnreg``); the default partition (consumer 0) gets what is left of the
    64K. ``LSE``: None (inference), or fp32 [B, H, N] for the rows' log-sum-exps (the training
    forward, ``_store_o``). ``q_tail_desc`` ... ``o_tail_desc``: None, or the head-dim tail's
    descriptors (:func:`tile_widths`: the columns from the main tiles' width on, in narrower tiles
    of their own). ``k_keys_desc`` ... ``v_keys_tail_desc``: None, or a key tail's (:func:`key_widths`:
    a K/V tile of ``BLOCK_N`` keys as two parts, its last rows in tiles of their own, main columns and
    tail columns). See the module docstring."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    ROWS_PER_PROGRAM: gl.constexpr = ROWS * CONSUMERS
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * Q_BUFS] + q_desc.block_type.shape, q_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [CONSUMERS * Q_BUFS, 1], mbarrier.MBarrierLayout())
    # One ping-pong barrier per consumer, each its own allocation (see _my_turn); turn2 is unused
    # with two consumers (8 bytes).
    turn0 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn1 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    turn2 = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(CONSUMERS * Q_BUFS):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    mbarrier.init(turn0, count=1)
    mbarrier.init(turn1, count=1)
    mbarrier.init(turn2, count=1)
    ring = (k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty)
    # The head-dim tail's tiles, one per main tile.
    q_tail_bufs = _tiles_like(q_tail_desc, CONSUMERS * Q_BUFS, q_bufs)
    k_tail_bufs = _tiles_like(k_tail_desc, STAGES, k_bufs)
    v_tail_bufs = _tiles_like(v_tail_desc, STAGES, v_bufs)
    tail = (q_tail_desc, k_tail_desc, v_tail_desc, o_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs)
    # A key tail's tiles (the last rows of every K/V tile), one per ring slot.
    keys = (k_keys_desc, v_keys_desc, k_keys_tail_desc, v_keys_tail_desc, _tiles_like(k_keys_desc, STAGES, k_bufs),
            _tiles_like(v_keys_desc, STAGES, v_bufs), _tiles_like(k_keys_tail_desc, STAGES, k_bufs),
            _tiles_like(v_keys_tail_desc, STAGES, v_bufs))

    # The same consumer function runs in the default partition (WG 0) and in worker partitions.
    args = (q_desc, o_desc, Q, LSE, stride_qb, stride_qh, stride_qn, q_bufs, q_bars, ring, H, N, n_m, total,
            qk_scale)
    producer_args = (k_desc, v_desc, ring, tail, keys, H, N, n_m, total, ROWS_PER_PROGRAM, BLOCK_N, CAUSAL, ZIGZAG,
                     GROUP)
    if PDL:  # (every thread waits: the producer before its first copy, the consumers before any store)
        _wait_for_prior_grids()
    if CONSUMERS == 1:  # ladder rung 1: one consumer, nobody to share K/V or take turns with
        gl.warp_specialize([
            (_consumer, (args, tail, keys, (turn0, turn1), 0, 1, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_producer, producer_args),
        ], [1], [PRODUCER_REGS])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (args, tail, keys, (turn0, turn1), 0, 2, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_consumer, (args, tail, keys, (turn1, turn0), 1, 2, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_producer, producer_args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (args, tail, keys, (turn0, turn1), 0, 3, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_consumer, (args, tail, keys, (turn1, turn2), 1, 3, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_consumer, (args, tail, keys, (turn2, turn0), 2, 3, ISSUE_TURNS, EXP_TURNS, CAUSAL, EVEN_N, ZIGZAG,
                         PREFETCH_L2, LAZY_RESCALE, LANE_ROW_SUMS, FRESH_PV)),
            (_producer, producer_args),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


@lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype: str) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout TMA writes a tile in (computed once per tile shape: the
    launch path runs on every call and must stay short, see ``plan``)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype])


def smem_layout(block: tuple, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a ``block`` tile of fp16/bf16 (cached per tile shape)."""
    return _smem_layout(tuple(block), {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype])


def descriptor(t, block: tuple) -> GluonTensorDescriptor:
    """A 4-D TMA descriptor over ``t`` ([B, H, N, D], its own strides) with tile ``block``; the N
    bound is per head, so a ragged last tile reads zeros instead of the next head."""
    dtype = {torch.float16: "fp16", torch.bfloat16: "bf16"}[t.dtype]
    return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _smem_layout(tuple(block), dtype))


def key_widths(block_n: int) -> tuple[int, int]:
    """(main, tail): the rows of the two parts a K/V tile of ``block_n`` keys comes in. A power of two
    is one part (``block_n``, 0); otherwise the power of two below it and the rest, which must be a
    power of two of at least 16 rows (it is the reduction of the tail's ``P·V``): 96 = 64 + 32, as
    the head dim's tail (:func:`tile_widths`) is along the columns. Triton's tensors and
    shared-memory buffers have power-of-two shapes, so a 96-key tile is two."""
    if block_n < 16:
        raise ValueError(f"block_n must be at least 16 keys, got {block_n}")
    main = 1 << (block_n.bit_length() - 1)
    tail = block_n - main
    if tail and (tail < 16 or tail & (tail - 1)):
        raise ValueError(f"block_n must be a power of two or one plus a power of two of at least 16 (96 = 64 + 32), "
                         f"got {block_n}")
    return main, tail


#: The kernel's descriptor arguments: Q, K, V, O; their head-dim tails (:func:`tile_widths`); and the
#: key tails of K and V (:func:`key_widths`: a tile's last keys, main columns and tail columns).
DESCRIPTOR_ARGS = ("q_desc", "k_desc", "v_desc", "o_desc", "q_tail_desc", "k_tail_desc", "v_tail_desc",
                   "o_tail_desc", "k_keys_desc", "v_keys_desc", "k_keys_tail_desc", "v_keys_tail_desc")


def descriptor_boxes(D: int, block_n: int, pad: bool = False) -> dict:
    """Every descriptor argument of the kernel (:data:`DESCRIPTOR_ARGS`) -> (the tensor it is over,
    its TMA box), or None where the kernel takes none (no head-dim tail, no key tail). Q and O in
    64-row tiles (one consumer's), K and V in tiles of the key tile's main part, the key tail's boxes
    as many rows as it has; the main boxes as wide as the main part of the head dim, the tail's as the
    tail. The copy engine fills the columns past D and the rows past N with zeros, and the store
    leaves them out."""
    main, tail = tile_widths(D, pad)
    keys, key_tail = key_widths(block_n)
    rows = {"q": ROWS_PER_CONSUMER, "k": keys, "v": keys, "o": ROWS_PER_CONSUMER}
    boxes = {}
    for role, n in rows.items():
        boxes[f"{role}_desc"] = (role, (1, 1, n, main))
        boxes[f"{role}_tail_desc"] = (role, (1, 1, n, tail)) if tail else None
    for role in ("k", "v"):
        boxes[f"{role}_keys_desc"] = (role, (1, 1, key_tail, main)) if key_tail else None
        boxes[f"{role}_keys_tail_desc"] = (role, (1, 1, key_tail, tail)) if key_tail and tail else None
    return {name: boxes[name] for name in DESCRIPTOR_ARGS}


def descriptors(q, k, v, o, block_n: int, pad_head_dim: bool = False) -> dict:
    """The descriptors of one call (:func:`descriptor_boxes`), over each tensor's own [B, H, N, D]
    shape, by argument name (None where the kernel takes none)."""
    tensors = {"q": q, "k": k, "v": v, "o": o}
    return {name: None if box is None else descriptor(tensors[box[0]], box[1])
            for name, box in descriptor_boxes(q.shape[-1], block_n, pad_head_dim).items()}


def q_buffers(persistent: bool, deep_q: bool = False) -> int:
    """Q buffers per consumer: two when a program walks several items (the next item's Q lands
    while this one runs), three with ``deep_q`` (the Q of the item after next is asked for while
    this one runs: a whole item's time to arrive, where with two it has from this item's first
    softmax to the next item's first product, which for an item of one K/V tile is almost nothing),
    one when a program has a single item."""
    return (3 if deep_q else 2) if persistent else 1


#: The warp-specialized kernel at the head dims between the powers of two (40-56 in 64-column tiles,
#: 104-120 in 128, 200-248 in 256; 72-96 and 136-192 as a main part and a tail, :func:`tile_widths`):
#: TMA fills the columns past D with zeros on load and leaves them out on store. On by default since
#: its GPU tests and the head-dim sweep ran on an H200 (forward, N 4096, bf16: padded to the next power
#: of two, C / cuDNN 1.04-1.16 at D 40-120, where the tl kernel ran 0.87-0.97; 1.02-1.10 at D 200-248
#: and 0.76-0.91 at D 136-192, where it ran 0.36-0.58; with the tail, docs/performance-log entry 58);
#: ``LAB_WS_PADDED_HEAD_DIMS=0`` in the environment turns it off (the tl kernel, padded, runs them).
PADDED_HEAD_DIMS = os.environ.get("LAB_WS_PADDED_HEAD_DIMS", "1") == "1"

#: A head dim past a power of two by a little runs in two parts (:func:`tile_widths`): the main
#: columns in tiles of the power of two below, the rest in tiles of their own, as narrow as wgmma's
#: reduction (16 columns) and a power of two (Triton's tensors are), so D 136 costs 144 columns'
#: work instead of 256's. A config named ``...-pad`` (``Config.pad_head_dim``) pads instead.
def tile_widths(D: int, pad: bool = False) -> tuple[int, int]:
    """(main, tail): the column widths of the warp-specialized forward's tiles for head dim ``D``.
    (``padded_head_dim(D)``, 0), one tile as wide as the next power of two, unless half that power
    of two plus a tail of at least 16 columns (the next power of two of what is left) is narrower:
    D 72 and 80 run as 64 + 16, 88 and 96 as 64 + 32, 136 and 144 as 128 + 16, 152 and 160 as
    128 + 32, 168 to 192 as 128 + 64; 104 to 128 and 200 to 256 take the whole power of two.
    ``pad``: always the whole power of two."""
    padded = padded_head_dim(D)
    if pad or padded < 128:
        return padded, 0
    main = padded // 2
    tail = max(16, padded_head_dim(D - main))
    return (main, tail) if main + tail < padded else (padded, 0)


def tile_width(D: int, pad: bool = False) -> int:
    """The columns the warp-specialized forward computes for head dim ``D``: main + tail."""
    return sum(tile_widths(D, pad))


#: The widest tile each kernel has: the forward's 64 x 256 accumulator per consumer (128 registers of
#: a thread's 240) still fits beside a 64 x 64 score tile; the Hopper backward keeps dK and dV of its
#: key rows in registers, and above 128 columns two consumers split them by head-dim halves
#: (``hopper_bwd.split_head_dim``).
MAX_HEAD_DIM = {"forward": 256, "backward": 256}

#: The widest (padded) head dim whose dK and dV one consumer of the Hopper backward keeps whole.
SPLIT_ABOVE = 128


def split_head_dim(D_pad: int) -> int:
    """How many consumers of the Hopper dK/dV kernel (``hopper_bwd.py``) share one 64-row K/V tile,
    each keeping the dK and dV columns of its part of the head dim: 1 up to 128 columns, 2 above
    (dK and dV of 64 rows × 256 columns in fp32 would take 256 registers per thread on their own;
    halves take 128)."""
    return 1 if D_pad <= SPLIT_ABOVE else 2


def supported(dtype: torch.dtype, D: int, arch: int, kernel: str = "forward") -> bool:
    """Whether the warp-specialized ``kernel`` ("forward": this module's; "backward": hopper_bwd.py's)
    runs head dim ``D``: Hopper, fp16/bf16, D a power of two from 64 to :data:`MAX_HEAD_DIM`, and with
    :data:`PADDED_HEAD_DIMS` every multiple of 8 from 40 up to it (Nq = Nk for the forward: the
    caller checks that, it is not a property of the dtype or head dim)."""
    if arch != 90 or dtype not in (torch.float16, torch.bfloat16):
        return False
    if D in (64, 128, 256):
        return D <= MAX_HEAD_DIM[kernel]
    return PADDED_HEAD_DIMS and D % 8 == 0 and 40 <= D <= MAX_HEAD_DIM[kernel]


def supported_head_dims(kernel: str = "forward") -> str:
    """The head dims :func:`supported` takes, in words, for the errors that name them."""
    top = MAX_HEAD_DIM[kernel]
    if PADDED_HEAD_DIMS:
        return f"D a multiple of 8 from 40 to {top}"
    powers = [str(D) for D in (64, 128, 256) if D <= top]
    return "D " + ", ".join(powers[:-1]) + " or " + powers[-1]


#: The ladder of the module docstring, bottom to top: (name, what the rung adds). Stage C's
#: ``attention(..., ws_rung=k)`` runs rungs 1..k with the rest off (``rung_options``); rung 6 is the
#: kernel with every mechanism, as stage C runs it by default.
LADDER = (
    ("producer", "producer warp + mbarrier ring (one consumer warpgroup, 64 rows per item)"),
    ("consumers", "+ consumer warpgroups sharing each K/V tile + register reallocation (setmaxnreg)"),
    ("pingpong", "+ ping-pong: two consumers take turns at the exponentials, three at wgmma issue"),
    ("persistent", "+ persistent grid, zigzag item order, items run into each other"),
    ("lane-sums", "+ per-lane row sums (lanes added once per item, not per tile)"),
    ("lazy-rescale", "+ lazy rescale of O (only when a row's maximum grew past 2^8)"),
)


def rung_options(rung: int, consumers: int, persistent: bool, lazy_rescale: bool) -> dict:
    """``static_plan``'s switches for ladder rung ``rung`` (1..len(LADDER)), on top of a tuned
    config's ``consumers``, ``persistent`` and ``lazy_rescale``: a rung turns its mechanism on the way
    the tuned config has it (so where the tuner chose one program per item, or the eager rescale,
    that rung changes nothing: the tuner found the mechanism not worth it there), and the top rung
    is the tuned kernel itself."""
    if not 1 <= rung <= len(LADDER):
        raise ValueError(f"rung must be in 1..{len(LADDER)}, got {rung}")
    return dict(consumers=consumers if rung >= 2 else 1, register_realloc=rung >= 2, pingpong=rung >= 3,
                persistent=persistent and rung >= 4, lane_row_sums=rung >= 5, lazy_rescale=lazy_rescale and rung >= 6)


#: Registers per thread the producer partition keeps when registers are reallocated (the
#: ``setmaxnreg`` minimum): it only issues TMA copies and waits on mbarriers.
PRODUCER_REGS = 24


def static_plan(B: int, H: int, N: int, D: int, q_stride: tuple, *, causal: bool, block_n: int, stages: int,
                consumers: int = 2, pingpong: bool = True, persistent: bool = True, num_sms: int = 132,
                prefetch_l2: bool = True, lazy_rescale: bool = True, group: int = 1, lane_row_sums: bool = True,
                register_realloc: bool = True, deep_q: bool = False, programs_per_sm: int = 1) -> tuple[tuple, dict, dict]:
    """The launch but its tensors and descriptors: (grid, every other argument, launch options), the
    union of :func:`kernel_constants` (what the compiled kernel is keyed on) and
    :func:`runtime_args` (what each call computes from its shapes)."""
    constants, extra = kernel_constants(causal=causal, block_n=block_n, stages=stages, consumers=consumers,
                                        pingpong=pingpong, persistent=persistent, prefetch_l2=prefetch_l2,
                                        lazy_rescale=lazy_rescale, group=group, lane_row_sums=lane_row_sums,
                                        register_realloc=register_realloc, even_n=N % block_n == 0,
                                        deep_q=deep_q, programs_per_sm=programs_per_sm)
    grid, ints = runtime_args(B, H, N, q_stride, causal=causal, consumers=consumers, persistent=persistent,
                              num_sms=num_sms, programs_per_sm=programs_per_sm)
    return grid, {**dict(zip(RUNTIME_ARGS, ints)), **constants}, extra


#: The kernel's integer arguments that each call supplies (in :func:`runtime_args`' order). The sizes
#: are ``do_not_specialize``: a new sequence length is a new value, not a new kernel.
RUNTIME_ARGS = ("stride_qb", "stride_qh", "stride_qn", "H", "N", "n_m", "total")


def kernel_constants(*, causal: bool, block_n: int, stages: int, consumers: int = 2, pingpong: bool = True,
                     persistent: bool = True, prefetch_l2: bool = True, lazy_rescale: bool = True, group: int = 1,
                     lane_row_sums: bool = True, register_realloc: bool = True,
                     even_n: bool = True, deep_q: bool = False, pdl: bool | None = None,
                     programs_per_sm: int = 1, fresh_pv: bool | None = None) -> tuple[dict, dict]:
    """(constexpr arguments, launch options): everything about the launch that no size changes, but
    ``even_n`` (N a multiple of ``block_n``: the consumers' K/V loop then runs without the ragged-N
    mask, the one length fact this kernel is compiled for; two variants at most).

    ``consumers``: 1, 2 or 3 consumer warpgroups (64 query rows each). ``register_realloc``: the
    producer keeps ``PRODUCER_REGS`` registers per thread and the consumers take the rest (240
    with two, 160 with three); off, every warpgroup gets the same share of the 64K (with one
    consumer that share is the hardware's per-thread limit already, so it is always off). ``pdl``: a
    programmatic dependent launch (None: as :data:`PDL` says). ``programs_per_sm``: see
    :func:`register_budget` (the kernel is the same; its register pool is halved). ``fresh_pv``: an
    item's first tile starts the accumulator in its ``P·V`` (None: as :data:`FRESH_PV` says)."""
    if consumers not in (1, 2, 3):
        raise ValueError(f"consumers must be 1, 2 or 3, got {consumers}")
    pdl = PDL if pdl is None else pdl
    zigzag = causal and persistent
    consumer_regs, producer_regs, maxnreg = register_budget(consumers, register_realloc, programs_per_sm)
    constants = dict(BLOCK_N=block_n, STAGES=stages, CONSUMERS=consumers, CAUSAL=causal,
                     EVEN_N=even_n, ZIGZAG=zigzag, Q_BUFS=q_buffers(persistent, deep_q),
                     CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs,
                     ISSUE_TURNS=pingpong and consumers == 3,
                     EXP_TURNS=pingpong and consumers == 2, PREFETCH_L2=prefetch_l2, LAZY_RESCALE=lazy_rescale,
                     GROUP=group, LANE_ROW_SUMS=lane_row_sums, PDL=pdl,
                     FRESH_PV=FRESH_PV if fresh_pv is None else fresh_pv)
    return constants, {"maxnreg": maxnreg, "launch_pdl": pdl}


def register_budget(consumers: int, register_realloc: bool = True, programs_per_sm: int = 1) -> tuple[int, int, int]:
    """(registers per consumer thread, per producer thread, ``maxnreg``) of a kernel with ``consumers``
    consumer warpgroups and one producer warp (this kernel and ``hopper_bwd.py``'s). 4 warps run the
    default partition (consumer 0); the workers add 4 per further consumer and 1 producer warp,
    rounded up to whole warpgroups. ``maxnreg`` sets the register pool they share: 65536 registers
    over all the threads (at most 256 each: setmaxnreg's ceiling). With ``register_realloc`` the
    producer keeps ``PRODUCER_REGS`` and the consumers take the rest (240 with two, 160 with three);
    without it, or with one consumer, every partition asks for the even share.

    ``programs_per_sm`` (1 or 2): programs that share an SM's 64K registers. Two are for one consumer
    (``maxnreg`` 128): the producer drops to its minimum and the consumer, the default partition,
    takes what is left of the program's 32K, 232 per thread (Triton sets the default partition's
    share), enough for a 64-row tile at D 64."""
    if programs_per_sm not in (1, 2):
        raise ValueError(f"programs_per_sm must be 1 or 2, got {programs_per_sm}")
    if programs_per_sm == 2 and consumers != 1:
        raise ValueError(f"two programs per SM take one consumer warpgroup each, got consumers={consumers}")
    threads = 128 * (consumers + 1)
    maxnreg = min((65536 // programs_per_sm // threads) // 8 * 8, 256)
    if register_realloc and consumers > 1:
        return (240 if consumers == 2 else 160), PRODUCER_REGS, maxnreg
    if programs_per_sm > 1:
        return (65536 // programs_per_sm - 128 * PRODUCER_REGS) // 128 // 8 * 8, PRODUCER_REGS, maxnreg
    return maxnreg, maxnreg, maxnreg


def work_units(total: int, causal: bool, persistent: bool) -> int:
    """The units of work a grid deals out of ``total`` items: a persistent program walks items
    round-robin, causal ones in pairs (see _tile_coords), so there a pair is the unit it is dealt."""
    return -(-total // 2) if causal and persistent else total


def runtime_args(B: int, H: int, N: int, q_stride: tuple, *, causal: bool, consumers: int, persistent: bool,
                 num_sms: int, programs_per_sm: int = 1) -> tuple[tuple, tuple]:
    """(grid, the :data:`RUNTIME_ARGS` values) of one call: the work items of ``consumers × 64``
    query rows, and the persistent grid's size (``programs_per_sm`` programs per SM, at most one per
    unit of work)."""
    n_m = -(-N // (ROWS_PER_CONSUMER * consumers))
    total = n_m * B * H
    units = work_units(total, causal, persistent)
    grid = (min(units, num_sms * programs_per_sm) if persistent else total,)
    return grid, (q_stride[0], q_stride[1], q_stride[2], H, N, n_m, total)


def plan(q, k, v, o, *, causal: bool, qk_scale: float, block_n: int, stages: int, lse=None, consumers: int = 2,
         pingpong: bool = True, persistent: bool = True, num_sms: int = 132, prefetch_l2: bool = True,
         lazy_rescale: bool = True, lane_row_sums: bool = True, register_realloc: bool = True,
         deep_q: bool = False, pad_head_dim: bool = False, programs_per_sm: int = 1) -> Launch:
    """The launch of ``ws_attention_kernel`` for these tensors: grid, arguments and options.

    This runs on every call, on the host, before the GPU sees the kernel, so it is kept short: when
    it takes longer than the work queued ahead of it on the stream, the GPU idles and a small problem
    measures the host instead of the kernel (``do_bench`` times from the event before the call).
    Stage C's own path goes further: it keeps ``kernel_constants`` per kernel key and computes only
    ``runtime_args`` and the descriptors per call.

    ``pingpong``: the consumers take turns, two at the exponentials (named barriers), three at
    wgmma issue (mbarriers); see the module docstring.

    ``prefetch_l2``: each consumer asks L2 for its next item's Q rows at the start of an item (a
    persistent program only: its next item is known an item ahead, and the TMA copy of that Q,
    one tile into the item, then hits L2; measured within a few percent either way,
    docs/performance-log/scheduling.md, entry 28).

    ``lazy_rescale``: O is rescaled only when some row of a warp raised its maximum by more than
    2^8 (``_rescale_if_needed``); else on every tile (the ``-E`` configs).

    ``lane_row_sums``: each thread keeps its part of its rows' sums (``_thread_row_sums``); else
    ``gl.sum`` over each row on every tile. ``register_realloc``: see ``static_plan``.

    ``deep_q`` (persistent only): three Q buffers per consumer, each Q fetched two items ahead
    (``q_buffers``); for items of one or two K/V tiles, where the next item's Q otherwise arrives
    late.

    ``pad_head_dim``: tiles as wide as the next power of two of the head dim, never a main part and
    a narrow tail (:func:`tile_widths`). ``programs_per_sm``: see :func:`register_budget`.

    ``lse``: an fp32 [B, H, N] tensor for the rows' log-sum-exps (the training forward), or None.

    Grouped-query attention (k, v with fewer heads than q) works; Nq must equal Nk."""
    B, H, N, D = q.shape
    if k.shape[2] != N:
        raise ValueError(f"the warp-specialized kernel needs Nq == Nk, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    grid, args, extra = static_plan(B, H, N, D, q.stride(), causal=causal, block_n=block_n, stages=stages,
                                    consumers=consumers, pingpong=pingpong, persistent=persistent, num_sms=num_sms,
                                    prefetch_l2=prefetch_l2, lazy_rescale=lazy_rescale, group=H // k.shape[1],
                                    lane_row_sums=lane_row_sums, register_realloc=register_realloc,
                                    deep_q=deep_q, programs_per_sm=programs_per_sm)
    args.update(descriptors(q, k, v, o, block_n, pad_head_dim))
    args.update(Q=q, LSE=lse, qk_scale=qk_scale)
    return Launch(ws_attention_kernel, grid, args, num_warps=4, num_stages=1, extra=extra)
