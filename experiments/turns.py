"""What the experiments that race variants of a call over model-suite cells share (``ws_launch.py``,
``small_tiles.py``): their command line (``--cells``, ``--rounds``, ``--csv``), one timing of one
variant that records a failure instead of stopping the run, the medians over the rounds, and the rows
they write (one per cell, variant, timing and round)."""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import timing  # noqa: E402
from harness.suites import named_cells  # noqa: E402

CSV_COLUMNS = ("cell", "variant", "timing", "round", "us", "status")


def parse(description: str, rounds: int, argv=None) -> tuple | None:
    """(args, the named suite cells) from the command line, or None (after saying why) without a GPU;
    a wrong ``--cells`` or ``--rounds`` is a usage error that names it."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--cells", default="short", help="model-suite cells by name, comma-separated")
    ap.add_argument("--rounds", type=int, default=rounds, help=f"rounds of turns (default {rounds})")
    ap.add_argument("--csv", help="also write one row per (cell, variant, timing, round) here")
    args = ap.parse_args(argv)
    try:
        cells = named_cells(args.cells)
    except ValueError as e:
        ap.error(f"--cells: {e}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("error: this experiment times kernels on a CUDA GPU; none here", file=sys.stderr)
        return None
    return args, cells


def header(sms: int) -> None:
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; µs per call, eager (events around each call) and on the GPU "
          f"alone (graph replay), the harness's reading flush before each; medians over rounds")


def cell_inputs(c, sms: int) -> tuple:
    """(q, k, v) of a suite cell on the GPU (the harness's inputs) and stage C's choice for it."""
    from harness.inputs import make_inputs
    from stages.c_optimized import kernels
    from stages.contract import Problem

    q, k, v = make_inputs(Problem(c.B, c.Hq, c.Nq, c.D, c.dtype, c.causal, c.Hkv, c.Nk), "cuda")
    return q, k, v, kernels.select(c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, q.dtype, c.causal, 90, sms)


def failure(e: Exception, chars: int = 120) -> str:
    """A status that says why a variant did not run (the run goes on)."""
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:chars]}"


def median_us(samples_ms) -> tuple[float, str]:
    """(µs, "ok") of one timing's samples, or (nan, why) where ``samples_ms`` is a callable that raised."""
    try:
        return timing.summarize(samples_ms(), True).ms_median * 1e3, "ok"
    except Exception as e:  # a config that does not run here: recorded, the rest go on
        return float("nan"), failure(e)


def eager_or_graph(fn, how: str):
    """The samples (ms) of ``fn`` timed eagerly (events around each call; one call first, untimed, in case
    it compiles) or replayed from a CUDA graph, the harness's reading flush before each, as a callable for
    :func:`median_us`."""
    if how == "eager":
        return lambda: (fn(), timing.samples_gpu(fn, 50, 60))[1]
    return lambda: timing.samples_graph(lambda: fn, 50, 60)


def print_medians(times: dict, variants, hows, width: int = 13) -> None:
    """One line per variant: each timing's median over the rounds, and the eager rounds themselves."""
    for kind in variants:
        line = "  ".join(f"{how} {statistics.median(times[kind, how]):8.2f} µs" for how in hows)
        rounds = " ".join(f"{t:.2f}" for t in times[kind, "eager"])
        print(f"  {kind:{width}} {line}   eager rounds: {rounds}", flush=True)


def write_rows(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            w.writeheader()
            w.writerows(rows)
