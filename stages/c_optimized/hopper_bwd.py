"""Stage C's Hopper backward: dK and dV by a warp-specialized Gluon kernel.

The ``tl`` dK/dV kernel (``backward.py``) asks Triton for the whole loop: pointer loads of Q and dO
pipelined by ``cp.async``/async copies, ``tl.dot`` on wgmma, one program of 8 warps per K/V tile. On
the H200 it holds one program per SM (208 registers, 140 KB of shared memory), with a third of its
stalls at barriers: every warp loads, waits and computes in lock step. This kernel writes the roles
down, as FlashAttention-3's backward does on Hopper:

* **A producer warp** (``_producer``) loads this program's K and V tiles once, by TMA, then streams
  the Q and dO tiles of every query head of the K/V head's group through a ring of ``STAGES``
  shared-memory slots; mbarriers say when a slot's bytes have arrived (``ready``) and when every
  consumer is done with it (``empty``).
* **Consumer warpgroups** (``_consumer``), ``CONSUMERS`` of them, each owning 64 of the tile's K/V
  rows, run the four products of a (K/V tile, Q tile) pair on wgmma, asynchronously:
  ``Sᵀ = K·Qᵀ`` and ``dPᵀ = V·dOᵀ`` (operands from shared memory), then ``dV += Pᵀ·dO`` and
  ``dK += dSᵀ·Q`` with Pᵀ and dSᵀ straight from registers (never stored). dK and dV stay in fp32
  registers over the whole loop and leave once, through shared memory and a TMA store.
* **Overlap**: the softmax of ``Sᵀ`` runs while ``dPᵀ`` is still on the tensor cores, and dSᵀ is
  formed while ``dV``'s product runs; the consumer warpgroups are independent, so one's
  exponentials run beside the other's products.

dQ comes from a kernel of its own, the ``tl`` one (``attention_bwd_dq_kernel``) or the Hopper one
below (``ws_bwd_dq_kernel``): Q resident, K/V streamed, dQ in registers, a fixed summation order, so
this path is deterministic too; it recomputes Sᵀ and dPᵀ, seven products per tile pair in all.
**Fused dQ** (``ws_dq_config="fused"``), a rung that can be switched on, does five: the consumers
store their dSᵀ tiles to shared memory, multiply them (read back transposed) by the K tiles, 64
columns of dQ at a time, and add the result into an fp32 accumulator shaped like Q, which a cast
turns into dQ after the kernel. The additions race between programs, so the last bits of dQ vary
from run to run. How it adds (:data:`FUSED_DQ_ATOMICS`) is what decides its speed: by default
("pair") the two consumers' dSᵀ tiles meet in double-buffered shared memory, so a Q tile's share from
the program's 128 keys is one product 128 keys deep and one bulk reduce by the copy engine
(:func:`_pair_dq`; at D 64 the consumers take turns by Q tile, at D 128 each adds its 64 columns);
the tuner keeps it at D 64 and, with the compact row statistics below, at D 128 (performance-log
entries 48, 54 and 70). Two switches reorder it, each program's Q tiles from its own one on
(:data:`FUSED_DQ_STAGGER`) and each tile's dQ slice formed during the next
(:data:`FUSED_DQ_LAG`); measured beside cuDNN's kernel under Nsight Compute, neither is on (entry 61),
and a config named with ``-r`` turns both on for its own tiles: a candidate the tuner races (entry 70).
**Ordered dQ** (``ws_dq_config="ordered"``, ``backward.ORDERED_DQ``) is fused dQ made deterministic, as
FlashAttention-3 makes its own: every Q tile's adds come in a fixed order. A semaphore per (batch·query
head, column slice, Q tile) in global memory counts the adds done; before its bulk reduce a consumer
waits until the count equals its rank (:func:`_ordered_dq_rank`), and it adds one once that reduce is
complete, at its next turn, by when the reduce has had a Q tile's time to finish (:func:`_ordered_dq_turn`).
Without a mask the rank is the K/V tile's index, and the grid interleaves the K/V tiles of a few heads
(:func:`ordered_dq_heads`) so that a head's tiles start far enough apart not to wait for each other;
causal the rank runs the other way, the diagonal tile first, and the grid with it (a head's last K/V tile
is launched first). Either way a program waits only for programs launched before it, and causal, for
ones that met the tile earlier in their own loops. Taking its turns costs a consumer a wait for its reduce
to complete, a barrier and a release between one tile's products and the next's; with a **dQ writer**
(:data:`ORDERED_DQ_WRITER`, a rung) a partition of one warp takes the turns instead (:func:`_dq_writer`, as
FlashAttention-3 does): a consumer stores its share to shared memory and goes on, and waits only where the
writer has not yet sent its last share on (a second stage buffer per consumer, :data:`DQ_WRITER_BUFFERS`, so
that it never waits for that, bought nothing: entry 96). Where each consumer adds its own column slice (D 128)
a writer warp per slice takes the two slices' turns side by side (:data:`DQ_WRITER_PER_SLICE`, entry 98).
Knowing which add comes first, the writer makes it a store (:data:`ORDERED_DQ_FIRST_STORES`, a rung, on), so
nothing zeroes the fp32 accumulator first: the Δ pre-pass zeroes the semaphores instead (entry 99).
A third, for fused dQ or not, keeps the row statistics compact until their use
(:data:`COMPACT_ROW_STATS`: a quarter fewer instructions per Q tile, and at D 128 with 64-row Q tiles
fewer spills; on: the 64-row dK/dV kernel at D 128 causal 1.59 → 0.99 ms on the H200, entries 63, 68, 70).
Row statistics: the forward's base-2 log-sum-exp and the pre-pass's Δ = rowsum(dO ∘ O), loaded per Q tile by the
consumers (64 floats, from L2); without a causal mask at up to 64 columns the first tile's are asked for
before the K/V wait (:data:`FIRST_ROW_STATS_EARLY`: a program of few Q tiles otherwise waits on that load
first, entry 82). Masks: keys past Nk and (causal, bottom-right) keys after a query are zeroed in Pᵀ after
the exponential, only on the tiles that need it (a runtime branch); query rows
past Nq read zeros by TMA and lse = +inf, so their P is exactly 0.

**Above 128 columns** (D 256, and 136-248 padded to it) a consumer cannot keep dK and dV whole: two
64 × 256 fp32 accumulators are 256 registers per thread before anything else (compiled for sm_90 that
way they spilled about 3 KB per thread). So the two consumers **split the head dim**
(``SPLIT_D`` = :func:`hopper_ws.split_head_dim`): they share one 64-row K/V tile, each keeps the dK and
dV columns of its half (128 registers), and each multiplies Pᵀ and dSᵀ into its half of dO and Q. Each
needs all of Pᵀ and dSᵀ for that, and there are two rungs to get them:

* **recompute** (``_consumer`` with ``SPLIT_D`` = 2): both compute the whole Sᵀ and dPᵀ, half again
  the tensor work the four products need, but neither consumer waits for the other in the loop;
* **share** (``_consumer_shared_scores``, ``SHARE_SCORES``, a config named ``...-x``): each computes the
  scores of half the Q tile's queries, keeps them in registers for its own products and hands them to
  the other through shared memory (two buffers, an mbarrier pair each), as FlashAttention-3 does at 256.
  A third less tensor work, two meetings per Q tile. On the H200 it is the faster one
  (performance-log entry 52).

Either way both consumers write their halves of dK and dV over the K/V tile once neither reads it any
more (an mbarrier says so) and one stores the whole tiles.

**A head-dim tail** (D 72-96, :func:`tile_widths`): as in the forward, a head dim just past 64 runs
as 64 columns and a tail of 16 or 32 instead of 128 columns. Every tile comes as two TMA copies, its
main columns and its tail, into buffers of their own on one mbarrier; ``Sᵀ`` and ``dPᵀ`` add the
tail's product (a chained wgmma 16 or 32 deep); dK and dV (and in the dQ kernel dQ) have a tail
accumulator of their own, fed by one more product from the same Pᵀ and dSᵀ registers, and leave
through the tail's buffers. The multiply-adds then follow D (80 costs 80 columns, not 128), and the
consumers' registers are those of D 64 plus 8-16 per tail accumulator, so 64-row Q tiles fit with
no spills. Fused dQ and the split head dim keep the padded width. A ``-pad`` config turns it off.

**A persistent grid** (:data:`PERSISTENT_DKDV`, a rung that can be switched on): one program per SM
walks work items (a K/V tile of one batch·K/V head) in the grid's order, instead of one program per
item. The consumers release an item's K/V buffers (an mbarrier, ``kv_free``) as soon as they are done
reading them, so the producer loads the next item's K and V while this item's dK and dV leave straight
from the registers; the ring of Q/dO slots and every barrier's phase run on from item to item.

Covers sm_90, fp16/bf16, D 64, 128 and 256 (and, with ``hopper_ws.PADDED_HEAD_DIMS``, every multiple
of 8 from 40: with a tail, or in tiles of the padded width), Nq ≠ Nk, GQA, 16-byte aligned strides
(TMA's rule).
"""

from __future__ import annotations

import functools
import os

import torch

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..contract import cdiv, padded_head_dim
from ..launch import Launch
from . import hopper_ws
from .configs import SHARED_MEMORY_LIMIT
from .hopper_ws import (SPLIT_ABOVE, GluonTensorDescriptor, _signal, _tiles_like, descriptor, register_budget,
                        split_head_dim)

#: K/V rows per consumer warpgroup: wgmma's M is 64 per warpgroup.
ROWS_PER_CONSUMER = 64
#: How fused dQ adds its tiles into the fp32 accumulator (``LAB_FUSED_DQ_ATOMICS``): "mma", by the
#: threads' atomics straight from the accumulator's registers (a warp's instruction touches 8 rows, 32
#: bytes of each); "rows", the same after a conversion, through shared memory, to a layout whose warp
#: instruction covers 2 whole rows of 64 columns; "tma", staged in shared memory and added by the copy
#: engine's bulk reduce, one instruction per 64 × 64 tile per consumer; "pair", the bulk reduce once per
#: pair of consumers: both consumers' dSᵀ tiles meet in shared memory and each multiplies both by its
#: columns of K, so a Q tile's dQ share from the program's 128 K/V rows is added once, half the bytes
#: (FlashAttention-3's way; with one consumer it is "tma").
FUSED_DQ_ATOMICS = os.environ.get("LAB_FUSED_DQ_ATOMICS", "pair")
FUSED_DQ_ATOMICS_CHOICES = ("mma", "rows", "tma", "pair")
#: "pair" at D 128 (each consumer its column slice every Q tile): issue a tile's dQ product at the start
#: of the next tile's turn, ahead of its Sᵀ, and add it while dPᵀ runs (``LAB_FUSED_DQ_AHEAD=1``).
FUSED_DQ_AHEAD = os.environ.get("LAB_FUSED_DQ_AHEAD", "0") == "1"
#: "pair" at D 128: form a Q tile's dQ slice one tile late, queued behind the next tile's dK and dV
#: products, so each consumer waits for the other's dSᵀ of the tile before, which has had a whole tile's
#: time to arrive, and the two consumers need not keep in step (``LAB_FUSED_DQ_LAG=1``).
FUSED_DQ_LAG = os.environ.get("LAB_FUSED_DQ_LAG", "0") == "1"
#: Fused dQ: each program walks its Q tiles from a different one on (program ``n`` from tile ``n``, modulo
#: its count), so the programs of one head that run side by side, which all add into that head's dQ,
#: add into different tiles of it at any moment instead of all into the same one (``LAB_FUSED_DQ_STAGGER``).
FUSED_DQ_STAGGER = os.environ.get("LAB_FUSED_DQ_STAGGER", "0") == "1"
#: A causal program walks its Q tiles from the last one down to its diagonal, as FlashAttention-2's backward
#: does, instead of up from the diagonal (``LAB_BWD_WALK_DOWN``). Up, the programs of a head that run side by
#: side each start at their own diagonal, so a Q tile (its Q, dO and fp32 dQ rows) is met by each of them at
#: a different time, as far apart as the kernel is long, and between two visits it has left L2; down, they
#: all start at the last tile and meet each tile at the same step, as the programs of an unmasked head do.
#: Nsight Compute on an H100 (bf16, D 128, causal, the walk up): Llama 3 8B's grouped cell (B 1, H 32/8, N
#: 8192) read 1.38 GB from DRAM in the dK/dV kernel against cuDNN's 0.33, and wrote 0.86 GB against 0.25
#: (its accumulator's lines evicted between adds); the FA grid's N 4096 cell (B 4, H 16) read cuDNN's bytes.
#: A model of L2 over the kernel's schedule (``experiments/walk_locality.py``, performance-log entry 101)
#: predicts no fewer bytes either way: a grouped program walks one query head's tiles after another's, so
#: the programs of a head fall out of step after the first, and programs past the first wave start apart.
#: Not with ordered dQ (whose turns follow the walk up) or the stagger. Timed on the H200 (entry 102), it
#: moved no cell by more than the runs of the walk up moved between themselves (Llama 3 8B 2.86 ms against
#: 2.86 and 2.91; the causal grid's four bf16 cells within 1 %), as the model said. Off.
CAUSAL_WALK_DOWN = os.environ.get("LAB_BWD_WALK_DOWN", "0") == "1"
#: The orders a program's Q tiles can be walked in (:func:`q_walk`, the kernel's ``WALK``).
WALK_UP, WALK_STAGGERED, WALK_DOWN = 0, 1, 2
#: The consumers' row statistics (the Q tile's 64 log-sum-exps and Δs) loaded one per thread before the
#: tile's wait (their latency still hidden) and spread to the 16 columns of Sᵀ each thread holds only
#: right before their use, through 256 bytes of shared memory (a store, the warpgroup's barrier, four
#: 16-byte loads), instead of living in 2 × 16 registers per thread the whole tile long. Compiled for
#: sm_90a at D 128 (64-row Q tiles) the dK/dV kernel spills 28 bytes per thread instead of 48 (16
#: instead of 232 causal), with fused dQ 80 instead of 248 (76 instead of 368). Measured on the H200
#: (bf16, D 128, B 4, H 16, N 4096, the kernel alone): 64-row tiles 1.85 -> 1.64 ms (causal 1.59 -> 0.99),
#: with fused dQ 3.17 -> 2.74 (causal 2.12 -> 1.43), which made fused dQ the faster plan at D 128 too
#: (performance-log entry 70). On; ``LAB_COMPACT_ROW_STATS=0`` for the kernel before it.
COMPACT_ROW_STATS = os.environ.get("LAB_COMPACT_ROW_STATS", "1") == "1"
#: With compact row statistics, spread both (the log-sum-exps and the Δs) in one conversion instead of
#: one each. A conversion goes through a scratch buffer in shared memory: a store, the warpgroup's
#: barrier, loads. Two conversions share that buffer, so the second also waits at a barrier for the
#: first one's loads: three warpgroup barriers per Q tile where one does (``LAB_JOINED_ROW_STATS``).
#: The Δs then live from the scores' exponentials to dSᵀ, 16 registers more in that stretch: only
#: where they fit (:func:`joined_row_stats`).
JOINED_ROW_STATS = os.environ.get("LAB_JOINED_ROW_STATS", "0") == "1"
#: With compact row statistics, load the next Q tile's log-sum-exps and Δs while this tile runs (two
#: more registers per thread), instead of at the top of the tile: the Sᵀ product they wait for takes a
#: few hundred cycles, a load from L2 more (``LAB_PREFETCH_ROW_STATS``).
PREFETCH_ROW_STATS = os.environ.get("LAB_PREFETCH_ROW_STATS", "0") == "1"
#: With compact row statistics, ask for the first Q tile's before waiting for the K and V tiles (the
#: program's first latency), and every later tile's at the top of that tile as without the switch
#: (``LAB_FIRST_ROW_STATS_EARLY``). :data:`PREFETCH_ROW_STATS` does this and more.
FIRST_ROW_STATS_EARLY = os.environ.get("LAB_FIRST_ROW_STATS_EARLY", "1") == "1"
#: A consumer hands its ring slot (the Q and dO tiles) back to the producer as soon as the products that
#: read it are done, before it forms the tile's share of fused dQ (which reads dSᵀ and K, not Q or dO),
#: instead of at the end of the tile (``LAB_EARLY_SLOT_RELEASE``).
EARLY_SLOT_RELEASE = os.environ.get("LAB_EARLY_SLOT_RELEASE", "0") == "1"
#: The order a causal backward's programs start in (``LAB_BWD_HEAVY_FIRST``, both Hopper kernels). A
#: causal program's work depends on its tile: the dK/dV kernel's first K/V tile meets every Q tile, its
#: last only the diagonal's (the dQ kernel the other way round), and the GPU starts programs in grid
#: order as SMs free up. ``0``: one batch·head's tiles after another, heaviest first within each, so the
#: last wave starts the heavy tiles of the last heads and the SMs that finished early wait for them (a
#: list-scheduling model, :func:`makespan`: 24 % over the balanced time at Llama 3 8B's grouped cell,
#: 1-7 % on the FA grid's causal cells). ``k`` ≥ 1: the tiles in chunks of ``k``, each chunk across every
#: batch·head before the next, heaviest chunk first: balanced as ``k`` falls, but fewer programs of one
#: head run side by side to share its Q and dO tiles in L2. ``auto`` (the default): chunks of
#: :data:`AUTO_CHUNK` where the model says they end at least :data:`AUTO_MIN_GAIN` of the balanced time
#: earlier than head by head, else head by head (:func:`auto_chunk`). Measured on the H200 (bf16 causal,
#: whole backward; ``experiments/program_order.py``, performance-log entry 76): chunks of 8 took the
#: Llama 3 8B cell from 3.32 to 3.01 ms and cost 5 % at B 1, H 16, N 16384, D 128, where the model
#: promises nothing (16 heads' Q and dO streamed at once no longer share L2). Non-causal programs all
#: do the same work and always run head by head.
_HEAVY_FIRST = os.environ.get("LAB_BWD_HEAVY_FIRST", "auto")
if _HEAVY_FIRST != "auto" and not _HEAVY_FIRST.isdigit():
    raise ValueError(f"LAB_BWD_HEAVY_FIRST must be auto, 0 (head by head) or a chunk of tiles >= 1, got "
                     f"{_HEAVY_FIRST!r}")
HEAVY_FIRST: int | str = _HEAVY_FIRST if _HEAVY_FIRST == "auto" else int(_HEAVY_FIRST)
#: How many batch·heads a causal order's chunks run across (``LAB_BWD_HEAD_GROUP``, both Hopper kernels).
#: ``0``: all of them, so the first chunk starts the heavy tiles of every batch·head before any light one
#: (:data:`HEAVY_FIRST`'s order). ``g`` ≥ 1: the batch·heads in groups of ``g``, one group after another,
#: each group's tiles chunk by chunk across its own batch·heads: the heavy tiles still start early within
#: each group, and the programs side by side belong to about two groups' batch·heads, whose Q, dO and fused
#: dQ accumulator can stay in L2 where every batch·head's cannot. ``auto`` (the default, with
#: ``HEAVY_FIRST=auto``): the fewest batch·heads side by side that the model says balance
#: (:func:`auto_order`). Measured on an H100 against chunks across every head (performance-log entry 85):
#: the grouped Llama 3 8B cell 3.04 → 2.87 ms, the FA grid's causal N 4096 cells 2.6–3.1 % faster, the
#: other causal cells 1–2.6 %; a forced ``g`` takes the chunk ``HEAVY_FIRST`` gives.
_HEAD_GROUP = os.environ.get("LAB_BWD_HEAD_GROUP", "auto")
if _HEAD_GROUP != "auto" and not _HEAD_GROUP.isdigit():
    raise ValueError(f"LAB_BWD_HEAD_GROUP must be auto, 0 (every batch·head) or a group of batch·heads >= 1, got "
                     f"{_HEAD_GROUP!r}")
HEAD_GROUP: int | str = _HEAD_GROUP if _HEAD_GROUP == "auto" else int(_HEAD_GROUP)
#: ``auto``'s chunk: the best of 8, 4, 2 and 1 over the measured cells (chunks of 1 and 2 lost L2 sharing
#: everywhere but the most unbalanced cells).
AUTO_CHUNK = 8
#: ``auto`` takes the chunks where the model's end falls by this share of the balanced time or more.
AUTO_MIN_GAIN = 0.02
#: A persistent grid for the dK/dV kernel (``LAB_BWD_PERSISTENT``): one program per SM, each walking the
#: work items (K/V tile, batch·K/V head) from its own index on in steps of the grid's size, in the order
#: :data:`HEAVY_FIRST` and :data:`HEAD_GROUP` give. One program per item, as without it, ends each item
#: with the pipeline empty: the K/V tiles stored (through the K/V buffers, by TMA) and the store waited
#: for, then a new program's barriers, K/V load and first Q/dO tiles; with several items per program the
#: next item's K and V are loaded as soon as the consumers are done reading this one's (an mbarrier,
#: ``kv_free``), while its dK and dV leave straight from the registers, and the ring of Q/dO slots runs
#: on from item to item. cuDNN's backward kernel is persistent; it leads most where items are short (N 1024:
#: a program's K/V tile meets 16 Q tiles). Not with :data:`FUSED_DQ_AHEAD` or :data:`FUSED_DQ_LAG` (a
#: ``-r`` config), whose last Q tile's dQ slice each item flushes: those keep one program per item.
#: Measured on an H100 (performance-log entry 93): off is faster in 15 of 16 cells, causal by 15-44 %. A
#: fixed round of items undoes the heavy-first order, which counts on the GPU handing the next program to
#: whichever SM frees up first; a persistent grid needs a scheduler of its own that does the same. Off.
PERSISTENT_DKDV = os.environ.get("LAB_BWD_PERSISTENT", "0") == "1"
if FUSED_DQ_ATOMICS not in FUSED_DQ_ATOMICS_CHOICES:
    raise ValueError(f"LAB_FUSED_DQ_ATOMICS must be one of {', '.join(FUSED_DQ_ATOMICS_CHOICES)}, "
                     f"got {FUSED_DQ_ATOMICS!r}")


def fused_dq_block_ms(consumers: int) -> tuple[int, ...]:
    """The Q tile rows fused dQ takes with ``consumers`` warpgroups, adding as :data:`FUSED_DQ_ATOMICS`
    says: 64, the dQ product's M being the tile's queries (one warpgroup's 64); adding once per pair of
    consumers, 32 too: the product then runs transposed, dQᵀ = Kᵀ·dSᵀ, 64 head-dim columns as its M and
    the 32 queries as its N, so its accumulator (and the scores') take half the registers."""
    return (32, 64) if FUSED_DQ_ATOMICS == "pair" and consumers == 2 else (64, )


#: None where a kernel's tuple of values holds no object (a local variable cannot hold None in a kernel)
_NONE = gl.constexpr(None)


@gluon.jit
def _q_range(start_n, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The Q tiles a K/V tile starting at key ``start_n`` meets: (first row, tiles, first row of the
    tiles that see all its keys). Row i sees key j iff j <= i + (Nk - Nq) (bottom-right causal)."""
    if CAUSAL:
        offset = Nk - Nq
        first = gl.maximum(start_n - offset, 0) // BLOCK_M * BLOCK_M
        unmasked = gl.maximum(start_n + BLOCK_N - 1 - offset, first)
    else:
        first = start_n * 0
        unmasked = first
    return first, gl.cdiv(Nq - first, BLOCK_M), unmasked


@gluon.jit
def _q_tile_row(first, j, n_tiles, start_n, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, WALK: gl.constexpr):
    """The first row of the ``j``-th Q tile a program visits, by ``WALK`` (:func:`q_walk`): :data:`WALK_UP`,
    tile ``j`` from ``first`` on; :data:`WALK_STAGGERED` (:data:`FUSED_DQ_STAGGER`), tile ``j`` counted from
    the program's own index (its K/V tile, ``start_n // BLOCK_N``), modulo the ``n_tiles`` it visits;
    :data:`WALK_DOWN` (:data:`CAUSAL_WALK_DOWN`), from the last tile down to ``first``. Producer and
    consumers ask the same."""
    if WALK == 1:
        j = (j + start_n // BLOCK_N) % n_tiles
    elif WALK == 2:
        j = n_tiles - 1 - j
    return first + j * BLOCK_M


@gluon.jit
def _load_row_stats(LSE, DELTA, bh, row0, Nq, valid, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """A Q tile's log-sum-exps and Δs (``BLOCK_M`` rows from ``row0`` of batch·head ``bh``) in
    ``layout``; rows past Nq, or all where not ``valid``, read lse = +inf (P = 0) and Δ = 0."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=layout)
    inside = (rows < Nq) & valid
    return (gl.load(LSE + bh * Nq + rows, mask=inside, other=float("inf")),
            gl.load(DELTA + bh * Nq + rows, mask=inside, other=0.0))


@gluon.jit
def _copy_tile(desc, tail_desc, bar, buf, tail_buf, b, h, row):
    """Copy a tile of (``b``, ``h``) from ``row`` on into ``buf`` and, with a head-dim tail, its tail
    columns (from the main tile's width on) into ``tail_buf``, counted on ``bar``, whose expected bytes
    the caller has set for all its copies."""
    tma.async_copy_global_to_shared(desc, [b, h, row, 0], bar, buf)
    if tail_desc is not None:
        tma.async_copy_global_to_shared(tail_desc, [b, h, row, desc.block_type.shape[3]], bar, tail_buf)


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, kv_free, ring, tail, sched, Nq, Nk,
              GROUP: gl.constexpr, CAUSAL: gl.constexpr, WALK: gl.constexpr):
    """One warp: :func:`_producer_item` for each work item of this program, the ring's slots running on
    from item to item. ``sched``: the program's one item (batch, K/V head, first key), or with a
    persistent grid what finds its items (:func:`_item_coords`'s five values). (Told apart by its length:
    a worker partition's arguments arrive as values, so a switch among them would not be a constant.)"""
    ROWS_TOTAL: gl.constexpr = k_bufs.shape[0] * k_bufs.shape[3]
    args = (q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, kv_free, ring, tail, Nq, Nk)
    if len(sched) == 3:
        b, h_kv, start_n = sched
        _producer_item(args, b, h_kv, start_n, start_n * 0, 0, GROUP, CAUSAL, WALK, False)
    else:
        it = 0
        t = 0
        for item in range(gl.program_id(0), _items(sched), gl.num_programs(0)):
            b, h_kv, start_n = _item_coords(item, sched, ROWS_TOTAL)
            it = _producer_item(args, b, h_kv, start_n, it, t, GROUP, CAUSAL, WALK, True)
            t += 1


@gluon.jit
def _producer_item(args, b, h_kv, start_n, it, t, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                   WALK: gl.constexpr, PERSISTENT: gl.constexpr):
    """One work item: its K and V tiles (64 rows each: one per consumer, or one that two consumers split
    by head-dim halves) once (persistent: as soon as the consumers are done with the last item's,
    ``kv_free``), then the Q and dO tiles of every query head of the group, in the consumers' order,
    through the ring. With a head-dim tail (``tail``, :func:`hopper_ws.tile_widths`) every tile comes as
    two copies, main columns and tail, on one barrier. Returns the ring's count of tiles."""
    q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, kv_free, ring, tail, Nq, Nk = args
    q_bufs, do_bufs, ready, empty = ring
    q_tail_desc, k_tail_desc, v_tail_desc, do_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs = tail
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[3]
    KV_TILES: gl.constexpr = k_bufs.shape[0]
    ROWS: gl.constexpr = k_bufs.shape[3]
    if PERSISTENT:
        # (a fresh mbarrier counts as "phase 1 completed": the first item does not wait)
        mbarrier.wait(kv_free, (t & 1) ^ 1)
    if k_tail_desc is not None:
        mbarrier.expect(kv_bar, 2 * KV_TILES * (k_desc.block_type.nbytes + k_tail_desc.block_type.nbytes))
    else:
        mbarrier.expect(kv_bar, 2 * KV_TILES * k_desc.block_type.nbytes)
    for c in gl.static_range(KV_TILES):
        _copy_tile(k_desc, k_tail_desc, kv_bar, k_bufs.index(c), k_tail_bufs.index(c), b, h_kv, start_n + c * ROWS)
        _copy_tile(v_desc, v_tail_desc, kv_bar, v_bufs.index(c), v_tail_bufs.index(c), b, h_kv, start_n + c * ROWS)
    first, n_tiles, unmasked = _q_range(start_n, Nq, Nk, BLOCK_M, ROWS * KV_TILES, CAUSAL)
    for g in range(GROUP):
        h = h_kv * GROUP + g
        for j in range(n_tiles):
            s = it % STAGES
            # A fresh mbarrier counts as "phase 1 completed", so the first lap does not wait.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            if q_tail_desc is not None:
                mbarrier.expect(ready.index(s), 2 * (q_desc.block_type.nbytes + q_tail_desc.block_type.nbytes))
            else:
                mbarrier.expect(ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
            row = _q_tile_row(first, j, n_tiles, start_n, ROWS * KV_TILES, BLOCK_M, WALK)
            _copy_tile(q_desc, q_tail_desc, ready.index(s), q_bufs.index(s), q_tail_bufs.index(s), b, h, row)
            _copy_tile(do_desc, do_tail_desc, ready.index(s), do_bufs.index(s), do_tail_bufs.index(s), b, h, row)
            it += 1
    return it


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[the box at ``coord``] += shared memory ``src``, element by element, by the copy engine
    (``cp.reduce.async.bulk.tensor.add``): Triton 3.6 has the op but no Gluon name for it (later
    versions call it ``tma.async_atomic_add``). Completes like a TMA store: ``tma.store_wait``."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _bulk_wait_all():
    """Wait until this thread's bulk reduces are complete, their sums written in global memory, not only
    their shared-memory source read (``cp.async.bulk.wait_group 0``; ``tma.store_wait`` is the
    ``.read`` variant): what a program must know before it tells the next one it may add."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _bulk_wait_all_but_one():
    """Wait until at most the last bulk group this thread issued is still in flight, its sums not yet
    written (``cp.async.bulk.wait_group 1``): the dQ writer's wait for the add before its last."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _load_acquire(ptr):
    """``*ptr`` (an int32 in global memory) loaded with acquire semantics at GPU scope by every thread, with
    no broadcast through shared memory: the load is asked for here and waited for where its value is
    first used, so its trip to L2 can hide behind work issued in between."""
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _ordered_dq_turn(DQ_SEM, pend, index, rank, seen, ANOTHER_IN_FLIGHT: gl.constexpr = False):
    """Ordered dQ (``backward.ORDERED_DQ``): before a consumer (or the dQ writer) adds its share of a dQ
    tile, it tells the next program that its last add (semaphore ``pend``, -1 for none) is complete
    (``ANOTHER_IN_FLIGHT``: all but the bulk group issued after it, which may fly on), then waits until the
    tile's semaphore ``index`` has counted ``rank`` adds: every program ahead of it in the tile's fixed
    order has added. ``seen``: the count as loaded at the start of the tile (:func:`_load_acquire`), so
    that where the turn has come by then, nothing here waits for L2. Returns ``index``, this add's
    semaphore, to be released at the consumer's next turn (by then the bulk reduce has had a Q tile's
    time to finish, so the wait for it rarely waits)."""
    if ANOTHER_IN_FLIGHT:
        _bulk_wait_all_but_one()
    else:
        _bulk_wait_all()
    gl.thread_barrier()  # (every thread's bulk group is done before one thread releases: the issuer may differ)
    if pend >= 0:
        gl.atomic_add(DQ_SEM + pend, 1, sem="release", scope="gpu")
    while seen != rank:
        seen = _load_acquire(DQ_SEM + index)
    return index


@gluon.jit
def _ordered_dq_release(DQ_SEM, pend):
    """The end of a consumer's (or the dQ writer's) adds: its last bulk reduce complete, its semaphore released."""
    _bulk_wait_all()
    gl.thread_barrier()
    if pend >= 0:
        gl.atomic_add(DQ_SEM + pend, 1, sem="release", scope="gpu")


@gluon.jit
def _dq_writer(wargs, tail, GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
               SLICES: gl.constexpr, SLICE: gl.constexpr = -1, FIRST_STORES: gl.constexpr = False):
    """Ordered dQ's writer (:data:`ORDERED_DQ_WRITER`), one warp: it walks the consumers' Q tiles in their
    order and, for each share of dQ they leave in their fp32 stage buffers (``full``: one per consumer,
    or :data:`DQ_WRITER_BUFFERS` taken in turn), waits for the tile's turn, adds it by bulk reduce, gives
    the buffer back once the copy engine has read it (``empty``), and hands the turn on at the same column
    slice's next add, by when the reduce has had a tile's time to complete. ``SLICES``: 2 where each
    consumer adds 64 of a tile's 128 columns (every tile, both buffers), 1 where the consumers take turns
    by Q tile (buffer ``it % 2``). ``SLICE``
    (0 or 1, with two slices: :data:`DQ_WRITER_PER_SLICE`): this warp takes that slice's adds only, and a
    second writer warp the other's, so a late turn of one slice holds up no add of the other.
    ``FIRST_STORES`` (:data:`ORDERED_DQ_FIRST_STORES`): a tile's first add (turn 0) stores instead."""
    DQ_ACC, dq_stages, bars, DQ_SEM, sched, Hq, Nq, Nk = wargs
    dq_tail_desc = tail[6]
    dq_tail_stages = tail[7]
    b, h_kv, start_n = sched
    BUFFERS: gl.constexpr = bars.shape[0] // 4  # stage buffers per consumer (:data:`DQ_WRITER_BUFFERS`)
    BLOCK_M: gl.constexpr = dq_stages.shape[3]
    COLS: gl.constexpr = dq_stages.shape[4]
    q_tiles = gl.cdiv(Nq, BLOCK_M)
    first, n_tiles, unmasked = _q_range(start_n, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
    # The semaphore of each slice's last add, released at its next (-1: none yet). int32 indices: one
    # semaphore per batch·query head, slice and Q tile, far fewer than 2^31 (and registers are few here).
    pend0 = start_n * 0 - 1
    pend1 = pend0
    it = 0
    for g in range(GROUP):
        h = h_kv * GROUP + g
        bh = b * Hq + h
        for j in range(n_tiles):
            row0 = _q_tile_row(first, j, n_tiles, start_n, BLOCK_N, BLOCK_M, False)
            rank = _ordered_dq_rank(start_n, row0, Nq, Nk, BLOCK_M, BLOCK_N, CAUSAL)
            tile = row0 // BLOCK_M
            if SLICES == 2 and SLICE >= 0:  # (its own last add is all it has in flight)
                pend0 = _dq_writer_add(DQ_SEM, pend0, (bh * 2 + SLICE) * q_tiles + tile, rank, bars, SLICE, it,
                                       BUFFERS, DQ_ACC, dq_stages, dq_tail_desc, dq_tail_stages, b, h, row0,
                                       SLICE * COLS, False, FIRST_STORES)
            elif SLICES == 2:  # (the other slice's add is the one still in flight at each release)
                pend0 = _dq_writer_add(DQ_SEM, pend0, (bh * 2) * q_tiles + tile, rank, bars, 0, it, BUFFERS,
                                       DQ_ACC, dq_stages, dq_tail_desc, dq_tail_stages, b, h, row0, 0, True,
                                       FIRST_STORES)
                pend1 = _dq_writer_add(DQ_SEM, pend1, (bh * 2 + 1) * q_tiles + tile, rank, bars, 1, it, BUFFERS,
                                       DQ_ACC, dq_stages, dq_tail_desc, dq_tail_stages, b, h, row0, COLS, True,
                                       FIRST_STORES)
            else:
                pend0 = _dq_writer_add(DQ_SEM, pend0, bh * q_tiles + tile, rank, bars, it % 2, it // 2, BUFFERS,
                                       DQ_ACC, dq_stages, dq_tail_desc, dq_tail_stages, b, h, row0, 0, False,
                                       FIRST_STORES)
            it += 1
    _ordered_dq_release(DQ_SEM, pend0)
    _ordered_dq_release(DQ_SEM, pend1)  # (its wait finds nothing left in flight)


@gluon.jit
def _dq_writer_add(DQ_SEM, pend, index, rank, bars, w, n, BUFFERS: gl.constexpr, dq_desc, dq_stages, dq_tail_desc,
                   dq_tail_stages, b, h, row0, COL0: gl.constexpr, ANOTHER_IN_FLIGHT: gl.constexpr,
                   FIRST_STORES: gl.constexpr = False):
    """One add of :func:`_dq_writer`: consumer ``w``'s ``n``-th share (in its buffer ``n % BUFFERS``),
    columns ``COL0`` on of the Q tile from ``row0``, at its turn ``rank`` of semaphore ``index``; first the
    add before it at semaphore ``pend`` is released (complete, but for ``ANOTHER_IN_FLIGHT``: the other
    slice's last add, issued after it). ``FIRST_STORES``: turn 0 stores the share (a TMA store, complete
    like a bulk reduce) over whatever the accumulator held. Returns ``index``, to release at the next add."""
    COLS: gl.constexpr = dq_stages.shape[4]
    slot = w * BUFFERS + n % BUFFERS
    seen = _load_acquire(DQ_SEM + index)  # (asked for before the wait on the consumer: its trip to L2 hides)
    mbarrier.wait(bars.index(slot), (n // BUFFERS) & 1)  # the consumer's share is in its buffer
    _ordered_dq_turn(DQ_SEM, pend, index, rank, seen, ANOTHER_IN_FLIGHT)
    if FIRST_STORES and rank == 0:
        tma.async_copy_shared_to_global(dq_desc, [b, h, row0, COL0], dq_stages.index(slot))
        if dq_tail_desc is not None:
            tma.async_copy_shared_to_global(dq_tail_desc, [b, h, row0, COLS], dq_tail_stages.index(slot))
    else:
        _tma_reduce_add(dq_desc, [b, h, row0, COL0], dq_stages.index(slot))
        if dq_tail_desc is not None:  # the head-dim tail's columns, in the same turn (a tail: one 64-column slice)
            _tma_reduce_add(dq_tail_desc, [b, h, row0, COLS], dq_tail_stages.index(slot))
    tma.store_wait(0)  # the copy engine has read the buffers: the consumer may fill them again
    mbarrier.arrive(bars.index(2 * BUFFERS + slot))
    return index


@gluon.jit
def _pair_dq_stage(ds_bufs, x, k_bufs, stage, free, phase, sm_scale, COL0: gl.constexpr, dq_layout: gl.constexpr):
    """Ordered dQ with a writer: :func:`_pair_dq_issue`'s product, waited for, scaled into this consumer's
    fp32 ``stage`` buffer once the writer has sent its last share on (mbarrier ``free`` at ``phase``);
    the caller fences and tells the writer."""
    BLOCK_M: gl.constexpr = stage.shape[2]
    COLS: gl.constexpr = stage.shape[3]
    acc = _pair_dq_issue(ds_bufs, x, k_bufs, COL0, COLS, dq_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if BLOCK_M < 64:
        acc = gl.permute(acc, [1, 0])
    mbarrier.wait(free, phase)
    stage.reshape([BLOCK_M, COLS]).store(acc * sm_scale)


@gluon.jit
def _ordered_dq_rank(start_n, row0, Nq, Nk, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Where the program whose K/V rows start at ``start_n`` adds into the dQ tile from ``row0`` in the
    tile's fixed order. Without a mask, every program adds to every tile, by K/V tile: program ``j``
    adds ``j``-th. Causal (bottom-right), the tile's adders are the K/V tiles 0 … J − 1 that some
    of its rows see, and they add last tile first: the diagonal one, whose first Q tile this is, adds
    first, then each one before it, which met the tile ``BLOCK_N / BLOCK_M`` tiles earlier in its own
    loop. So no program waits at its start for the ones before it to get there (the grid then starts
    the programs of a head last tile first, so a program waits only for programs already started)."""
    j = start_n // BLOCK_N
    if CAUSAL:
        adders = gl.minimum(gl.cdiv(Nk, BLOCK_N), (row0 + BLOCK_M - 1 + Nk - Nq) // BLOCK_N + 1)
        return adders - 1 - j
    else:
        return j


@gluon.jit
def _fused_dq(ds, k_t, dq_acc, dq_stages, first_stage: gl.constexpr, b, h, row0, Nq, sm_scale, HEAD_DIM: gl.constexpr, DQ_COLS: gl.constexpr,
              dq_layout: gl.constexpr, ATOMICS: gl.constexpr):
    """dQ[row0 : row0 + BLOCK_M] += sm_scale · dS·K, ``DQ_COLS`` columns per product, each product's
    tile added to the fp32 accumulator as ``ATOMICS`` says (:data:`FUSED_DQ_ATOMICS`): by the threads'
    own ``red.global.add`` from the accumulator's registers ("mma") or from a row-contiguous layout
    ("rows"), both into ``dq_acc``, the head's rows; or staged in shared memory and added by the copy
    engine's bulk reduce ("tma": ``dq_acc`` is then the accumulator's TMA descriptor, and this
    consumer's fp32 buffers, one per product, are ``dq_stages`` from ``first_stage`` on)."""
    BLOCK_M: gl.constexpr = ds.shape[0]
    D: gl.constexpr = k_t.shape[1]
    PARTS: gl.constexpr = D // DQ_COLS
    zero = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    row_layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 * 4 // DQ_COLS, DQ_COLS // 4], [4, 1], [1, 0])
    for c in gl.static_range(PARTS):
        part = warpgroup_mma(ds, k_t.slice(c * DQ_COLS, DQ_COLS, dim=1), zero, use_acc=False, is_async=True)
        part = warpgroup_mma_wait(0, deps=(part, ))
        if ATOMICS == "tma":
            # Buffer c was last read by the reduce issued PARTS reduces ago: wait for that one only.
            tma.store_wait(PARTS - 1)
            buf = dq_stages.index(first_stage + c)
            buf.reshape([BLOCK_M, DQ_COLS]).store(part * sm_scale)
            fence_async_shared()
            _tma_reduce_add(dq_acc, [b, h, row0, c * DQ_COLS], buf)  # (rows past Nq, columns past D clipped)
        else:
            if ATOMICS == "rows":
                # Each warp's atomics over whole rows (16 threads × 4 columns: one 256-byte run per row),
                # not the accumulator's 8 rows × 8 bytes per thread pair: fewer, fuller L2 requests.
                part = gl.convert_layout(part, row_layout)
                r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, row_layout))
                cols = c * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, row_layout))
            else:
                r = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
                cols = c * DQ_COLS + gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, dq_layout))
            mask = gl.expand_dims(r < Nq, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
            # (int32 offsets: a head holds under 2^31 elements)
            ptrs = dq_acc + gl.expand_dims(r * HEAD_DIM, 1) + gl.expand_dims(cols, 0)
            gl.atomic_add(ptrs, part * sm_scale, mask=mask, sem="relaxed")


@gluon.jit
def _pair_dq_issue(ds_bufs, x, k_bufs, COL0: gl.constexpr, COLS: gl.constexpr, dq_layout: gl.constexpr):
    """Start (asynchronously) columns ``COL0 : COL0 + COLS`` of a Q tile's dQ share from both consumers'
    K/V rows, dS₀·K₀ + dS₁·K₁: their dSᵀ tiles in exchange buffer ``x``, one product 128 keys deep. With
    64-row Q tiles dS (dSᵀ read back transposed) is the product's A and the queries its M; with 32-row
    ones (under wgmma's M of 64) it runs transposed, dQᵀ = Kᵀ·dSᵀ (:func:`_pair_dq_add` turns it back)."""
    BLOCK_M: gl.constexpr = ds_bufs.shape[2]
    ROWS: gl.constexpr = k_bufs.shape[3]
    D: gl.constexpr = k_bufs.shape[4]
    if BLOCK_M < 64:
        t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_M, 16])
        acc = gl.zeros([COLS, BLOCK_M], gl.float32, t_layout)
        for c in gl.static_range(2):
            k_ct = k_bufs.index(c).reshape([ROWS, D]).slice(COL0, COLS, dim=1).permute((1, 0))
            acc = warpgroup_mma(k_ct, ds_bufs.index(2 * x + c), acc, use_acc=c > 0, is_async=True)
    else:
        acc = gl.zeros([BLOCK_M, COLS], gl.float32, dq_layout)
        for c in gl.static_range(2):
            k_c = k_bufs.index(c).reshape([ROWS, D]).slice(COL0, COLS, dim=1)
            acc = warpgroup_mma(ds_bufs.index(2 * x + c).permute((1, 0)), k_c, acc, use_acc=c > 0, is_async=True)
    return acc


@gluon.jit
def _pair_dq_add(acc, dq_desc, stage, b, h, row0, sm_scale, COL0: gl.constexpr):
    """dQ[row0 : row0 + BLOCK_M, COL0 :] += sm_scale · ``acc`` (a finished :func:`_pair_dq_issue`, transposed
    with 32-row Q tiles), by one bulk reduce from this consumer's fp32 ``stage`` buffer."""
    BLOCK_M: gl.constexpr = stage.shape[2]
    COLS: gl.constexpr = stage.shape[3]
    if BLOCK_M < 64:
        acc = gl.permute(acc, [1, 0])
    tma.store_wait(0)  # the reduce issued from this buffer last time has read it
    stage.reshape([BLOCK_M, COLS]).store(acc * sm_scale)
    fence_async_shared()
    _tma_reduce_add(dq_desc, [b, h, row0, COL0], stage)  # (rows past Nq, columns past D clipped)


@gluon.jit
def _pair_dq(ds_bufs, x, k_bufs, dq_desc, stage, b, h, row0, sm_scale, COL0: gl.constexpr,
             dq_layout: gl.constexpr, OUT_COL0: gl.constexpr = -1, DQ_SEM=None, pend=-1, index=0, rank=0,
             seen=0):
    """dQ[row0 : row0 + BLOCK_M, COL0 : COL0 + COLS] += sm_scale · (dS₀·K₀ + dS₁·K₁)[:, those columns]:
    :func:`_pair_dq_issue`, waited for, then :func:`_pair_dq_add`. ``OUT_COL0`` (if not -1): the
    columns of dQ the result goes to, where ``k_bufs`` are a head-dim tail's (columns 0 on in them).
    With ``DQ_SEM`` (ordered dQ) the add waits for its turn at semaphore ``index`` (:func:`_ordered_dq_turn`,
    after the product, so the wait overlaps it; ``seen`` its count loaded earlier); returns the semaphore
    to release next (``pend``)."""
    acc = _pair_dq_issue(ds_bufs, x, k_bufs, COL0, stage.shape[3], dq_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    if DQ_SEM is not None:
        pend = _ordered_dq_turn(DQ_SEM, pend, index, rank, seen)
    _pair_dq_add(acc, dq_desc, stage, b, h, row0, sm_scale, COL0 if OUT_COL0 == -1 else OUT_COL0)
    return pend


@gluon.jit
def _probabilities_t(st, lse, keys, queries, qk_scale, need_mask, Nk, offset, CAUSAL: gl.constexpr):
    """Pᵀ = 2^(Sᵀ · scale − lse) of a (K/V rows × queries) tile, with keys past Nk and (causal,
    bottom-right) keys after a query zeroed where ``need_mask`` says the tile has any (a runtime branch)."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if need_mask:
        valid = gl.expand_dims(keys, 1) < Nk
        if CAUSAL:
            valid = valid & (gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0) + offset)
        pt = gl.where(valid, pt, 0.0)
    return pt


@gluon.jit
def _store_halves(dk, dv, k_bufs, v_bufs, bars, kv_free, dk_desc, dv_desc, b, h_kv, start_n, phase,
                  WG: gl.constexpr, COL0: gl.constexpr, PERSISTENT: gl.constexpr):
    """The epilogue of two consumers that split the head dim: the shared K/V tile is read by both
    consumers' products until their last one, so each writes its halves of dK and dV over it only
    when both are done (``bars`` 0: one arrival per warpgroup, after the warpgroup barrier Triton puts
    before it), and consumer 0 TMA-stores the whole tiles once both halves are in (``bars`` 1). The K/V
    buffers are free for the next item (``kv_free``) once that store has read them. ``phase``: the
    program's item count's parity (each barrier completes once per item)."""
    DH: gl.constexpr = dk.shape[1]
    mbarrier.arrive(bars.index(0))
    mbarrier.wait(bars.index(0), phase)
    k_t = k_bufs.index(0).reshape([k_bufs.shape[3], k_bufs.shape[4]])
    v_t = v_bufs.index(0).reshape([v_bufs.shape[3], v_bufs.shape[4]])
    k_t.slice(COL0, DH, dim=1).store(dk.to(k_bufs.dtype))
    v_t.slice(COL0, DH, dim=1).store(dv.to(v_bufs.dtype))
    fence_async_shared()
    mbarrier.arrive(bars.index(1))
    if WG == 0:
        mbarrier.wait(bars.index(1), phase)
        tma.async_copy_shared_to_global(dk_desc, [b, h_kv, start_n, 0], k_bufs.index(0))
        tma.async_copy_shared_to_global(dv_desc, [b, h_kv, start_n, 0], v_bufs.index(0))
        tma.store_wait(0)
    if PERSISTENT:
        mbarrier.arrive(kv_free)


@gluon.jit
def _store_rows(ptr, acc, row0, Nk, COL0: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Rows ``row0 ...`` of a contiguous ``[Nk, HEAD_DIM]`` gradient (``ptr``: its head's first element),
    columns from ``COL0`` on, from the accumulator's registers as they lie (rows past Nk and columns
    past the head dim left out): the persistent epilogue, which leaves the K/V buffers to the next item."""
    layout: gl.constexpr = acc.type.layout
    rows = row0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(rows < Nk, 1) & gl.expand_dims(cols < HEAD_DIM, 0)
    # (int32 offsets: a head holds under 2^31 elements)
    gl.store(ptr + gl.expand_dims(rows * HEAD_DIM, 1) + gl.expand_dims(cols, 0), acc.to(ptr.dtype.element_ty),
             mask=mask)


@gluon.jit
def _consumer(args, tail, WG: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr,
              ATOMICS: gl.constexpr, SPLIT_D: gl.constexpr, AHEAD: gl.constexpr, WALK: gl.constexpr,
              LAG: gl.constexpr, COMPACT_STATS: gl.constexpr, EARLY_RELEASE: gl.constexpr,
              PREFETCH_STATS: gl.constexpr):
    """One warpgroup, over this program's work items (``sched`` in ``args``, as :func:`_producer` reads
    it): each is :func:`_consumer_item`, the ring's slot count running on from one to the next. A
    persistent program waits for the bulk reduces of fused dQ still in flight after its last item
    before it ends (they read shared memory)."""
    k_bufs = args[2]
    sched = args[13]
    ROWS_TOTAL: gl.constexpr = k_bufs.shape[0] * k_bufs.shape[3]
    if len(sched) == 3:  # one item: the same machine code as before the persistent grid
        b, h_kv, start_n = sched
        _consumer_item(args, tail, b, h_kv, start_n, start_n * 0, 0, WG, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D,
                       AHEAD, WALK, LAG, COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS, False)
    else:
        it = 0
        t = 0
        for item in range(gl.program_id(0), _items(sched), gl.num_programs(0)):
            b, h_kv, start_n = _item_coords(item, sched, ROWS_TOTAL)
            it = _consumer_item(args, tail, b, h_kv, start_n, it, t, WG, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D,
                                AHEAD, WALK, LAG, COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS, True)
            t += 1
        tma.store_wait(0)


@gluon.jit
def _consumer_item(args, tail, b, h_kv, start_n, it, t, WG: gl.constexpr, GROUP: gl.constexpr,
                   CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, ATOMICS: gl.constexpr, SPLIT_D: gl.constexpr,
                   AHEAD: gl.constexpr, WALK: gl.constexpr, LAG: gl.constexpr, COMPACT_STATS: gl.constexpr,
                   EARLY_RELEASE: gl.constexpr, PREFETCH_STATS: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warpgroup, one work item: dK and dV of its 64 K/V rows, over every Q tile of the group's query heads; with
    a dQ accumulator (``DQ_ACC``, fused dQ), also each Q tile's share of dQ from these rows. With
    ``SPLIT_D`` = 2 two consumers share one 64-row K/V tile and each keeps the dK and dV columns of
    its half of the head dim: both compute the whole Sᵀ and dPᵀ (products over the full head dim),
    and each multiplies them into its half of Q and dO. With a head-dim tail (``tail``; neither fused
    dQ nor a split head dim): ``Sᵀ`` and ``dPᵀ`` each add the tail columns' product, and dK and dV
    have a tail accumulator each, fed by a product of their own."""
    (dk_desc, dv_desc, k_bufs, v_bufs, kv_bar, out_bar, ring, LSE, DELTA, DQ_ACC, ds_bufs, dq_stages, kv_free,
     sched, DK, DV, Hq, Hkv, Nq, Nk, qk_scale, sm_scale, DQ_SEM, DQ_BARS) = args
    q_bufs, do_bufs, ready, empty = ring
    dk_tail_desc, dv_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs, dq_tail_desc, dq_tail_stages = tail
    TAIL: gl.constexpr = dk_tail_desc is not None
    DT: gl.constexpr = k_tail_bufs.shape[4]
    # wgmma groups issued after Sᵀ's last (dPᵀ's), and after dPᵀ's last (dV's): what a wait leaves running
    AFTER: gl.constexpr = 2 if TAIL else 1
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[3]
    D: gl.constexpr = q_bufs.shape[4]
    KV_TILES: gl.constexpr = k_bufs.shape[0]
    ROWS: gl.constexpr = k_bufs.shape[3]
    TILE: gl.constexpr = WG // SPLIT_D           # which of the program's K/V tiles is this consumer's
    DH: gl.constexpr = D // SPLIT_D              # the dK/dV columns it keeps,
    COL0: gl.constexpr = (WG % SPLIT_D) * DH     # from this one on
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DH, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DT, 16])
    t_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=t_layout, k_width=2)
    t_dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                          instr_shape=[16, DT, 16])  # (fused dQ's tail columns)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)   # one value per K/V row of Sᵀ
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # one value per query (column of Sᵀ)
    stat_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # (COMPACT_STATS: one value per thread)
    # Fused dQ: the share dS·K of this pair, DQ_COLS columns at a time (so only a 64-row × DQ_COLS
    # fp32 tile is ever live beside dK and dV), added into the fp32 accumulator by the L2's atomics.
    DQ_COLS: gl.constexpr = 64 if D > 64 else D
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    # "pair": the Q tile's dQ share has D / DQ_COLS column slices; with two (D 128) each consumer
    # takes one, with one (D 64) the consumers take turns by Q tile. AHEAD (two slices only): a tile's
    # product is issued at the start of the next tile's turn, ahead of its Sᵀ, and added while its dPᵀ
    # runs; ``pend_h`` and ``pend_row`` say whose rows it holds.
    SLICES: gl.constexpr = D // DQ_COLS
    AHEAD_ON: gl.constexpr = AHEAD and SLICES == 2
    # LAG (two slices, not AHEAD): a tile's slice is issued during the next tile, after its dK product.
    LAG_ON: gl.constexpr = LAG and SLICES == 2 and not AHEAD and not TAIL
    pend_h = h_kv * GROUP
    pend_row = start_n * 0
    # Ordered dQ (DQ_SEM): the semaphore of this consumer's last add, released at its next turn (-1: none
    # yet); a Q tile's semaphore per batch·query head, dQ column slice and tile.
    pend = (start_n * 0).to(gl.int64) - 1
    q_tiles = gl.cdiv(Nq, BLOCK_M)
    # With a dQ writer (DQ_BARS: "full" per consumer, then "empty") the turns are the writer's: a consumer
    # only stores its share in its stage buffer.
    WRITER: gl.constexpr = DQ_BARS is not None
    BUFFERS: gl.constexpr = DQ_BARS.shape[0] // 4 if WRITER else 1  # its stage buffers (DQ_WRITER_BUFFERS)
    OWN_TURNS: gl.constexpr = (DQ_SEM is not None) and not WRITER

    first, n_tiles, unmasked = _q_range(start_n, Nq, Nk, BLOCK_M, ROWS * KV_TILES, CAUSAL)
    keys = start_n + TILE * ROWS + gl.arange(0, ROWS, layout=key_layout)
    ragged = start_n + ROWS * KV_TILES > Nk  # this program's tile runs past the last key
    offset = Nk - Nq
    k_t = k_bufs.index(TILE).reshape([ROWS, D])
    v_t = v_bufs.index(TILE).reshape([ROWS, D])
    dk = gl.zeros([ROWS, DH], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, DH], gl.float32, acc_layout)
    k_tt = k_tail_bufs.index(TILE).reshape([ROWS, DT])  # (without a tail: never read, compiled away)
    v_tt = v_tail_bufs.index(TILE).reshape([ROWS, DT])
    dk_t = gl.zeros([ROWS, DT], gl.float32, t_layout)
    dv_t = gl.zeros([ROWS, DT], gl.float32, t_layout)
    if PREFETCH_STATS > 0:  # the first Q tile's statistics, asked for before the wait on K and V
        lse_n, delta_n = _load_row_stats(LSE, DELTA, (b * Hq + h_kv * GROUP).to(gl.int64),
                                         _q_tile_row(first, 0, n_tiles, start_n, ROWS * KV_TILES, BLOCK_M, WALK),
                                         Nq, n_tiles > 0, BLOCK_M, stat_layout)
    mbarrier.wait(kv_bar, t & 1)
    it0 = it  # (the ring's slots count on from the last item; this item's tiles from here)
    for g in range(GROUP):
        bh = (b * Hq + h_kv * GROUP + g).to(gl.int64)
        for j in range(n_tiles):
            row0 = _q_tile_row(first, j, n_tiles, start_n, ROWS * KV_TILES, BLOCK_M, WALK)
            queries = row0 + gl.arange(0, BLOCK_M, layout=query_layout)
            if OWN_TURNS:  # ordered dQ: this tile's semaphore, its count asked for now, used at the add
                sem_index = (bh * SLICES + WG % SLICES) * q_tiles + row0 // BLOCK_M
                sem_seen = _load_acquire(DQ_SEM + sem_index)
            if PREFETCH_STATS == 1:  # the first tile's were asked for before the K/V wait
                if it == it0:
                    lse_c = lse_n
                    delta_c = delta_n
                else:
                    lse_c, delta_c = _load_row_stats(LSE, DELTA, bh, row0, Nq, True, BLOCK_M, stat_layout)
            elif PREFETCH_STATS == 2:
                # This tile's, asked for a tile ago; now the next one's: (g, j + 1), or the next query
                # head's first tile (none after the last).
                lse_c = lse_n
                delta_c = delta_n
                wrap = (j + 1 == n_tiles).to(gl.int32)
                lse_n, delta_n = _load_row_stats(
                    LSE, DELTA, (b * Hq + h_kv * GROUP + g + wrap).to(gl.int64),
                    _q_tile_row(first, (j + 1) % n_tiles, n_tiles, start_n, ROWS * KV_TILES, BLOCK_M, WALK), Nq,
                    g + wrap < GROUP, BLOCK_M, stat_layout)
            elif COMPACT_STATS:  # asked for before the wait on the tile, so their latency hides behind it
                lse_c, delta_c = _load_row_stats(LSE, DELTA, bh, row0, Nq, True, BLOCK_M, stat_layout)
            else:
                lse = gl.load(LSE + bh * Nq + queries, mask=queries < Nq, other=float("inf"))
                delta = gl.load(DELTA + bh * Nq + queries, mask=queries < Nq, other=0.0)
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            q_t = q_bufs.index(s).reshape([BLOCK_M, D])
            do_t = do_bufs.index(s).reshape([BLOCK_M, D])
            if SPLIT_D == 1:
                q_half = q_t
                do_half = do_t
            else:  # (the B operands of dK's and dV's products: this consumer's columns)
                q_half = q_t.slice(COL0, DH, dim=1)
                do_half = do_t.slice(COL0, DH, dim=1)
            if DQ_ACC is not None and ATOMICS == "pair" and AHEAD_ON:
                # The last tile's slice, first in the queue (the first turn multiplies a buffer not
                # yet written, and adds nothing).
                xp = (it + 1) % 2
                if it > it0:
                    mbarrier.wait(out_bar.index(2 + xp), ((it - 1) // 2) & 1)  # the other's dSᵀ is in
                dq = _pair_dq_issue(ds_bufs, xp, k_bufs, WG * DQ_COLS, DQ_COLS, dq_layout)
            q_tt = q_tail_bufs.index(s).reshape([BLOCK_M, DT])
            do_tt = do_tail_bufs.index(s).reshape([BLOCK_M, DT])
            st = warpgroup_mma(k_t, q_t.permute((1, 0)), gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout),
                               use_acc=False, is_async=True)
            if TAIL:  # the tail columns' share of the same scores
                st = warpgroup_mma(k_tt, q_tt.permute((1, 0)), st, is_async=True)
            dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout),
                                use_acc=False, is_async=True)
            if TAIL:
                dpt = warpgroup_mma(v_tt, do_tt.permute((1, 0)), dpt, is_async=True)
            if DQ_ACC is not None and ATOMICS == "pair" and AHEAD_ON:
                dq, st = warpgroup_mma_wait(1, deps=(dq, st))  # the slice and Sᵀ are done
                if it > it0:
                    _pair_dq_add(dq, DQ_ACC, dq_stages.index(WG), b, pend_h, pend_row, sm_scale, WG * DQ_COLS)
                    mbarrier.arrive(out_bar.index(4 + xp))  # done reading the last tile's buffer
            else:
                st = warpgroup_mma_wait(AFTER, deps=(st, ))  # Sᵀ is done; dPᵀ may still be running
            need_mask = ragged
            if CAUSAL:
                need_mask = need_mask | (row0 < unmasked)
            if COMPACT_STATS == 2:  # (JOINED_ROW_STATS) both in one conversion: one warpgroup barrier
                spread_zero = gl.zeros([BLOCK_M], gl.float32, query_layout)  # (only its layout is used)
                lse, delta = gl.split(gl.convert_layout(gl.join(lse_c, delta_c),
                                                        gl.join(spread_zero, spread_zero).type.layout))
                lse = gl.convert_layout(lse, query_layout)  # (the layout split gives, named: no data moves)
                delta = gl.convert_layout(delta, query_layout)
            elif COMPACT_STATS:
                lse = gl.convert_layout(lse_c, query_layout)
            pt = _probabilities_t(st, lse, keys, queries, qk_scale, need_mask, Nk, offset, CAUSAL)
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_half, dv, is_async=True)
            if TAIL:
                pt_t = gl.convert_layout(pt.to(dtype), t_op_layout)
                dv_t = warpgroup_mma(pt_t, do_tt, dv_t, is_async=True)
            dpt = warpgroup_mma_wait(AFTER, deps=(dpt, ))  # dPᵀ is done; dV's product may still be running
            if COMPACT_STATS == 1:
                delta = gl.convert_layout(delta_c, query_layout)
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            dst_op = gl.convert_layout(dst.to(dtype), op_layout)
            dk = warpgroup_mma(dst_op, q_half, dk, is_async=True)
            if TAIL:
                dst_t = gl.convert_layout(dst.to(dtype), t_op_layout)
                dk_t = warpgroup_mma(dst_t, q_tt, dk_t, is_async=True)
            if DQ_ACC is not None:
                # dQ's product wants dS (queries × keys), the registers hold dSᵀ: through shared
                # memory, read back transposed (the pair's, with 32-row Q tiles: as stored, into the
                # transposed product); its other operand is this consumer's K tile (the pair's: both).
                if ATOMICS == "pair":
                    # Exchange buffer x was last read two Q tiles ago: both consumers must be done
                    # with it (out_bar 4 + x; a fresh mbarrier counts as "phase 1 completed").
                    x = it % 2
                    mbarrier.wait(out_bar.index(4 + x), ((it // 2) & 1) ^ 1)
                    ds_t = ds_bufs.index(2 * x + WG)
                else:
                    ds_t = ds_bufs.index(WG)
                ds_t.store(dst.to(dtype))
                fence_async_shared()
                if ATOMICS == "pair":
                    mbarrier.arrive(out_bar.index(2 + x))  # my dSᵀ is in
            if DQ_ACC is not None and ATOMICS == "pair" and LAG_ON:
                # The last tile's slice, queued behind this tile's dK and dV products (the first turn
                # multiplies a buffer not yet written, and adds nothing).
                xp = (it + 1) % 2
                if it > it0:
                    mbarrier.wait(out_bar.index(2 + xp), ((it - 1) // 2) & 1)  # the other's dSᵀ is in
                dq = _pair_dq_issue(ds_bufs, xp, k_bufs, WG * DQ_COLS, DQ_COLS, dq_layout)
                dv, dk, pt_op, dst_op, dq = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op, dq))
                if it > it0:
                    _pair_dq_add(dq, DQ_ACC, dq_stages.index(WG), b, pend_h, pend_row, sm_scale, WG * DQ_COLS)
                    mbarrier.arrive(out_bar.index(4 + xp))  # done reading the last tile's buffer
            elif TAIL:
                dv, dk, pt_op, dst_op, dv_t, dk_t, pt_t, dst_t = warpgroup_mma_wait(
                    0, deps=(dv, dk, pt_op, dst_op, dv_t, dk_t, pt_t, dst_t))
            else:
                dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            if EARLY_RELEASE:  # every product that reads the slot's Q and dO is done (dQ's reads dSᵀ and K)
                _signal(empty.index(s))
            if DQ_ACC is not None and ATOMICS == "pair":
                if AHEAD_ON or LAG_ON:
                    pend_h = h_kv * GROUP + g
                    pend_row = row0
                elif SLICES == 2:
                    mbarrier.wait(out_bar.index(2 + x), (it // 2) & 1)  # and the other's
                    if WRITER:  # (this consumer's slice of every tile: its (it - it0)-th share)
                        slot = WG * BUFFERS + (it - it0) % BUFFERS
                        _pair_dq_stage(ds_bufs, x, k_bufs, dq_stages.index(slot), DQ_BARS.index(2 * BUFFERS + slot),
                                       (((it - it0) // BUFFERS) & 1) ^ 1, sm_scale, WG * DQ_COLS, dq_layout)
                        fence_async_shared()
                        mbarrier.arrive(DQ_BARS.index(slot))
                    elif DQ_SEM is not None:
                        pend = _pair_dq(ds_bufs, x, k_bufs, DQ_ACC, dq_stages.index(WG), b, h_kv * GROUP + g, row0,
                                        sm_scale, WG * DQ_COLS, dq_layout, -1, DQ_SEM, pend, sem_index,
                                        _ordered_dq_rank(start_n, row0, Nq, Nk, BLOCK_M, ROWS * KV_TILES, CAUSAL),
                                        sem_seen)
                    else:
                        _pair_dq(ds_bufs, x, k_bufs, DQ_ACC, dq_stages.index(WG), b, h_kv * GROUP + g, row0,
                                 sm_scale, WG * DQ_COLS, dq_layout)
                elif x == WG:
                    mbarrier.wait(out_bar.index(2 + x), (it // 2) & 1)
                    if WRITER:
                        # (every other tile: this consumer's ((it - it0) // 2)-th share; a tail's in the same turn)
                        n_add = (it - it0) // 2
                        slot = WG * BUFFERS + n_add % BUFFERS
                        _pair_dq_stage(ds_bufs, x, k_bufs, dq_stages.index(slot), DQ_BARS.index(2 * BUFFERS + slot),
                                       ((n_add // BUFFERS) & 1) ^ 1, sm_scale, 0, dq_layout)
                        if TAIL:
                            _pair_dq_stage(ds_bufs, x, k_tail_bufs, dq_tail_stages.index(slot),
                                           DQ_BARS.index(2 * BUFFERS + slot), ((n_add // BUFFERS) & 1) ^ 1, sm_scale, 0,
                                           t_dq_layout)
                        fence_async_shared()
                        mbarrier.arrive(DQ_BARS.index(slot))
                    else:
                        if DQ_SEM is not None:
                            pend = _pair_dq(ds_bufs, x, k_bufs, DQ_ACC, dq_stages.index(WG), b, h_kv * GROUP + g,
                                            row0, sm_scale, 0, dq_layout, -1, DQ_SEM, pend, sem_index,
                                            _ordered_dq_rank(start_n, row0, Nq, Nk, BLOCK_M, ROWS * KV_TILES, CAUSAL),
                                            sem_seen)
                        else:
                            _pair_dq(ds_bufs, x, k_bufs, DQ_ACC, dq_stages.index(WG), b, h_kv * GROUP + g, row0,
                                     sm_scale, 0, dq_layout)
                        if TAIL:  # the tail columns' share, from both consumers' K tails, its own reduce
                            _pair_dq(ds_bufs, x, k_tail_bufs, dq_tail_desc, dq_tail_stages.index(WG), b,
                                     h_kv * GROUP + g, row0, sm_scale, 0, t_dq_layout, D)
                if not (AHEAD_ON or LAG_ON):
                    mbarrier.arrive(out_bar.index(4 + x))  # done reading buffer x
            elif DQ_ACC is not None:
                if ATOMICS == "tma":
                    dq_acc = DQ_ACC
                else:
                    dq_acc = DQ_ACC + bh * Nq * HEAD_DIM
                _fused_dq(ds_t.permute((1, 0)), k_t, dq_acc, dq_stages, WG * (D // DQ_COLS), b, h_kv * GROUP + g,
                          row0, Nq, sm_scale, HEAD_DIM, DQ_COLS, dq_layout, ATOMICS)
            if not EARLY_RELEASE:
                _signal(empty.index(s))  # this consumer is done with the slot's Q and dO
            it += 1
    if DQ_ACC is not None and ATOMICS == "pair":
        if AHEAD_ON or LAG_ON:
            if it > it0:  # the last Q tile's slice, not issued ahead of anything
                xp = (it + 1) % 2
                mbarrier.wait(out_bar.index(2 + xp), ((it - 1) // 2) & 1)
                _pair_dq(ds_bufs, xp, k_bufs, DQ_ACC, dq_stages.index(WG), b, pend_h, pend_row, sm_scale,
                         WG * DQ_COLS, dq_layout)
        if OWN_TURNS:  # the last add's turn passes on
            _ordered_dq_release(DQ_SEM, pend)
        # Both consumers' dQ products read both K tiles up to their last Q tile: neither writes its dK
        # over its K tile before the other is done with them (out_bar 0, one arrival per consumer).
        mbarrier.arrive(out_bar.index(0))
        mbarrier.wait(out_bar.index(0), t & 1)
    if SPLIT_D == 1 and PERSISTENT:
        # Nothing reads this item's K and V any more: the producer may bring the next item's in while
        # this one's dK and dV leave straight from the registers (rows past Nk and columns past the
        # head dim left out), not through the K/V buffers.
        mbarrier.arrive(kv_free)
        head = (b * Hkv + h_kv).to(gl.int64) * Nk * HEAD_DIM
        rows0 = start_n + WG * ROWS
        _store_rows(DK + head, dk * sm_scale, rows0, Nk, 0, HEAD_DIM)
        _store_rows(DV + head, dv, rows0, Nk, 0, HEAD_DIM)
        if TAIL:
            _store_rows(DK + head, dk_t * sm_scale, rows0, Nk, D, HEAD_DIM)
            _store_rows(DV + head, dv_t, rows0, Nk, D, HEAD_DIM)
    elif SPLIT_D == 1:
        # Out through this consumer's own K and V buffers (nothing reads them any more), TMA-stored:
        # the store clips rows past Nk.
        k_bufs.index(WG).reshape([ROWS, D]).store((dk * sm_scale).to(dtype))
        v_bufs.index(WG).reshape([ROWS, D]).store(dv.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dk_desc, [b, h_kv, start_n + WG * ROWS, 0], k_bufs.index(WG))
        tma.async_copy_shared_to_global(dv_desc, [b, h_kv, start_n + WG * ROWS, 0], v_bufs.index(WG))
        if TAIL:  # the tail columns, out through the tail's K and V buffers (columns past D clipped)
            k_tt.store((dk_t * sm_scale).to(dtype))
            v_tt.store(dv_t.to(dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(dk_tail_desc, [b, h_kv, start_n + WG * ROWS, D], k_tail_bufs.index(WG))
            tma.async_copy_shared_to_global(dv_tail_desc, [b, h_kv, start_n + WG * ROWS, D], v_tail_bufs.index(WG))
        tma.store_wait(0)
        if PERSISTENT:
            mbarrier.arrive(kv_free)  # (the stores have read the K/V buffers)
    else:
        _store_halves(dk * sm_scale, dv, k_bufs, v_bufs, out_bar, kv_free, dk_desc, dv_desc, b, h_kv, start_n, t & 1,
                      WG, COL0, PERSISTENT)
    return it


@gluon.jit
def _consumer_shared_scores(args, WG: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, WALK: gl.constexpr):
    """:func:`_consumer_shared_scores_item` over this program's work items, as :func:`_consumer`."""
    sched = args[13]
    if len(sched) == 3:
        b, h_kv, start_n = sched
        _consumer_shared_scores_item(args, b, h_kv, start_n, start_n * 0, 0, WG, GROUP, CAUSAL, WALK, False)
    else:
        it = 0
        t = 0
        for item in range(gl.program_id(0), _items(sched), gl.num_programs(0)):
            b, h_kv, start_n = _item_coords(item, sched, args[2].shape[3])
            it = _consumer_shared_scores_item(args, b, h_kv, start_n, it, t, WG, GROUP, CAUSAL, WALK, True)
            t += 1


@gluon.jit
def _consumer_shared_scores_item(args, b, h_kv, start_n, it, t, WG: gl.constexpr, GROUP: gl.constexpr,
                                 CAUSAL: gl.constexpr, WALK: gl.constexpr, PERSISTENT: gl.constexpr):
    """One work item of one of two warpgroups that share one 64-row K/V tile and split its head dim (as ``_consumer``
    with ``SPLIT_D`` = 2), computing the scores once between them: of each Q tile this consumer
    computes the columns of Sᵀ and dPᵀ of its half of the queries, keeps its Pᵀ and dSᵀ in registers
    for its own products and hands them to the other consumer through shared memory, and takes the
    other half from there. Per Q tile: dV[:, my columns] += Pᵀ[:, my queries] · dO[my queries, my
    columns] + Pᵀ[:, other queries] · dO[other queries, my columns], dK alike. The exchange buffers are
    double-buffered: mbarriers ``xready`` (both halves written) and ``xfree`` (both consumers done
    reading the other's) per buffer, one arrival per warpgroup."""
    (dk_desc, dv_desc, k_bufs, v_bufs, kv_bar, bars, ring, LSE, DELTA, DQ_ACC, p_x, s_x, kv_free, sched, DK, DV,
     Hq, Hkv, Nq, Nk, qk_scale, sm_scale, DQ_SEM, DQ_BARS) = args
    q_bufs, do_bufs, ready, empty = ring
    STAGES: gl.constexpr = q_bufs.shape[0]
    BLOCK_M: gl.constexpr = q_bufs.shape[3]
    D: gl.constexpr = q_bufs.shape[4]
    ROWS: gl.constexpr = k_bufs.shape[3]
    HALF: gl.constexpr = BLOCK_M // 2   # the queries of a Q tile whose scores this consumer computes
    DH: gl.constexpr = D // 2           # the dK/dV columns it keeps,
    COL0: gl.constexpr = WG * DH        # from this one on
    OTHER: gl.constexpr = 1 - WG
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, DH, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    first, n_tiles, unmasked = _q_range(start_n, Nq, Nk, BLOCK_M, ROWS, CAUSAL)
    keys = start_n + gl.arange(0, ROWS, layout=key_layout)
    ragged = start_n + ROWS > Nk
    offset = Nk - Nq
    k_t = k_bufs.index(0).reshape([ROWS, D])
    v_t = v_bufs.index(0).reshape([ROWS, D])
    dk = gl.zeros([ROWS, DH], gl.float32, acc_layout)
    dv = gl.zeros([ROWS, DH], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, t & 1)
    for g in range(GROUP):
        bh = (b * Hq + h_kv * GROUP + g).to(gl.int64)
        for j in range(n_tiles):
            row0 = _q_tile_row(first, j, n_tiles, start_n, ROWS, BLOCK_M, WALK)
            queries = row0 + WG * HALF + gl.arange(0, HALF, layout=query_layout)
            lse = gl.load(LSE + bh * Nq + queries, mask=queries < Nq, other=float("inf"))
            delta = gl.load(DELTA + bh * Nq + queries, mask=queries < Nq, other=0.0)
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            q_t = q_bufs.index(s).reshape([BLOCK_M, D])
            do_t = do_bufs.index(s).reshape([BLOCK_M, D])
            q_mine = q_t.slice(WG * HALF, HALF, dim=0)
            do_mine = do_t.slice(WG * HALF, HALF, dim=0)
            st = warpgroup_mma(k_t, q_mine.permute((1, 0)), gl.zeros([ROWS, HALF], gl.float32, s_layout),
                               use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_t, do_mine.permute((1, 0)), gl.zeros([ROWS, HALF], gl.float32, s_layout),
                                use_acc=False, is_async=True)
            st = warpgroup_mma_wait(1, deps=(st, ))
            need_mask = ragged
            if CAUSAL:
                need_mask = need_mask | (row0 < unmasked)
            pt = _probabilities_t(st, lse, keys, queries, qk_scale, need_mask, Nk, offset, CAUSAL)
            x = it % 2
            use = it // 2
            # Exchange buffer x was last read by the other consumer two Q tiles ago (a fresh mbarrier
            # counts as "phase 1 completed": the first two tiles do not wait).
            mbarrier.wait(bars.index(4 + x), (use & 1) ^ 1)
            p_x.index(2 * x + WG).store(pt.to(dtype))
            dpt = warpgroup_mma_wait(0, deps=(dpt, ))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            s_x.index(2 * x + WG).store(dst.to(dtype))
            fence_async_shared()
            mbarrier.arrive(bars.index(2 + x))  # my halves are in
            pt_op = gl.convert_layout(pt.to(dtype), op_layout)
            dst_op = gl.convert_layout(dst.to(dtype), op_layout)
            dv = warpgroup_mma(pt_op, do_mine.slice(COL0, DH, dim=1), dv, is_async=True)
            dk = warpgroup_mma(dst_op, q_mine.slice(COL0, DH, dim=1), dk, is_async=True)
            mbarrier.wait(bars.index(2 + x), use & 1)  # and the other's
            dv = warpgroup_mma(p_x.index(2 * x + OTHER), do_t.slice(OTHER * HALF, HALF, dim=0).slice(COL0, DH, dim=1),
                               dv, is_async=True)
            dk = warpgroup_mma(s_x.index(2 * x + OTHER), q_t.slice(OTHER * HALF, HALF, dim=0).slice(COL0, DH, dim=1),
                               dk, is_async=True)
            dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
            mbarrier.arrive(bars.index(4 + x))  # done reading the other's halves in buffer x
            _signal(empty.index(s))
            it += 1
    _store_halves(dk * sm_scale, dv, k_bufs, v_bufs, bars, kv_free, dk_desc, dv_desc, b, h_kv, start_n, t & 1,
                  WG, COL0, PERSISTENT)
    return it


@gluon.jit
def _program_tile(item, n_tiles, heads, chunk, group):
    """(tile, batch·head) of work item ``item`` of ``n_tiles`` per batch·head over ``heads`` batch·heads,
    ordered as :func:`program_order` says: the batch·heads in groups of ``group``, one group after
    another, and within a group the tiles in chunks of ``chunk`` across its batch·heads."""
    per_group = group * n_tiles
    first_head = item // per_group * group
    in_group = gl.minimum(group, heads - first_head)
    r = item % per_group
    per_chunk = chunk * in_group
    first = r // per_chunk * chunk
    in_chunk = gl.minimum(chunk, n_tiles - first)
    r = r % per_chunk
    return first + r % in_chunk, first_head + r // in_chunk


@gluon.jit
def _items(sched):
    """How many work items (K/V tile, batch·K/V head) the grid has: ``sched`` is (K/V tiles per
    batch·head, batch·heads, ``tiles_per_chunk``, ``heads_per_group``, K/V heads)."""
    n_tiles, heads, chunk, group, Hkv = sched
    return n_tiles * heads


@gluon.jit
def _item_coords(item, sched, ROWS_TOTAL: gl.constexpr):
    """(batch, K/V head, first key) of work item ``item``. A program walks the items from its own index
    on in steps of the grid's size: one item where the grid has a program per item, several where it has
    one per SM (:data:`PERSISTENT_DKDV`). Producer and consumers ask the same."""
    n_tiles, heads, chunk, group, Hkv = sched
    pid_n, bh = _program_tile(item, n_tiles, heads, chunk, group)
    return bh // Hkv, bh % Hkv, pid_n * ROWS_TOTAL


@gluon.jit(do_not_specialize=["Hq", "Hkv", "Nq", "Nk", "tiles_per_chunk", "heads_per_group", "heads"])
def ws_bwd_dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_tail_desc, k_tail_desc, v_tail_desc,
                       do_tail_desc, dk_tail_desc, dv_tail_desc, LSE, DELTA, DQ_ACC, DQ_TAIL_ACC, DQ_SEM, DK, DV,
                       qk_scale, sm_scale,
                       Hq, Hkv, Nq, Nk, tiles_per_chunk, heads_per_group, heads,
                       STAGES: gl.constexpr, CONSUMERS: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                       HEAD_DIM: gl.constexpr, ATOMICS: gl.constexpr, SPLIT_D: gl.constexpr,
                       SHARE_SCORES: gl.constexpr, AHEAD: gl.constexpr, WALK: gl.constexpr, LAG: gl.constexpr,
                       COMPACT_STATS: gl.constexpr, EARLY_RELEASE: gl.constexpr, PREFETCH_STATS: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, PERSISTENT: gl.constexpr,
                       DQ_WRITER: gl.constexpr = False, DQ_BUFFERS: gl.constexpr = 1,
                       DQ_WRITERS: gl.constexpr = 1, DQ_FIRST_STORES: gl.constexpr = False):
    """Work items (K/V tile of ``CONSUMERS / SPLIT_D × 64`` rows, batch·K/V head) over ``heads``
    batch·K/V heads, in the order ``tiles_per_chunk`` and ``heads_per_group`` give (:func:`program_order`):
    one program per item, or (``PERSISTENT``, a grid of one program per SM) each program walking every
    grid-size-th item, the next item's K/V tiles loaded as soon as the consumers are done reading this
    one's and its dK/dV stored from the registers (``DK``, ``DV``: the contiguous gradients). ``q_tail_desc`` ... ``dv_tail_desc``: None, or the
    head-dim tail's descriptors (the columns from the main tiles' width on); with fused dQ,
    ``DQ_TAIL_ACC`` the fp32 accumulator's tail descriptor. See the module docstring."""
    ROWS: gl.constexpr = k_desc.block_type.shape[2]
    KV_TILES: gl.constexpr = CONSUMERS // SPLIT_D
    if PERSISTENT:  # what a program needs to find its items
        sched = (gl.cdiv(Nk, ROWS * KV_TILES), heads, tiles_per_chunk, heads_per_group, Hkv)
    else:  # its one item, found here as before the persistent grid (fewer values into the partitions)
        pid = gl.program_id(0)
        if DQ_SEM is not None:
            if CAUSAL:  # ordered dQ: the grid's order backwards, a head's last K/V tile first (_ordered_dq_rank)
                pid = gl.num_programs(0) - 1 - pid
        sched = _item_coords(pid, (gl.cdiv(Nk, ROWS * KV_TILES), heads, tiles_per_chunk,
                                   heads_per_group, Hkv), ROWS * KV_TILES)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [KV_TILES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [KV_TILES] + v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # SPLIT_D's epilogue (0, 1; fused dQ's "pair" meets on 0 before its epilogue) and the exchange's
    # "ready" (2, 3) and "free" (4, 5) per buffer, of SHARE_SCORES' scores or the pair's dSᵀ tiles
    out_bar = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_free, count=CONSUMERS)  # one arrival per consumer warpgroup, once per item
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)  # one arrival per consumer warpgroup
    for i in gl.static_range(6):
        mbarrier.init(out_bar.index(i), count=CONSUMERS)
    ring = (q_bufs, do_bufs, ready, empty)
    # The head-dim tail's tiles, one per main tile; with fused dQ, one fp32 buffer per consumer for the
    # tail columns' share of dQ.
    q_tail_bufs = _tiles_like(q_tail_desc, STAGES, q_bufs)
    do_tail_bufs = _tiles_like(do_tail_desc, STAGES, do_bufs)
    k_tail_bufs = _tiles_like(k_tail_desc, KV_TILES, k_bufs)
    v_tail_bufs = _tiles_like(v_tail_desc, KV_TILES, v_bufs)
    dq_tail_stages = _tiles_like(DQ_TAIL_ACC, CONSUMERS * DQ_BUFFERS, k_tail_bufs)
    tail = (dk_tail_desc, dv_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs, DQ_TAIL_ACC,
            dq_tail_stages)
    producer_tail = (q_tail_desc, k_tail_desc, v_tail_desc, do_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs,
                     do_tail_bufs)
    ds_bufs = k_bufs  # (unused without fused dQ)
    if DQ_ACC is not None:  # one dSᵀ tile per consumer, the fused dQ product's operand ("pair": two sets)
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_M], q_desc.dtype)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * (2 if ATOMICS == "pair" else 1), ROWS, BLOCK_M],
                                            ds_layout)
    dq_stages = k_bufs  # (unused but with the bulk reduce)
    if DQ_ACC is not None and ATOMICS == "tma":  # per consumer, one fp32 buffer per D-slice of the dQ tile
        dq_block: gl.constexpr = DQ_ACC.block_type.shape
        dq_stages = gl.allocate_shared_memory(gl.float32, [CONSUMERS * (k_desc.block_type.shape[3] // dq_block[3])]
                                              + dq_block, DQ_ACC.layout)
    if DQ_ACC is not None and ATOMICS == "pair":  # per consumer, an fp32 buffer for its slice (a writer's: DQ_BUFFERS)
        pair_block: gl.constexpr = DQ_ACC.block_type.shape
        dq_stages = gl.allocate_shared_memory(gl.float32, [CONSUMERS * DQ_BUFFERS] + pair_block, DQ_ACC.layout)
    if SHARE_SCORES:  # Pᵀ and dSᵀ halves, [2 · buffer + consumer]: what _consumer_shared_scores exchanges
        BM: gl.constexpr = q_desc.block_type.shape[2]
        x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BM // 2], q_desc.dtype)
        ds_bufs = gl.allocate_shared_memory(q_desc.dtype, [4, ROWS, BM // 2], x_layout)
        dq_stages = gl.allocate_shared_memory(q_desc.dtype, [4, ROWS, BM // 2], x_layout)
    if DQ_WRITER:
        # ordered dQ's writer warp: per stage buffer (consumer · DQ_BUFFERS + buffer), "full", then "empty"
        dq_bars = gl.allocate_shared_memory(gl.int64, [4 * DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4 * DQ_BUFFERS):
            mbarrier.init(dq_bars.index(i), count=1)
    args = (dk_desc, dv_desc, k_bufs, v_bufs, kv_bar, out_bar, ring, LSE, DELTA, DQ_ACC, ds_bufs, dq_stages, kv_free,
            sched, DK, DV, Hq, Hkv, Nq, Nk, qk_scale, sm_scale, DQ_SEM, dq_bars if DQ_WRITER else _NONE)
    producer_args = (q_desc, do_desc, k_desc, v_desc, k_bufs, v_bufs, kv_bar, kv_free, ring, producer_tail, sched,
                     Nq, Nk, GROUP, CAUSAL, WALK)
    if SHARE_SCORES:
        gl.warp_specialize([
            (_consumer_shared_scores, (args, 0, GROUP, CAUSAL, WALK)),
            (_consumer_shared_scores, (args, 1, GROUP, CAUSAL, WALK)),
            (_producer, producer_args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif DQ_WRITER and DQ_WRITERS == 2:  # a writer warp per column slice (DQ_WRITER_PER_SLICE)
        gl.warp_specialize([
            (_consumer, (args, tail, 0, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_consumer, (args, tail, 1, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_producer, producer_args),
            (_dq_writer, ((DQ_ACC, dq_stages, dq_bars, DQ_SEM, sched, Hq, Nq, Nk), tail, GROUP, CAUSAL,
                          ROWS * KV_TILES, k_desc.block_type.shape[3] // DQ_ACC.block_type.shape[3], 0,
                          DQ_FIRST_STORES)),
            (_dq_writer, ((DQ_ACC, dq_stages, dq_bars, DQ_SEM, sched, Hq, Nq, Nk), tail, GROUP, CAUSAL,
                          ROWS * KV_TILES, k_desc.block_type.shape[3] // DQ_ACC.block_type.shape[3], 1,
                          DQ_FIRST_STORES)),
        ], [4, 1, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif DQ_WRITER:
        gl.warp_specialize([
            (_consumer, (args, tail, 0, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_consumer, (args, tail, 1, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_producer, producer_args),
            (_dq_writer, ((DQ_ACC, dq_stages, dq_bars, DQ_SEM, sched, Hq, Nq, Nk), tail, GROUP, CAUSAL,
                          ROWS * KV_TILES, k_desc.block_type.shape[3] // DQ_ACC.block_type.shape[3], -1,
                          DQ_FIRST_STORES)),
        ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
    elif CONSUMERS == 1:
        gl.warp_specialize([
            (_consumer, (args, tail, 0, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_producer, producer_args),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (args, tail, 0, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_consumer, (args, tail, 1, GROUP, CAUSAL, HEAD_DIM, ATOMICS, SPLIT_D, AHEAD, WALK, LAG,
                         COMPACT_STATS, EARLY_RELEASE, PREFETCH_STATS)),
            (_producer, producer_args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# ------------------------------------------------------------------------------------------ host side



def order_chunk(work: list[int], heads: int, sms: int, heavy_first: int | str | None = None) -> int:
    """The kernels' ``tiles_per_chunk`` for a causal grid of ``len(work)`` tiles per batch·head
    (``work``: each tile's work in launch order, :func:`causal_dkdv_work` or :func:`causal_dq_work`) on
    ``sms`` SMs, as ``heavy_first`` (default :data:`HEAVY_FIRST`) says. (A non-causal grid's programs
    all do the same work: it runs one batch·head after another, ``tiles_per_chunk`` = its tiles.)"""
    n_tiles = len(work)
    chunk = HEAVY_FIRST if heavy_first is None else heavy_first
    if chunk == "auto":
        return auto_chunk(tuple(work), heads, sms)
    return min(chunk, n_tiles) if chunk > 0 else n_tiles


@functools.lru_cache(maxsize=256)
def auto_chunk(work: tuple[int, ...], heads: int, sms: int) -> int:
    """:data:`AUTO_CHUNK` if the model (:func:`makespan`) ends that order at least :data:`AUTO_MIN_GAIN`
    of the balanced time earlier than head by head, else ``len(work)`` (head by head). A list schedule
    ends at most one program's work after the balanced time (Graham's bound), so where the heaviest
    program is under that share no order can gain it and nothing is simulated."""
    n_tiles = len(work)
    chunk = min(AUTO_CHUNK, n_tiles)
    balanced = sum(work) * heads / sms
    if chunk == n_tiles or balanced == 0 or max(work) < AUTO_MIN_GAIN * balanced:
        return n_tiles

    def end(c):
        return makespan([work[t] for t, _ in program_order(n_tiles, heads, c)], sms)

    return chunk if end(n_tiles) - end(chunk) >= AUTO_MIN_GAIN * balanced else n_tiles


def program_order(n_tiles: int, heads: int, chunk: int, group: int = 0) -> list[tuple[int, int]]:
    """(tile, batch·head) of each program in launch order, as the kernels decode it (``_program_tile``):
    the batch·heads in groups of ``group`` (0: one group of all), one group after another; within a
    group the tiles in chunks of ``chunk``, each chunk across the group's batch·heads before the next.
    ``chunk`` = ``n_tiles`` is one batch·head after another, whatever the groups."""
    group = heads if group <= 0 else min(group, heads)
    out = []
    per_group = group * n_tiles
    for pid in range(n_tiles * heads):
        first_head = pid // per_group * group
        in_group = min(group, heads - first_head)
        r = pid % per_group
        per_chunk = chunk * in_group
        first = r // per_chunk * chunk
        in_chunk = min(chunk, n_tiles - first)
        r = r % per_chunk
        out.append((first + r % in_chunk, first_head + r // in_chunk))
    return out


def heads_in_flight(order: list[tuple[int, int]], sms: int) -> int:
    """The most batch·heads among any ``sms`` programs next to each other in launch ``order``: about how
    many batch·heads' Q and dO tiles (and fused dQ accumulators) the programs running at once read."""
    if len(order) <= sms:
        return len({h for _, h in order})
    counts: dict[int, int] = {}
    for _, h in order[:sms]:
        counts[h] = counts.get(h, 0) + 1
    most = len(counts)
    for (_, gone), (_, new) in zip(order, order[sms:]):
        counts[gone] -= 1
        if not counts[gone]:
            del counts[gone]
        counts[new] = counts.get(new, 0) + 1
        most = max(most, len(counts))
    return most


def causal_order(work: list[int], heads: int, sms: int, heavy_first: int | str | None = None,
                 head_group: int | str | None = None) -> dict:
    """The kernels' order arguments for a causal grid of ``len(work)`` tiles per batch·head on ``sms``
    SMs, ``tiles_per_chunk`` and ``heads_per_group``: :func:`auto_order`'s where both switches are
    ``auto`` (:data:`HEAVY_FIRST`, :data:`HEAD_GROUP`, or the arguments), else the chunk
    :func:`order_chunk` gives in groups of the forced size (0 or ``auto``: all ``heads``)."""
    chunk = HEAVY_FIRST if heavy_first is None else heavy_first
    group = HEAD_GROUP if head_group is None else head_group
    if chunk == "auto" and group == "auto":
        chunk, group = auto_order(tuple(work), heads, sms)
        return dict(tiles_per_chunk=chunk, heads_per_group=group)
    group = heads if group == "auto" or group <= 0 else min(group, heads)
    return dict(tiles_per_chunk=order_chunk(work, heads, sms, chunk), heads_per_group=group)


@functools.lru_cache(maxsize=256)
def auto_order(work: tuple[int, ...], heads: int, sms: int) -> tuple[int, int]:
    """(tiles per chunk, batch·heads per group) of a causal grid: of the orders head by head, chunks of
    one tile within groups of 2, 4, 8, ... batch·heads, and chunks of :data:`AUTO_CHUNK` across every
    batch·head, the first in that list (the smallest groups first, so that the programs side by side
    read few batch·heads' Q and dO and share them in L2) whose modelled end (:func:`makespan`) is within
    :data:`AUTO_MIN_GAIN` of the balanced time of the best one's. Where the heaviest program is under that share no order can gain it and
    the grid runs head by head without a simulation (Graham's bound, as :func:`auto_chunk`)."""
    n_tiles = len(work)
    balanced = sum(work) * heads / sms
    if n_tiles == 1 or balanced == 0 or max(work) < AUTO_MIN_GAIN * balanced:
        return n_tiles, heads
    candidates = [(n_tiles, heads)]
    group = 2
    while group < heads:
        candidates.append((1, group))
        group *= 2
    candidates.append((min(AUTO_CHUNK, n_tiles), heads))
    ends = [makespan([work[t] for t, _ in program_order(n_tiles, heads, c, g)], sms) for c, g in candidates]
    best = min(ends)
    return next(c for c, end in zip(candidates, ends) if end <= best + AUTO_MIN_GAIN * balanced)


def causal_dkdv_work(Nq: int, Nk: int, kv_rows: int = 128, block_m: int = 64, group: int = 1) -> list[int]:
    """Per K/V tile of ``kv_rows`` keys, the Q tiles of ``block_m`` rows a causal dK/dV program multiplies
    (``_q_range``'s count, bottom-right aligned), times the ``group`` query heads it walks: the work
    :func:`makespan` schedules."""
    return [group * cdiv(Nq - max(t * kv_rows - (Nk - Nq), 0) // block_m * block_m, block_m)
            for t in range(cdiv(Nk, kv_rows))]


def causal_dq_work(Nq: int, Nk: int, q_rows: int = 128, block_n: int = 128) -> list[int]:
    """Per query block of ``q_rows`` rows in the dQ kernel's launch order (last rows first), the K/V tiles
    of ``block_n`` keys it walks (bottom-right aligned, as ``_kv_range`` counts them)."""
    n_tiles = cdiv(Nq, q_rows)
    return [cdiv(max(min((t + 1) * q_rows + Nk - Nq, Nk), 0), block_n) for t in reversed(range(n_tiles))]


#: The SMs a plan made without a GPU (meta tensors: the CPU tests, a compiler's trace) models: the H200's.
SMS_WITHOUT_A_GPU = 132


@functools.lru_cache(maxsize=8)
def sm_count(device) -> int:
    """The GPU's SMs: how many programs of these kernels run at once (one each)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return SMS_WITHOUT_A_GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def makespan(work: list[float], sms: int) -> float:
    """When the last of these programs ends if each SM runs one at a time and takes the next in list
    order as it frees up (the GPU's block scheduler, modelled: one resident program per SM, as these
    kernels' shared memory and registers allow)."""
    import heapq

    free = [0.0] * sms
    for w in work:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def ordered_dq_makespan(order: list[tuple[int, int]], Nq: int, Nk: int, block_m: int, block_n: int, causal: bool,
                        sms: int, turn: int) -> float:
    """When the last program of a grid with ordered dQ ends, in Q-tile times, as :func:`makespan`
    schedules programs (``order``: (K/V tile, batch·head) in launch order, from :func:`program_order`,
    reversed for causal as the kernel runs it). Each program visits its Q tiles (:func:`visited_q_rows`),
    one time unit each, and adds to each at the end of its time, but not before the program ahead of it in
    that tile's order (:func:`ordered_dq_rank`) has handed the turn on: at its own add ``turn`` tiles
    later, or at its end. A program holds its SM while it waits. (A model: the add's own cost and a
    consumer's overlap of one tile's add with the next are left out.)"""
    import heapq

    visits = [list(visited_q_rows(j * block_n, Nq, Nk, block_m, causal)) for j in range(cdiv(Nk, block_n))]
    ahead = {}  # (rank, first row of a Q tile) -> the K/V tile that takes that turn at that tile
    for j, rows in enumerate(visits):
        for row0 in rows:
            ahead[ordered_dq_rank(j * block_n, row0, Nq, Nk, block_m, block_n, causal), row0] = j
    free = [0.0] * sms
    handed: dict = {}  # (K/V tile, head) -> {Q tile row: when it handed that tile's turn on}
    end = 0.0
    for j, h in order:
        t = heapq.heappop(free)
        adds = []
        for row0 in visits[j]:
            rank = ordered_dq_rank(j * block_n, row0, Nq, Nk, block_m, block_n, causal)
            t = max(t + 1, handed[ahead[rank - 1, row0], h][row0] if rank else 0.0)  # (the turn before ours)
            adds.append(t)
        handed[j, h] = {row0: adds[min(i + turn, len(adds) - 1)] for i, row0 in enumerate(visits[j])}
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def kernel_options(consumers: int) -> tuple[int, int, dict]:
    """(consumer registers, producer registers, launch options): the forward's budget
    (``hopper_ws.register_budget``): with two consumers the producer keeps its minimum and each
    consumer takes 240 (dK and dV in fp32 are 2 · D / 2 registers per thread on their own)."""
    consumer_regs, producer_regs, maxnreg = register_budget(consumers)
    return consumer_regs, producer_regs, {"maxnreg": maxnreg}


def _dq_descriptor(dq_acc, D: int, block_m: int) -> GluonTensorDescriptor:
    """The fp32 dQ accumulator's TMA descriptor for the bulk reduce: boxes of a Q tile's ``block_m``
    rows by the D-slice the fused dQ product makes (``_consumer``'s ``DQ_COLS``) of tiles ``D`` wide
    (the main part's, or the head-dim tail's)."""
    block = [1, 1, block_m, 64 if D > 64 else D]
    return GluonTensorDescriptor(dq_acc, list(dq_acc.shape), list(dq_acc.stride()), block,
                                 gl.NVMMASharedLayout.get_default_for(block, gl.float32))


def tile_widths(D: int, pad: bool = False) -> tuple[int, int]:
    """(main, tail): the column widths of the Hopper backward kernels' tiles at head dim ``D``: the
    forward's (``hopper_ws.tile_widths``: D 72-80 as 64 + 16, 88-96 as 64 + 32) where one consumer
    keeps dK and dV whole (up to 128 columns); else, or with ``pad``, the next power of two (above 128
    the consumers split the head dim). D 40-48 stay in 64 columns: as 32 + 16 their backward measured
    slower on the H200 (4.93 ms against 4.35 at D 48, bf16, N 4096): products 16 and 32 wide use the
    tensor cores worse than one 64 wide, and fused dQ then needs two products and two reduces."""
    padded = padded_head_dim(D)
    if padded > SPLIT_ABOVE:
        return padded, 0
    return hopper_ws.tile_widths(D, pad)


def fused_dq_takes_tail(block_m: int, consumers: int) -> bool:
    """Whether fused dQ runs beside a head-dim tail with these tiles: where the two consumers add once
    per pair and take turns by Q tile (a 64-column main part: one slice), with 64-row Q tiles, since
    the tail's dQ product has the queries as its M (a 16- or 32-column tail cannot be wgmma's M, which
    the transposed product of 32-row tiles needs)."""
    return FUSED_DQ_ATOMICS == "pair" and consumers == 2 and block_m == 64


def first_row_stats_early(columns: int, causal: bool) -> bool:
    """Whether a consumer asks for its first Q tile's row statistics before the K/V wait
    (:data:`FIRST_ROW_STATS_EARLY`): without a causal mask at up to 64 dK/dV ``columns``, where it
    measured faster in every cell, 0.3-5 % (the fewer Q tiles a program has, the more: BERT's and
    ViT's 257-512 tokens, a batch of 128-token items); not causal or from 80 columns on, where it read
    0-2 % slower, within what two runs of one kernel differ by (an H100,
    ``experiments/backward_switches.py``, performance-log entry 82)."""
    return FIRST_ROW_STATS_EARLY and not causal and columns <= 64


def joined_row_stats(columns: int, block_m: int) -> bool:
    """Whether a consumer spreads its two row statistics in one conversion (:data:`JOINED_ROW_STATS`):
    where its live fp32 tiles leave room for the Δs to live 16 registers longer, ``columns`` (the dK and
    dV columns it keeps, a tail's included: one register per column for the two) plus ``block_m`` (the
    scores and dPᵀ) at most 128 registers per thread. Compiled for sm_90a
    (``experiments/backward_spills.py --switch JOINED_ROW_STATS``): at D 64 with 32- and 64-row Q tiles
    joining changed a kernel's spills by 12 bytes per thread at most; at D 96 and 128 with 64-row tiles,
    and at D 64 with 128-row ones, it took them from 0-80 bytes to 20-420 (compiled before this limit)."""
    return JOINED_ROW_STATS and columns + block_m <= 128


def _tail_descriptors(tensors: dict, rows: dict, main: int, tail: int) -> dict:
    """``{role}_tail_desc`` for each of ``tensors``: TMA tiles of ``rows[role]`` rows by the ``tail``
    columns from ``main`` on (zero-filled past the head dim on load, clipped on store); all None
    without a tail."""
    return {f"{role}_tail_desc": descriptor(t, (1, 1, rows[role], tail)) if tail else None
            for role, t in tensors.items()}


def ordered_dq_takes(consumers: int, reorder: bool = False) -> bool:
    """Whether fused dQ can add in a fixed order (:func:`_ordered_dq_turn`) with these tiles: where the
    two consumers add once per pair (:data:`FUSED_DQ_ATOMICS` "pair"), each tile in its own turn (none
    of the switches that move a tile's add into the next tile's turn, nor the staggered tile order)."""
    return (FUSED_DQ_ATOMICS == "pair" and consumers == 2 and not reorder
            and not (FUSED_DQ_AHEAD or FUSED_DQ_LAG or FUSED_DQ_STAGGER))


def q_walk(causal: bool, *, fused_dq: bool = False, ordered: bool = False, reorder: bool = False) -> int:
    """The order the dK/dV kernel's programs walk their Q tiles in: staggered where fused dQ is reordered
    (:data:`FUSED_DQ_STAGGER`, or a ``-r`` config), down from the last tile where the problem is causal and
    :data:`CAUSAL_WALK_DOWN` is on (not with ordered dQ: its turns follow the walk up), else up."""
    if fused_dq and (FUSED_DQ_STAGGER or reorder):
        return WALK_STAGGERED
    return WALK_DOWN if causal and CAUSAL_WALK_DOWN and not ordered else WALK_UP


def ordered_dq_first_stores(ordered: bool) -> bool:
    """Whether ordered dQ's first add of each tile stores (:data:`ORDERED_DQ_FIRST_STORES`): with its turns
    taken by the writer (:data:`ORDERED_DQ_WRITER`), so that the accumulator need not be zeroed first."""
    return ordered and ORDERED_DQ_WRITER and ORDERED_DQ_FIRST_STORES


def ordered_dq_rank(start_n: int, row0: int, Nq: int, Nk: int, block_m: int, block_n: int, causal: bool) -> int:
    """:func:`_ordered_dq_rank` on the host (the tests check the order it gives: each tile's adders take
    the turns 0, 1, ... once each, and each waits only for a program started before it)."""
    j = start_n // block_n
    if causal:
        return min(cdiv(Nk, block_n), (row0 + block_m - 1 + Nk - Nq) // block_n + 1) - 1 - j
    return j


def visited_q_rows(start_n: int, Nq: int, Nk: int, block_m: int, causal: bool) -> range:
    """The first rows of the Q tiles the program whose K/V rows start at ``start_n`` visits, in its order
    (:func:`_q_range` on the host, no stagger)."""
    first = max(start_n - (Nk - Nq), 0) // block_m * block_m if causal else 0
    return range(first, Nq, block_m)


#: Ordered dQ without a mask: spread a head's K/V tiles apart in the grid's order (:func:`ordered_dq_heads`);
#: off (``LAB_ORDERED_DQ_SPREAD=0``), head by head, where they start side by side and wait for each other.
ORDERED_DQ_SPREAD = os.environ.get("LAB_ORDERED_DQ_SPREAD", "1") == "1"

#: Ordered dQ's turns taken by a dQ-writer warp (:func:`_dq_writer`); off (``LAB_ORDERED_DQ_WRITER=0``), by the
#: consumers themselves (:func:`_ordered_dq_turn` in :func:`_pair_dq`), the rung below, 1.3-1.4x slower at D 64
#: on an H100 (performance-log entry 95).
ORDERED_DQ_WRITER = os.environ.get("LAB_ORDERED_DQ_WRITER", "1") == "1"
#: Stage buffers per consumer for the dQ writer (``LAB_DQ_WRITER_BUFFERS``, 1 or 2). With two (where they fit
#: the shared memory, :func:`dq_writer_buffers`) a consumer may store its share of the next Q tile while the
#: writer still waits for the last one's turn, a tile ahead of the writer. Timed on an H100 (performance-log
#: entry 96) that bought nothing at D 64 and cost 1-5 points at D 128, where the kernel spills more: one it is.
DQ_WRITER_BUFFERS = int(os.environ.get("LAB_DQ_WRITER_BUFFERS", "1"))
if DQ_WRITER_BUFFERS not in (1, 2):
    raise ValueError(f"LAB_DQ_WRITER_BUFFERS must be 1 or 2, got {DQ_WRITER_BUFFERS}")
#: A dQ-writer warp per column slice where each consumer adds its own 64 of a Q tile's 128 columns (D above
#: 64; ``LAB_DQ_WRITER_PER_SLICE=0`` for one writer): one warp takes the two slices' turns one after the other,
#: so a late turn of one holds up the other's add; two take them side by side, in the third warpgroup beside
#: the producer. On an H100 that took ordered dQ at D 128 from +15-19 % over fused dQ to +7.5-12 % (Llama 3
#: 8B's grouped, causal cell from +39-43 % to +25-26 %), performance-log entry 98.
DQ_WRITER_PER_SLICE = os.environ.get("LAB_DQ_WRITER_PER_SLICE", "1") == "1"
#: Ordered dQ with the writer: each tile's first add (turn 0) *stores* its share, by a TMA store, instead of
#: adding it (``LAB_ORDERED_DQ_FIRST_STORES``). Then nothing need zero the fp32 accumulator first: the Δ
#: pre-pass writes Δ and zeroes the semaphores (a few bytes per Q tile) instead of the accumulator's four
#: bytes per element (``backward.plan_backward``); only rows that no K/V tile sees (causal with Nq > Nk)
#: are zeroed. The adds in a fixed order are what make this possible: fused dQ without one cannot tell
#: which add comes first. Timed on an H100 (performance-log entry 99), the deterministic backward on ordered
#: dQ 1.0-8.6 points faster in each of six cells, from +2.9 to -2.6 % over the default plan at D 64 N 1024 and
#: from +8.3 to -0.3 % at GPT-2's shape. On; ``LAB_ORDERED_DQ_FIRST_STORES=0`` for the zeroed accumulator.
ORDERED_DQ_FIRST_STORES = os.environ.get("LAB_ORDERED_DQ_FIRST_STORES", "1") == "1"


def dkdv_shared_bytes(block_m: int, main: int, tail: int, stages: int, consumers: int, element_bytes: int, *,
                      fused_dq: bool = False, dq_buffers: int = 0) -> int:
    """Shared memory of one dK/dV program (one tile per K/V tile and ring slot, the head-dim tail's beside
    each), bytes: the resident K and V tiles, ``stages`` slots of Q and dO; with fused dQ added once per pair
    of consumers (``fused_dq``), the two sets of dSᵀ exchange tiles and ``dq_buffers`` fp32 stage buffers
    per consumer (one, or a writer's :data:`DQ_WRITER_BUFFERS`) of the Q tile by 64 columns (and the tail's)."""
    width = main + tail
    total = (2 * consumers * ROWS_PER_CONSUMER + 2 * stages * block_m) * width * element_bytes
    if fused_dq:
        total += 2 * consumers * ROWS_PER_CONSUMER * block_m * element_bytes
        total += consumers * dq_buffers * block_m * (min(main, 64) + tail) * 4
    return total


def dq_writer_buffers(block_m: int, main: int, tail: int, stages: int, consumers: int, element_bytes: int,
                      arch: int = 90) -> int:
    """The dQ writer's stage buffers per consumer: :data:`DQ_WRITER_BUFFERS` where they fit the shared
    memory of an sm_``arch`` block (the kernel's: sm_90; a kilobyte left for the barriers and alignment),
    else one."""
    limit = SHARED_MEMORY_LIMIT.get(arch, 99 * 1024) - 1024
    for buffers in range(DQ_WRITER_BUFFERS, 1, -1):
        if dkdv_shared_bytes(block_m, main, tail, stages, consumers, element_bytes, fused_dq=True,
                             dq_buffers=buffers) <= limit:
            return buffers
    return 1


def ordered_dq_heads(q_tiles: int, heads: int, sms: int, turn: int) -> int:
    """Batch·heads per group of the grid's order for ordered dQ without a mask (``heads_per_group`` of
    :func:`program_order`, chunks of one K/V tile). K/V tile ``j`` of a head adds to each Q tile after tile
    ``j − 1`` has, and tile ``j − 1`` hands the turn on ``turn`` Q tiles later (at the next add of the one
    taking the turns: 2 where the consumers take them and take turns by Q tile, 1 where each adds its
    columns of every tile or a dQ writer takes them all), so
    ``j`` should start about ``turn`` Q tiles after ``j − 1``, or it holds its SM waiting. Head by head,
    the GPU starts a head's K/V tiles a few hundred cycles apart; with the tiles of ``g`` heads
    interleaved, program ``j`` starts about ``g / sms`` of a program's ``q_tiles`` after ``j − 1``. The
    smallest power of two that makes that twice ``turn`` (a margin for programs that run unevenly)."""
    group = 1
    while group < heads and group * q_tiles < 2 * turn * sms:
        group *= 2
    return min(group, heads)


def ordered_dq_semaphores(B: int, Hq: int, Nq: int, device) -> torch.Tensor:
    """Zeroed int32 semaphores for ordered dQ: one per batch·query head, dQ column slice (two at most:
    D 128's consumers each add 64 columns) and Q tile (32 rows at least), more than any config uses."""
    return torch.zeros(B * Hq * 2 * cdiv(Nq, 32), dtype=torch.int32, device=device)


def plan_dkdv(q, k, v, do, dk, dv, lse, delta, *, causal: bool, qk_scale: float, sm_scale: float, block_m: int,
              consumers: int, stages: int, dq_acc=None, share_scores: bool = False, pad: bool = False,
              reorder: bool = False, persistent: bool | None = None, dq_sem=None,
              first_stores: bool | None = None) -> Launch:
    """The launch of ``ws_bwd_dkdv_kernel`` for these tensors: K/V tiles of ``consumers × 64`` rows
    (above 128 columns, one tile of 64 rows whose head dim the two consumers split:
    :func:`split_head_dim`), Q/dO tiles of ``block_m`` rows through ``stages`` slots; with ``dq_acc`` (a
    zeroed fp32 tensor shaped like ``q``) it also adds dQ into it (fused dQ: 64-row Q tiles,
    wgmma's M; 32-row ones too where it adds once per pair of consumers: :func:`fused_dq_block_ms`).
    ``share_scores`` (with the split head dim only): the two consumers compute the scores of a Q tile's
    halves and exchange them (``_consumer_shared_scores``) instead of both computing all. The tiles'
    widths: :func:`tile_widths` (``pad``: the whole power of two, for the ablation). ``reorder`` (fused dQ):
    :data:`FUSED_DQ_STAGGER` and :data:`FUSED_DQ_LAG` for this launch, whatever the module's switches say.
    ``persistent``: a grid of one program per SM walking the items (:data:`PERSISTENT_DKDV` where None),
    where the kernel takes it (contiguous dK and dV, neither ahead nor lagging fused dQ). ``dq_sem`` (with
    ``dq_acc``): ordered dQ, each Q tile's adds in a fixed order (:func:`ordered_dq_semaphores`, zeroed):
    bitwise the same sums every run, on one program per item, the two consumers adding once per pair (their
    turns taken by a writer warp where :data:`ORDERED_DQ_WRITER` is on); ``first_stores``: whether each
    tile's first add stores (:func:`ordered_dq_first_stores` where None; then nothing need zero ``dq_acc``)."""
    if dq_sem is not None and (dq_acc is None or not ordered_dq_takes(consumers, reorder)):
        raise ValueError(f"ordered dQ (dq_sem) adds fused dQ in a fixed order: it needs the fp32 accumulator "
                         f"(dq_acc), two consumers adding once per pair (LAB_FUSED_DQ_ATOMICS=pair), in each "
                         f"tile's own turn (no '-r', LAB_FUSED_DQ_AHEAD, _LAG or _STAGGER); got "
                         f"{consumers} consumer(s), adding by {FUSED_DQ_ATOMICS!r}, reorder={reorder}")
    if first_stores and not (dq_sem is not None and ORDERED_DQ_WRITER):
        raise ValueError("first_stores: a tile's first add stores where ordered dQ's turns are taken by the writer "
                         "warp (dq_sem and ORDERED_DQ_WRITER); the consumers' own turns add into a zeroed accumulator")
    if dq_acc is not None and block_m not in fused_dq_block_ms(consumers):
        raise ValueError(f"fused dQ with {consumers} consumer(s) adding by {FUSED_DQ_ATOMICS!r} takes Q tiles of "
                         f"{' or '.join(map(str, fused_dq_block_ms(consumers)))} rows, got {block_m}")
    B, Hq, Nq, _ = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    D = padded_head_dim(q.shape[-1])  # tiles of the padded width: TMA zero-fills past the head dim
    main, tail = tile_widths(q.shape[-1], pad or (dq_acc is not None and not fused_dq_takes_tail(block_m, consumers)))
    split = split_head_dim(D)
    if split > 1 and (consumers != split or dq_acc is not None):
        raise ValueError(f"above head dim {SPLIT_ABOVE} the Hopper dK/dV kernel splits the head dim between "
                         f"{split} consumer warpgroups and forms no dQ itself: it takes ws configs with c{split} "
                         f"and a dQ kernel of its own, got {consumers} consumer(s)"
                         + (" and fused dQ" if dq_acc is not None else ""))
    if share_scores and split == 1:
        raise ValueError(f"share_scores: the consumers share scores only where they split the head dim (above "
                         f"{SPLIT_ABOVE} columns); got D {q.shape[-1]}")
    rows = (1, 1, ROWS_PER_CONSUMER, main)
    n_tiles = cdiv(Nk, ROWS_PER_CONSUMER * consumers // split)
    lag = FUSED_DQ_LAG or reorder
    persistent = (PERSISTENT_DKDV if persistent is None else persistent) and dk.is_contiguous() and \
        dv.is_contiguous() and not (dq_acc is not None and (FUSED_DQ_AHEAD or lag)) and dq_sem is None
    items = n_tiles * B * Hkv
    # (a pair of one consumer is the per-consumer bulk reduce)
    atomics = "tma" if FUSED_DQ_ATOMICS == "pair" and consumers == 1 else FUSED_DQ_ATOMICS
    writer = dq_sem is not None and ORDERED_DQ_WRITER  # ordered dQ's turns taken by writer warps
    consumer_regs, producer_regs, extra = kernel_options(consumers)
    args = dict(q_desc=descriptor(q, (1, 1, block_m, main)), k_desc=descriptor(k, rows), v_desc=descriptor(v, rows),
                do_desc=descriptor(do, (1, 1, block_m, main)), dk_desc=descriptor(dk, rows),
                dv_desc=descriptor(dv, rows),
                **_tail_descriptors(dict(q=q, k=k, v=v, do=do, dk=dk, dv=dv),
                                    dict(q=block_m, do=block_m, k=ROWS_PER_CONSUMER, v=ROWS_PER_CONSUMER,
                                         dk=ROWS_PER_CONSUMER, dv=ROWS_PER_CONSUMER), main, tail),
                LSE=lse, DELTA=delta, DK=dk, DV=dv,
                DQ_ACC=_dq_descriptor(dq_acc, main, block_m) if dq_acc is not None and atomics in ("tma", "pair")
                else dq_acc,
                DQ_TAIL_ACC=_dq_descriptor(dq_acc, tail, block_m) if dq_acc is not None and tail else None,
                DQ_SEM=dq_sem, qk_scale=qk_scale,
                sm_scale=sm_scale, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, **causal_order(
                    causal_dkdv_work(Nq, Nk, ROWS_PER_CONSUMER * consumers // split, block_m, Hq // Hkv), B * Hkv,
                    sm_count(q.device)) if causal and dq_sem is None
                # (ordered dQ, causal: head by head, which the kernel runs backwards, a head's lightest tile
                # first; not causal: a head's K/V tiles spread apart in the order, ordered_dq_heads)
                else dict(tiles_per_chunk=1, heads_per_group=ordered_dq_heads(
                    Hq // Hkv * cdiv(Nq, block_m), B * Hkv, sm_count(q.device),
                    2 if main <= 64 and not ORDERED_DQ_WRITER else 1))
                if dq_sem is not None and not causal and ORDERED_DQ_SPREAD
                else dict(tiles_per_chunk=n_tiles, heads_per_group=B * Hkv),
                heads=B * Hkv,
                STAGES=stages, CONSUMERS=consumers,
                GROUP=Hq // Hkv, CAUSAL=causal, HEAD_DIM=q.shape[-1], ATOMICS=atomics, SPLIT_D=split,
                SHARE_SCORES=share_scores, AHEAD=FUSED_DQ_AHEAD,
                WALK=q_walk(causal, fused_dq=dq_acc is not None, ordered=dq_sem is not None, reorder=reorder),
                LAG=lag,
                COMPACT_STATS=(2 if joined_row_stats((main + tail) // split, block_m) else 1) if COMPACT_ROW_STATS
                else 0,
                EARLY_RELEASE=EARLY_SLOT_RELEASE,
                PREFETCH_STATS=(2 if PREFETCH_ROW_STATS else 1 if first_row_stats_early((main + tail) // split, causal)
                                else 0) if COMPACT_ROW_STATS else 0,
                CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, PERSISTENT=persistent,
                DQ_WRITER=writer,
                DQ_BUFFERS=dq_writer_buffers(block_m, main, tail, stages, consumers, q.element_size()) if writer else 1,
                DQ_WRITERS=2 if writer and DQ_WRITER_PER_SLICE and main > 64 else 1,
                DQ_FIRST_STORES=ordered_dq_first_stores(dq_sem is not None) if first_stores is None
                else first_stores)
    grid = (min(items, sm_count(q.device)) if persistent else items,)
    return Launch(ws_bwd_dkdv_kernel, grid, args, num_warps=4, num_stages=1, extra=extra)


# ------------------------------------------------------------------------------------------ dQ

@gluon.jit
def _kv_range(start_m, Nq, Nk, ROWS_PER_PROGRAM: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """The K/V tiles a block of query rows from ``start_m`` visits, and how many of the first ones
    every row sees whole (no mask): causal, row i sees keys j <= i + (Nk - Nq)."""
    if CAUSAL:
        offset = Nk - Nq
        hi = gl.maximum(gl.minimum(start_m + ROWS_PER_PROGRAM + offset, Nk), 0)
        n_unmasked = gl.maximum(start_m + offset + 1, 0) // BLOCK_N
    else:
        hi = Nk
        n_unmasked = Nk // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), gl.minimum(n_unmasked, Nk // BLOCK_N)


@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, q_bar, ring, tail, b, h, start_m, Nq, Nk,
                 GROUP: gl.constexpr, CAUSAL: gl.constexpr):
    """One warp: each consumer's 64 Q and dO rows once, then the K/V tiles through the ring (with a
    head-dim tail, each tile as two copies on one barrier, as in ``_producer``)."""
    k_bufs, v_bufs, ready, empty = ring
    q_tail_desc, k_tail_desc, v_tail_desc, do_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs = tail
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    CONSUMERS: gl.constexpr = q_bufs.shape[0]
    ROWS: gl.constexpr = q_bufs.shape[3]
    if q_tail_desc is not None:
        mbarrier.expect(q_bar, 2 * CONSUMERS * (q_desc.block_type.nbytes + q_tail_desc.block_type.nbytes))
    else:
        mbarrier.expect(q_bar, 2 * CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        _copy_tile(q_desc, q_tail_desc, q_bar, q_bufs.index(c), q_tail_bufs.index(c), b, h, start_m + c * ROWS)
        _copy_tile(do_desc, do_tail_desc, q_bar, do_bufs.index(c), do_tail_bufs.index(c), b, h, start_m + c * ROWS)
    n_tiles, n_unmasked = _kv_range(start_m, Nq, Nk, ROWS * CONSUMERS, BLOCK_N, CAUSAL)
    h_kv = h // GROUP
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        if k_tail_desc is not None:
            mbarrier.expect(ready.index(s), 2 * (k_desc.block_type.nbytes + k_tail_desc.block_type.nbytes))
        else:
            mbarrier.expect(ready.index(s), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _copy_tile(k_desc, k_tail_desc, ready.index(s), k_bufs.index(s), k_tail_bufs.index(s), b, h_kv, j * BLOCK_N)
        _copy_tile(v_desc, v_tail_desc, ready.index(s), v_bufs.index(s), v_tail_bufs.index(s), b, h_kv, j * BLOCK_N)


@gluon.jit
def _dq_consumer(args, tail, WG: gl.constexpr, CAUSAL: gl.constexpr):
    """One warpgroup: dQ of its 64 query rows, over the K/V tiles they see; with a head-dim tail, S and
    dP add the tail columns' products and dQ's tail columns have an accumulator of their own."""
    dq_desc, q_bufs, do_bufs, q_bar, ring, LSE, DELTA, b, h, start_m, Hq, Nq, Nk, qk_scale, sm_scale = args
    k_bufs, v_bufs, ready, empty = ring
    dq_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs = tail
    TAIL: gl.constexpr = dq_tail_desc is not None
    DT: gl.constexpr = k_tail_bufs.shape[4]
    AFTER: gl.constexpr = 2 if TAIL else 1  # wgmma groups of dP, issued after S's last
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[3]
    D: gl.constexpr = k_bufs.shape[4]
    CONSUMERS: gl.constexpr = q_bufs.shape[0]
    ROWS: gl.constexpr = q_bufs.shape[3]
    dtype: gl.constexpr = q_bufs.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    t_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DT, 16])
    t_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=t_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    n_tiles, n_unmasked = _kv_range(start_m, Nq, Nk, ROWS * CONSUMERS, BLOCK_N, CAUSAL)
    offset = Nk - Nq
    rows = start_m + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    bh = (b * Hq + h).to(gl.int64)
    lse = gl.load(LSE + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
    delta = gl.load(DELTA + bh * Nq + rows, mask=rows < Nq, other=0.0)
    q_t = q_bufs.index(WG).reshape([ROWS, D])
    do_t = do_bufs.index(WG).reshape([ROWS, D])
    dq = gl.zeros([ROWS, D], gl.float32, acc_layout)
    q_tt = q_tail_bufs.index(WG).reshape([ROWS, DT])  # (without a tail: never read, compiled away)
    do_tt = do_tail_bufs.index(WG).reshape([ROWS, DT])
    dq_t = gl.zeros([ROWS, DT], gl.float32, t_layout)
    mbarrier.wait(q_bar, 0)
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(ready.index(s), (j // STAGES) & 1)
        k_t = k_bufs.index(s).reshape([BLOCK_N, D])
        v_t = v_bufs.index(s).reshape([BLOCK_N, D])
        k_tt = k_tail_bufs.index(s).reshape([BLOCK_N, DT])
        st = warpgroup_mma(q_t, k_t.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        if TAIL:
            st = warpgroup_mma(q_tt, k_tt.permute((1, 0)), st, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                           use_acc=False, is_async=True)
        if TAIL:
            dp = warpgroup_mma(do_tt, v_tail_bufs.index(s).reshape([BLOCK_N, DT]).permute((1, 0)), dp, is_async=True)
        st = warpgroup_mma_wait(AFTER, deps=(st, ))  # S is done; dP may still be running
        p = gl.exp2(st * qk_scale - gl.expand_dims(lse, 1))
        if j >= n_unmasked:
            cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            valid = gl.expand_dims(cols, 0) < Nk
            if CAUSAL:
                valid = valid & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows, 1) + offset)
            p = gl.where(valid, p, 0.0)
        dp = warpgroup_mma_wait(0, deps=(dp, ))
        ds_tile = (p * (dp - gl.expand_dims(delta, 1))).to(dtype)  # (in the inputs' dtype: both products' A operand)
        ds = gl.convert_layout(ds_tile, op_layout)
        dq = warpgroup_mma(ds, k_t, dq, is_async=True)
        if TAIL:
            ds_t = gl.convert_layout(ds_tile, t_op_layout)
            dq_t = warpgroup_mma(ds_t, k_tt, dq_t, is_async=True)
            dq_t, ds_t = warpgroup_mma_wait(0, deps=(dq_t, ds_t))
        dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
        _signal(empty.index(s))  # this consumer is done with the slot's K and V
    # Out through this consumer's Q buffer (nothing reads it any more), TMA-stored (rows past Nq clipped).
    q_bufs.index(WG).reshape([ROWS, D]).store((dq * sm_scale).to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dq_desc, [b, h, start_m + WG * ROWS, 0], q_bufs.index(WG))
    if TAIL:  # the tail columns, out through the tail's Q buffer (columns past D clipped)
        q_tt.store((dq_t * sm_scale).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dq_tail_desc, [b, h, start_m + WG * ROWS, D], q_tail_bufs.index(WG))
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["Hq", "Nq", "Nk", "tiles_per_chunk", "heads_per_group"])
def ws_bwd_dq_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, q_tail_desc, k_tail_desc, v_tail_desc, do_tail_desc,
                     dq_tail_desc, LSE, DELTA, qk_scale, sm_scale, Hq, Nq, Nk, tiles_per_chunk, heads_per_group,
                     STAGES: gl.constexpr, CONSUMERS: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                     CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    """One program per (query block of ``CONSUMERS × 64`` rows, batch·query head), in the order
    ``tiles_per_chunk`` and ``heads_per_group`` give (:func:`program_order`), causal blocks longest first. The ``*_tail_desc``:
    None, or the head-dim tail's descriptors (as ``ws_bwd_dkdv_kernel``'s)."""
    ROWS: gl.constexpr = q_desc.block_type.shape[2]
    n_tiles = gl.cdiv(Nq, ROWS * CONSUMERS)
    pid_m, bh = _program_tile(gl.program_id(0), n_tiles, gl.num_programs(0) // n_tiles, tiles_per_chunk,
                              heads_per_group)
    if CAUSAL:
        pid_m = n_tiles - 1 - pid_m  # the last rows see the most keys: first
    b = bh // Hq
    h = bh % Hq
    start_m = pid_m * (ROWS * CONSUMERS)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [CONSUMERS] + do_desc.block_type.shape, do_desc.layout)
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    ring = (k_bufs, v_bufs, ready, empty)
    # The head-dim tail's tiles, one per main tile.
    q_tail_bufs = _tiles_like(q_tail_desc, CONSUMERS, q_bufs)
    do_tail_bufs = _tiles_like(do_tail_desc, CONSUMERS, do_bufs)
    k_tail_bufs = _tiles_like(k_tail_desc, STAGES, k_bufs)
    v_tail_bufs = _tiles_like(v_tail_desc, STAGES, v_bufs)
    tail = (dq_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs, do_tail_bufs)
    producer_tail = (q_tail_desc, k_tail_desc, v_tail_desc, do_tail_desc, q_tail_bufs, k_tail_bufs, v_tail_bufs,
                     do_tail_bufs)
    args = (dq_desc, q_bufs, do_bufs, q_bar, ring, LSE, DELTA, b, h, start_m, Hq, Nq, Nk, qk_scale, sm_scale)
    producer_args = (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, q_bar, ring, producer_tail, b, h, start_m, Nq,
                     Nk, GROUP, CAUSAL)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_dq_consumer, (args, tail, 0, CAUSAL)),
            (_dq_producer, producer_args),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_dq_consumer, (args, tail, 0, CAUSAL)),
            (_dq_consumer, (args, tail, 1, CAUSAL)),
            (_dq_producer, producer_args),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def plan_dq(q, k, v, do, dq, lse, delta, *, causal: bool, qk_scale: float, sm_scale: float, block_n: int,
            consumers: int, stages: int, pad: bool = False) -> Launch:
    """The launch of ``ws_bwd_dq_kernel``: query blocks of ``consumers × 64`` rows, K/V tiles of
    ``block_n`` rows through ``stages`` slots, as wide as :func:`tile_widths` says."""
    B, Hq, Nq, _ = q.shape
    Hkv = k.shape[1]
    main, tail = tile_widths(q.shape[-1], pad)
    rows = (1, 1, ROWS_PER_CONSUMER, main)
    n_tiles = cdiv(Nq, ROWS_PER_CONSUMER * consumers)
    consumer_regs, producer_regs, extra = kernel_options(consumers)
    args = dict(q_desc=descriptor(q, rows), k_desc=descriptor(k, (1, 1, block_n, main)),
                v_desc=descriptor(v, (1, 1, block_n, main)), do_desc=descriptor(do, rows), dq_desc=descriptor(dq, rows),
                **_tail_descriptors(dict(q=q, k=k, v=v, do=do, dq=dq),
                                    dict(q=ROWS_PER_CONSUMER, do=ROWS_PER_CONSUMER, dq=ROWS_PER_CONSUMER, k=block_n,
                                         v=block_n), main, tail),
                LSE=lse, DELTA=delta, qk_scale=qk_scale, sm_scale=sm_scale, Hq=Hq, Nq=Nq, Nk=k.shape[2],
                **causal_order(causal_dq_work(Nq, k.shape[2], ROWS_PER_CONSUMER * consumers, block_n), B * Hq,
                               sm_count(q.device)) if causal else dict(tiles_per_chunk=n_tiles, heads_per_group=B * Hq),
                STAGES=stages, CONSUMERS=consumers, GROUP=Hq // Hkv, CAUSAL=causal, CONSUMER_REGS=consumer_regs,
                PRODUCER_REGS=producer_regs)
    return Launch(ws_bwd_dq_kernel, (n_tiles * B * Hq,), args, num_warps=4, num_stages=1, extra=extra)
