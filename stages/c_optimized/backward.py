"""Stage C's backward pass: FlashAttention-2's algorithm, with the forward's optimizations.

The math (per query head, rows i, keys j; x_ij = scale · q_i·k_j, P = softmax_j(x), O = P V)
---------------------------------------------------------------------------------------------
Given dO = ∂L/∂O, the chain rule through O = P V and the softmax gives

    dV_j  = Σ_i P_ij dO_i                         (P^T dO)
    dP_ij = dO_i · V_j                            (dO V^T)
    dx_ij = P_ij (dP_ij − Δ_i),   Δ_i = Σ_j P_ij dP_ij     (the softmax's Jacobian)
    dQ_i  = scale · Σ_j dx_ij K_j                 (dS K)
    dK_j  = scale · Σ_i dx_ij Q_i                 (dS^T Q)

Δ_i looks like it needs a whole row of P and dP, which a tiled kernel never holds. But
Δ_i = Σ_j P_ij (dO_i·V_j) = dO_i · (Σ_j P_ij V_j) = dO_i · O_i: one dot product of two vectors
the forward already left in memory. So a cheap pre-pass computes Δ = rowsum(dO ∘ O) for every row
first, and the tiled kernels only ever need one tile of P at a time.

Why recompute P instead of storing it: P is Nq×Nk per head (stage A stores it: 512 MiB per head
at N = 16384 in fp16). The forward saves only the row log-sum-exp ``lse`` (4 bytes per row), and
P_ij = 2^(x_ij·log2 e − lse_i) rebuilds any tile exactly, for one extra QK^T matmul per tile.
That matmul is cheaper than reading a stored P tile would be, and the memory is O(N), not O(N²).

The kernels
-----------
1. ``attention_bwd_delta_kernel``: Δ = rowsum(dO ∘ O) in fp32 (and, with atomic dQ, zeroes the fp32
   dQ accumulator: one launch fewer than a separate memset).
2. ``attention_bwd_dkdv_kernel``: one program per (K/V tile, batch, KV head). The K and V tiles stay
   on chip; the program walks the Q tiles of *every query head of its group* (GQA: the sum of dK/dV
   over the group happens in registers, no atomics), recomputes P^T, and accumulates dV += P^T dO
   and dK += dS^T Q in fp32 registers; dK is multiplied by ``scale`` once at the end.
3. dQ, two ways (``BwdPlan.separate_dq``; ``deterministic=True`` always takes the second, and on a GPU
   with a tuning file the faster one is taken by default: on the H200 that is the separate kernel in
   five of the six tuned cells, the atomics' read-modify-writes costing more than its recomputation):
   * ``False`` (default): the dK/dV program also forms dS K for the Q tile it is visiting and adds it
     into an fp32 dQ accumulator with ``tl.atomic_add`` (then a cast to the input dtype). Five
     matmuls per (Q tile, K tile) pair, the 2.5× forward FLOPs of the convention. Costs: the fp32
     accumulator (4·Nq·D bytes per head), and a read-modify-write of a BLOCK_M×D fp32 tile per
     pair, done by the L2 cache's atomic units: the order of the additions depends on scheduling,
     so the last bits of dQ vary from run to run.
   * ``True``: ``attention_bwd_dq_kernel``, one program per (Q tile, batch, query head) looping over
     K/V tiles, accumulates dQ in registers in a fixed order: bitwise reproducible. It recomputes
     QK^T and dO V^T, so seven matmuls per pair instead of five (3.5× the forward's FLOPs instead of
     2.5×, +40 %), and reads K and V once more per Q tile; no fp32 workspace, no atomics.
   On Hopper the dK/dV kernel can add dQ itself in a fixed order instead (``ORDERED_DQ``, see
   ``hopper_bwd.py``): five products and bitwise reproducible, each Q tile's adds taking turns at a
   semaphore, taken by a dQ-writer warp (one per column slice at D 128); the backward tuner races it among
   the deterministic plans (on an H100 it wins at D 64, and at D 128 without a mask), and ``LAB_ORDERED_DQ=1``
   makes it what ``deterministic=True`` runs wherever fused dQ is the plan.
4. A decoding-shaped problem (the group's query rows fit one tile after a cache, the forward's decode
   class) runs none of these: the split backward of ``decode_backward.py`` holds every query row in each
   program and shares out the keys, as the forward's split-KV path does (``split_backward``).

The switches (each turns one optimization off for the ablation; all off = stage B's settings)
-------------------------------------------------------------------------------------------
``tuned_tiles``  per head dim / dtype / GPU tile shapes, warps and pipeline depth (``backward_config``),
                 checked against the shared-memory budget; off: stage B's 64×64, 4 warps.
``pipelining``   ``num_stages`` > 1: Triton software-pipelines the Q-tile loop (dK/dV) and the K/V-tile
                 loop (dQ) with ``cp.async`` on sm_80 and async copies on sm_90; off: 1 stage.
``exp2``         P = 2^(q·k·(scale·log2 e) − lse) with log2 e folded into the scale (lse arrives in base 2
                 already), one FMA and one ``ex2.approx`` per score; off: ``exp`` with the natural scale
                 and lse·ln 2.
``causal_skip``  causal problems visit only tile pairs with a visible score: a K/V tile starts at the
                 first Q tile whose rows can see it, and only the diagonal tiles pay for the mask (the
                 loop is split at compile time into a masked and a mask-free part, as in the forward);
                 off: every tile is visited and masked, as in stage B.
``tma``          accepted for the ablation's sake but a no-op here: the backward uses pointer loads
                 (with ``cp.async`` pipelining) on every GPU. TMA descriptors for the five streamed
                 tensors are future work.

Masking: the causal mask (bottom-right: row i sees key j iff j ≤ i + Nk − Nq) and the ragged last
K/V tile are applied to P *after* the exponential (``tl.where(valid, p, 0)``), so no −inf − (+inf)
ever happens; query rows past Nq and rows that see no key load lse = +∞, which makes their P
exactly 0 (2^(finite − ∞) = 0), so they contribute nothing and need no mask of their own.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import triton
import triton.language as tl

from .. import contract, ops
from ..contract import DTYPES, CompiledKernel, HbmTraffic, Problem, cdiv, new_output, padded_head_dim, \
    key_ranges_alignment, validate_backward_inputs
from ..launch import KeptLaunch, Launch, compiles_without_interpreter
from .configs import SHARED_MEMORY_LIMIT, device_arch, gpu_slug, sm_count, this_arch, tuning_file
from . import decode_backward, hopper_ws  # (hopper_ws: where the Hopper kernels run, the forward's rule)
from . import aligned
from .aligned import aligned_strides, row_alignment
from .decode import key_range
from .kernels import tma_supported

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DELTA_BLOCK = 64  # rows per program of the Δ pre-pass (a streaming kernel: any size near this is fine)
#: Ordered dQ's semaphores zeroed by each program of the Δ pre-pass: the kernel's one per batch·query head,
#: column slice (2 at most) and Q tile (32 rows at least) are at most 2 · DELTA_BLOCK / 32 per DELTA_BLOCK rows.
SEM_CHUNK = 2 * DELTA_BLOCK // 32


# ------------------------------------------------------------------------------------------ configs

@dataclass(frozen=True)
class BwdConfig:
    """Tiles of the backward kernels. ``block_n``: K/V rows a dK/dV program keeps on chip;
    ``block_m``: Q rows per step of its loop. The deterministic dQ kernel uses them the other way
    round (``block_n`` Q rows resident, ``block_m`` K/V rows per step): in both kernels the resident
    tile is the big one, because it carries the two fp32 accumulators (dK, dV) or the one (dQ)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "BwdConfig":
        m = re.fullmatch(r"M(\d+)-N(\d+)-w(\d+)-s(\d+)", text)
        if not m:
            raise ValueError(f"config must look like 'M64-N128-w8-s2', got {text!r}")
        return cls(*(int(g) for g in m.groups()))


#: Stage B's settings, what every switch off runs.
BASELINE = BwdConfig(64, 64, 4, 1)

#: Candidates per (arch, padded head dim), best guess first. The dK/dV kernel is register-bound:
#: its two BLOCK_N×D fp32 accumulators (dK, dV), the resident K and V tiles (Triton keeps them in
#: registers as matmul A operands) and four BLOCK_N×BLOCK_M score-shaped tiles (S^T, P^T, dP^T, dS^T)
#: all live across the loop. At BLOCK_N = 128, D = 64 and 4 warps the first two alone are ~192 of the
#: 255 registers a thread may have. So the K/V tile stays at 128 rows for the tensor cores' sake,
#: the streamed Q tile is narrow (32 rows) and wide heads get 8 warps or 32-row K/V tiles. Checked with
#: ptxas -v (sm_90a, fp16, causal, atomic dQ): 237 / 217 / 250 / 207 registers for D = 16 / 64 / 128 /
#: 256 and no spills; 64-row Q tiles spilled at D >= 64, and 4 warps at BLOCK_N = 128 spilled from D = 64.
_HALF_CONFIGS = {
    90: {
        16: [BwdConfig(32, 128, 4, 3)],
        32: [BwdConfig(32, 128, 8, 3)],
        64: [BwdConfig(32, 128, 8, 3), BwdConfig(32, 64, 4, 2)],
        128: [BwdConfig(32, 128, 8, 2), BwdConfig(16, 64, 4, 2)],
        256: [BwdConfig(16, 32, 8, 2), BwdConfig(16, 32, 4, 1)],
    },
    # sm_80's mma.sync fragments cost more registers than wgmma's: 64-row K/V tiles (128 rows and
    # 8 warps spilled at D = 64). ptxas: no spills at D = 16, 128 and 256 (251 / 249 / 243 registers);
    # 20-24 bytes of spill stores remain at D = 32 and 64 with every config tried (64 rows with 4 or
    # 8 warps, 2 or 3 stages): a tuning item for a GPU run.
    80: {
        16: [BwdConfig(32, 64, 4, 3)],
        32: [BwdConfig(32, 64, 4, 3)],
        64: [BwdConfig(32, 64, 8, 2)],
        128: [BwdConfig(32, 64, 8, 2), BwdConfig(16, 32, 4, 2)],
        256: [BwdConfig(16, 32, 8, 2), BwdConfig(16, 32, 4, 1)],
    },
}
#: fp32 ("ieee" products on the FMA units, operands twice as wide): small tiles on every GPU. No
#: spills at D <= 64; at D = 128 and 256 ptxas reports 16-44 bytes of spill stores (fp32 training
#: is a correctness path here, not a speed target).
_FP32_CONFIGS = {
    16: [BwdConfig(16, 64, 4, 2)], 32: [BwdConfig(16, 64, 4, 2)], 64: [BwdConfig(16, 64, 8, 2)],
    128: [BwdConfig(16, 32, 8, 2)], 256: [BwdConfig(16, 16, 8, 1)],
}


def shared_memory_bytes(config: BwdConfig, D_pad: int, element_bytes: int) -> int:
    """Estimated shared memory of one dK/dV program, bytes: the resident K and V tiles, ``num_stages``
    buffers of the streamed Q and dO tiles *per pipelined loop* (Triton gives each loop its own, and
    the causal split has two: diagonal and mask-free), and one BLOCK_N×BLOCK_M tile (P^T or dS^T on
    its way from the accumulator layout to a matmul operand). Compiled sm_90 fp16 causal kernels
    allocate within ~1 KB of this at D = 64 and 128 (82 432 B and 139 520 B)."""
    resident = 2 * config.block_n * D_pad * element_bytes
    streamed = 2 * max(config.num_stages, 1) * 2 * config.block_m * D_pad * element_bytes
    staging = config.block_m * config.block_n * element_bytes
    return resident + streamed + staging


def fits(config: BwdConfig, D_pad: int, element_bytes: int, arch: int) -> bool:
    limit = SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)
    return shared_memory_bytes(config, D_pad, element_bytes) + 1024 <= limit


@dataclass(frozen=True)
class WsConfig:
    """Tiles of a Hopper backward kernel (``hopper_bwd.py``): ``consumers`` warpgroups of 64 resident
    rows each, tiles of ``block_m`` rows streamed through ``stages`` shared-memory slots. In the dK/dV
    kernel the K/V rows are resident and Q/dO streamed; in the dQ kernel the other way round. ``share``
    ("-x" in the name; the dK/dV kernel where it splits the head dim): its two consumers compute each
    Q tile's scores once between them and exchange them through shared memory. ``reorder`` ("-r"; the
    dK/dV kernel with fused dQ only): each program walks its Q tiles from its own one on and forms a
    tile's dQ slice during the next tile (``hopper_bwd.FUSED_DQ_STAGGER`` and ``FUSED_DQ_LAG`` for these
    tiles alone), so the tuner can race the order per head dim and mask. ``pad`` ("-pad"): tiles as wide
    as the next power of two above the head dim, where the kernels would otherwise run a main part and a
    tail (``hopper_bwd.tile_widths``; the ablation of the tail)."""

    block_m: int
    consumers: int
    stages: int
    share: bool = False
    pad: bool = False
    reorder: bool = False

    @property
    def block_n(self) -> int:
        return 64 * self.consumers

    def __str__(self) -> str:
        return (f"ws-M{self.block_m}-c{self.consumers}-s{self.stages}" + ("-x" if self.share else "")
                + ("-r" if self.reorder else "") + ("-pad" if self.pad else ""))

    @classmethod
    def parse(cls, text: str) -> "WsConfig":
        m = re.fullmatch(r"ws-M(\d+)-c(\d+)-s(\d+)(-x)?(-r)?(-pad)?", text)
        if not m or int(m.group(2)) not in (1, 2) or int(m.group(1)) not in (32, 64, 128) \
                or (m.group(4) and int(m.group(2)) != 2):
            raise ValueError(f"a Hopper backward config looks like 'ws-M64-c2-s2' (M 32, 64 or 128 query rows, "
                             f"c 1 or 2 consumer warpgroups, s stages; '-x' after it: two consumers that "
                             f"share the scores; '-r': fused dQ's Q tiles reordered; '-pad' last: tiles of "
                             f"the next power of two, no head-dim tail), got {text!r}")
        return cls(int(m.group(1)), int(m.group(2)), int(m.group(3)), bool(m.group(4)), bool(m.group(6)),
                   bool(m.group(5)))

    def resident_rows(self, D: int, kernel: str = "dkdv") -> int:
        """Rows of the resident tiles: ``block_n``, but in the dK/dV kernel above 128 columns, where
        the consumers share one 64-row K/V tile and split its head dim (``hopper_ws.split_head_dim``)."""
        return self.block_n // (hopper_ws.split_head_dim(D) if kernel == "dkdv" else 1)

    def fits_head_dim(self, D: int, kernel: str = "dkdv") -> bool:
        """Whether the kernel takes these tiles at (padded) head dim ``D``: a dK/dV kernel that splits
        the head dim needs that many consumers, and only such a kernel shares the scores ("-x")."""
        if kernel != "dkdv":
            return not (self.share or self.reorder)
        split = hopper_ws.split_head_dim(D)
        return split in (1, self.consumers) and (not self.share or split > 1)

    def shared_bytes(self, D: int, element_bytes: int, kernel: str = "dkdv") -> int:
        """Shared memory of one program: the two resident tiles, ``stages`` slots of the two streamed ones."""
        exchange = 2 * 2 * 64 * self.block_m * element_bytes if self.share else 0  # Pᵀ and dSᵀ, two buffers
        return (2 * self.resident_rows(D, kernel) + 2 * self.stages * self.block_m) * D * element_bytes + exchange


#: The Hopper dK/dV kernel's tiles per head dim before a GPU has chosen: the largest Q tile with no
#: spills under ptxas (sm_90a, 240 registers per consumer thread): at D = 128, 64-row Q tiles spill
#: (two fp32 64×128 accumulators leave too little for two 64×64 score tiles), 32-row ones do not; at
#: D = 256 (the head dim split between two consumers) 32-row tiles spill least (36-96 bytes).
WS_HAND_CONFIGS = {64: WsConfig(64, 2, 2), 128: WsConfig(32, 2, 2), 256: WsConfig(32, 2, 3)}


@dataclass(frozen=True)
class BwdPlan:
    """What one backward runs: the dK/dV kernel's tiles, whether dQ comes from a separate kernel
    (``separate_dq``: fixed order, no atomics) or from atomics in the dK/dV kernel, and the separate
    dQ kernel's tiles (``block_n`` Q rows resident, ``block_m`` K/V rows per step). ``ws``: dK and dV
    from the Hopper kernel with these tiles instead (dQ then always from a separate kernel), ``ws_dq``:
    dQ from the Hopper dQ kernel with these tiles."""

    dkdv: BwdConfig
    separate_dq: bool
    dq: BwdConfig
    ws: WsConfig | None = None
    ws_dq: WsConfig | str | None = None

    @property
    def atomic_dq(self) -> bool:
        """Whether dQ is added into an fp32 accumulator (the tl plan's atomic dQ, or fused into the
        Hopper dK/dV kernel) rather than written once by a dQ kernel of its own."""
        return self.ws_dq in FUSED_DQS or not self.separate_dq

    def __str__(self) -> str:
        dkdv = str(self.ws) if self.ws is not None else str(self.dkdv)
        if self.ws_dq in FUSED_DQS:
            return f"dkdv:{dkdv}+{self.ws_dq}-dq"
        dq = str(self.ws_dq) if self.ws_dq is not None else str(self.dq)
        return f"dkdv:{dkdv}+" + (f"dq:{dq}" if self.separate_dq else "atomic-dq")


#: ``ws_dq_config`` / a tuned entry's ``ws_dq`` naming no dQ kernel: dQ added by atomics inside the
#: Hopper dK/dV kernel (``hopper_bwd._fused_dq``: five products per pair instead of seven, not
#: deterministic, 64-row Q tiles).
FUSED_DQ = "fused"
#: ``ws_dq_config`` / a tuned ``deterministic`` entry's ``ws_dq``: fused dQ added in a fixed order, so
#: deterministic with five products per pair: each Q tile's adds wait their turn at a semaphore in global
#: memory (``hopper_bwd._dq_writer``), as FlashAttention-3's deterministic backward does.
ORDERED_DQ = "ordered"
#: The ``ws_dq`` values that form dQ inside the Hopper dK/dV kernel.
FUSED_DQS = (FUSED_DQ, ORDERED_DQ)
#: Where the tuned plan adds dQ inside the Hopper dK/dV kernel (:data:`FUSED_DQ`) and a deterministic
#: backward is asked for, run the same tiles with :data:`ORDERED_DQ` instead of the tuner's plan without
#: fused dQ (``LAB_ORDERED_DQ=1``; off: timed on an H100 it lost at D 128 and in grouped causal cells, so the
#: tuner's ``deterministic`` entry decides per head dim and mask, performance-log entry 95).
ORDERED_DQ_DEFAULT = os.environ.get("LAB_ORDERED_DQ", "0") == "1"

#: Ordered dQ as the default plan (where the tuner timed it ahead of fused dQ) needs a grid that hides its
#: order: K/V tile ``j`` of a head adds to each Q tile after tile ``j − 1`` has, so the programs of one head
#: that start together wait for each other, an add each, before they run in step. Over many (query head,
#: Q tile) pairs per SM that chain is a small share of the kernel, and the passes ordered dQ saves (the
#: accumulator's zeroing) pay for it; over few it is not. Timed both ways on an H100, grids of up to 15.5
#: pairs per SM lost 3-20 % with the order (two heads of 8k tokens, 3.9 per SM: 20 %) and grids of 31 or
#: more won 1-3.5 %, whatever batch, heads, group and length made up the count. A grid with fewer pairs per
#: SM than this runs fused dQ with the same tiles instead; a deterministic backward keeps the order whatever
#: it costs (performance-log entry 100).
ORDERED_DQ_MIN_PAIRS_PER_SM = 18


def query_tile_pairs(B: int, Hq: int, Nq: int, block_m: int) -> int:
    """The (query head, Q tile) pairs of a backward grid: ``B·Hq`` query heads of ``Nq`` rows in Q tiles of
    ``block_m``, the work ordered dQ's start-up chain is spread over."""
    return B * Hq * cdiv(Nq, block_m)


def ordered_dq_hides_its_order(B: int, Hq: int, Nq: int, block_m: int, sms: int) -> bool:
    """Whether the grid holds at least :data:`ORDERED_DQ_MIN_PAIRS_PER_SM` (query head, Q tile) pairs per SM
    (:func:`query_tile_pairs`): where ordered dQ may stand as the default plan. A count of the grid's work,
    never of a sequence length alone."""
    return query_tile_pairs(B, Hq, Nq, block_m) >= ORDERED_DQ_MIN_PAIRS_PER_SM * sms


def parse_ws_dq(text: WsConfig | str) -> WsConfig | str:
    """A Hopper dQ kernel's tiles, :data:`FUSED_DQ` or :data:`ORDERED_DQ`."""
    return text if text in FUSED_DQS else WsConfig.parse(text) if isinstance(text, str) else text


def _hand_config(D_pad: int, dtype: torch.dtype, arch: int, element_bytes: int) -> BwdConfig:
    table = _FP32_CONFIGS if dtype == torch.float32 else _HALF_CONFIGS[90 if arch >= 90 else 80]
    return next((c for c in table[D_pad] if fits(c, D_pad, element_bytes, arch)), table[D_pad][-1])


@lru_cache(maxsize=None)
def tuned_backward_table(slug: str | None) -> dict:
    """The backward tuner's winners for one GPU (``tune_backward.py``): ``{"bf16/D128/causal0":
    {"dq_method": "separate", "dkdv": "M64-N128-w8-s2", "dq": "M32-N64-w4-s3"}, ...}`` and the
    ``arch`` they were measured on."""
    path = tuning_file(slug, "-backward", this_arch())  # (its own, or a same-arch GPU's)
    if path is None:
        return {}
    data = json.loads(path.read_text())
    return {"arch": data.get("arch"), **data.get("best", {})}


def tuned_width(D: int) -> int:
    """The head-dim width a tuned backward plan is stored under: the Hopper kernels' columns where they
    run a main part and a tail (``hopper_bwd.tile_widths``: D 72 and 80 under 80, 88 and 96 under 96),
    else the padded head dim (the tl kernels' and every other Hopper tile's width)."""
    from . import hopper_bwd  # (Gluon: imported only where it is asked for)

    main, tail = hopper_bwd.tile_widths(D)
    return main + tail if tail else padded_head_dim(D)


def _tuned_entry(D: int, dtype: torch.dtype, causal: bool, arch: int) -> dict | None:
    """The tuned plan for this head dim, dtype and mask on this GPU, if one was measured: under the
    head dim's own width (:func:`tuned_width`) or else under its padded one. fp16 takes bf16's (the
    tensor cores run both at one rate, and the tiles fit alike); fp32 is never tuned."""
    if dtype == torch.float32:
        return None
    table = tuned_backward_table(gpu_slug())
    if table.get("arch") != arch:
        return None
    names = ("fp16", "bf16") if dtype == torch.float16 else ("bf16",)
    widths = dict.fromkeys((tuned_width(D), padded_head_dim(D)))
    return next((table[k] for k in (f"{n}/D{w}/causal{int(causal)}" for w in widths for n in names) if k in table),
                None)


@lru_cache(maxsize=None)
def backward_plan(D: int, dtype: torch.dtype, arch: int, causal: bool = False, *, deterministic: bool = False,
                  tuned_tiles: bool = True, pipelining: bool = True, warp_specialization: bool = True) -> BwdPlan:
    """The backward's tiles and dQ method for this head dim, dtype, mask and GPU.

    With ``tuned_tiles``: the tuner's measured winner on this GPU when there is one (which dQ method
    is faster depends on the head dim and the mask: measured, not assumed), else the first hand-picked
    candidate that fits, with atomic dQ. Off: stage B's 64×64 tiles. ``deterministic`` always takes
    the separate dQ kernel. One stage everywhere when ``pipelining`` is off. The Hopper dK/dV kernel
    (``plan.ws``) only where the tuner measured it faster and ``warp_specialization`` is on (the
    caller still checks TMA's alignment rules on the tensors). Keyed on what changes the kernel
    only: never on sequence lengths."""
    D_pad = padded_head_dim(D)
    e = torch.empty((), dtype=dtype).element_size()
    plan = BwdPlan(BASELINE, False, BASELINE)
    hopper = False  # (whether the tuned entry's Hopper kernels may run here)
    if tuned_tiles:
        hand = _hand_config(D_pad, dtype, arch, e)
        plan = BwdPlan(hand, False, hand)
        entry = _tuned_entry(D, dtype, causal, arch)
        if entry is not None:
            dkdv = BwdConfig.parse(entry["dkdv"])
            dq = BwdConfig.parse(entry["dq"]) if "dq" in entry else dkdv
            if fits(dkdv, D_pad, e, arch) and fits(dq, D_pad, e, arch):
                plan = BwdPlan(dkdv, entry["dq_method"] == "separate", dq)
            hopper = warp_specialization and pipelining and hopper_ws.supported(dtype, D, arch, "backward")
            if hopper:
                ws = WsConfig.parse(entry["ws"]) if "ws" in entry else None
                ws_dq = parse_ws_dq(entry["ws_dq"]) if "ws_dq" in entry else None
                if ws_dq == FUSED_DQ and ws is not None:
                    # (separate_dq stays the tl plan's: what runs where the Hopper kernel cannot)
                    plan = BwdPlan(dkdv, entry["dq_method"] == "separate", dq, ws, FUSED_DQ)
                elif ws is not None or ws_dq not in (None, FUSED_DQ):
                    plan = BwdPlan(dkdv, True, dq, ws, ws_dq if ws_dq != FUSED_DQ else None)
    if deterministic and plan.ws_dq == FUSED_DQ and ORDERED_DQ_DEFAULT and ordered_dq_fits(plan.ws):
        # (the same tiles, in order; separate_dq: what runs where the Hopper kernel cannot, deterministic too)
        plan = replace(plan, separate_dq=True, ws=replace(plan.ws, reorder=False), ws_dq=ORDERED_DQ)
    elif deterministic and hopper and "deterministic" in entry:
        # Where fused dQ (atomics) won, the tuner also kept the fastest plan without atomics: its Hopper
        # kernels by name, {} for the tl kernels alone (tune_backward.tune_hopper_cell).
        det = entry["deterministic"]
        ws_dq = parse_ws_dq(det["ws_dq"]) if "ws_dq" in det else None
        plan = replace(plan, separate_dq=True, ws=WsConfig.parse(det["ws"]) if "ws" in det else None, ws_dq=ws_dq)
    elif deterministic:
        # (fused dQ is atomics: a deterministic backward takes the separate tl dQ kernel instead)
        plan = replace(plan, separate_dq=True, ws_dq=None if plan.ws_dq == FUSED_DQ else plan.ws_dq)
    if plan.ws is not None and plan.ws.reorder and plan.ws_dq != FUSED_DQ:
        plan = replace(plan, ws=replace(plan.ws, reorder=False))  # ("-r" orders fused dQ's tiles: none here)
    if D % 16 and plan.ws is not None and plan.ws_dq is None and not aligned.ROW_ALIGNMENT:
        # Without being told its rows' alignment (aligned.py, on by default), the tl dQ kernel reads a
        # row stride of D elements not a multiple of 16 (D 40: 80 bytes) one element at a time, and ran
        # at about half speed (D 40 backward: 9.5 ms against 5.0 at D 48, on the H200). TMA has no such
        # rule: beside the Hopper dK/dV kernel, dQ then comes from the Hopper dQ kernel (deterministic
        # too), with the dK/dV kernel's tiles where the dQ kernel takes them. Told, the tl dQ kernel
        # loads 16-byte rows at every head dim and the tuned plan stands.
        plan = replace(plan, separate_dq=True,
                       ws_dq=plan.ws if plan.ws.fits_head_dim(D_pad, "dq") else WsConfig(64, 2, 2))
    if not pipelining:
        plan = replace(plan, dkdv=replace(plan.dkdv, num_stages=1), dq=replace(plan.dq, num_stages=1))
    return plan


def backward_config(D: int, dtype: torch.dtype, arch: int, tuned_tiles: bool = True,
                    pipelining: bool = True, causal: bool = False) -> BwdConfig:
    """The dK/dV kernel's tile config (``backward_plan``'s ``dkdv``)."""
    return backward_plan(D, dtype, arch, causal, tuned_tiles=tuned_tiles, pipelining=pipelining).dkdv


# ------------------------------------------------------------------------------------------ kernels

@triton.jit(do_not_specialize=["H", "N", "ZERO_ROWS"])
def attention_bwd_delta_kernel(
    O, DO, DELTA, DQ_ACC, DQ_SEM,
    stride_ob, stride_oh, stride_on,
    stride_dob, stride_doh, stride_don,
    H, N, ZERO_ROWS,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, SEM_CHUNK: tl.constexpr,
):
    """Δ_i = Σ_d dO_id·O_id in fp32, one program per BLOCK rows of one (batch, query head). With a
    DQ_ACC (atomic dQ) it also zeroes those of its rows below ``ZERO_ROWS`` in the fp32 dQ accumulator;
    with DQ_SEM (ordered dQ) ``SEM_CHUNK`` semaphores per program, the program's own share of them
    (:func:`ordered_dq_semaphore_count`). ``ALIGN``: the rows' 16-byte alignment as the host checked it
    (``aligned.row_alignment``)."""
    stride_ob, stride_oh, stride_on = aligned_strides(stride_ob, stride_oh, stride_on, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_strides(stride_dob, stride_doh, stride_don, ALIGN)
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid * BLOCK + tl.arange(0, BLOCK)
    ds = tl.arange(0, D_PAD)
    mask = (rows[:, None] < N) & (ds[None, :] < D)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + rows[:, None] * stride_on
                + ds[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows[:, None] * stride_don
                 + ds[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh.to(tl.int64) * N + rows, delta, mask=rows < N)
    if DQ_ACC is not None:
        # The accumulator is contiguous [B, H, N, D] fp32.
        tl.store(DQ_ACC + bh.to(tl.int64) * N * D + rows[:, None] * D + ds[None, :],
                 tl.zeros((BLOCK, D_PAD), tl.float32), mask=mask & (rows[:, None] < ZERO_ROWS))
    if DQ_SEM is not None:
        sems = (bh.to(tl.int64) * tl.num_programs(0) + pid) * SEM_CHUNK + tl.arange(0, SEM_CHUNK)
        tl.store(DQ_SEM + sems, tl.zeros((SEM_CHUNK, ), tl.int32))


@triton.jit
def _load_tile(ptrs, rows, n, ds, D: tl.constexpr, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a [rows, D_PAD] tile, masking rows ≥ n and head-dim columns ≥ D only where needed (the
    masks are compile-time, so an even tile of a power-of-two head dim loads without any)."""
    if MASK_ROWS and MASK_COLS:
        return tl.load(ptrs, mask=(rows[:, None] < n) & (ds[None, :] < D), other=0.0)
    elif MASK_ROWS:
        return tl.load(ptrs, mask=rows[:, None] < n, other=0.0)
    elif MASK_COLS:
        return tl.load(ptrs, mask=ds[None, :] < D, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _dkdv_visit_q_tiles(
    dk, dv, k, v, cols,
    Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
    stride_qn, stride_don,
    lo, hi, Nq, Nk, causal_offset, qk_scale, dq_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    MASK_CAUSAL: tl.constexpr, MASK_NK: tl.constexpr, MASK_NQ: tl.constexpr,
    EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, first_key, MASK_START: tl.constexpr,
):
    """Fold Q tiles [lo, hi) of one query head into dK, dV (transposed formulation: every tile here
    is [BLOCK_N keys, BLOCK_M queries], so the resident K/V rows are the matmuls' M dimension).
    ``MASK_START``: keys before ``first_key`` (a key range's start) are masked too."""
    ds = tl.arange(0, D_PAD)
    MASK_D: tl.constexpr = D != D_PAD
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q = _load_tile(Q_h + rows[:, None] * stride_qn + ds[None, :], rows, Nq, ds, D, MASK_NQ, MASK_D)
        do = _load_tile(DO_h + rows[:, None] * stride_don + ds[None, :], rows, Nq, ds, D, MASK_NQ, MASK_D)
        if MASK_NQ:
            # Rows past Nq get lse = +inf: their P is exactly 0, so they add nothing anywhere.
            lse = tl.load(LSE_h + rows, mask=rows < Nq, other=float("inf"))
            delta = tl.load(DELTA_h + rows, mask=rows < Nq, other=0.0)
        else:
            lse = tl.load(LSE_h + rows)
            delta = tl.load(DELTA_h + rows)

        # P^T = 2^(K Q^T · scale·log2e − lse): recomputed, never stored (see the module docstring).
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        if EXP2:
            p_t = tl.math.exp2(qk_t * qk_scale - lse[None, :])
        else:
            p_t = tl.exp(qk_t * qk_scale - lse[None, :] * 0.6931471805599453)  # lse arrives in base 2
        if MASK_CAUSAL or MASK_NK or MASK_START:
            # After the exponential: a masked score never enters an arithmetic, so no inf − inf.
            valid = cols[:, None] < Nk
            if MASK_START:
                valid = valid & (cols[:, None] >= first_key)
            if MASK_CAUSAL:
                valid = valid & (cols[:, None] <= rows[None, :] + causal_offset)
            p_t = tl.where(valid, p_t, 0.0)

        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if DQ_h is not None:
            # Atomic dQ: this tile's share dS K, already scaled, added by the L2's atomic units.
            # "relaxed": no ordering with other memory operations is needed, only the sum.
            dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * dq_scale
            dq_ptrs = DQ_h + rows[:, None] * D + ds[None, :]
            if MASK_NQ or MASK_D:
                tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < Nq) & (ds[None, :] < D), sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_visit_group(
    dk, dv, k, v, cols, start_n, b, h_kv,
    Q, DO, LSE, DELTA, DQ_ACC,
    stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
    Hq, Nq, Nk, qk_scale, sm_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr, MASK_NK: tl.constexpr,
    EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, first_key, MASK_START: tl.constexpr,
):
    """Fold every Q tile of every query head of the K/V head's group into dK, dV. Each head's Q tiles
    split at run time into the masked ones (the diagonal band, the ragged last tile) and the
    mask-free rest, so no kernel is compiled per sequence length."""
    causal_offset = Nk - Nq
    nq_full = Nq // BLOCK_M * BLOCK_M  # whole Q tiles; the ragged rest needs the Nq mask
    # GQA: the query heads h_kv·GROUP ... h_kv·GROUP + GROUP − 1 all read this K/V head; their
    # contributions are summed here, in registers, in a fixed order.
    for g in range(GROUP):
        h = h_kv * GROUP + g
        bh_q = b.to(tl.int64) * Hq + h
        Q_h = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        DO_h = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        LSE_h = LSE + bh_q * Nq
        DELTA_h = DELTA + bh_q * Nq
        DQ_h = DQ_ACC + bh_q * Nq * D if DQ_ACC is not None else None
        if CAUSAL and CAUSAL_SKIP:
            # Row i sees key j iff j ≤ i + offset: the first row that sees this tile's first key is
            # start_n − offset. Tiles before its tile are skipped; tiles until the one whose first row
            # sees the tile's last key (start_n + BLOCK_N − 1) are diagonal and masked; the rest
            # see every key of the tile and run mask-free.
            first = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
            unmasked = tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0)
            unmasked = tl.maximum(first, (unmasked + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
            dk, dv = _dkdv_visit_q_tiles(dk, dv, k, v, cols, Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
                                         stride_qn, stride_don, first, tl.minimum(unmasked, Nq), Nq, Nk,
                                         causal_offset, qk_scale, sm_scale, D, D_PAD, BLOCK_M,
                                         True, MASK_NK, True, EXP2, DOT_PRECISION, first_key,
                                         MASK_START)
            dk, dv = _dkdv_visit_q_tiles(dk, dv, k, v, cols, Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
                                         stride_qn, stride_don, unmasked, nq_full, Nq, Nk,
                                         causal_offset, qk_scale, sm_scale, D, D_PAD, BLOCK_M,
                                         False, MASK_NK, False, EXP2, DOT_PRECISION, first_key,
                                         MASK_START)
            dk, dv = _dkdv_visit_q_tiles(dk, dv, k, v, cols, Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
                                         stride_qn, stride_don, tl.maximum(unmasked, nq_full), Nq, Nq, Nk,
                                         causal_offset, qk_scale, sm_scale, D, D_PAD, BLOCK_M,
                                         False, MASK_NK, True, EXP2, DOT_PRECISION, first_key,
                                         MASK_START)
        else:
            # Every Q tile, masked like stage B when causal; the ragged last one with the Nq mask.
            dk, dv = _dkdv_visit_q_tiles(dk, dv, k, v, cols, Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
                                         stride_qn, stride_don, 0, nq_full, Nq, Nk,
                                         causal_offset, qk_scale, sm_scale, D, D_PAD, BLOCK_M,
                                         CAUSAL, MASK_NK, False, EXP2, DOT_PRECISION, first_key,
                                         MASK_START)
            dk, dv = _dkdv_visit_q_tiles(dk, dv, k, v, cols, Q_h, DO_h, LSE_h, DELTA_h, DQ_h,
                                         stride_qn, stride_don, nq_full, Nq, Nq, Nk,
                                         causal_offset, qk_scale, sm_scale, D, D_PAD, BLOCK_M,
                                         CAUSAL, MASK_NK, True, EXP2, DOT_PRECISION, first_key,
                                         MASK_START)
    return dk, dv


#: Sizes are runtime values (``do_not_specialize``): no kernel is compiled per sequence length. Strides
#: keep their divisibility facts (16-byte vector loads).
@triton.jit(do_not_specialize=["Hq", "Hkv", "Nq", "Nk"])
def attention_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, DQ_ACC, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, Nq, Nk,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr,
    EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, KEY_STARTS, KEY_LENGTHS,
):
    # (16-byte rows at every head dim: the host checked the strides, aligned.py)
    stride_qb, stride_qh, stride_qn = aligned_strides(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_strides(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_strides(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_strides(stride_dob, stride_doh, stride_don, ALIGN)
    stride_dkb, stride_dkh, stride_dkn = aligned_strides(stride_dkb, stride_dkh, stride_dkn, ALIGN)
    stride_dvb, stride_dvh, stride_dvn = aligned_strides(stride_dvb, stride_dvh, stride_dvn, ALIGN)
    pid_n, bh = tl.program_id(0), tl.program_id(1)
    b, h_kv = bh // Hkv, bh % Hkv
    start_n = pid_n * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    ds = tl.arange(0, D_PAD)
    MASK_D: tl.constexpr = D != D_PAD
    K_tile = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh + cols[:, None] * stride_kn + ds[None, :]
    V_tile = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh + cols[:, None] * stride_vn + ds[None, :]
    dk = tl.zeros((BLOCK_N, D_PAD), tl.float32)
    dv = tl.zeros((BLOCK_N, D_PAD), tl.float32)
    if KEY_STARTS is not None or KEY_LENGTHS is not None:
        # A key range per batch entry (the forward's): keys [first, end) of the Nk, the causal
        # diagonal aligned to its end. Keys outside it are never loaded (they may hold anything) and
        # get zero gradients; every score is masked against the range.
        first, end = key_range(KEY_STARTS, KEY_LENGTHS, b, Nk)
        in_range = (cols[:, None] >= first) & (cols[:, None] < end) & (ds[None, :] < D)
        k = tl.load(K_tile, mask=in_range, other=0.0)
        v = tl.load(V_tile, mask=in_range, other=0.0)
        dk, dv = _dkdv_visit_group(dk, dv, k, v, cols, start_n, b, h_kv, Q, DO, LSE, DELTA, DQ_ACC,
                                   stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
                                   Hq, Nq, end, qk_scale, sm_scale, D, D_PAD, BLOCK_M, BLOCK_N, GROUP, CAUSAL,
                                   CAUSAL_SKIP, True, EXP2, DOT_PRECISION, first, True)
    else:
        # The K and V tiles are loaded once per program: masked always (cheap here); the Nk mask of the
        # inner loop, per score, only in the one program whose tile is ragged.
        k = _load_tile(K_tile, cols, Nk, ds, D, True, MASK_D)
        v = _load_tile(V_tile, cols, Nk, ds, D, True, MASK_D)
        if start_n + BLOCK_N <= Nk:
            dk, dv = _dkdv_visit_group(dk, dv, k, v, cols, start_n, b, h_kv, Q, DO, LSE, DELTA, DQ_ACC,
                                       stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
                                       Hq, Nq, Nk, qk_scale, sm_scale, D, D_PAD, BLOCK_M, BLOCK_N, GROUP, CAUSAL,
                                       CAUSAL_SKIP, False, EXP2, DOT_PRECISION, 0, False)
        else:
            dk, dv = _dkdv_visit_group(dk, dv, k, v, cols, start_n, b, h_kv, Q, DO, LSE, DELTA, DQ_ACC,
                                       stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don,
                                       Hq, Nq, Nk, qk_scale, sm_scale, D, D_PAD, BLOCK_M, BLOCK_N, GROUP, CAUSAL,
                                       CAUSAL_SKIP, True, EXP2, DOT_PRECISION, 0, False)

    dk = dk * sm_scale  # dK = scale · dS^T Q: the scale once per element, not once per tile pair
    dk_ptrs = DK + b.to(tl.int64) * stride_dkb + h_kv.to(tl.int64) * stride_dkh + cols[:, None] * stride_dkn + ds[None, :]
    dv_ptrs = DV + b.to(tl.int64) * stride_dvb + h_kv.to(tl.int64) * stride_dvh + cols[:, None] * stride_dvn + ds[None, :]
    mask = (cols[:, None] < Nk) & (ds[None, :] < D)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _dq_visit_kv_tiles(
    dq, q, do, lse, delta, rows,
    K_h, V_h, stride_kn, stride_vn,
    lo, hi, Nk, causal_offset, qk_scale,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_CAUSAL: tl.constexpr, MASK_NK: tl.constexpr, EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Fold K/V tiles [lo, hi) into dQ (unscaled): dQ += dS K, with P and dP recomputed."""
    ds = tl.arange(0, D_PAD)
    MASK_D: tl.constexpr = D != D_PAD
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K_h + cols[:, None] * stride_kn + ds[None, :], cols, Nk, ds, D, MASK_NK, MASK_D)
        v = _load_tile(V_h + cols[:, None] * stride_vn + ds[None, :], cols, Nk, ds, D, MASK_NK, MASK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if EXP2:
            p = tl.math.exp2(qk * qk_scale - lse[:, None])
        else:
            p = tl.exp(qk * qk_scale - lse[:, None] * 0.6931471805599453)
        if MASK_CAUSAL or MASK_NK:
            valid = cols[None, :] < Nk
            if MASK_CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + causal_offset)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds_ = p * (dp - delta[:, None])
        dq = tl.dot(ds_.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["Hq", "Nq", "Nk"])
def attention_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, qk_scale, sm_scale,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    Hq, Nq, Nk,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr, CAUSAL: tl.constexpr, CAUSAL_SKIP: tl.constexpr,
    EXP2: tl.constexpr, DOT_PRECISION: tl.constexpr, ALIGN: tl.constexpr, KEY_STARTS, KEY_LENGTHS,
):
    """Deterministic dQ: one program per (Q tile of BLOCK_M rows, batch·query head), K/V tiles of
    BLOCK_N rows visited in a fixed order."""
    # (16-byte rows at every head dim: the host checked the strides, aligned.py)
    stride_qb, stride_qh, stride_qn = aligned_strides(stride_qb, stride_qh, stride_qn, ALIGN)
    stride_kb, stride_kh, stride_kn = aligned_strides(stride_kb, stride_kh, stride_kn, ALIGN)
    stride_vb, stride_vh, stride_vn = aligned_strides(stride_vb, stride_vh, stride_vn, ALIGN)
    stride_dob, stride_doh, stride_don = aligned_strides(stride_dob, stride_doh, stride_don, ALIGN)
    stride_dqb, stride_dqh, stride_dqn = aligned_strides(stride_dqb, stride_dqh, stride_dqn, ALIGN)
    bh = tl.program_id(1)
    if CAUSAL and CAUSAL_SKIP:
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # most work first, as in the forward
    else:
        pid_m = tl.program_id(0)
    b, h = bh // Hq, bh % Hq
    h_kv = h // GROUP
    start_m = pid_m * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    ds = tl.arange(0, D_PAD)
    MASK_D: tl.constexpr = D != D_PAD
    q = _load_tile(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + rows[:, None] * stride_qn
                   + ds[None, :], rows, Nq, ds, D, True, MASK_D)  # once per program: always masked
    do = _load_tile(DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + rows[:, None] * stride_don
                    + ds[None, :], rows, Nq, ds, D, True, MASK_D)
    lse = tl.load(LSE + bh.to(tl.int64) * Nq + rows, mask=rows < Nq, other=float("inf"))
    delta = tl.load(DELTA + bh.to(tl.int64) * Nq + rows, mask=rows < Nq, other=0.0)
    K_h = K + b.to(tl.int64) * stride_kb + h_kv.to(tl.int64) * stride_kh
    V_h = V + b.to(tl.int64) * stride_vb + h_kv.to(tl.int64) * stride_vh
    dq = tl.zeros((BLOCK_M, D_PAD), tl.float32)
    causal_offset = Nk - Nq
    n_full = Nk // BLOCK_N * BLOCK_N  # whole K/V tiles; the ragged rest needs the Nk mask
    if KEY_STARTS is not None or KEY_LENGTHS is not None:
        # A key range (the forward's): the tiles start at its first key, so none reads a key before
        # it, and are all masked against its end and the diagonal aligned to that end.
        first, end = key_range(KEY_STARTS, KEY_LENGTHS, b, Nk)
        offset = end - Nq
        hi = end
        if CAUSAL:
            hi = tl.maximum(tl.minimum(start_m + BLOCK_M + offset, end), 0)
        dq = _dq_visit_kv_tiles(dq, q, do, lse, delta, rows, K_h, V_h, stride_kn, stride_vn,
                                first, hi, end, offset, qk_scale, D, D_PAD, BLOCK_N, CAUSAL, True, EXP2,
                                DOT_PRECISION)
    elif CAUSAL and CAUSAL_SKIP:
        # Every row of the tile sees keys j ≤ start_m + offset: whole tiles below that run mask-free;
        # tiles up to the last row's last key (start_m + BLOCK_M − 1 + offset) are masked.
        unmasked = tl.minimum(tl.maximum(start_m + causal_offset + 1, 0) // BLOCK_N * BLOCK_N, n_full)
        dq = _dq_visit_kv_tiles(dq, q, do, lse, delta, rows, K_h, V_h, stride_kn, stride_vn,
                                0, unmasked, Nk, causal_offset, qk_scale, D, D_PAD, BLOCK_N,
                                False, False, EXP2, DOT_PRECISION)
        dq = _dq_visit_kv_tiles(dq, q, do, lse, delta, rows, K_h, V_h, stride_kn, stride_vn,
                                unmasked, tl.minimum(start_m + BLOCK_M + causal_offset, Nk), Nk, causal_offset,
                                qk_scale, D, D_PAD, BLOCK_N, True, True, EXP2, DOT_PRECISION)
    else:
        dq = _dq_visit_kv_tiles(dq, q, do, lse, delta, rows, K_h, V_h, stride_kn, stride_vn,
                                0, n_full, Nk, causal_offset, qk_scale, D, D_PAD, BLOCK_N,
                                CAUSAL, False, EXP2, DOT_PRECISION)
        # The ragged last K/V tile: a loop that runs zero times when Nk is a multiple of BLOCK_N.
        dq = _dq_visit_kv_tiles(dq, q, do, lse, delta, rows, K_h, V_h, stride_kn, stride_vn,
                                n_full, Nk, Nk, causal_offset, qk_scale, D, D_PAD, BLOCK_N,
                                CAUSAL, True, EXP2, DOT_PRECISION)
    dq = dq * sm_scale
    dq_ptrs = DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + rows[:, None] * stride_dqn + ds[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(rows[:, None] < Nq) & (ds[None, :] < D))


# ------------------------------------------------------------------------------------------ host side

def fused_dq_fits(ws: WsConfig) -> bool:
    """Whether fused dQ runs with these Hopper dK/dV tiles (``hopper_bwd.fused_dq_block_ms``: 64-row Q
    tiles, or 32-row ones with two consumers that add once per pair)."""
    from . import hopper_bwd  # (Gluon: imported only where it runs)

    return ws.block_m in hopper_bwd.fused_dq_block_ms(ws.consumers)


def ordered_dq_fits(ws: WsConfig | None) -> bool:
    """Whether ordered dQ (:data:`ORDERED_DQ`) runs with these Hopper dK/dV tiles: fused dQ's, two
    consumers adding once per pair (``hopper_bwd.ordered_dq_takes``; a '-r' config runs in order)."""
    from . import hopper_bwd

    return ws is not None and fused_dq_fits(ws) and hopper_bwd.ordered_dq_takes(ws.consumers)


def _new_gradient(t: torch.Tensor) -> torch.Tensor:
    """A contiguous gradient buffer shaped like ``t`` (NaN-filled when the tests poison outputs)."""
    return new_output(t)


def choose_ws(planned: WsConfig | None, forced: WsConfig | str | None, q, k, v, do, arch: int, *,
              switches_on: bool, name: str = "ws_config") -> WsConfig | None:
    """A Hopper backward kernel's tiles for this call, or None for the ``tl`` kernel: ``forced``
    (the argument ``name``) when given, a ValueError where that kernel cannot run; else the plan's
    where the tensors meet TMA's alignment rules. ``switches_on``: every ablation switch the Hopper
    kernels have built in (tuned tiles, pipelining, exp2, causal skipping, warp specialization) is on."""
    if forced is not None:
        ws = parse_ws_dq(forced) if name == "ws_dq_config" else WsConfig.parse(forced) if isinstance(forced, str) \
            else forced
        D = q.shape[-1]
        if not (hopper_ws.supported(q.dtype, D, arch, "backward") and tma_supported(arch, q, k, v, do) and switches_on):
            raise ValueError(f"{name}={ws}: the Hopper backward kernels run on sm_90 with fp16/bf16, "
                             f"{hopper_ws.supported_head_dims('backward')}, 16-byte aligned strides and every switch on; "
                             f"got arch {arch}, {q.dtype}, D {D}, "
                             f"switches on: {switches_on}")
        kernel = "dkdv" if name == "ws_config" else "dq"
        if isinstance(ws, WsConfig) and not ws.fits_head_dim(padded_head_dim(D), kernel):
            raise ValueError(f"{name}={ws}: above head dim {hopper_ws.SPLIT_ABOVE} the Hopper dK/dV kernel splits the "
                             f"head dim between two consumer warpgroups (a config with c2 there, e.g. "
                             f"'ws-M32-c2-s3'), and only there can they share the scores ('-x'); the dQ kernel "
                             f"takes no '-x' or '-r'; got D {D}")
        return ws
    if planned is not None and switches_on and tma_supported(arch, q, k, v, do):
        return planned
    return None


def plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, dq_acc, *, causal: bool, scale: float, arch: int,
                  deterministic: bool = False, tuned_tiles: bool = True, pipelining: bool = True,
                  exp2: bool = True, causal_skip: bool = True, tma: bool = True,
                  config: BwdConfig | None = None, dq_config: BwdConfig | None = None,
                  ws: WsConfig | None = None, ws_dq: WsConfig | None = None, key_starts=None,
                  key_lengths=None, dq_sem=None) -> list[Launch]:
    """The backward's launches in order: Δ pre-pass, dK/dV (+ atomic dQ into ``dq_acc``), and with
    ``deterministic`` the dQ kernel writing ``dq``. ``dq_acc`` is None in deterministic mode. ``tma``
    is accepted and ignored (pointer loads everywhere, see the module docstring). ``config`` forces the
    dK/dV kernel's tiles, ``dq_config`` the dQ kernel's (default: ``config`` the other way round).
    ``ws``: dK/dV from the Hopper kernel with these tiles (``choose_ws``; needs ``deterministic``,
    the separate dQ kernel, unless ``ws_dq`` is :data:`FUSED_DQ`: dQ added into ``dq_acc`` by the
    Hopper dK/dV kernel itself, or :data:`ORDERED_DQ`: the same in a fixed order, deterministic, with the
    zeroed semaphores ``dq_sem``); ``ws_dq``: dQ from the Hopper dQ kernel (``deterministic`` too).
    ``key_starts``/``key_lengths``: the forward's key ranges (the ``tl`` kernels take them)."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    D_pad = padded_head_dim(D)
    if config is None:
        plan = backward_plan(D, q.dtype, arch, causal, deterministic=deterministic, tuned_tiles=tuned_tiles,
                             pipelining=pipelining)
        config, dq_config = plan.dkdv, dq_config or plan.dq
    dq_config = dq_config or config
    ordered = ws_dq == ORDERED_DQ
    if ordered and not (ordered_dq_fits(ws) and dq_acc is not None and dq_sem is not None):
        raise ValueError(f"ws_dq_config={ORDERED_DQ!r} (fused dQ added in a fixed order) needs a Hopper dK/dV config "
                         f"fused dQ takes with two consumers (e.g. 'ws-M64-c2-s2'), adding once per pair, the fp32 "
                         f"accumulator and the semaphores (dq_sem); got ws_config={ws}")
    fused = ws_dq == FUSED_DQ or ordered
    if ws_dq == FUSED_DQ and (ws is None or deterministic or dq_acc is None or not fused_dq_fits(ws)):
        raise ValueError(f"ws_dq_config={FUSED_DQ!r} (dQ by atomics inside the Hopper dK/dV kernel) needs a Hopper "
                         f"dK/dV config with 64-row Q tiles, or 32-row ones with two consumers (ws_config, e.g. "
                         f"'ws-M64-c2-s2' or 'ws-M32-c2-s3'), deterministic off and the fp32 accumulator; got "
                         f"ws_config={ws}, deterministic={deterministic}")
    if ws is not None and ws.reorder and not fused:
        raise ValueError(f"ws_config={str(ws)!r}: '-r' reorders the Q tiles of fused dQ; it takes "
                         f"ws_dq_config={FUSED_DQ!r} (or drop the '-r')")
    if (key_starts is not None or key_lengths is not None) and (ws is not None or ws_dq is not None):
        raise ValueError("key_starts/key_lengths run on the tl backward kernels, not the Hopper ones: leave "
                         "ws_config and ws_dq_config None")
    if (ws is not None or ws_dq is not None) and not deterministic and not fused:
        raise ValueError("the Hopper kernels form dQ in a kernel of its own: plan_backward needs deterministic=True "
                         "with ws or ws_dq")
    BM, BN = config.block_m, config.block_n
    qk_scale = scale * LOG2E if exp2 else scale
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    common = dict(D=D, D_PAD=D_pad, GROUP=Hq // Hkv, CAUSAL=causal, CAUSAL_SKIP=causal_skip, EXP2=exp2,
                  DOT_PRECISION=precision)
    # What the pre-pass zeroes beside Δ: the fp32 accumulator's rows; where ordered dQ's first add of each
    # tile stores (hopper_bwd.ORDERED_DQ_FIRST_STORES), only rows that no K/V tile sees (causal, Nq > Nk), and
    # ordered dQ's semaphores (which the caller then allocates unzeroed: _allocate's ``first_stores``).
    first_stores = ordered and hopper_bwd_first_stores()
    zero_rows = (max(Nq - Nk, 0) if causal else 0) if first_stores else Nq
    launches = [Launch(
        attention_bwd_delta_kernel, (cdiv(Nq, DELTA_BLOCK), B * Hq),
        dict(O=o, DO=do, DELTA=delta, DQ_ACC=dq_acc if zero_rows else None, DQ_SEM=dq_sem if first_stores else None,
             stride_ob=o.stride(0), stride_oh=o.stride(1), stride_on=o.stride(2),
             stride_dob=do.stride(0), stride_doh=do.stride(1), stride_don=do.stride(2),
             H=Hq, N=Nq, ZERO_ROWS=zero_rows, D=D, D_PAD=D_pad, BLOCK=DELTA_BLOCK, ALIGN=row_alignment(o, do),
             SEM_CHUNK=SEM_CHUNK),
        num_warps=4, num_stages=1)]
    if ws is not None:
        from . import hopper_bwd  # (Gluon: imported only where it runs)

        launches.append(hopper_bwd.plan_dkdv(q, k, v, do, dk, dv, lse, delta, causal=causal, qk_scale=qk_scale,
                                             sm_scale=scale, block_m=ws.block_m, consumers=ws.consumers,
                                             stages=ws.stages, dq_acc=dq_acc if fused else None,
                                             share_scores=ws.share, pad=ws.pad, reorder=ws.reorder and not ordered,
                                             dq_sem=dq_sem if ordered else None, first_stores=first_stores))
    else:
        launches.append(Launch(
            attention_bwd_dkdv_kernel, (cdiv(Nk, BN), B * Hkv),
            dict(Q=q, K=k, V=v, DO=do, DK=dk, DV=dv, LSE=lse, DELTA=delta, DQ_ACC=dq_acc,
                 qk_scale=qk_scale, sm_scale=scale,
                 stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
                 stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
                 stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
                 stride_dob=do.stride(0), stride_doh=do.stride(1), stride_don=do.stride(2),
                 stride_dkb=dk.stride(0), stride_dkh=dk.stride(1), stride_dkn=dk.stride(2),
                 stride_dvb=dv.stride(0), stride_dvh=dv.stride(1), stride_dvn=dv.stride(2),
                 Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, BLOCK_M=BM, BLOCK_N=BN, KEY_STARTS=key_starts,
                 KEY_LENGTHS=key_lengths, ALIGN=row_alignment(q, k, v, do, dk, dv), **common),
            num_warps=config.num_warps, num_stages=config.num_stages))
    if fused:
        pass  # (dQ is in dq_acc once the dK/dV kernel is done)
    elif ws_dq is not None:
        from . import hopper_bwd

        launches.append(hopper_bwd.plan_dq(q, k, v, do, dq, lse, delta, causal=causal, qk_scale=qk_scale,
                                           sm_scale=scale, block_n=ws_dq.block_m, consumers=ws_dq.consumers,
                                           stages=ws_dq.stages, pad=ws_dq.pad))
    elif deterministic:
        # The resident tile is the big one here too: block_n Q rows, block_m K/V rows per step.
        launches.append(Launch(
            attention_bwd_dq_kernel, (cdiv(Nq, dq_config.block_n), B * Hq),
            dict(Q=q, K=k, V=v, DO=do, DQ=dq, LSE=lse, DELTA=delta, qk_scale=qk_scale, sm_scale=scale,
                 stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qn=q.stride(2),
                 stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
                 stride_vb=v.stride(0), stride_vh=v.stride(1), stride_vn=v.stride(2),
                 stride_dob=do.stride(0), stride_doh=do.stride(1), stride_don=do.stride(2),
                 stride_dqb=dq.stride(0), stride_dqh=dq.stride(1), stride_dqn=dq.stride(2),
                 Hq=Hq, Nq=Nq, Nk=Nk, BLOCK_M=dq_config.block_n, BLOCK_N=dq_config.block_m, KEY_STARTS=key_starts,
                 KEY_LENGTHS=key_lengths, ALIGN=row_alignment(q, k, v, do, dq), **common),
            num_warps=dq_config.num_warps, num_stages=dq_config.num_stages))
    return launches


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, *, causal: bool, scale: float, deterministic: bool = False,
                       tuned_tiles: bool = True, pipelining: bool = True, exp2: bool = True,
                       causal_skip: bool = True, tma: bool = True, warp_specialization: bool = True,
                       config: BwdConfig | None = None, dq_config: BwdConfig | None = None,
                       ws_config: WsConfig | str | None = None, ws_dq_config: WsConfig | str | None = None,
                       key_starts: torch.Tensor | None = None, key_lengths: torch.Tensor | None = None):
    """Gradients (dq, dk, dv) of attention, in the input dtypes, shaped like q, k, v (contiguous).

    ``o`` is the forward's output and ``lse`` its fp32 ``[B, Hq, Nq]`` row log-sum-exp in base 2 of
    the scaled scores (+inf for a row that sees no key). ``deterministic=True`` computes dQ without
    atomics (bitwise reproducible, ~40 % more FLOPs); without it, ``backward_plan`` picks the faster
    of the two ways on this GPU (measured by the tuner). The other switches are the ablation's (module
    docstring); ``config``/``dq_config`` force the kernels' tiles (tests, tuning), ``ws_config`` the Hopper
    dK/dV kernel and its tiles (``hopper_bwd.py``), ``ws_dq_config`` the Hopper dQ kernel; each
    otherwise runs where the tuner measured it faster; ``warp_specialization=False`` keeps to the ``tl`` kernels. ``do`` may come in any layout
    (the gradient of ``o.sum()`` is an expanded tensor): it is made contiguous where the kernels need that.
    ``key_starts``/``key_lengths``: the forward's key ranges (int32 [B], checked by ``attention``): keys
    outside a sequence's range get zero gradients; the ``tl`` kernels run them.
    """
    if isinstance(do, torch.Tensor):
        do = ops.maybe_contiguous(do)
    return run_backward(do, q, k, v, o, lse, causal, scale, deterministic, tuned_tiles, pipelining, exp2,
                        causal_skip, warp_specialization, key_starts, key_lengths, tma, config, dq_config,
                        ws_config, ws_dq_config)


def run_backward(do, q, k, v, o, lse, causal, scale, deterministic=False, tuned_tiles=True, pipelining=True,
                 exp2=True, causal_skip=True, warp_specialization=True, key_starts=None, key_lengths=None,
                 tma=True, config=None, dq_config=None, ws_config=None, ws_dq_config=None):
    """:func:`attention_backward` with the arguments by position (what the autograd node calls), ``do``
    already contiguous in its last dim (:func:`ops.maybe_contiguous`)."""
    # The lean path: what this layout runs (plan, tiles, kernels, every argument but the tensors) is
    # worked out at its first call and kept; a later call allocates the gradients and hands its
    # tensors to the kept launches (stages/launch.py, KeptLaunch). Keyed on everything the launches'
    # other arguments depend on (shapes, strides, dtype, alignment, the scale, the options) and on
    # everything the checks read (each tensor's shape, dtype and device), so a layout is checked at its
    # first call only: a model calls its backward with the same layouts step after step.
    try:
        aligned = (q.data_ptr() | k.data_ptr() | v.data_ptr() | do.data_ptr() | o.data_ptr()) % 16 == 0
        ranges = None if key_starts is None and key_lengths is None else key_ranges_alignment(key_starts, key_lengths)
        key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), do.shape, do.stride(), o.shape,
               o.stride(), lse.shape, lse.stride(), q.dtype, k.dtype, v.dtype, do.dtype, o.dtype, lse.dtype,
               q.device, k.device, v.device, do.device, o.device, lse.device, aligned, causal, scale, deterministic,
               tuned_tiles, pipelining, exp2, causal_skip, tma, warp_specialization, config, dq_config, ws_config,
               ws_dq_config, ranges)
        kept = _KEPT.get(key)
    except (AttributeError, TypeError):  # (not tensors, or an option of a type it cannot be: the checks say)
        key = kept = None
    if kept is None:
        validate_backward_inputs(do, q, k, v, o, lse, scale, causal=causal)
        kept = _plan_layout(do, q, k, v, o, lse, causal=causal, scale=scale, deterministic=deterministic,
                            tuned_tiles=tuned_tiles, pipelining=pipelining, exp2=exp2, causal_skip=causal_skip,
                            tma=tma, warp_specialization=warp_specialization, config=config, dq_config=dq_config,
                            ws_config=ws_config, ws_dq_config=ws_dq_config, key_starts=key_starts,
                            key_lengths=key_lengths)
        if key is not None:
            if len(_KEPT) >= _KEPT_MAX:
                _KEPT.clear()  # a model's layouts come back every step; a cleared table refills
            _KEPT[key] = kept
    tensors = _allocate(q, k, v, kept.separate, kept.workspace, kept.split, kept.ordered, kept.first_stores)
    tensors.update(do=do, q=q, k=k, v=v, o=o, lse=lse, key_starts=key_starts, key_lengths=key_lengths)
    bound = kept.bound
    if bound and bound[0].open():  # (one check for all: they were bound on one device)
        # The leanest path: launches bound at this layout's first call (launch.BoundKeptLaunch): per call
        # only addresses, and tensor maps found by address. It matters most here: autograd runs a CUDA backward on a
        # thread of its own, where the same Python takes longer than on the caller's.
        for launch in bound:
            launch(tensors)
    else:
        for launch in kept.launches:
            launch(tensors)
        if bound is None:
            bound = tuple(launch.bind(tensors) for launch in kept.launches)
            kept.bound = bound if all(bound) else False  # (False: some launch cannot be bound; not tried again)
    dq = tensors["dq"]
    if dq is None:
        dq = tensors["dq_acc"].to(q.dtype)
    return dq, tensors["dk"], tensors["dv"]


#: layout key -> its :class:`KeptLayout`: ``attention_backward``'s memo of the layouts seen
_KEPT: dict = {}
_KEPT_MAX = 256


@dataclass
class KeptLayout:
    """What ``attention_backward`` keeps of one layout: whether dQ has its own kernel (``separate``),
    the launches planned at its first call (``launch.KeptLaunch``) and, once a call has run them, the
    same launches bound (``launch.BoundKeptLaunch``; False where one cannot be)."""

    separate: bool
    launches: tuple
    bound: object = None
    workspace: tuple | None = None  # the split backward's dQ partials (decode_backward.workspace_shape)
    split: bool = False  # the split backward (which forms Δ in its own programs: no buffer for it)
    ordered: bool = False  # ordered dQ (its semaphores, per call)
    first_stores: bool = False  # ordered dQ's first adds store: the Δ pre-pass zeroes the semaphores

#: Which call tensor each tensor or descriptor argument of the backward kernels takes.
_ROLES = {"Q": "q", "K": "k", "V": "v", "O": "o", "DO": "do", "DQ": "dq", "DK": "dk", "DV": "dv", "LSE": "lse",
          "DELTA": "delta", "DQ_ACC": "dq_acc", "q_desc": "q", "k_desc": "k", "v_desc": "v", "do_desc": "do",
          "dq_desc": "dq", "dk_desc": "dk", "dv_desc": "dv", "q_tail_desc": "q", "k_tail_desc": "k",
          "v_tail_desc": "v", "do_tail_desc": "do", "dq_tail_desc": "dq", "dk_tail_desc": "dk", "dv_tail_desc": "dv", "DQ_TAIL_ACC": "dq_acc",
          "KEY_STARTS": "key_starts", "KEY_LENGTHS": "key_lengths", "DQ_PART": "dq_part",
          "DQ_SEM": "dq_sem"}


def _allocate(q, k, v, separate: bool, workspace: tuple | None = None, split: bool = False,
              ordered: bool = False, first_stores: bool = False) -> dict:
    """The buffers one backward writes: Δ, dK, dV, and dQ (separate kernel) or the fp32 atomic
    accumulator (which fp32 inputs use as dQ itself); ``split``: the split backward's, dK, dV, dQ
    and, with ``workspace``, its fp32 dQ partials of that shape (``dq_part``), no Δ; ``ordered``:
    ordered dQ's semaphores (``dq_sem``), zeroed unless ``first_stores`` (the Δ pre-pass zeroes them)."""
    B, Hq, Nq, D = q.shape
    out = dict(delta=None if split else torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device),
               dk=_new_gradient(k), dv=_new_gradient(v),
               dq_part=torch.empty(workspace, dtype=torch.float32, device=q.device) if workspace else None,
               dq_sem=None)
    if ordered:  # (zeroed here, or by the Δ pre-pass where the first adds store)
        out["dq_sem"] = (torch.empty if first_stores else torch.zeros)(
            ordered_dq_semaphore_count(B, Hq, Nq), dtype=torch.int32, device=q.device)
    if separate:
        out.update(dq=_new_gradient(q), dq_acc=None)
    else:
        # fp32 inputs accumulate straight into dq; the pre-pass zeroes it (or, with ordered dQ's first adds
        # storing, the first adds overwrite it: NaN-filled when the tests poison outputs, so a row they miss fails).
        dq_acc = torch.empty((B, Hq, Nq, D), dtype=torch.float32, device=q.device)
        if first_stores and contract.poison_outputs:
            dq_acc.fill_(float("nan"))
        out.update(dq_acc=dq_acc, dq=dq_acc if q.dtype == torch.float32 else None)
    return out


def ordered_dq_semaphore_count(B: int, Hq: int, Nq: int) -> int:
    """Ordered dQ's semaphores as the backward allocates them and the Δ pre-pass zeroes them: :data:`SEM_CHUNK`
    per program of its grid, at least the Hopper dK/dV kernel's one per batch·query head, column slice (2 at
    most) and Q tile (32 rows at least; ``hopper_bwd.ordered_dq_semaphores`` for a caller of the kernel alone)."""
    return B * Hq * cdiv(Nq, DELTA_BLOCK) * SEM_CHUNK


def hopper_bwd_first_stores() -> bool:
    """``hopper_bwd.ordered_dq_first_stores`` for ordered dQ (imported where it runs: Gluon)."""
    from . import hopper_bwd

    return hopper_bwd.ordered_dq_first_stores(True)


def split_backward(q, k, *, tuned_tiles: bool = True, exp2: bool = True, forced: bool = False,
                   arch: int = 90) -> tuple | None:
    """(splits, keys per split) where the split backward runs (a decoding-shaped problem with the tuned
    tiles and exp2 on, as the forward's split path asks, no kernel forced, and tiles that fit the shared
    memory of the GPU, ``arch`` where the tensors are not on one), else None. The choice depends on the
    group's rows and whether Nq < Nk, never on Nk itself; the split count follows Nk."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    if forced or not (tuned_tiles and exp2) or not decode_backward.takes_split_backward(
            Hq, Hkv, Nq, Nk, D, q.element_size(), device_arch(q.device) if q.device.type != "meta" else arch):
        return None
    return decode_backward.backward_splits(B, Hkv, Hq // Hkv, Nq, Nk, D, sm_count(q.device), q.element_size())


def _plan_layout(do, q, k, v, o, lse, *, causal, scale, deterministic, tuned_tiles, pipelining, exp2, causal_skip,
                 tma, warp_specialization, config, dq_config, ws_config, ws_dq_config, key_starts=None,
                 key_lengths=None) -> tuple:
    """The :class:`KeptLayout` of a layout: the plan, the Hopper kernels' choice, the launches (key ranges:
    the ``tl`` kernels, whatever the plan)."""
    D = q.shape[-1]
    arch = device_arch(q.device)
    forced = any(x is not None for x in (config, dq_config, ws_config, ws_dq_config))
    split = split_backward(q, k, tuned_tiles=tuned_tiles, exp2=exp2, forced=forced)
    if split is not None:
        # A decoding-shaped backward: the keys shared out, every query row in each program
        # (decode_backward.py). Deterministic by construction, whatever ``deterministic`` asks.
        splits, chunk = split
        workspace = decode_backward.workspace_shape(*q.shape[:3], D, splits)
        t = _allocate(q, k, v, True, workspace, split=True)
        launches = decode_backward.plan(do, q, k, v, o, lse, t["dq"], t["dk"], t["dv"], t["dq_part"], causal=causal,
                                        scale=scale, splits=splits, chunk=chunk, pipelining=pipelining,
                                        key_starts=key_starts, key_lengths=key_lengths)
        return KeptLayout(True, tuple(KeptLaunch(launch, _ROLES) for launch in launches), workspace=workspace,
                          split=True)
    plan = backward_plan(D, q.dtype, arch, causal, deterministic=deterministic, tuned_tiles=tuned_tiles,
                         pipelining=pipelining, warp_specialization=warp_specialization)
    ranged = key_starts is not None or key_lengths is not None
    switches_on = tuned_tiles and pipelining and exp2 and causal_skip and warp_specialization and not ranged
    auto = config is None and dq_config is None  # forced tl tiles: the tl kernels, unless a Hopper one is forced too
    ws = choose_ws(plan.ws if auto else None, ws_config, q, k, v, do, arch, switches_on=switches_on)
    ws_dq = choose_ws(plan.ws_dq if auto else None, ws_dq_config, q, k, v, do, arch, switches_on=switches_on,
                      name="ws_dq_config")
    if ws_dq == FUSED_DQ and ws_dq_config is None and (ws is None or ws_config is not None or not fused_dq_fits(ws)):
        ws_dq = None  # a planned fused dQ goes with the planned dK/dV kernel only (else the tl kernels' dQ)
    if ws_dq == ORDERED_DQ and ws_dq_config is None and (ws is None or ws_config is not None or not ordered_dq_fits(ws)):
        ws_dq = None  # (a planned ordered dQ likewise; the tl dQ kernel, in a fixed order too, instead)
    if ws_dq == ORDERED_DQ and ws_dq_config is None and not deterministic and fused_dq_fits(ws) and \
            not ordered_dq_hides_its_order(*q.shape[:3], ws.block_m, sm_count(q.device)):
        ws_dq = FUSED_DQ  # (ordered dQ as the default plan, on a grid too small to hide its order)
    if ws_dq == FUSED_DQ and deterministic:
        raise ValueError(f"ws_dq_config={FUSED_DQ!r} adds dQ by atomics: it cannot be deterministic (its "
                         f"deterministic twin is ws_dq_config={ORDERED_DQ!r})")
    if ws_dq in FUSED_DQS and ws is None:
        raise ValueError(f"ws_dq_config={ws_dq!r} needs the Hopper dK/dV kernel (ws_config) to run")
    ordered = ws_dq == ORDERED_DQ
    separate = (plan.separate_dq or ws is not None or ws_dq is not None) and ws_dq not in FUSED_DQS
    # (planned over stand-ins of this call's buffers: only their layout counts)
    t = _allocate(q, k, v, separate, ordered=ordered)
    launches = plan_backward(do, q, k, v, o, lse, t["delta"], t["dq"], t["dk"], t["dv"], t["dq_acc"], causal=causal,
                             scale=scale, arch=arch, deterministic=separate or ordered, tuned_tiles=tuned_tiles,
                             pipelining=pipelining, exp2=exp2, causal_skip=causal_skip, tma=tma, config=config,
                             dq_config=dq_config, ws=ws, ws_dq=ws_dq, key_starts=key_starts, key_lengths=key_lengths,
                             dq_sem=t["dq_sem"])
    # (where the Δ pre-pass zeroes ordered dQ's semaphores, a call allocates them unzeroed)
    first_stores = launches[0].args["DQ_SEM"] is not None
    return KeptLayout(separate, tuple(KeptLaunch(launch, _ROLES) for launch in launches), ordered=ordered,
                      first_stores=first_stores)


@compiles_without_interpreter
def compile_backward(problem: Problem, arch: int, **switches) -> list[CompiledKernel]:
    """Compile the backward kernels for ``problem`` on an sm_``arch`` GPU without one (storage-free
    ``meta`` tensors); ``switches`` as for ``attention_backward`` (``deterministic`` and ``ws_config``
    included: the Hopper dK/dV kernel is compiled only when ``ws_config`` names its tiles; ``key_ranges=True``:
    the kernels a call with key starts and lengths runs)."""
    dtype = DTYPES[problem.dtype]
    if switches.pop("key_ranges", False):
        switches["key_starts"], switches["key_lengths"] = (
            torch.empty(problem.B, dtype=torch.int32, device="meta") for _ in range(2))

    def meta(*shape, dt=dtype):
        return torch.empty(shape, dtype=dt, device="meta")

    B, Hq, Nq, D, Hkv, Nk = problem.B, problem.H, problem.N, problem.D, problem.Hkv, problem.Nk
    q, o, do, dq = (meta(B, Hq, Nq, D) for _ in range(4))
    k, v, dk, dv = (meta(B, Hkv, Nk, D) for _ in range(4))
    lse, delta = meta(B, Hq, Nq, dt=torch.float32), meta(B, Hq, Nq, dt=torch.float32)
    ws, ws_dq = (switches.pop(name, None) for name in ("ws_config", "ws_dq_config"))
    split = split_backward(q, k, tuned_tiles=switches.get("tuned_tiles", True), exp2=switches.get("exp2", True),
                           forced=any(x is not None for x in (ws, ws_dq, switches.get("config"),
                                                               switches.get("dq_config"))), arch=arch)
    if split is not None:
        splits, chunk = split
        workspace = decode_backward.workspace_shape(B, Hq, Nq, D, splits)
        launches = decode_backward.plan(do, q, k, v, o, lse, dq, dk, dv,
                                        meta(*workspace, dt=torch.float32) if workspace else None,
                                        causal=problem.causal, scale=D ** -0.5, splits=splits, chunk=chunk,
                                        pipelining=switches.get("pipelining", True),
                                        key_starts=switches.get("key_starts"), key_lengths=switches.get("key_lengths"))
        return [launch.compile(arch) for launch in launches]
    ws = WsConfig.parse(ws) if isinstance(ws, str) else ws
    ws_dq = parse_ws_dq(ws_dq) if ws_dq is not None else None
    deterministic = (switches.pop("deterministic", False) or ws is not None or ws_dq is not None) and ws_dq != FUSED_DQ
    ordered = ws_dq == ORDERED_DQ
    dq_acc = None if deterministic and not ordered else meta(B, Hq, Nq, D, dt=torch.float32)
    dq_sem = meta(B * Hq * 2 * cdiv(Nq, 32), dt=torch.int32) if ordered else None
    launches = plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, dq_acc, causal=problem.causal,
                             scale=D ** -0.5, arch=arch, deterministic=deterministic, ws=ws, ws_dq=ws_dq,
                             dq_sem=dq_sem, **switches)
    return [launch.compile(arch) for launch in launches]


# ------------------------------------------------------------------------------------------ models

def bwd_hbm_bytes(p: Problem, deterministic: bool = False, tuned_tiles: bool = True, pipelining: bool = True,
                  causal_skip: bool = True, config: BwdConfig | None = None, **_other) -> HbmTraffic:
    """Bytes the backward kernels request from device memory (no cache assumed), given the saved
    O and lse. e = element bytes, rows of D elements:

    * Δ pre-pass: reads O and dO, writes Δ (4 B/row); atomic dQ: also writes the zeroed fp32 accumulator
      (ordered dQ whose first adds store, ``hopper_bwd.ORDERED_DQ_FIRST_STORES``: only the rows no K/V tile
      sees, and a visited row's first add reads nothing).
    * dK/dV: reads K and V once, writes dK and dV; for every (K/V tile, visited Q tile) pair reads the
      Q and dO rows plus lse and Δ (8 B/row). With causal skipping a K/V tile starting at key n visits
      query rows from the tile holding row n − (Nk − Nq) on; without, all Nq rows. Atomic dQ: every
      visited Q row is a read-modify-write of 4·D bytes, then the cast reads the accumulator
      (4·D/row) and writes dQ (skipped for fp32, which accumulates in place).
    * separate dQ (``deterministic``, or where the tuner found it faster): reads Q, dO, lse, Δ once,
      K and V rows for every visited K/V tile, writes dQ.
    """
    forced = config is not None or any(_other.get(n) is not None for n in ("dq_config", "ws_config", "ws_dq_config"))
    if not forced and tuned_tiles and _other.get("exp2", True) and \
            decode_backward.takes_split_backward(p.H, p.Hkv, p.N, p.Nk, p.D, p.element_bytes, device_arch(None)):
        return decode_backward.hbm_bytes(p, sm_count(None))  # a decoding-shaped backward: the split kernel's
    plan = backward_plan(p.D, DTYPES[p.dtype], device_arch(None), p.causal, deterministic=deterministic,
                         tuned_tiles=tuned_tiles, pipelining=pipelining)
    # The tiles plan_backward launches: a forced config serves the dQ kernel too.
    dq_config = plan.dq if config is None else config
    separate = plan.separate_dq
    if config is None and plan.ws is not None:
        # The Hopper dK/dV kernel: 64-row K/V tiles per consumer, the same visits as the tl kernel's.
        config = BwdConfig(plan.ws.block_m, plan.ws.block_n, 4, plan.ws.stages)
        separate = plan.ws_dq not in FUSED_DQS  # fused dQ (ordered or not): the atomic plan's bytes
    if plan.ws_dq not in (None, *FUSED_DQS):  # resident Q rows (block_n) and streamed K/V rows, as the tl dQ kernel's
        dq_config, separate = BwdConfig(plan.ws_dq.block_m, plan.ws_dq.block_n, 4, plan.ws_dq.stages), True
    config = config or plan.dkdv
    e, D = p.element_bytes, p.D
    row = D * e
    BM, BN = config.block_m, config.block_n
    skip = p.causal and causal_skip
    offset = p.Nk - p.N

    # Q rows visited per K/V tile (per query head).
    q_rows = 0
    for start_n in range(0, p.Nk, BN):
        first = max(start_n - offset, 0) // BM * BM if skip else 0
        q_rows += max(0, p.N - first)
    q_rows_all = p.B * p.H * q_rows

    read = 2 * p.q_bytes                                   # pre-pass: O, dO
    write = p.heads * p.N * 4                              # Δ
    read += 2 * p.kv_bytes + q_rows_all * (2 * row + 8)    # dK/dV: K, V once; Q, dO, lse, Δ per visit
    write += 2 * p.kv_bytes                                # dK, dV
    if separate:
        dq_rows = dq_config.block_n  # Q rows a dQ program keeps
        kv_rows = 0
        for start_m in range(0, p.N, dq_rows):
            kv_rows += min(p.Nk, max(0, start_m + dq_rows + offset)) if skip else p.Nk
        read += p.q_bytes * 2 + p.heads * p.N * 8 + p.heads * kv_rows * 2 * row
        write += p.q_bytes
    else:
        if plan.ws_dq == ORDERED_DQ and hopper_bwd_first_stores() and \
                (deterministic or ordered_dq_hides_its_order(p.B, p.H, p.N, BM, sm_count(None))):
            # Ordered dQ whose first add of each tile stores: the pre-pass zeroes only the rows no K/V tile
            # sees (causal, N > Nk), and each visited row's first add writes without reading (as the default
            # plan, on a grid that hides its order: else fused dQ runs, the zeroed accumulator's bytes).
            visited = p.N - (max(-offset, 0) // BM * BM if skip else 0)
            write += p.heads * (max(-offset, 0) if p.causal else 0) * D * 4
            read += (q_rows_all - p.heads * visited) * D * 4
        else:
            write += p.heads * p.N * D * 4                 # zeroing the accumulator
            read += q_rows_all * D * 4                     # atomic read-modify-write
        write += q_rows_all * D * 4
        if p.dtype != "fp32":
            read += p.heads * p.N * D * 4                  # cast to the input dtype
            write += p.q_bytes
    return HbmTraffic(read=read, write=write)


def train_workspace_bytes(p: Problem, deterministic: bool = False) -> int:
    """Extra device memory of one training step besides q, k, v, o, dO and the three gradients, bytes:
    the saved lse and the pre-pass's Δ (4 B per query row each) and, with atomic dQ and a 16-bit
    dtype, the fp32 dQ accumulator (4·D B per query row; fp32 inputs accumulate in dq itself); a
    decoding-shaped problem: the lse and the split backward's fp32 dQ partials (it forms Δ in its programs)."""
    rows = p.heads * p.N
    if decode_backward.takes_split_backward(p.H, p.Hkv, p.N, p.Nk, p.D, p.element_bytes, device_arch(None)):
        splits, _ = decode_backward.backward_splits(p.B, p.Hkv, p.group, p.N, p.Nk, p.D, sm_count(None),
                                                    p.element_bytes)
        return rows * 4 + (splits * rows * p.D * 4 if splits > 1 else 0)
    plan = backward_plan(p.D, DTYPES[p.dtype], device_arch(None), p.causal, deterministic=deterministic)
    extra = rows * p.D * 4 if plan.atomic_dq and p.dtype != "fp32" else 0
    return 2 * rows * 4 + extra


__all__ = ["BwdConfig", "BwdPlan", "WsConfig", "BASELINE", "FUSED_DQ", "ORDERED_DQ", "parse_ws_dq", "choose_ws", "attention_backward", "backward_config", "backward_plan", "bwd_hbm_bytes", "compile_backward",
           "plan_backward", "shared_memory_bytes", "train_workspace_bytes"]
