"""Conceptual diagrams, drawn by code so they are regenerated like the measured figures:

``tiling.png``          which Q tile meets which K/V tiles, and what causal skipping leaves out
``pipeline.png``        the ``cp.async`` double buffer: tile j+1's copy runs under tile j's math
``ping_pong.png``       the Hopper kernel: a producer warp's TMA copies feeding two consumer
                        warpgroups that take turns at the softmax and the tensor cores

    python -m harness.diagrams [out_dir]      (default: docs/figures)

Nothing here is measured: the timelines are schematic (durations in arbitrary units), chosen to show
the order of events, not their length on any GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

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


DIAGRAMS = {"tiling.png": draw_tiling, "pipeline.png": draw_pipeline, "ping_pong.png": draw_ping_pong}


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
