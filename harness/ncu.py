"""DRAM bytes measured by Nsight Compute (``harness profile`` and ``harness compare --ncu``).

For one impl on one cell we start a child process under ``ncu``::

    ncu --clock-control none --profile-from-start off --cache-control all --target-processes all \
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum \
        --csv --print-units base  python -m harness _ncu_child --impl c --B 4 ...

The child (:func:`child_main`) makes the cell's seeded inputs, makes one *warm* call (compilation,
autotuning: not profiled), then brackets exactly one call with ``cudaProfilerStart``/``Stop`` (what
``--profile-from-start off`` listens to) and an NVTX range ``harness:<impl>`` (for timelines). So
the profiled window holds the kernels of one call and nothing else: a peer's kernels are whatever
SDPA launches inside it. We sum ``dram__bytes_*`` over those kernels.

Caveats (also in harness/README.md): ``--clock-control none`` keeps the GPU's own clocks (ncu would
otherwise lock them to base); ``--cache-control all`` (the default) flushes caches before each kernel
replay, so each kernel starts with a cold L2 — a later kernel in stage A does not find the S that the
previous one just wrote. K/V re-reads that hit L2 are not DRAM traffic, so measured bytes can be far
below the model; an output that fits in the 60 MB L2 may not be written back to DRAM within the
kernel's window, so writes can read low. Bank-conflict counters only see LSU shared-memory
accesses (``ld.shared``/``st.shared``/``ldmatrix``), not TMA or wgmma operand reads.
"""

from __future__ import annotations

import argparse
import csv
import glob
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from stages.contract import Problem

METRICS: tuple[str, ...] = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
)
REPO_ROOT = Path(__file__).resolve().parents[1]
NVTX_RANGE_PREFIX = "harness:"


class NcuError(RuntimeError):
    """ncu is missing, failed, or profiled no kernel."""


def find_ncu() -> str | None:
    """The ncu executable: on PATH, in /usr/local/cuda/bin, or the newest /opt/nvidia/nsight-compute/*/."""
    found = shutil.which("ncu")
    if found:
        return found
    candidates = ["/usr/local/cuda/bin/ncu"] + sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"), reverse=True)
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


NO_NCU_MESSAGE = ("Nsight Compute (ncu) was not found on PATH, in /usr/local/cuda/bin or in "
                  "/opt/nvidia/nsight-compute/*/; install Nsight Compute or put ncu on PATH "
                  "(DRAM bytes can only be measured with it, on a machine with an NVIDIA GPU).")


#: ``harness profile --sections``: Nsight Compute's own analysis sections (what limits a kernel),
#: kept as ncu writes them, one CSV per impl and cell.
SECTIONS: tuple[str, ...] = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "SchedulerStats",
                             "Occupancy", "LaunchStats")
#: Collected with the sections: how busy each pipe is, how often a scheduler issues, and why warps
#: wait. The sections show these only as charts; these raw counters put them in the CSV. Busy
#: percentages are of the SM's active cycles: tensor cores (``wgmma``/``mma``), XU (the
#: special-function unit behind ``ex2``), FMA and ALU. Stall ratios are warps waiting for that
#: reason per issued instruction (``barrier``: at a CTA/named barrier; ``wait``: a fixed-latency
#: dependency; ``long_scoreboard``: global memory or mbarrier; ``no_instruction``: instruction fetch).
PIPE_AND_STALL_METRICS: tuple[str, ...] = (
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "smsp__warps_active.avg.per_cycle_active",
) + tuple(f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio" for reason in (
    "barrier", "wait", "long_scoreboard", "short_scoreboard", "no_instruction", "math_pipe_throttle",
    "mio_throttle", "dispatch_stall", "not_selected", "gmma"))
#: Also collected with the sections: the two counters of the five-metric profiler table that no
#: section shows as a number (``harness.profiler_table`` reads them). Shared-memory bank conflicts,
#: loads and stores apart (LSU accesses only: TMA writes and wgmma operand reads are not counted),
#: and the 32-byte sectors the SMs read from L2: every global load, ``cp.async`` or TMA copy arrives
#: there first, so this counts "global load transactions" whatever instruction asked, and it counts
#: re-reads that L2 then serves (DRAM bytes count only what L2 missed). ``lts__t_sectors_op_read``
#: (L2 reads from any source) is kept beside it as a cross-check.
PROFILER_TABLE_METRICS: tuple[str, ...] = (
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "lts__t_sectors_srcunit_tex_op_read.sum",
    "lts__t_sectors_op_read.sum",
)
#: Every raw counter ``--sections`` asks ncu for, beside the sections.
SECTION_RAW_METRICS: tuple[str, ...] = PIPE_AND_STALL_METRICS + PROFILER_TABLE_METRICS
#: What ``sections_summary.csv`` keeps per kernel: a few section metrics (ncu's display names) and
#: :data:`SECTION_RAW_METRICS` (raw names). ``Duration`` is in ns (``--print-units base``).
SECTION_SUMMARY: tuple[str, ...] = (
    "Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput", "Executed Ipc Active",
    "Issue Slots Busy", "No Eligible", "Warp Cycles Per Issued Instruction", "Achieved Occupancy",
    "Registers Per Thread", "Block Size", "Grid Size", "Dynamic Shared Memory Per Block") + SECTION_RAW_METRICS


def ncu_command(ncu: str, impl_name: str, variant: str, problem: Problem, seed: int = 0,
                sections: tuple[str, ...] = ()) -> list[str]:
    """The full command line: ncu options, then the child process (see the module docstring).
    With ``sections`` ncu collects those analysis sections and :data:`SECTION_RAW_METRICS` instead
    of :data:`METRICS`."""
    # "--variant=-tma", not "--variant -tma": argparse would take "-tma" for an option.
    child = [sys.executable, "-m", "harness", "_ncu_child", "--impl", impl_name, f"--variant={variant}",
             "--B", str(problem.B), "--H", str(problem.H), "--N", str(problem.N), "--D", str(problem.D),
             "--dtype", problem.dtype, "--seed", str(seed)] + (["--causal"] if problem.causal else [])
    if sections:
        what = [arg for s in sections for arg in ("--section", s)] + ["--metrics", ",".join(SECTION_RAW_METRICS)]
    else:
        what = ["--metrics", ",".join(METRICS)]
    return [ncu, "--clock-control", "none", "--profile-from-start", "off", "--cache-control", "all",
            "--target-processes", "all", *what, "--csv", "--print-units", "base", *child]


def _number(text: str) -> float | None:
    text = (text or "").strip().replace(",", "")
    if not text or text.lower() in ("n/a", "nan"):
        return None
    try:
        return float(text)
    except ValueError:
        return None


def csv_lines(text: str, first_column: str = "ID") -> list[str]:
    """The CSV part of ncu's output: its header line (``"ID",...`` on the details page,
    ``"Address",...`` on the source page) and the quoted lines after it; ``==PROF==`` lines and the
    child's own output are dropped. Empty when there is no header."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f'"{first_column}"')), None)
    return [] if start is None else [line for line in lines[start:] if line.startswith('"')]


def parse_ncu_csv(text: str) -> list[dict]:
    """ncu ``--csv`` (details page) output -> one dict per profiled kernel launch, in launch order:
    ``{"id": str, "name": str, "metrics": {metric: float | None}}``. Non-CSV lines (``==PROF==``,
    the child's own output) are skipped."""
    body = csv_lines(text)
    if not body:
        return []
    kernels: dict[str, dict] = {}
    for rec in csv.DictReader(io.StringIO("\n".join(body))):
        kid = rec.get("ID", "")
        name = rec.get("Kernel Name") or rec.get("Function Name") or rec.get("Name") or ""
        k = kernels.setdefault(kid, {"id": kid, "name": name, "metrics": {}})
        metric = rec.get("Metric Name")
        if metric:
            k["metrics"][metric] = _number(rec.get("Metric Value", ""))
    return list(kernels.values())


def summarize(kernels: list[dict]) -> dict:
    """Results columns from the kernels of one call: summed bytes, mean L2 hit rate, bank conflicts."""
    def total(metric: str) -> int | None:
        values = [k["metrics"].get(metric) for k in kernels]
        values = [v for v in values if v is not None]
        return int(round(sum(values))) if values else None

    hits = [k["metrics"].get("lts__t_sector_hit_rate.pct") for k in kernels]
    hits = [h for h in hits if h is not None]
    ld = total("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum")
    st = total("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum")
    return {
        "dram_read_measured": total("dram__bytes_read.sum"),
        "dram_write_measured": total("dram__bytes_write.sum"),
        "l2_hit_rate_pct": sum(hits) / len(hits) if hits else None,
        "smem_bank_conflicts": None if ld is None and st is None else (ld or 0) + (st or 0),
        "bank_conflicts_ld": ld,
        "bank_conflicts_st": st,
    }


def kernel_summary(kernels: list[dict]) -> str:
    """``name×count`` for the kernels seen, names shortened (for the note column)."""
    counts: dict[str, int] = {}
    for k in kernels:
        short = k["name"].split("(")[0][:40]
        counts[short] = counts.get(short, 0) + 1
    return ", ".join(f"{n}×{c}" if c > 1 else n for n, c in counts.items())


def predicted_bank_conflicts(impl_name: str, problem: Problem, variant_kwargs: dict) -> dict | None:
    """stages.bank_model's prediction for this impl ({"ld": int, "st": int}) or None."""
    try:
        from stages import bank_model
    except ImportError:
        return None
    try:
        return bank_model.predicted_conflicts(impl_name, problem, **variant_kwargs)
    except Exception:
        return None


@dataclass
class NcuResult:
    """What one profiled call gave: results columns, the kernels seen, and bank conflicts split."""

    columns: dict
    kernels: list[dict]
    conflicts_ld: int | None
    conflicts_st: int | None
    predicted: dict | None

    @property
    def note(self) -> str:
        notes = [f"ncu kernels: {kernel_summary(self.kernels)}"]
        if self.conflicts_ld is not None or self.conflicts_st is not None:
            notes.append(f"bank conflicts ld/st measured {self.conflicts_ld}/{self.conflicts_st}")
        if self.predicted:
            notes.append(f"predicted {self.predicted.get('ld')}/{self.predicted.get('st')}")
        return "; ".join(notes)

    def as_row(self) -> dict:
        """The results columns plus ``note`` (for ``measure_impl``'s ncu hook)."""
        return {**self.columns, "note": self.note}


def profile_impl(impl, problem: Problem, *, seed: int = 0, ncu: str | None = None,
                 timeout_s: float = 1800) -> NcuResult:
    """Run the child under ncu for one impl on one cell and summarize the kernels of its one call.

    Raises :class:`NcuError` when ncu is missing, fails, or profiles no kernel.
    """
    kernels, _ = _run_under_ncu(impl, problem, seed, ncu, timeout_s, sections=())
    columns = summarize(kernels)
    ld, st = columns.pop("bank_conflicts_ld"), columns.pop("bank_conflicts_st")
    predicted = predicted_bank_conflicts(impl.name, problem, impl.variant_kwargs)
    return NcuResult(columns, kernels, ld, st, predicted)


def profile_sections(impl, problem: Problem, *, seed: int = 0, ncu: str | None = None,
                     timeout_s: float = 1800) -> tuple[str, list[dict]]:
    """The :data:`SECTIONS` of the kernels of one call: ncu's CSV text as it wrote it, and one
    summary row per kernel (:func:`section_summary`). Raises :class:`NcuError` like ``profile_impl``."""
    kernels, text = _run_under_ncu(impl, problem, seed, ncu, timeout_s, sections=SECTIONS)
    return "\n".join(csv_lines(text)) + "\n", section_summary(kernels)


def section_summary(kernels: list[dict]) -> list[dict]:
    """One row per profiled kernel: its short name and the :data:`SECTION_SUMMARY` metrics."""
    return [{"kernel": k["name"].split("(")[0][:60], **{m: k["metrics"].get(m) for m in SECTION_SUMMARY}}
            for k in kernels]


def _run_under_ncu(impl, problem: Problem, seed: int, ncu: str | None, timeout_s: float,
                   sections: tuple[str, ...]) -> tuple[list[dict], str]:
    ncu = ncu or find_ncu()
    if not ncu:
        raise NcuError(NO_NCU_MESSAGE)
    cmd = ncu_command(ncu, impl.name, impl.variant, problem, seed, sections)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=timeout_s)
    kernels = parse_ncu_csv(proc.stdout)
    if proc.returncode != 0 or not kernels:
        detail = [ln for ln in (proc.stdout + "\n" + proc.stderr).splitlines()
                  if ln.startswith(("==ERROR==", "==WARNING==")) or "Error" in ln]
        why = "; ".join(detail[-3:]) or (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise NcuError(f"ncu exit {proc.returncode}, {len(kernels)} kernels profiled: {why[:400]}")
    return kernels, proc.stdout


# --------------------------------------------------------------------------------------- child process

def add_child_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--impl", required=True)
    p.add_argument("--variant", default="")
    for name in ("B", "H", "N", "D"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def child_main(args: argparse.Namespace) -> int:
    """Warm call, then exactly one call inside cudaProfilerStart/Stop and an NVTX range."""
    import torch

    from .impls import resolve_impl
    from .inputs import make_inputs

    problem = Problem(args.B, args.H, args.N, args.D, args.dtype, args.causal)
    impl = resolve_impl(args.impl, args.variant)
    q, k, v = make_inputs(problem, "cuda", args.seed)
    impl.attention(q, k, v, causal=problem.causal)  # warm: compile / autotune outside the window
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    torch.cuda.nvtx.range_push(f"{NVTX_RANGE_PREFIX}{impl.label}")
    out = impl.attention(q, k, v, causal=problem.causal)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    torch.cuda.profiler.stop()
    del out
    return 0
