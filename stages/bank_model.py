"""A small model of shared-memory bank conflicts, for the CUDA twins' access patterns.

The hardware model
------------------
Shared memory is 32 banks, each 4 bytes wide: byte address ``a`` lives in bank ``(a // 4) % 32``.
One *wavefront* delivers at most one 4-byte word per bank. A warp-wide access needs as many
wavefronts as the busiest bank has **distinct** words (lanes reading the same word share it: a
broadcast). Accesses wider than 4 bytes are split into phases of 128 bytes worth of lanes:

* up to 4 bytes per lane: one phase of 32 lanes;
* 8 bytes per lane: two phases of 16 lanes;
* 16 bytes per lane (``LDS.128``, ``cp.async`` 16 B, and ``ldmatrix``, whose 8 lanes of a phase
  each give one 16-byte row of an 8x8 matrix): four phases of 8 lanes.

A warp access whose words fit in one wavefront (e.g. every lane reading the same address) takes one
wavefront whatever its width. The *ideal* count is the fewest wavefronts that could move the distinct
bytes asked for (distinct bytes / 128, rounded up); the *conflict degree* is wavefronts / ideal, and
the *extra* wavefronts (wavefronts - ideal) are what Nsight Compute's
``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum`` count.

What is modelled, and what is not
---------------------------------
:func:`access_patterns` lists, per kernel, every shared-memory instruction of the inner loop with
the addresses one warp touches (computed from the same index formulas as the ``.cu`` files) and how
often a warp issues it. :func:`predicted_conflicts` multiplies the extra wavefronts by those counts
over the whole launch. Not modelled: the compiler's choice of vector width beyond what the SASS of
the shipped build shows (noted per pattern), ``cp.async`` (LDGSTS) stores, which Nsight Compute
reports under its own ``op_ldgsts`` counters rather than ``op_st``, and any counter noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .contract import Problem, cdiv

BANKS = 32
BANK_BYTES = 4
WAVEFRONT_BYTES = BANKS * BANK_BYTES  # 128


def _words(address: int, access_bytes: int) -> range:
    first = address // BANK_BYTES
    return range(first, (address + max(access_bytes, 1) - 1) // BANK_BYTES + 1)


def _max_words_per_bank(addresses: Sequence[int], access_bytes: int) -> int:
    per_bank: dict[int, set[int]] = {}
    for a in addresses:
        for w in _words(a, access_bytes):
            per_bank.setdefault(w % BANKS, set()).add(w)
    return max((len(ws) for ws in per_bank.values()), default=0)


def wavefronts(addresses: Sequence[int], access_bytes: int) -> int:
    """Wavefronts one warp-wide shared-memory instruction needs.

    ``addresses``: the byte address each lane accesses (32 of them, lane order);
    ``access_bytes``: bytes per lane (2, 4, 8 or 16; 16 for ldmatrix rows).
    """
    if _max_words_per_bank(addresses, access_bytes) <= 1:
        return 1  # everything fits in one wavefront (includes broadcasts)
    lanes_per_phase = 32 if access_bytes <= 4 else WAVEFRONT_BYTES // access_bytes
    total = 0
    for start in range(0, len(addresses), lanes_per_phase):
        total += max(1, _max_words_per_bank(addresses[start:start + lanes_per_phase], access_bytes))
    return total


def ideal_wavefronts(addresses: Sequence[int], access_bytes: int) -> int:
    """Fewest wavefronts that could deliver the distinct bytes the warp asks for."""
    words = {w for a in addresses for w in _words(a, access_bytes)}
    return max(1, cdiv(len(words) * BANK_BYTES, WAVEFRONT_BYTES))


@dataclass(frozen=True)
class Pattern:
    """One shared-memory instruction of a kernel, as one warp issues it."""

    name: str
    op: str                    # "ld" or "st" (the Nsight Compute counter it lands in)
    access_bytes: int          # bytes per lane
    addresses: tuple[int, ...]  # byte offsets the 32 lanes touch (relative to the array)
    per_tile: int = 0          # times a warp issues it per K/V tile
    per_block: int = 0         # times a warp issues it once per block (outside the K/V loop)

    @property
    def wavefronts(self) -> int:
        return wavefronts(self.addresses, self.access_bytes)

    @property
    def ideal(self) -> int:
        return ideal_wavefronts(self.addresses, self.access_bytes)

    @property
    def extra(self) -> int:
        """Wavefronts beyond the ideal: what the ncu bank-conflict counters add per instruction."""
        return self.wavefronts - self.ideal

    @property
    def conflict_degree(self) -> float:
        """1.0 = conflict-free; 8.0 = every wavefront's worth of data needed 8."""
        return self.wavefronts / self.ideal


# ---------------------------------------------------------------------------------------------
# the kernels' layouts and index formulas (mirroring flash_b.cu and flash_c.cu)

def _b_offset(D: int, smem_pad: bool) -> Callable[[int, int], int]:
    row = D + (2 if smem_pad else 0)  # flash_b.cu: ROW = D + (PAD ? 2 : 0)
    return lambda r, c: r * row + c


def _c_offset(D: int, smem_pad: bool, swizzle: bool) -> Callable[[int, int], int]:
    if smem_pad and swizzle:
        raise ValueError("choose one layout: smem_pad or swizzle")
    row = D + (8 if smem_pad else 0)  # flash_c.cu: Tile::ROW

    def offset(r: int, c: int) -> int:
        if swizzle:
            return r * row + (((c >> 3) ^ (r & 7)) << 3) + (c & 7)
        return r * row + c
    return offset


def access_patterns(impl: str, smem_pad: bool, D: int, dtype_bytes: int, swizzle: bool = False) -> list[Pattern]:
    """The shared-memory instructions of ``impl`` ("b_cuda" or "c_cuda") for one warp.

    Addresses are those of warp 0 at the first loop index; every other warp and index shifts all
    lanes by the same multiple of 16 bytes within the same rows, which keeps the bank pattern.
    """
    e, lanes = dtype_bytes, range(32)
    if impl in ("b_cuda", "b"):
        if swizzle:
            raise ValueError("b_cuda has no swizzled layout")
        off = _b_offset(D, smem_pad)
        # S = Q K^T, lane = key: lane l reads row l of K at column d. The SASS of the shipped build
        # shows the unpadded reads merged into 16-byte LDS.128 (8 columns at once; rows are 16-byte
        # aligned), the padded ones as 4-byte LDS (rows of D+2 elements are only 4-byte aligned).
        k_bytes = 16 if not smem_pad else 4
        k_cols = k_bytes // e
        return [
            Pattern("K column read (S = QK^T; lane l reads K row l)", "ld", k_bytes,
                    tuple(off(l, 0) * e for l in lanes), per_tile=D // k_cols),
            Pattern("Q row read (broadcast: the warp's row, same column)", "ld", 4,
                    tuple(off(0, 0) * e for _ in lanes), per_tile=8 * D // 2),
            Pattern("V row read (O += PV; lane l reads columns 2l, 2l+1)", "ld", 4,
                    tuple(off(0, 2 * l) * e for l in lanes), per_tile=32 * (D // 64)),
            Pattern("P broadcast read (fp32 Ps[row][c])", "ld", 4, tuple(0 for _ in lanes), per_tile=8 * 32),
            Pattern("K/V tile store (4 bytes per lane, consecutive columns)", "st", 4,
                    tuple(off((i * 2) // D, (i * 2) % D) * e for i in lanes),
                    per_tile=2 * 32 * D // 2 // 128),
            Pattern("Q tile store (once)", "st", 4, tuple(off((i * 2) // D, (i * 2) % D) * e for i in lanes),
                    per_block=32 * D // 2 // 128),
            Pattern("P row store (fp32, lane = column)", "st", 4, tuple(4 * l for l in lanes), per_tile=8),
        ]
    if impl in ("c_cuda", "c"):
        off = _c_offset(D, smem_pad, swizzle)
        q_rows = [(l % 16, (l // 16) * 8) for l in lanes]                          # qf[kk] load
        k_rows = [(l % 8 + (l // 16) * 8, ((l // 8) % 2) * 8) for l in lanes]      # K, non-transposed
        v_rows = [(l % 8 + ((l // 8) % 2) * 8, (l // 16) * 8) for l in lanes]      # V, .trans
        chunks = D // 8
        copy = [(i // chunks, (i % chunks) * 8) for i in lanes]                    # load_tile_async
        return [
            Pattern("ldmatrix.x4 Q fragments (once)", "ld", 16, tuple(off(r, c) * e for r, c in q_rows),
                    per_block=D // 16),
            Pattern("ldmatrix.x4 K (S = QK^T)", "ld", 16, tuple(off(r, c) * e for r, c in k_rows),
                    per_tile=(D // 16) * (64 // 16)),
            Pattern("ldmatrix.x4.trans V (O += PV)", "ld", 16, tuple(off(r, c) * e for r, c in v_rows),
                    per_tile=(64 // 16) * (D // 16)),
            Pattern("cp.async 16-byte K/V tile copy (LDGSTS; not in op_st)", "ldgsts", 16,
                    tuple(off(r, c) * e for r, c in copy), per_tile=2 * 64 * chunks // 128),
        ]
    raise ValueError(f"no bank model for implementation {impl!r} (known: b_cuda, c_cuda)")


def predicted_conflicts(impl: str, problem: Problem, **variant_kwargs) -> dict | None:
    """Predicted extra shared-memory wavefronts for one launch of ``impl`` on ``problem``.

    Returns ``{"ld": int, "st": int}``, comparable to Nsight Compute's
    ``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum`` and ``..._op_st.sum``
    (summed over all warps, blocks and loop iterations), or None for an implementation or dtype the
    model does not cover (the Triton stages: their layouts are chosen by the compiler).
    ``variant_kwargs`` are the stage's ``attention`` switches (``smem_pad``, ``swizzle``).
    """
    if impl not in ("b_cuda", "c_cuda") or problem.dtype not in ("fp16", "bf16") or problem.D not in (64, 128):
        return None
    e, n = problem.element_bytes, problem.N
    if impl == "b_cuda":
        smem_pad = variant_kwargs.get("smem_pad", False)
        patterns = access_patterns(impl, smem_pad, problem.D, e)
        warps, tiles_q = 4, cdiv(n, 32)
        tile_visits = tiles_q * cdiv(n, 32)  # per head: every Q tile visits every K/V tile
    else:
        smem_pad = variant_kwargs.get("smem_pad", True)
        patterns = access_patterns(impl, smem_pad, problem.D, e, swizzle=variant_kwargs.get("swizzle", False))
        warps, tiles_q = 4, cdiv(n, 64)
        n_kv = cdiv(n, 64)
        tile_visits = sum(min(t + 1, n_kv) for t in range(tiles_q)) if problem.causal else tiles_q * n_kv
    out = {"ld": 0, "st": 0}
    for p in patterns:
        if p.op not in out:
            continue
        issues = warps * (p.per_block * tiles_q + p.per_tile * tile_visits)
        out[p.op] += p.extra * issues * problem.heads
    return out
