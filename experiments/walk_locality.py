"""Which way a causal dK/dV program should walk its Q tiles, by what L2 keeps: a model of the Hopper
dK/dV kernel's DRAM traffic, walking up from the diagonal (as it does) or down from the last tile
(``hopper_bwd.CAUSAL_WALK_DOWN``, as FlashAttention-2's backward does), checked against Nsight Compute.

Every K/V tile's program meets the Q tiles at or below its diagonal, for each query head of its group.
Each meeting reads the tile's Q and dO rows (and, with fused dQ, adds into its fp32 dQ rows). Programs
of one head that run side by side read the same tiles, so whether those reads come from DRAM or from L2
depends on *when* each program gets to a tile. Walking up, program j starts at its own diagonal: a
tile is met by the programs below it at times as far apart as the kernel is long. Walking down, all
start at the last tile and meet each tile at the same step.

The model: the programs in the kernel's launch order (``hopper_bwd.program_order`` with the order the
kernel takes, ``causal_order``) are list-scheduled one per SM, each taking a start-up step and one step
per Q tile it meets; every meeting is an access to that tile's lines (Q, dO, the row statistics and
the accumulator's rows) in an LRU cache of the L2's size. A miss reads the lines from DRAM; an
accumulator line evicted is written back. Each program also reads its K and V tiles and writes dK and dV
once. Lines still in the cache at the end are not written (Nsight Compute counts what one kernel moves).

    python experiments/walk_locality.py
    python experiments/walk_locality.py --cells llama3-8b,grid-d128-n4096 --l2-mb 50,45,40 --csv <file>

What it printed is in docs/performance-log/backward.md (entry 101), beside Nsight Compute's bytes: at the
L2's 50 MB every cell reads its bytes once whichever way it walks, and the grouped Llama 3 8B cell falls
off a cliff a few MB below it (45 MB: 0.46 GB, 40 MB: 2.0 GB, where Nsight Compute measured 1.38), again
nearly alike both ways. So in this model the walk's direction is not what decides; which programs run
side by side is (the grouped cell's programs read four query heads each, 34 MB per K/V head).
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.c_optimized import hopper_bwd  # noqa: E402
from stages.c_optimized.tune_backward import _write_csv  # noqa: E402
from stages.contract import cdiv  # noqa: E402

#: (B, Hq, Hkv, Nq, Nk, D, element bytes): the causal cells Nsight Compute measured (entry 101), and more
CELLS = {
    "llama3-8b": (1, 32, 8, 8192, 8192, 128, 2),
    "grid-d128-n4096": (4, 16, 16, 4096, 4096, 128, 2),
    "llama2-7b": (4, 32, 32, 2048, 2048, 128, 2),
    "grid-d64-n4096": (4, 32, 32, 4096, 4096, 64, 2),
    "long-context": (1, 32, 32, 65536, 65536, 128, 2),
}


def accesses(B, Hq, Hkv, Nq, Nk, kv_rows, block_m, sms, walk, startup, heads_inner=False):
    """(time, batch·query head, Q tile) of every meeting, and the programs' count, as the model schedules them.
    ``heads_inner``: a grouped program meets each Q tile for every query head of its group before the next
    tile (the kernel walks one query head's tiles, then the next head's)."""
    group = Hq // Hkv
    work = hopper_bwd.causal_dkdv_work(Nq, Nk, kv_rows, block_m, group)
    order = hopper_bwd.causal_order(work, B * Hkv, sms)
    programs = hopper_bwd.program_order(len(work), B * Hkv, order["tiles_per_chunk"], order["heads_per_group"])
    free = [(0, sm) for sm in range(sms)]
    out = []
    for tile, bh_kv in programs:
        start, sm = heapq.heappop(free)
        first = max(tile * kv_rows - (Nk - Nq), 0) // block_m
        tiles = list(range(first, cdiv(Nq, block_m)))
        if walk == "down":
            tiles.reverse()
        t = start + startup
        pairs = [(g, q) for q in tiles for g in range(group)] if heads_inner else \
            [(g, q) for g in range(group) for q in tiles]
        for g, q_tile in pairs:
            out.append((t, bh_kv * group + g, q_tile))
            t += 1
        heapq.heappush(free, (t, sm))
    out.sort(key=lambda a: a[0])
    return out, len(programs)


def dram_bytes(cell, *, walk, l2_mb=50.0, sms=132, kv_rows=128, block_m=64, fused_dq=True, startup=2,
               heads_inner=False):
    """(read, written) bytes of the model for one cell and walk."""
    B, Hq, Hkv, Nq, Nk, D, e = cell
    stream = block_m * (2 * D * e + 8)  # Q and dO rows, the log-sum-exps and Δs
    acc = block_m * D * 4 if fused_dq else 0  # the fp32 dQ rows a meeting adds into
    capacity = int(l2_mb * 2**20) // (stream + acc)
    cache: OrderedDict = OrderedDict()
    read = written = 0
    meetings, n_programs = accesses(B, Hq, Hkv, Nq, Nk, kv_rows, block_m, sms, walk, startup, heads_inner)
    for _, bh, q_tile in meetings:
        line = (bh, q_tile)
        if line in cache:
            cache.move_to_end(line)
            continue
        read += stream + acc
        cache[line] = True
        if len(cache) > capacity:
            cache.popitem(last=False)
            written += acc
    kv = n_programs * kv_rows * D * e  # one K/V tile's rows per program
    return read + 2 * kv, written + 2 * kv


def l2_sizes(text: str) -> list[float]:
    """``--l2-mb``'s comma-separated sizes, each a positive number of MB."""
    try:
        sizes = [float(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(x <= 0 for x in sizes):
        raise argparse.ArgumentTypeError(f"expected positive sizes in MB separated by commas (e.g. 50,40), got {text!r}")
    return sizes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default=",".join(c for c in CELLS if c != "long-context"),
                    help=f"some of {','.join(CELLS)}")
    ap.add_argument("--l2-mb", type=l2_sizes, default=[50.0, 40.0],
                    help="the L2 sizes the model keeps, MB, comma-separated (an H100's and H200's L2 is 50)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name in args.cells.split(","):
        if name not in CELLS:
            print(f"--cells: unknown cell {name!r}; the cells are {', '.join(CELLS)}", file=sys.stderr)
            return 2
        for l2 in args.l2_mb:
            for walk in ("up", "down"):
                for inner in (False, True):
                    read, written = dram_bytes(CELLS[name], walk=walk, l2_mb=l2, sms=args.sms, heads_inner=inner)
                    rows.append(dict(cell=name, l2_mb=l2, walk=walk, heads="inner" if inner else "outer",
                                     read_gb=round(read / 1e9, 3), written_gb=round(written / 1e9, 3)))
                    print(f"{name:16s} L2 {l2:4.0f} MB  walk {walk:4s}  group heads {rows[-1]['heads']:5s}  "
                          f"read {read / 1e9:6.3f} GB  written {written / 1e9:6.3f} GB", flush=True)
    _write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
