"""Stage C's split-KV path (flash-decoding): attention when there are too few queries to fill the GPU.

The one-pass kernel gives each program BLOCK_M query rows of one head and walks *all* the keys.
Its parallelism is the number of such row blocks, B·Hq·⌈Nq/BLOCK_M⌉. In decoding (Nq = 1, a long
cache of Nk keys), or with one head of a long sequence, that is a handful of programs on a GPU
with 132 SMs: most SMs idle while a few walk the whole key sequence one tile at a time.

The fix is to parallelize over the keys as well. Softmax is not a sum, but it can be merged:

**Split.** The keys are cut into ``splits`` chunks of ``chunk`` keys (a multiple of BLOCK_N, at
least ``MIN_TILES_PER_SPLIT`` tiles long, so each program has a loop worth pipelining). Program
(s, b, kv head, row block) runs the ordinary online softmax over chunk s only and writes, per
query row, its chunk's *normalized* partial output and the chunk's log-sum-exp, in base 2:

    O_s = Σ_{j in s} 2^(x_j − L_s) v_j,     L_s = log2 Σ_{j in s} 2^(x_j),    x_j = q·k_j · scale · log2 e

(L_s = −inf for a chunk in which the row sees no key: a causal row, or a chunk past its diagonal.)

**Merge.** The row's full log-sum-exp is the log-sum-exp of the chunks' ones, and its output the
chunks' outputs weighted by their share of the total mass:

    L = log2 Σ_s 2^(L_s),      O = Σ_s 2^(L_s − L) · O_s

which the second, small kernel computes with the same running-maximum trick as the main loop
(subtract max_s L_s before exponentiating, so nothing overflows), a few splits per step
(``MERGE_SHAPES``). A row with no key anywhere has
every L_s = −inf; it gets O = 0 and L = +inf (the backward's convention: P = 2^(x − L) = 0).

**Or no merge kernel** (``LAB_DECODE_MERGE=fused``): each program, its partials written, adds one to a
counter of its row block (an atomic add that releases its writes), and the program that finds every
other split already counted merges the row block itself and zeroes the counter for the next call,
the "last block" pattern of a reduction in one pass. One launch instead of two; the merge still
runs, at the end of the last program.

**Grouped-query attention.** One program takes *all* the query heads that share its KV head (and
all their Nq rows) as the rows of one tile: row r is query head ``kv_head·group + r // Nq``, query
row ``r % Nq``. Each K/V tile is then read once per KV head, not once per query head, and the
tensor cores get ``group·Nq`` rows instead of Nq (with Nq = 1 and no grouping the tile is mostly
padding, which costs nothing here: decoding is limited by reading K and V, not by the products).

**Causal.** Bottom-right aligned: row i sees keys j <= i + Nk − Nq, so with few query rows the
last rows see (nearly) every key. The mask is applied per row on every tile; a program stops at
the last key any of its rows sees.

**Key ranges.** A static KV cache is as long as the longest sequence it will hold; only its first
slots are filled, and how many is data on the GPU (``key_lengths``; ``key_starts`` skips a
left-padded prompt's pads). Each program reads its batch entry's range [first, end) and the splits
share out that range, not Nk (chunks of Nk would leave a short filled range to the first split and
nothing to the others); the causal diagonal is aligned to the range's end, and no key outside the
range is loaded (unfilled slots may hold anything, and a NaN survives P = 0 in P·V). A split past
the range's end finds no key: L_s = −inf, and the merge gives it no weight.

The traffic: K and V once per (batch, KV head, row block), Q once, and the partials written in fp32
and read back once by the merge: ``splits·B·Hq·Nq·(D + 1)·4`` bytes each way, small beside K and V
when Nk is long (the only case this path is chosen for).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..contract import cdiv, padded_head_dim
from .aligned import aligned_strides

#: Each split walks at least this many K/V tiles: fewer would spend more on the merge and the
#: program's start-up than the split saves.
MIN_TILES_PER_SPLIT = 4
#: At most this many splits (partials grow with the count; beyond this the GPU is full anyway).
MAX_SPLITS = 256


@dataclass(frozen=True)
class SplitConfig:
    """Tiles of the split kernel: ``block_m`` query rows (of the flattened group·Nq rows) by
    ``block_n`` keys, ``splits`` chunks of ``chunk`` keys each. ``splits = 0`` means "counted per
    call from Nk" (a decoding call's kernel config: the count follows the cache, the kernel does
    not), of ``forced`` chunks if given (``split_kv``), else as many as :func:`decode_splits` wants."""

    block_m: int
    block_n: int
    splits: int
    chunk: int
    num_warps: int = 4
    num_stages: int = 2
    forced: int | None = None


@dataclass(frozen=True)
class SplitTiles:
    """What the split kernel is compiled with: ``block_m`` query rows by ``block_n`` keys per tile,
    ``num_warps``, and ``num_stages`` (K/V tiles in the software pipeline)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def split_tiles(group: int, Nq: int, D: int, element_bytes: int = 2) -> SplitTiles:
    """The split kernel's tiles for inputs of ``element_bytes``: BLOCK_M covers the group's rows (16:
    ``tl.dot``'s smallest tile, up to 64), BLOCK_N 64 keys (32 at the widest head dims, to fit shared
    memory), 4 warps. fp32: 8 warps, at most 32 rows and from D 128 on 16 rows of 32 keys. The one
    place the split path's tiles are decided (``experiments/decode_tiles.py`` sweeps alternatives
    through it; :func:`decode_tiles` deepens them for decoding)."""
    rows = group * Nq
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    width = padded_head_dim(D)
    if element_bytes > 2:
        # fp32's exact products run on the FMA units, each thread holding its slice of both operands
        # across the head dim. Compiled with 4 warps, 16-64 rows of 32-64 keys spilled 1-20 KB per
        # thread at D 128-256 on sm_90 (64 rows: 44 KB), and 128-key decoding tiles 0.2-0.5 KB at D 64.
        # These spill nothing on sm_80 or sm_90 (``experiments/resource_check.py --shapes
        # decode,long-keys``); the one-pass kernel's fp32 tiles shrink the same way (configs.py).
        if width >= 128:
            return SplitTiles(16, 32, 8)
        return SplitTiles(min(block_m, 32), 64, 8)
    return SplitTiles(block_m, 64 if width <= 128 else 32)


#: How a decoding call is planned (``LAB_DECODE_PLAN``). "deep", the default: one program per SM, each
#: with a three-stage ring of the widest K/V tile whose ring fits the SM's shared memory
#: (:func:`decode_tiles`), so a grid that already has a program per SM runs unsplit, with no merge,
#: as cuDNN runs it. "waves": :func:`split_tiles`' two-stage tiles, split to about :data:`DECODE_WAVES`
#: programs per SM, then merged. Timed in turns on an H100 (``experiments/decode_tiles.py --plans``,
#: performance log entry 79), "deep" was ahead in all nine cells, B 1 to 64 and 4k to 128k keys
#: (decode-gqa 179.9 -> 174.3 µs, cuDNN 174.1; B 1 · H 32/8 · Nk 4096 17.6 -> 15.6, cuDNN 17.2), and
#: within 0.4 % of cuDNN or ahead of it in each.
DECODE_PLANS = ("waves", "deep")
DECODE_PLAN = os.environ.get("LAB_DECODE_PLAN", "deep")
if DECODE_PLAN not in DECODE_PLANS:
    raise ValueError(f"LAB_DECODE_PLAN must be one of {', '.join(DECODE_PLANS)}, got {DECODE_PLAN!r}")
#: the deep plan's K/V tiles in flight per program
DEEP_STAGES = 3


def decode_tiles(group: int, Nq: int, D: int, element_bytes: int, shared_bytes: int) -> SplitTiles:
    """A decoding call's tiles under :data:`DECODE_PLAN`, for inputs of ``element_bytes`` on a GPU with
    ``shared_bytes`` of shared memory per block: :func:`split_tiles`' ("waves"), or ("deep") their rows
    and warps with :data:`DEEP_STAGES` K/V tiles of 128, 64 or 32 keys (fp32: no wider than
    :func:`split_tiles`'), the widest whose ring (and the Q tile, and some room for the compiler's own)
    fits."""
    tiles = split_tiles(group, Nq, D, element_bytes)
    if DECODE_PLAN != "deep":
        return tiles
    width = padded_head_dim(D)
    widest = tiles.block_n if element_bytes > 2 else 128  # (fp32: wider tiles spill, as split_tiles says)
    for block_n in (b for b in (128, 64, 32) if b <= widest):
        ring = DEEP_STAGES * 2 * block_n * width * element_bytes  # K and V
        if ring + tiles.block_m * width * element_bytes + 8 * 1024 <= shared_bytes:
            return SplitTiles(tiles.block_m, block_n, tiles.num_warps, DEEP_STAGES)
    return tiles


def call_tiles(group: int, Nq: int, Nk: int | None, D: int, element_bytes: int, shared_bytes: int) -> SplitTiles:
    """The split kernel's tiles for one call: :func:`decode_tiles` when it decodes (``Nk`` None: a
    decoding call planned for every cache length), else :func:`split_tiles`' for its dtype."""
    if Nk is None or is_decoding(group, Nq, Nk):
        return decode_tiles(group, Nq, D, element_bytes, shared_bytes)
    return split_tiles(group, Nq, D, element_bytes)


def decode_waves() -> int:
    """Programs per SM a decoding call's split count aims at, under :data:`DECODE_PLAN`."""
    return 1 if DECODE_PLAN == "deep" else DECODE_WAVES


def _config(tiles: SplitTiles, splits: int, chunk: int, forced: int | None = None) -> SplitConfig:
    return SplitConfig(tiles.block_m, tiles.block_n, splits, chunk, tiles.num_warps, tiles.num_stages, forced)


#: A call is *decoding* when all the query rows of a KV head's group (group · Nq) fit one tile and
#: they come after a cache (Nq < Nk): a new token, or a few, against the keys so far.
DECODE_ROWS = 64


def is_decoding(group: int, Nq: int, Nk: int) -> bool:
    return group * Nq <= DECODE_ROWS and Nq < Nk


#: Programs per SM the split-KV grid aims at when the query rows of each KV head fit one tile
#: (decoding): measured on the H200, 4 waves of split programs read the cache fastest (B=16, Hq=32,
#: Hkv=8, Nk=8192: 2 splits 0.149 ms, 4 splits 0.140, 8 splits 0.151; B=8, Nk=16384: 8 splits best),
#: enough loads in flight to cover DRAM latency without a merge of many partial results.
DECODE_WAVES = 4


@lru_cache(maxsize=1024)  # asked on every decoding call, with the same arguments a whole loop long
def _wanted_splits(B: int, Hkv: int, group: int, Nq: int, D: int, sms: int, waves: int = DECODE_WAVES) -> int:
    """Splits that would fill the GPU, before the keys limit them: about ``waves`` programs per SM
    when decoding, about one wave otherwise."""
    items = B * Hkv * cdiv(group * Nq, split_tiles(group, Nq, D).block_m)
    return round(waves * sms / items) if group * Nq <= DECODE_ROWS else sms // items


def decoding_splits_keys(B: int, Hkv: int, group: int, Nq: int, D: int, sms: int) -> bool:
    """Whether a decoding call takes the split kernel, at every cache length: grouped-query decoding
    always (its program holds all the query heads of a KV head, so the cache is read once per KV
    head, where the one-pass kernel reads it once per query head: B=64, Hq=32, Hkv=8 on the H200
    ran at 0.44x of cuDNN that way); multi-head decoding unless its unsplit grid already fills the
    GPU. The answer depends on the batch and heads, never on Nk, so a loop whose cache grows by a
    key per call never switches kernels (and so never compiles one) halfway through."""
    return group > 1 or _wanted_splits(B, Hkv, group, Nq, D, sms) >= 2


def decode_splits(B: int, Hkv: int, group: int, Nq: int, Nk: int, D: int, sms: int, block_n: int | None = None) -> int:
    """The chunks a decoding call splits its ``Nk`` keys into: :func:`_wanted_splits` at the plan's
    :func:`decode_waves`, at most one per ``MIN_TILES_PER_SPLIT`` tiles of ``block_n`` keys (default:
    :func:`split_tiles`') and :data:`MAX_SPLITS`, at least 1 (a short cache: one chunk, the same kernel)."""
    block_n = block_n or split_tiles(group, Nq, D).block_n
    wanted = _wanted_splits(B, Hkv, group, Nq, D, sms, decode_waves())
    return max(1, min(wanted, cdiv(Nk, block_n) // MIN_TILES_PER_SPLIT, MAX_SPLITS))


def choose_splits(B: int, Hkv: int, group: int, Nq: int, Nk: int, D: int, sms: int,
                  tiles: SplitTiles | None = None) -> SplitConfig | None:
    """The split-KV configuration for this problem, or None when splitting does not pay.

    Programs without splitting: ``items = B·Hkv·⌈group·Nq/BLOCK_M⌉``.

    * Decoding (every query row of a KV head's group fits one BLOCK_M tile, after a cache: e.g. one
      new token per sequence): the work is reading the cache once, a bandwidth problem, and the unsplit grid has
      one program per KV head. Split so the grid holds about :func:`decode_waves` programs per SM
      (one chunk while the cache is too short for more: the path does not change as it grows,
      :func:`decoding_splits_keys`); multi-head decoding whose unsplit grid already fills the GPU
      runs the one-pass kernel.
    * Otherwise split only when the unsplit programs fill at most half the SMs: ``sms // items``
      chunks then fill about one wave; with more items, a second wave of split programs would take
      as long as the unsplit ones, so the one-pass kernel runs instead.

    Never more chunks than the K/V tiles allow at ``MIN_TILES_PER_SPLIT`` tiles each. ``tiles``: the
    call's (:func:`call_tiles`; default :func:`split_tiles`' for 16-bit inputs)."""
    tiles = tiles or split_tiles(group, Nq, D)
    if is_decoding(group, Nq, Nk):
        if not decoding_splits_keys(B, Hkv, group, Nq, D, sms):
            return None
        return forced_splits(group, Nq, Nk, D, decode_splits(B, Hkv, group, Nq, Nk, D, sms, tiles.block_n), tiles)
    splits = min(_wanted_splits(B, Hkv, group, Nq, D, sms), cdiv(Nk, tiles.block_n) // MIN_TILES_PER_SPLIT,
                 MAX_SPLITS)
    if splits < 2:
        return None
    return forced_splits(group, Nq, Nk, D, splits, tiles)


def split_counts(block_n: int, Nk: int, splits: int) -> tuple[int, int]:
    """(chunks, keys per chunk) for ``splits`` wanted chunks of whole ``block_n``-key tiles: the count
    rounded to what equal chunks of whole tiles give (never more than one chunk per tile)."""
    tiles = cdiv(Nk, block_n)
    chunk_tiles = cdiv(tiles, max(1, min(splits, tiles)))
    return cdiv(tiles, chunk_tiles), chunk_tiles * block_n


def forced_splits(group: int, Nq: int, Nk: int, D: int, splits: int, tiles: SplitTiles | None = None) -> SplitConfig:
    """``splits`` chunks (``attention(..., split_kv=splits)``), each a whole number of K/V tiles
    (:func:`split_counts`) of ``tiles`` (default :func:`split_tiles`')."""
    tiles = tiles or split_tiles(group, Nq, D)
    return _config(tiles, *split_counts(tiles.block_n, Nk, splits))


def per_call_config(group: int, Nq: int, D: int, forced: int | None = None,
                    tiles: SplitTiles | None = None) -> SplitConfig:
    """The split kernel's config for decoding calls of every cache length: its tiles (default
    :func:`split_tiles`'), the count of chunks left to each call (``splits = 0``), ``forced`` chunks
    if given."""
    return _config(tiles or split_tiles(group, Nq, D), 0, 0, forced)


@triton.jit
def key_range(KEY_STARTS, KEY_LENGTHS, b, N_K):
    """Batch entry ``b``'s keys [first, end): ``KEY_STARTS[b]`` and ``KEY_LENGTHS[b]`` (None: 0 and
    Nk), clamped so that 0 <= first <= end <= Nk (the host cannot check the values without waiting
    for the GPU; out-of-range ones are cut to the keys that exist, never read past them)."""
    first = 0
    end = N_K
    if KEY_STARTS is not None:
        first = tl.minimum(tl.maximum(tl.load(KEY_STARTS + b), 0), N_K)
    if KEY_LENGTHS is not None:
        end = tl.minimum(tl.maximum(tl.load(KEY_LENGTHS + b), first), N_K)
    return first, end


#: Sizes are runtime values (``do_not_specialize``): a KV cache that grows by one key per call changes
#: N_K, CAUSAL_OFFSET and the chunk at every call, and Triton would compile a kernel whenever one of
#: them became 1 or a multiple of 16. Strides keep their divisibility facts (16-byte vector loads).
@triton.jit(do_not_specialize=["Hq", "Hkv", "N_Q", "N_K", "CAUSAL_OFFSET", "CHUNK", "ROWS_TOTAL"])
def split_kv_attention_kernel(
    Q, K, V, O_PART, LSE_PART, O, LSE, qk_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    Hq, Hkv, N_Q, N_K, CAUSAL_OFFSET, CHUNK, ROWS_TOTAL,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_LSE: tl.constexpr, ALIGN: tl.constexpr,
    KEY_STARTS, KEY_LENGTHS, EARLY_MERGE: tl.constexpr = False,
    COUNTERS=None, FUSED_STEP: tl.constexpr = 0,
):
    """Program (split, b·Hkv + kv head, row block): the online softmax of its rows over one chunk of
    keys; writes the chunk's normalized O (fp32) and base-2 log-sum-exp per row (module docstring).
    With a single chunk (a short cache) that is the answer: it goes straight to O (and LSE), and
    no merge runs. ``KEY_STARTS``/``KEY_LENGTHS`` (int32 [B], or None): batch entry b attends to
    keys [KEY_STARTS[b], KEY_LENGTHS[b]) only (module docstring, "Key ranges").

    ``COUNTERS`` (int32, one per (b·Hkv + kv head, row block), zero between calls; None: the merge
    kernel runs after this one): the merge fused in (:data:`MERGE` ``fused``). Each program counts
    itself in when its partials are written, and the last of its row block to arrive merges them,
    ``FUSED_STEP`` splits a step, and sets the counter back to zero."""
    if EARLY_MERGE:
        # Let the merge's programs be launched now (:data:`EARLY_MERGE`): they wait for this grid's
        # end in gdc_wait, so nothing here needs to happen before this line.
        gdc_launch_dependents()
    # (16-byte rows at every head dim: the host checked the strides, aligned.py)
    stride_qb, stride_qh, stride_qn = aligned_strides(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_strides(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_strides(stride_vb, stride_vh, stride_vn, ALIGN)
    split = tl.program_id(0)
    b = tl.program_id(1) // Hkv
    kv_h = tl.program_id(1) % Hkv
    r = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows of the group, flattened (head, row)
    row_ok = r < GROUP * N_Q
    h = kv_h * GROUP + r // N_Q
    i = r % N_Q
    ds = tl.arange(0, BLOCK_D)
    d_ok = ds < D

    q_ptrs = (Q + b.to(tl.int64) * stride_qb + h.to(tl.int64)[:, None] * stride_qh
              + i.to(tl.int64)[:, None] * stride_qn + ds[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    K_bh = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    V_bh = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh

    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, N_K)
    causal_offset = CAUSAL_OFFSET
    if KEY_STARTS is not None or KEY_LENGTHS is not None:
        # The splits share out the range, not Nk: a static cache is as long as the longest sequence
        # it will hold, and chunks of Nk would put a short filled range in the first split alone.
        # Chunks stay whole tiles; a split past the range's end finds no key.
        first, end = key_range(KEY_STARTS, KEY_LENGTHS, b, N_K)
        chunk = tl.cdiv(tl.cdiv(end - first, tl.num_programs(0)), BLOCK_N) * BLOCK_N
        lo = first + split * chunk
        hi = tl.minimum(lo + chunk, end)
        causal_offset = end - N_Q
    if CAUSAL:
        # No row of this program sees a key past its last row's diagonal: stop there.
        hi = tl.minimum(hi, tl.max(tl.where(row_ok, i, -1)) + causal_offset + 1)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in tl.range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        # Rows from the chunk's end on are never read (a key range's unfilled slots may hold anything;
        # a NaN there would survive P = 0 in P·V).
        kv_mask = (cols[:, None] < hi) & d_ok[None, :]
        k = tl.load(K_bh + cols[:, None] * stride_kn + ds[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V_bh + cols[:, None] * stride_vn + ds[None, :], mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        valid = cols[None, :] < hi
        if CAUSAL:
            valid = valid & (cols[None, :] <= i[:, None] + causal_offset)
        qk = tl.where(valid, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead (-inf - -inf is NaN).
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = m_i + tl.math.log2(tl.where(seen, l_i, 1.0))
    row = (b * Hq + h).to(tl.int64) * N_Q + i  # rows in (b, h, i) order, as O (contiguous) holds them
    mask = row_ok[:, None] & d_ok[None, :]
    if tl.num_programs(0) == 1:
        # One chunk: the merge would copy it. O and LSE as the merge writes them (+inf: no key).
        tl.store(O + row[:, None] * D + ds[None, :], out.to(O.dtype.element_ty), mask=mask)
        if STORE_LSE:
            tl.store(LSE + row, tl.where(seen, lse, float("inf")), mask=row_ok)
    else:
        # Partials: [splits, B·Hq·Nq rows, D] and [splits, B·Hq·Nq] (-inf: no key in this chunk).
        part = split.to(tl.int64) * ROWS_TOTAL + row
        tl.store(O_PART + part[:, None] * D + ds[None, :], out, mask=mask)
        tl.store(LSE_PART + part, tl.where(seen, lse, float("-inf")), mask=row_ok)
        if COUNTERS is not None:
            # The last to arrive merges. The barrier puts every thread's stores above before the
            # one thread's atomic add; the add releases them (gpu scope) and acquires the others':
            # the program that counts last sees every split's partials.
            tl.debug_barrier()
            counter = COUNTERS + tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == tl.num_programs(0) - 1:
                merged, lse = merge_partials(O_PART, LSE_PART, row, row_ok, ROWS_TOTAL, tl.num_programs(0),
                                             ds, d_ok, D, FUSED_STEP, ".cg")
                tl.store(O + row[:, None] * D + ds[None, :], merged.to(O.dtype.element_ty), mask=mask)
                if STORE_LSE:
                    tl.store(LSE + row, lse, mask=row_ok)
                tl.store(counter, 0)  # ready for the next call on this stream


@triton.jit(do_not_specialize=["ROWS_TOTAL", "SPLITS"])
def merge_splits_kernel(
    O_PART, LSE_PART, O, LSE, ROWS_TOTAL, SPLITS,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, SPLITS_PER_STEP: tl.constexpr,
    STORE_LSE: tl.constexpr, EARLY_MERGE: tl.constexpr = False,
):
    """O = Σ_s 2^(L_s − L)·O_s with L = log2 Σ_s 2^(L_s), for BLOCK_R rows (module docstring), folded
    in ``SPLITS_PER_STEP`` splits at a time with a running maximum, exactly like the main loop's
    online softmax over its key tiles. Each step's loads wait for nothing but the step before
    (the running maximum and sums), so a row of S splits is a chain of S / SPLITS_PER_STEP steps,
    each an L2 round trip: one split per step (the first version, :data:`MERGE_SHAPES`) makes a long
    chain when there are many splits and few rows to spread it over."""
    if EARLY_MERGE:
        # Launched before the split kernel ended (:data:`EARLY_MERGE`): wait here until it has, and
        # its partials are visible. Everything before this line must not read them.
        gdc_wait()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS_TOTAL
    ds = tl.arange(0, BLOCK_D)
    out, lse = merge_partials(O_PART, LSE_PART, rows, row_ok, ROWS_TOTAL, SPLITS, ds, ds < D, D, SPLITS_PER_STEP, "")
    tl.store(O + rows.to(tl.int64)[:, None] * D + ds[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (ds < D)[None, :])
    if STORE_LSE:
        tl.store(LSE + rows, lse, mask=row_ok)


@triton.jit
def merge_partials(O_PART, LSE_PART, rows, row_ok, ROWS_TOTAL, SPLITS, ds, d_ok, D: tl.constexpr,
                   SPLITS_PER_STEP: tl.constexpr, CACHE: tl.constexpr):
    """(O, L) of ``rows`` from their ``SPLITS`` partials, ``SPLITS_PER_STEP`` at a time: L = +inf for a
    row no split saw a key of (O = 0 there). ``CACHE``: the loads' cache modifier (``".cg"``, past
    the SM's L1, where other programs of the same kernel wrote the partials)."""
    m = tl.full(rows.shape, float("-inf"), tl.float32)
    den = tl.zeros(rows.shape, tl.float32)
    acc = tl.zeros((rows.shape[0], ds.shape[0]), tl.float32)
    for s0 in range(0, SPLITS, SPLITS_PER_STEP):
        s = s0 + tl.arange(0, SPLITS_PER_STEP)
        ok = (s < SPLITS)[:, None] & row_ok[None, :]                          # [S, R]
        part = s.to(tl.int64)[:, None] * ROWS_TOTAL + rows[None, :]           # [S, R]
        lse_s = tl.load(LSE_PART + part, mask=ok, other=float("-inf"), cache_modifier=CACHE)
        o_s = tl.load(O_PART + part[:, :, None] * D + ds[None, None, :],        # [S, R, BLOCK_D]
                      mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=CACHE)
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w_old = tl.math.exp2(m - m_use)
        w = tl.math.exp2(lse_s - m_use[None, :])
        den = den * w_old + tl.sum(w, axis=0)
        acc = acc * w_old[:, None] + tl.sum(w[:, :, None] * o_s, axis=0)
        m = m_new
    seen = den > 0.0
    out = acc / tl.where(seen, den, 1.0)[:, None]
    lse = tl.where(seen, m + tl.math.log2(tl.where(seen, den, 1.0)), float("inf"))
    return out, lse


#: The merge kernel's (rows per program, splits per step). "wide", the default: one row per program,
#: 32 splits per step, so the chain of dependent loads is 32 times shorter and a B 1 decode's 32 rows
#: are 32 programs, not 2; "serial" (``LAB_DECODE_MERGE=serial``): 16 rows, one split per step, the
#: first version. On the H200 the wide merge made B 1 grouped decoding 1.5x (Nk 4096) and 1.7x (Nk
#: 32768) faster, at the split counts the code picks, and tied or won every other decode cell
#: (docs/performance-log/model-shapes.md, entry 47).
#: "fused" (``LAB_DECODE_MERGE=fused``) runs no merge kernel: the split kernel's last program of each
#: row block to finish merges its rows (:func:`fused_step` splits a step), counted in by an atomic add
#: on a per-stream counter buffer (:func:`merge_counters`) that the merging program zeroes again. It
#: saves a launch and the gap before it; it pays with a merge at the end of the kernel's critical
#: path, in one program per row block, and with a buffer that must be zero when a call starts (kept
#: per stream; a CUDA graph captures the zeroing of a buffer of its own, one more node per replay).
#: Timed on an H100 it lost: decode-gqa 199.3 µs against the wide merge's 184.6, B 1 at 32k keys
#: (64 splits folded by 8 programs) 212 against 54.6; level or 0.5 % ahead only at B 4 · H 32 · 32k
#: keys (performance log entry 78). It stays a switch, off.
MERGE_SHAPES = {"serial": (16, 1), "wide": (1, 32)}
MERGES = (*MERGE_SHAPES, "fused")
MERGE = os.environ.get("LAB_DECODE_MERGE", "wide")
if MERGE not in MERGES:
    raise ValueError(f"LAB_DECODE_MERGE must be one of {', '.join(MERGES)}, got {MERGE!r}")


def fused_merge() -> bool:
    """Whether split-KV calls merge in the split kernel (:data:`MERGE` ``fused``)."""
    return MERGE == "fused"


def fused_step(block_m: int, block_d: int, num_warps: int) -> int:
    """Splits the fused merge folds per step: as many [block_m, block_d] fp32 partials as keep a
    step's loads within 64 registers a thread (the loads of one step are all in flight at once; the
    steps follow one another), a power of two from 1 to 32."""
    fit = 64 * 32 * num_warps // (block_m * block_d)
    return max(1, min(32, 1 << (max(fit, 1).bit_length() - 1)))


#: (device, stream) -> int32 counters, zero between calls: the fused merge's arrivals. Per stream, so
#: that calls on two streams never count into one buffer.
_MERGE_COUNTERS: dict = {}


def merge_counters(q, slots: int):
    """At least ``slots`` zeroed int32 counters for a fused-merge call with ``q``, on its device's
    current stream. While a CUDA graph is being captured, a fresh zeroed buffer of the graph's own
    (the zeroing is captured too): a buffer kept from the capture would live in the graph's memory
    pool past its outputs, which PyTorch refuses, and one kept from before it would be shared by
    the graph's replays and whatever else runs on that stream."""
    index = q.get_device()
    if index >= 0 and torch.cuda.is_current_stream_capturing():
        return torch.zeros(slots, dtype=torch.int32, device=q.device)
    # (the raw stream handle: what compiled PyTorch code asks for; building a Stream object costs more)
    key = (index, torch._C._cuda_getCurrentRawStream(index) if index >= 0 else 0)
    counters = _MERGE_COUNTERS.get(key)
    if counters is None or counters.numel() < slots:
        # Grown, never shrunk; the old buffer goes back to the allocator in stream order.
        size = max(slots, 1024, 2 * counters.numel() if counters is not None else 0)
        counters = _MERGE_COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=q.device)
    return counters


#: Launch the merge before the split kernel ends (programmatic dependent launch, sm_90 and later). A
#: kernel launched the ordinary way starts only after the one before it has finished and the GPU has
#: set the next grid up: a gap of microseconds, which a B 1 decode step, 40 µs in all, feels. With
#: this switch the split kernel tells the GPU at its start that the merge may be launched
#: (``griddepcontrol.launch_dependents``), and the merge's programs wait in ``griddepcontrol.wait``
#: until the split kernel is done and its writes are visible. The setup overlaps the split kernel;
#: the merge's work does not. ``LAB_DECODE_EARLY_MERGE=1`` switches it on. Off: on the H200 it was level
#: at B 1 and 0.7 % slower at B 16, whose many merge programs hold SM slots while they wait
#: (docs/performance-log/model-shapes.md, entry 65; ``experiments/decode_tiles.py --early-merge``).
EARLY_MERGE = os.environ.get("LAB_DECODE_EARLY_MERGE", "0") == "1"


def early_merge(arch: int) -> bool:
    """Whether a split-KV call on an sm_``arch`` GPU launches its merge early (:data:`EARLY_MERGE`):
    programmatic dependent launch needs sm_90 (the interpreter runs the sm_80 path)."""
    return EARLY_MERGE and arch >= 90


def merge_shape() -> tuple[int, int]:
    """(rows per program, splits per step) of the merge kernel, as :data:`MERGE` picks (the fused
    merge runs none: the default's shape, for a caller that asks anyway)."""
    return MERGE_SHAPES.get(MERGE, MERGE_SHAPES["wide"])


def workspace_shapes(B: int, Hq: int, Nq: int, D: int, splits: int) -> tuple[tuple, tuple]:
    """Shapes of the fp32 partials: O ``[splits, B·Hq·Nq, D]`` and the log-sum-exps ``[splits, B·Hq·Nq]``."""
    rows = B * Hq * Nq
    return (splits, rows, D), (splits, rows)


def workspace_bytes(B: int, Hq: int, Nq: int, D: int, splits: int) -> int:
    """Bytes of the partials one split-KV call allocates (fp32 O and log-sum-exp per split and row)."""
    return 4 * splits * B * Hq * Nq * (D + 1)
