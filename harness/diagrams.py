"""Conceptual diagrams, drawn by code so they are regenerated like the measured figures:

``tiling.png``          which Q tile meets which K/V tiles, and what causal skipping leaves out
``pipeline.png``        the ``cp.async`` double buffer: tile j+1's copy runs under tile j's math
``ping_pong.png``       the Hopper kernel: a producer warp's TMA copies feeding two consumer
                        warpgroups that take turns at the softmax and the tensor cores
``round_trips.png``     stage A's HBM ↔ SRAM round trips against stage B's: S and P cross the HBM
                        boundary in A (written, read back) and never leave the chip in B

    python -m harness.diagrams [out_dir]      (default: docs/figures)

Nothing here is measured: the timelines are schematic (durations in arbitrary units), chosen to show
the order of events, not their length on any GPU. The one diagram with numbers, ``round_trips.png``,
takes them from the stages' traffic models (``hbm_bytes``) for a stated problem, never from a
measurement: what reaches DRAM is in ``results/<gpu>/figures/bandwidth_share.png``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrow, Patch, Rectangle  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "figures"
COLORS = {"load": "#4c72b0", "mma": "#dd8452", "softmax": "#55a868", "wait": "#dddddd",
          "skip": "#f2f2f2", "masked": "#c44e52", "full": "#8fbf8f", "store": "#8172b3"}


def draw_tiling(path, n_tiles: int = 6) -> Path:
    """Left: non-causal, Q tile i meets every K/V tile. Right: causal, tiles below the diagonal run
    mask-free, diagonal tiles are masked, tiles above are never loaded (stage C's ``causal_skip``)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 5.2))
    for ax, causal in zip(axes, (False, True)):
        for i in range(n_tiles):          # Q tile (row)
            for j in range(n_tiles):      # K/V tile (column)
                if not causal:
                    kind = "full"
                elif j < i:
                    kind = "full"
                elif j == i:
                    kind = "masked"
                else:
                    kind = "skip"
                ax.add_patch(Rectangle((j, n_tiles - 1 - i), 1, 1, facecolor=COLORS[kind], edgecolor="0.3"))
                if kind == "masked":  # the visible lower triangle inside the diagonal tile
                    ax.fill([j, j, j + 1], [n_tiles - i, n_tiles - 1 - i, n_tiles - 1 - i],
                            color=COLORS["full"], alpha=0.9)
        highlight = 3  # one program: Q tile 3 walks along its row
        ax.add_patch(Rectangle((0, n_tiles - 1 - highlight), (highlight + 1) if causal else n_tiles, 1,
                               fill=False, edgecolor="black", linewidth=3))
        ax.annotate("one program: Q tile 3 loops over these K/V tiles", xy=(0.2, n_tiles - 0.5 - highlight),
                    xytext=(0.2, -0.9), fontsize=9, arrowprops=dict(arrowstyle="->"))
        ax.set_xlim(0, n_tiles)
        ax.set_ylim(-1.2, n_tiles)
        ax.set_aspect("equal")
        ax.set_xticks([j + 0.5 for j in range(n_tiles)], [f"K/V {j}" for j in range(n_tiles)], fontsize=8)
        ax.set_yticks([n_tiles - 0.5 - i for i in range(n_tiles)], [f"Q {i}" for i in range(n_tiles)], fontsize=8)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title("causal, with tile skipping" if causal else "non-causal: every pair of tiles")
    fig.legend(handles=[Patch(color=COLORS["full"], label="computed, no mask"),
                        Patch(color=COLORS["masked"], label="diagonal tile: masked part"),
                        Patch(facecolor=COLORS["skip"], edgecolor="0.3", label="never loaded (skipped)")],
               loc="lower center", ncol=3, frameon=False)
    fig.suptitle("Tiling: each program holds one Q tile and streams K/V tiles past it", fontsize=12)
    return _save(fig, path)


def _bar(ax, y, start, length, kind, text=""):
    ax.add_patch(Rectangle((start, y - 0.35), length, 0.7, facecolor=COLORS[kind], edgecolor="0.25"))
    if text:
        ax.text(start + length / 2, y, text, ha="center", va="center", fontsize=8)


def draw_pipeline(path, n_tiles: int = 4, copy: float = 3.0, math: float = 3.0) -> Path:
    """Top: ``num_stages = 1``, load then compute, the warps wait for every tile. Bottom:
    ``num_stages = 2``, the copy of tile j+1 (``cp.async`` into the other buffer) runs while tile j's
    math runs; ``cp.async.wait_group`` stops only if a copy is late."""
    fig, axes = plt.subplots(2, 1, figsize=(11, 5.2), sharex=True)
    ax = axes[0]
    t = 0.0
    for j in range(n_tiles):
        _bar(ax, 1, t, copy, "load", f"load K/V {j}")
        _bar(ax, 0, t, copy, "wait", "wait")
        _bar(ax, 0, t + copy, math, "mma", f"math, tile {j}")
        t += copy + math
    serial_end = t
    ax.set_yticks([1, 0], ["memory", "SM (math)"])
    ax.set_title("num_stages = 1: every load stalls the warps (stage B)", fontsize=10, loc="left")
    ax = axes[1]
    _bar(ax, 2.0, 0, copy, "load", "K/V 0 → buf 0")
    for j in range(n_tiles):
        start = copy + j * math
        if j + 1 < n_tiles:
            _bar(ax, 2.0 - 0.9 * ((j + 1) % 2), start, copy, "load", f"K/V {j + 1} → buf {(j + 1) % 2}")
        _bar(ax, 0, start, math, "mma", f"math, tile {j}")
    ax.axvline(copy, color="0.4", linestyle=":")
    ax.text(copy + 0.05, -0.65, "wait_group: tile 0 has landed", fontsize=8)
    pipelined_end = copy + n_tiles * math
    axes[0].set_ylim(-0.8, 1.6)
    axes[1].set_ylim(-0.8, 2.6)
    for a in axes:
        a.set_xlim(0, serial_end + 0.2)
        a.grid(False)
    ax.set_yticks([2.0, 1.1, 0], ["cp.async\ninto buffer 0", "cp.async\ninto buffer 1", "SM (math)"])
    ax.set_title(f"num_stages = 2: copies overlap the math (stage C, pipelining); "
                 f"{serial_end:.0f} → {pipelined_end:.0f} time units here", fontsize=10, loc="left")
    ax.set_xlabel("time (schematic units)")
    fig.suptitle("The cp.async double buffer", fontsize=12)
    return _save(fig, path)


def draw_ping_pong(path, n_tiles: int = 4, mma: float = 2.0, softmax: float = 2.0, copy: float = 1.5) -> Path:
    """The warp-specialized Hopper kernel: the producer issues TMA copies of K/V tiles into a ring of
    shared-memory slots; consumers 0 and 1 (64 query rows each) share every tile and alternate, so
    one runs its softmax while the other's wgmma (QKᵀ of this tile, PV of the last) runs."""
    fig, ax = plt.subplots(figsize=(12, 3.6))
    # producer: a copy per tile, running ahead as far as the ring of slots allows
    for j in range(n_tiles + 1):
        _bar(ax, 2, j * (mma + softmax) - copy if j else 0, copy, "load", f"K/V {j} → slot {j % 3}")
    start0 = copy
    for j in range(n_tiles):
        t0 = start0 + j * (mma + softmax)
        # consumer 0: tensor cores then softmax; consumer 1 shifted by half a period
        _bar(ax, 1, t0, mma, "mma", f"wgmma S{j}, O+=P{j - 1}V" if j else "wgmma S0")
        _bar(ax, 1, t0 + mma, softmax, "softmax", f"softmax {j}")
        _bar(ax, 0, t0 + mma, mma, "mma", f"wgmma S{j}, O+=P{j - 1}V" if j else "wgmma S0")
        _bar(ax, 0, t0 + 2 * mma, softmax, "softmax", f"softmax {j}")
    end = start0 + n_tiles * (mma + softmax) + mma
    ax.set_yticks([2, 1, 0], ["producer warp\n(TMA copies)", "consumer 0\n(rows 0-63)", "consumer 1\n(rows 64-127)"])
    ax.set_ylim(-0.7, 2.6)
    ax.set_xlim(0, end)
    ax.grid(False)
    ax.set_xlabel("time (schematic units)")
    ax.legend(handles=[Patch(color=COLORS["load"], label="TMA copy (producer)"),
                       Patch(color=COLORS["mma"], label="tensor cores (wgmma)"),
                       Patch(color=COLORS["softmax"], label="softmax (exp2 unit, FMA)")],
              loc="upper right", ncol=3, frameon=False, fontsize=8, bbox_to_anchor=(1, 1.22))
    ax.set_title("Ping-pong: while one consumer runs its softmax, the other's matrix products run",
                 fontsize=11, loc="left")
    return _save(fig, path)


# ------------------------------------------------------------------------------ HBM ↔ SRAM round trips

#: The problem ``round_trips.png`` is drawn for: the headline cell of the README and the waterfall.
ROUND_TRIP_PROBLEM = dict(B=4, H=32, N=4096, D=64, dtype="fp16", causal=False)
#: arrow shaft widths in data units (the lanes are 0.7 tall): the widest arrow, and the least any gets
MAX_ARROW_W, MIN_ARROW_W = 0.5, 0.035
ROUND_TRIP_COLORS = {"nn": "#c44e52", "io": "#4c72b0", "hbm": "#e3e9f3", "sram": "#e9f3e4"}


@dataclass(frozen=True)
class Crossing:
    """One arrow of ``round_trips.png``: a tensor crossing the HBM boundary in one kernel.

    ``nbytes`` is that tensor's share of the stage's traffic model (bytes requested, no cache);
    ``reread`` marks traffic that re-reads data already fetched (tiles of Q, K, V fetched once per
    tile, the softmax's second pass over S), which the L2 cache mostly serves; ``label`` is the
    text drawn beside the arrow, its bytes included."""

    stage: str        # "a" or "b"
    kernel: int       # 0, 1, 2: which of the stage's kernels (B has one)
    tensor: str       # "Q, K", "S", "P", "V", "K, V", "Q", "O"
    direction: str    # "read" (HBM → chip) or "write" (chip → HBM)
    nbytes: int
    nn: bool          # an N×N matrix (S or P)
    reread: bool
    label: str


def round_trip_crossings(problem=None) -> dict[str, list[Crossing]]:
    """The arrows of ``round_trips.png`` for ``problem`` (default :data:`ROUND_TRIP_PROBLEM`), by stage.

    Each stage's arrows add up to its traffic model exactly: reads to ``hbm_bytes(p).read``, writes
    to ``hbm_bytes(p).write``. The models give totals; the split into tensors follows their
    docstrings. Writes are what the tensors weigh: A writes S and P (one N×N matrix of all heads
    each) and O once, B writes O once; if a model's writes stop matching that, this raises, so the
    picture cannot drift from the model. Reads: A's softmax reads S twice (the visible entries), its
    PV kernel P once, its scores kernel Q and K what the model's own helper counts, and V is the
    rest of A's reads; B reads Q once and its K/V stream is the rest of its reads (both rests must
    come out positive)."""
    from stages.a_naive import kernels as a_kernels
    from stages.b_tiled import kernels as b_kernels
    from stages.contract import Problem

    from .views import fmt_bytes

    p = problem if problem is not None else Problem(**ROUND_TRIP_PROBLEM)
    e = p.element_bytes
    nn = p.heads * p.N * p.Nk * e          # one N×N matrix, all heads
    visible = p.heads * p.pairs * e        # the entries of it the softmax reads (causal: the visible ones)
    kv_per_head = p.heads * p.Nk * p.D * e  # K (or V) once for every query head (GQA: a KV head per group member)
    a, b = a_kernels.hbm_bytes(p), b_kernels.hbm_bytes(p)

    qk = sum(a_kernels._matmul_reads(p))   # the scores kernel's Q and K reads, as A's model counts them
    s_pass, p_read = visible, nn           # the softmax reads S twice, the PV kernel reads P once
    v_read = a.read - qk - 2 * s_pass - p_read
    arrows_a = [
        Crossing("a", 0, "Q, K", "read", qk, False, True,
                 f"Q, K read\n{fmt_bytes(qk)}\n({qk / (p.q_bytes + kv_per_head):.0f}× each:\nonce per tile)"),
        Crossing("a", 0, "S", "write", nn, True, False, f"S written\n{fmt_bytes(nn)}"),
        Crossing("a", 1, "S", "read", s_pass, True, False, f"S read\n{fmt_bytes(s_pass)}\n(pass 1:\nmax, sum)"),
        Crossing("a", 1, "S", "read", s_pass, True, True, f"S read again\n{fmt_bytes(s_pass)}\n(pass 2: P)"),
        Crossing("a", 1, "P", "write", nn, True, False, f"P written\n{fmt_bytes(nn)}"),
        Crossing("a", 2, "P", "read", p_read, True, False, f"P read\n{fmt_bytes(p_read)}"),
        Crossing("a", 2, "V", "read", v_read, False, True,
                 f"V read\n{fmt_bytes(v_read)}\n({v_read / kv_per_head:.0f}×: once\nper O tile)"),
        Crossing("a", 2, "O", "write", p.q_bytes, False, False, f"O written\n{fmt_bytes(p.q_bytes)}"),
    ]
    block_m, _ = b_kernels.tile_shape(p.D, p.dtype)
    kv_stream = b.read - p.q_bytes
    arrows_b = [
        Crossing("b", 0, "Q", "read", p.q_bytes, False, False, f"Q read once\n{fmt_bytes(p.q_bytes)}"),
        Crossing("b", 0, "K, V", "read", kv_stream, False, True,
                 f"K, V tiles streamed\n{fmt_bytes(kv_stream)}\n({kv_stream / (2 * kv_per_head):.0f}× each: once "
                 f"per\n{block_m}-row Q tile)"),
        Crossing("b", 0, "O", "write", p.q_bytes, False, False, f"O written once\n{fmt_bytes(p.q_bytes)}"),
    ]
    out = {"a": arrows_a, "b": arrows_b}
    for name, model in (("a", a), ("b", b)):
        arrows = out[name]
        got = (sum(x.nbytes for x in arrows if x.direction == "read"),
               sum(x.nbytes for x in arrows if x.direction == "write"))
        if got != (model.read, model.write) or min(x.nbytes for x in arrows) <= 0:
            raise AssertionError(f"stage {name.upper()}'s arrows (read, write = {got}) do not split its traffic "
                                 f"model ({model.read}, {model.write}) for {p}: update round_trip_crossings")
    return out


def _crossing(ax, x, arrow: Crossing, widest: int, y_hbm: float, y_sram: float, *, side: str = "right") -> None:
    """A vertical arrow between the lanes at ``x`` (down for a read, up for a write), its shaft as wide
    as its bytes (hatched for re-reads), labelled beside it."""
    w = max(MIN_ARROW_W, MAX_ARROW_W * arrow.nbytes / widest)
    c = ROUND_TRIP_COLORS["nn" if arrow.nn else "io"]
    top, bottom = y_hbm - 0.35, y_sram + 0.35
    y0, dy = (top, bottom - top) if arrow.direction == "read" else (bottom, top - bottom)
    ax.add_patch(FancyArrow(x, y0, 0, dy, width=w, head_width=max(0.2, 1.6 * w), head_length=0.18,
                            length_includes_head=True, facecolor="white" if arrow.reread else c, edgecolor=c,
                            hatch="////" if arrow.reread else None, linewidth=1.2))
    dx = max(0.1, 0.8 * w) + 0.06
    ax.text(x + dx if side == "right" else x - dx, (y_hbm + y_sram) / 2, arrow.label, fontsize=8,
            ha="left" if side == "right" else "right", va="center", color="0.1", linespacing=1.15)


def _lanes(ax, width: float, y_hbm: float, y_sram: float) -> None:
    for y, key in ((y_hbm, "hbm"), (y_sram, "sram")):
        ax.add_patch(Rectangle((0, y - 0.35), width, 0.7, facecolor=ROUND_TRIP_COLORS[key], edgecolor="none"))
    ax.set_yticks([y_hbm, y_sram], ["HBM\n(device memory)", "SRAM / registers\n(on chip, per SM)"])
    ax.set_xlim(0, width)
    ax.set_xticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)


def _chip(ax, x, y, text, *, width, color="white", fontsize=8, style="-") -> None:
    """A tensor, or a kernel, drawn as a labelled box centred at (x, y)."""
    ax.add_patch(Rectangle((x - width / 2, y - 0.22), width, 0.44, facecolor=color, edgecolor="0.35",
                           linestyle=style))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize)


def round_trip_figure(problem=None):
    """(the Figure of ``round_trips.png``, the :func:`round_trip_crossings` it drew) for ``problem``."""
    from stages.contract import Problem

    from .views import fmt_bytes

    p = problem if problem is not None else Problem(**ROUND_TRIP_PROBLEM)
    arrows = round_trip_crossings(p)
    widest = max(x.nbytes for xs in arrows.values() for x in xs)  # one scale for both stages
    nn = p.heads * p.N * p.Nk * p.element_bytes
    fig, (ax_a, ax_b) = plt.subplots(2, 1, figsize=(13, 8.6))
    y_hbm, y_sram, width = 1.9, 0.0, 14.0

    # stage A: three kernels; S and P are written to HBM and read back
    ax = ax_a
    _lanes(ax, width, y_hbm, y_sram)
    kernels = [(0.15, 4.65, "kernel 1: scores, S = Q Kᵀ"), (4.75, 9.25, "kernel 2: P = softmax(S)"),
               (9.35, 13.85, "kernel 3: O = P V")]
    for x0, x1, text in kernels:
        ax.add_patch(Rectangle((x0, y_sram - 0.35), x1 - x0, 0.7, fill=False, edgecolor="0.45", linewidth=1.2))
        ax.text(x1 - 0.1, y_sram, text, ha="right", va="center", fontsize=9)
    positions = {0: (0.55, 2.45), 1: (5.1, 6.55, 8.15), 2: (9.75, 11.0, 12.6)}
    for k, xs in positions.items():
        for x, arrow in zip(xs, [a for a in arrows["a"] if a.kernel == k]):
            _crossing(ax, x, arrow, widest, y_hbm, y_sram)
    _chip(ax, 0.55, y_hbm, "Q K V", width=0.8)
    _chip(ax, 3.6, y_hbm, f"S: N×N, {fmt_bytes(nn)}", width=1.9, color="#f3cfcf")
    _chip(ax, 8.2, y_hbm, f"P: N×N, {fmt_bytes(nn)}", width=1.9, color="#f3cfcf")
    _chip(ax, 13.45, y_hbm, "O", width=0.5)
    total_a = sum(x.nbytes for x in arrows["a"])
    nn_a = sum(x.nbytes for x in arrows["a"] if x.nn)
    ax.set_ylim(y_sram - 0.45, y_hbm + 0.45)
    nn_once = sum(x.nbytes for x in arrows["a"] if x.nn and not x.reread)
    ax.set_title(f"Stage A, naive (three kernels): S and P each cross the HBM boundary twice, written and read "
                 f"back.\nModel: {fmt_bytes(total_a)} per call, {fmt_bytes(nn_a)} of it S and P "
                 f"({fmt_bytes(nn_once)} solid: each written once and read once)", fontsize=10.5, loc="left")

    # stage B: one kernel; S and P exist one tile at a time, in registers
    ax = ax_b
    _lanes(ax, width, y_hbm, y_sram)
    ax.add_patch(Rectangle((0.15, y_sram - 0.35), 13.7, 0.7, fill=False, edgecolor="0.45", linewidth=1.2))
    q, kv, o = arrows["b"]
    _crossing(ax, 0.55, q, widest, y_hbm, y_sram)
    _crossing(ax, 2.75, kv, widest, y_hbm, y_sram)
    _crossing(ax, 13.45, o, widest, y_hbm, y_sram, side="left")
    for j, x in enumerate((6.2, 7.45, 8.7)):
        _chip(ax, x, y_sram + 0.05, f"K/V tile {j}:\nS, P", width=1.1, color="#f3cfcf", style="--", fontsize=7.5)
    _chip(ax, 4.55, y_sram + 0.05, "Q tile\n(kept on chip)", width=1.35, fontsize=7.5)
    _chip(ax, 11.75, y_sram + 0.05, "O tile, m, l\n(kept, written at end)", width=1.75, fontsize=7.5)
    ax.text(9.5, y_sram + 0.05, "…", ha="center", va="center", fontsize=14)
    n_tiles = -(-p.Nk // _b_tile_rows(p))
    _chip(ax, 10.3, y_sram + 0.05, f"tile {n_tiles - 1}:\nS, P", width=1.0, color="#f3cfcf", style="--", fontsize=7.5)
    ax.text(7.9, y_sram - 0.52, "one fused kernel: each program keeps its Q tile on chip and loops over the K/V "
            "tiles (S = QKᵀ, online softmax, O += PV);\nS and P exist one tile at a time, in registers: 0 bytes "
            "of them reach HBM", ha="center", va="top", fontsize=8.5)
    _chip(ax, 0.55, y_hbm, "Q K V", width=0.8)
    _chip(ax, 13.45, y_hbm, "O", width=0.5)
    ax.text(7.45, y_hbm, "no S, no P in HBM", ha="center", va="center", fontsize=9, color="0.3")
    ax.set_ylim(y_sram - 1.0, y_hbm + 0.45)
    ax.set_title(f"Stage B, tiled (one fused kernel): Q loaded once, K/V tiles streamed, O written once.\n"
                 f"Model: {fmt_bytes(sum(x.nbytes for x in arrows['b']))} per call, 0 B of it S and P",
                 fontsize=10.5, loc="left")

    handles = [Patch(color=ROUND_TRIP_COLORS["nn"], label="an N×N matrix (S or P)"),
               Patch(color=ROUND_TRIP_COLORS["io"], label="Q, K, V or O"),
               Patch(facecolor="white", edgecolor="0.35", hatch="////",
                     label="hatched: re-reads of data already fetched (the L2 cache serves most of them)")]
    fig.legend(handles=handles, loc="lower center", ncol=3, frameon=False, fontsize=9, bbox_to_anchor=(0.5, 0.04))
    fig.suptitle(f"HBM ↔ SRAM round trips, stage A against stage B:  N = {p.N}, D = {p.D}, {p.dtype}, B = {p.B}, "
                 f"H = {p.H}, {'causal' if p.causal else 'non-causal'}, forward", fontsize=12.5)
    fig.text(0.5, 0.005, "Arrow width ∝ bytes of the stage's traffic model (hbm_bytes in stages/*/kernels.py: "
             "bytes requested, no cache); one scale for both stages. Time runs left to right, schematic.\n"
             "What reaches DRAM is measured in results/<gpu>/figures/bandwidth_share.png: the hatched re-reads "
             "mostly hit in L2; S and P, far larger than any cache, cannot.",
             ha="center", va="bottom", fontsize=8.5, color="0.3")
    fig.subplots_adjust(left=0.1, right=0.99, top=0.9, bottom=0.12, hspace=0.3)
    return fig, arrows


def _b_tile_rows(p) -> int:
    """Stage B's K/V tile rows for ``p`` (its ``tile_shape``): how many tiles one program walks."""
    from stages.b_tiled import kernels as b_kernels

    return b_kernels.tile_shape(p.D, p.dtype)[1]


def draw_round_trips(path, problem=None) -> Path:
    """Stage A's HBM ↔ SRAM traffic against stage B's, arrows sized by the stages' traffic models for
    ``problem`` (default :data:`ROUND_TRIP_PROBLEM`, the headline cell). See :func:`round_trip_figure`."""
    fig, _ = round_trip_figure(problem)
    return _save(fig, path)

DIAGRAMS = {"tiling.png": draw_tiling, "pipeline.png": draw_pipeline, "ping_pong.png": draw_ping_pong,
            "round_trips.png": draw_round_trips}


def _save(fig, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def draw_all(out_dir=DEFAULT_OUT) -> list[Path]:
    """Draw every diagram into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    return [draw(out / name) for name, draw in DIAGRAMS.items()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: python -m harness.diagrams [out_dir]   (default: docs/figures)", file=sys.stderr)
        return 2
    for path in draw_all(argv[0] if argv else DEFAULT_OUT):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
