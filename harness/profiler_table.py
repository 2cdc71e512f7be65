"""The five-metric profiler table: five Nsight Compute metrics per impl, side by side.

A kernel can be read with five numbers from the profiler (the metrics Nsight Compute's own
SpeedOfLight, Occupancy and memory sections lead with): DRAM throughput, compute
throughput, achieved occupancy, shared-memory bank conflicts and global load transactions. This
module builds that table for every impl profiled at one cell (stage A, B, C, the CUDA C++ twins,
the SDPA peers) from what ``python -m harness profile --sections`` wrote to
``<profile_dir>/ncu/sections_summary.csv`` (one row per kernel of one call)::

    python -m harness.profiler_table results/h200/profile            # the headline cell
    python -m harness.profiler_table results/h200/profile --N 1024 --causal 1

Where each number comes from (ncu's section display name or raw metric name):

========================  ================================================================  ==========
column                    Nsight Compute                                                    over kernels
========================  ================================================================  ==========
DRAM throughput           ``DRAM Throughput`` (SpeedOfLight;                                time-weighted
                          ``gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed``)
compute (SM) throughput   ``Compute (SM) Throughput`` (SpeedOfLight;                        time-weighted
                          ``sm__throughput.avg.pct_of_peak_sustained_elapsed``)
achieved occupancy        ``Achieved Occupancy`` (Occupancy;                                time-weighted
                          ``sm__warps_active.avg.pct_of_peak_sustained_active``)
bank conflicts            ``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum``  summed
global load transactions  ``lts__t_sectors_srcunit_tex_op_read.sum`` (32-byte sectors)       summed
========================  ================================================================  ==========

An impl that launches several kernels per call (stage A: scores, softmax, PV) gets one row: the
percentages are averaged with each kernel's ``Duration`` as its weight (for DRAM throughput that is
exactly the call's bytes over its time against the peak; compute throughput is the busiest of several
SM units, so its weighted mean is close but not exact); the counts are summed. The
transactions are also given as a multiple of the least any kernel must load (Q, K and V once each).
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from .views import HEADLINE_N, impl_sort_key, label

SUMMARY_CSV = Path("ncu") / "sections_summary.csv"
#: What ``render_markdown`` expects to see at a cell; absent ones are named under the table.
EXPECTED_IMPLS: tuple[str, ...] = ("a", "b", "c", "b_cuda", "c_cuda", "sdpa_cudnn")
#: The headline cell of the README (views.HEADLINE_N, D = 64, fp16, non-causal).
HEADLINE_CELL = {"N": HEADLINE_N, "D": 64, "dtype": "fp16", "causal": 0}
#: A 32-byte sector: the unit L2 and DRAM move data in.
SECTOR_BYTES = 32
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}

DURATION = "Duration"  # ns, per kernel
DRAM_PCT = "DRAM Throughput"
COMPUTE_PCT = "Compute (SM) Throughput"
OCCUPANCY_PCT = "Achieved Occupancy"
CONFLICTS_LD = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"
CONFLICTS_ST = "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"
LOAD_SECTORS = "lts__t_sectors_srcunit_tex_op_read.sum"

#: (key of the table row, column heading with its unit) in the order the table shows them.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("dram_pct", "DRAM throughput (% of peak)"),
    ("compute_pct", "compute (SM) throughput (% of peak)"),
    ("occupancy_pct", "achieved occupancy (% of max warps)"),
    ("bank_conflicts", "shared-memory bank conflicts"),
    ("load_sectors", "global load transactions (M sectors of 32 B)"),
)

READING_GUIDE = (
    "How to read it: DRAM throughput near its peak while compute stays low means memory-bound (the N² "
    "traffic of S and P); compute high while DRAM stays low means the kernel is busy doing math, which is "
    "the goal; low occupancy points at registers or shared memory per block; bank conflicts are fixed by "
    "padding or swizzling shared memory; and load transactions over the minimum say how many times the "
    "kernel reads Q, K and V (mostly served by L2, so they cost less than DRAM bytes would).")


class NoProfilerData(FileNotFoundError):
    """No ``sections_summary.csv`` in the profile folder; the message names the command to run."""


def profile_command(cell: dict | None = None, out: str = "results/h200/profile") -> str:
    """The GPU command that fills the table at ``cell`` (default: the headline cell) for every
    expected impl. ``harness profile`` sizes the batch and heads like a sweep (B·N = 16384 tokens,
    H·D = 2048), which at the headline cell is B = 4, H = 32."""
    cell = {**HEADLINE_CELL, **(cell or {})}
    stages = ",".join(i for i in EXPECTED_IMPLS if not i.startswith("sdpa_"))
    peers = ",".join(i.removeprefix("sdpa_") for i in EXPECTED_IMPLS if i.startswith("sdpa_"))
    causal = "yes" if cell["causal"] else "no"
    return (f"python -m harness profile --sections --stages {stages} --peers {peers} --N {cell['N']} "
            f"--D {cell['D']} --causal {causal} --dtype {cell['dtype']} --out {out}")


def load_summary(profile_dir) -> list[dict]:
    """The kernel rows of ``<profile_dir>/ncu/sections_summary.csv``, as strings.

    Raises :class:`NoProfilerData` when the file is missing and ``ValueError`` when it lacks the
    columns that identify a row (impl, N, D, dtype, causal)."""
    path = Path(profile_dir) / SUMMARY_CSV
    if not path.exists():
        raise NoProfilerData(f"no profiler data yet: {path} does not exist; on a GPU with Nsight Compute run "
                             f"`{profile_command(out=str(profile_dir))}`")
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    needed = {"impl", "N", "D", "dtype", "causal", DURATION}
    missing = needed - set(rows[0] if rows else needed)
    if missing:
        raise ValueError(f"{path}: missing columns {sorted(missing)}")
    return rows


def _number(text) -> float | None:
    """A summary cell as a float: None for empty or unparsable cells (ncu writes n/a for some)."""
    try:
        return float(str(text).replace(",", ""))
    except (TypeError, ValueError):
        return None


def _same_cell(row: dict, cell: dict) -> bool:
    return (int(row["N"]) == cell["N"] and int(row["D"]) == cell["D"] and row["dtype"] == cell["dtype"]
            and int(row["causal"]) == int(cell["causal"]))


def time_weighted_mean(kernels: list[dict], metric: str) -> float | None:
    """Mean of ``metric`` over ``kernels``, each weighted by its ``Duration``; kernels without the
    metric are left out (weights too). If any of those lacks a duration, the plain mean instead."""
    pairs = [(_number(k.get(metric)), _number(k.get(DURATION))) for k in kernels]
    pairs = [(value, weight) for value, weight in pairs if value is not None]
    if not pairs:
        return None
    if any(weight is None for _, weight in pairs) or sum(w for _, w in pairs) <= 0:
        return sum(value for value, _ in pairs) / len(pairs)
    return sum(value * weight for value, weight in pairs) / sum(weight for _, weight in pairs)


def total(kernels: list[dict], *metrics: str) -> float | None:
    """Sum of ``metrics`` over ``kernels``; None when no kernel has any of them (not collected)."""
    values = [_number(k.get(m)) for k in kernels for m in metrics]
    values = [v for v in values if v is not None]
    return sum(values) if values else None


def minimum_load_sectors(B: int, H: int, N: int, D: int, dtype: str) -> int:
    """Sectors any kernel must load at least: Q, K and V once each (``[B, H, N, D]`` each; the
    summary does not record GQA or Nk, so K and V are taken as shaped like Q)."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"dtype must be one of {sorted(ELEMENT_BYTES)}, got {dtype!r}")
    return -(-3 * B * H * N * D * ELEMENT_BYTES[dtype] // SECTOR_BYTES)


def profiler_table(profile_dir, *, N: int = HEADLINE_CELL["N"], D: int = HEADLINE_CELL["D"],
                   dtype: str = HEADLINE_CELL["dtype"], causal: bool | int = False) -> list[dict]:
    """One row per impl profiled at the cell (N, D, dtype, causal), in the usual impl order.

    Each row: ``impl``, ``label``, ``B``, ``H``, ``kernels`` (how many kernels one call ran),
    ``duration_ms`` (their summed duration, ms), ``dram_pct``, ``compute_pct``, ``occupancy_pct``
    (% of peak, time-weighted over the kernels), ``bank_conflicts`` (ld + st, count),
    ``load_sectors`` (32-byte sectors read from L2, count) and ``load_sectors_x_min`` (those over
    :func:`minimum_load_sectors`). A metric the run did not collect is None. Empty list: nothing
    was profiled at that cell. Raises :class:`NoProfilerData` when there is no summary at all.
    """
    cell = {"N": N, "D": D, "dtype": dtype, "causal": int(causal)}
    by_impl: dict[str, list[dict]] = {}
    for row in load_summary(profile_dir):
        if _same_cell(row, cell):
            by_impl.setdefault(row["impl"], []).append(row)
    table = []
    for impl in sorted(by_impl, key=impl_sort_key):
        kernels = by_impl[impl]
        B, H = int(kernels[0].get("B") or 0), int(kernels[0].get("H") or 0)
        duration_ns = total(kernels, DURATION)
        sectors = total(kernels, LOAD_SECTORS)
        minimum = minimum_load_sectors(B, H, N, D, dtype) if B and H else None
        table.append({
            "impl": impl, "label": label(impl), "B": B, "H": H, "kernels": len(kernels),
            "duration_ms": None if duration_ns is None else duration_ns / 1e6,
            "dram_pct": time_weighted_mean(kernels, DRAM_PCT),
            "compute_pct": time_weighted_mean(kernels, COMPUTE_PCT),
            "occupancy_pct": time_weighted_mean(kernels, OCCUPANCY_PCT),
            "bank_conflicts": total(kernels, CONFLICTS_LD, CONFLICTS_ST),
            "load_sectors": sectors,
            "load_sectors_x_min": sectors / minimum if sectors is not None and minimum else None,
        })
    return table


def profiled_cells(profile_dir) -> list[dict]:
    """Every cell in the summary with the impls profiled there (to say what else there is)."""
    cells: dict[tuple, set] = {}
    for row in load_summary(profile_dir):
        key = (int(row["N"]), int(row["D"]), row["dtype"], int(row["causal"]))
        cells.setdefault(key, set()).add(row["impl"])
    return [{"N": n, "D": d, "dtype": t, "causal": c, "impls": sorted(i, key=impl_sort_key)}
            for (n, d, t, c), i in sorted(cells.items())]


def missing_impls(rows: list[dict], expected: tuple[str, ...] = EXPECTED_IMPLS) -> list[str]:
    """The expected impls that have no row in ``rows``."""
    present = {r["impl"] for r in rows}
    return [i for i in expected if i not in present]


def _fmt(key: str, value) -> str:
    if value is None:
        return "–"
    if key.endswith("_pct"):
        return f"{value:.1f}"
    if key == "load_sectors":
        return f"{value / 1e6:,.1f}"
    return f"{value:,.0f}"


def render_markdown(rows: list[dict], *, cell: dict | None = None,
                    expected: tuple[str, ...] = EXPECTED_IMPLS, out: str = "results/h200/profile") -> str:
    """The table as Markdown: a heading naming the cell, one line per impl, the impls that are
    missing (with the command that adds them, writing to ``out``), then the one-line reading guide."""
    cell = {**HEADLINE_CELL, **(cell or {})}
    where = (f"N = {cell['N']}, D = {cell['D']}, {cell['dtype']}, "
             f"{'causal' if cell['causal'] else 'non-causal'}")
    lines = [f"**Nsight Compute, one call per impl** ({where})", ""]
    if not rows:
        lines.append(f"No profiler data yet at this cell: run `{profile_command(cell, out)}` on a GPU.")
        return "\n".join(lines) + "\n"
    headings = ["impl", "B×H", "kernels", "time (ms)"] + [h for _, h in COLUMNS] + ["transactions ÷ minimum"]
    lines += ["| " + " | ".join(headings) + " |", "|" + "---|" + "---:|" * (len(headings) - 1)]
    for r in rows:
        cells = [r["label"], f"{r['B']}×{r['H']}", str(r["kernels"]),
                 "–" if r["duration_ms"] is None else f"{r['duration_ms']:.3f}"]
        cells += [_fmt(key, r[key]) for key, _ in COLUMNS]
        cells.append("–" if r["load_sectors_x_min"] is None else f"{r['load_sectors_x_min']:.1f}×")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    absent = missing_impls(rows, expected)
    if absent:
        lines.append(f"Not profiled at this cell yet: {', '.join(label(i) for i in absent)} "
                     f"(`{profile_command(cell, out)}` on a GPU adds them).")
    if any(r[key] is None for r in rows for key, _ in COLUMNS):
        lines.append("–: not collected by that run (runs before the bank-conflict and L2-sector counters "
                     "were added to `--sections`).")
    lines += ["Percentages are of each unit's peak, averaged over the call's kernels weighted by their time; "
              "counts are summed over them. Minimum: Q, K and V loaded once.", "", READING_GUIDE]
    return "\n".join(lines) + "\n"


def fallback_cell(profile_dir) -> dict | None:
    """The profiled cell with the most impls (then the longest N), or None: what to show while the
    headline cell has not been profiled yet."""
    cells = profiled_cells(profile_dir)
    if not cells:
        return None
    best = max(cells, key=lambda c: (len(c["impls"]), c["N"], c["D"] == HEADLINE_CELL["D"]))
    return {k: best[k] for k in ("N", "D", "dtype", "causal")}


def table_for_reading(profile_dir, *, out: str = "results/h200/profile") -> tuple[list[dict], dict, str]:
    """``(rows, cell, markdown)`` for the notebooks. The headline cell when it was profiled; else the
    profiled cell with the most impls, the markdown saying so; with no summary at all, no rows and a
    "no profiler data yet: run ..." line (``out``: the ``--out`` folder that command should name)."""
    cell = dict(HEADLINE_CELL)
    try:
        rows = profiler_table(profile_dir, **cell)
    except NoProfilerData:
        return [], cell, f"no profiler data yet: run `{profile_command(cell, out)}` on a GPU with Nsight Compute.\n"
    if rows:
        return rows, cell, render_markdown(rows, cell=cell, out=out)
    text = render_markdown([], cell=cell, out=out)
    other = fallback_cell(profile_dir)
    if other is None:
        return [], cell, text
    rows = profiler_table(profile_dir, **other)
    return rows, other, text + "\nMeanwhile, the profiled cell with the most impls:\n\n" + \
        render_markdown(rows, cell=other, out=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.profiler_table",
                                description="Print the five-metric profiler table from "
                                            "`harness profile --sections` output.")
    p.add_argument("profile_dir", type=Path, help="the --out folder of `harness profile` (e.g. results/h200/profile)")
    p.add_argument("--N", type=int, default=HEADLINE_CELL["N"], help="sequence length (default %(default)s)")
    p.add_argument("--D", type=int, default=HEADLINE_CELL["D"], help="head dim (default %(default)s)")
    p.add_argument("--dtype", default=HEADLINE_CELL["dtype"], choices=sorted(ELEMENT_BYTES))
    p.add_argument("--causal", type=int, choices=(0, 1), default=HEADLINE_CELL["causal"])
    args = p.parse_args(argv)
    cell = {"N": args.N, "D": args.D, "dtype": args.dtype, "causal": args.causal}
    try:
        rows = profiler_table(args.profile_dir, **cell)
    except (NoProfilerData, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(render_markdown(rows, cell=cell))
    if not rows:
        others = profiled_cells(args.profile_dir)
        if others:
            print("Cells with profiler data in this folder:")
            for c in others:
                print(f"  --N {c['N']} --D {c['D']} --dtype {c['dtype']} --causal {c['causal']}: "
                      f"{', '.join(c['impls'])}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
