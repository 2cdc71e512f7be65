"""Results files: one CSV of measurement rows plus one JSON of provenance per GPU.

Layout: ``results/<gpu-slug>/runs.csv`` and ``results/<gpu-slug>/env.json``.

Rows are appended (and flushed) as they are measured, a cell at a time, so Ctrl-C or a crash loses
no finished cell, and ``--resume`` can skip the cells a file already holds.

Columns (stable names; units in the name; empty string = not measured):

=====================  =====================================================================
column                 meaning
=====================  =====================================================================
run_id                 one id per harness invocation (UTC timestamp)
impl                   stage name (``a``, ``b``, ``c``, ``b_cuda``, ...) or peer (``sdpa_flash``, ...)
kind                   ``stage``, ``peer`` or ``ablation``
variant                ablation variant (``all``, ``-tma``, ...); empty for plain rows
B, H, N, D             problem shape
dtype                  ``fp16``, ``bf16`` or ``fp32``
causal                 ``0`` or ``1``
device                 ``gpu`` or ``interpreter`` (CPU, Triton interpreter: times are not GPU times)
ms_median              median time of one call, ms
ms_p20, ms_p80         20th / 80th percentile, ms (the spread)
tflops                 FLOPs / median time; FLOPs = 4·B·H·N²·D, halved for causal
gbps_model             modelled HBM bytes / median time, GB/s
dram_read_model        modelled bytes read (the stage's traffic model)
dram_write_model       modelled bytes written
dram_read_measured     Nsight Compute dram__bytes_read.sum over the impl's kernels, bytes
dram_write_measured    Nsight Compute dram__bytes_write.sum, bytes
l2_hit_rate_pct        Nsight Compute lts__t_sector_hit_rate.pct (mean over kernels)
smem_bank_conflicts    Nsight Compute shared-memory bank conflicts (ld + st), count
peak_mem_model         modelled extra device memory of one call (workspace + output), bytes
peak_mem_measured      max_memory_allocated during one call minus what was allocated before, bytes
energy_j_per_call      NVML total-energy delta over a >= 2 s loop / calls, J
power_w                average power over that loop, W
sm_clock_mhz           SM clock read after the loop, MHz
mem_clock_mhz          memory clock read after the loop, MHz
temp_c                 GPU temperature after the loop, deg C
throttle_reasons       NVML clocks-event reasons active after the loop (names joined by ``|``)
rel_err                ||o - ref|| / ||ref|| against a float64 reference
torch_rel_err          the same error for PyTorch's own same-precision computation
status                 ``ok``, ``oom``, ``unsupported: <why>`` or ``error: <what>``
note                   free text (e.g. which config stage C chose)
=====================  =====================================================================
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

from stages.contract import slugify  # noqa: F401  (results/<slug>/ is named by it)

COLUMNS: tuple[str, ...] = (
    "run_id", "impl", "kind", "variant", "B", "H", "N", "D", "dtype", "causal", "device",
    "ms_median", "ms_p20", "ms_p80", "tflops", "gbps_model",
    "dram_read_model", "dram_write_model", "dram_read_measured", "dram_write_measured",
    "l2_hit_rate_pct", "smem_bank_conflicts",
    "peak_mem_model", "peak_mem_measured",
    "energy_j_per_call", "power_w", "sm_clock_mhz", "mem_clock_mhz", "temp_c", "throttle_reasons",
    "rel_err", "torch_rel_err", "status", "note",
)

INT_COLUMNS = frozenset({"B", "H", "N", "D", "causal", "dram_read_model", "dram_write_model",
                         "dram_read_measured", "dram_write_measured", "smem_bank_conflicts",
                         "peak_mem_model", "peak_mem_measured"})
FLOAT_COLUMNS = frozenset({"ms_median", "ms_p20", "ms_p80", "tflops", "gbps_model", "l2_hit_rate_pct",
                           "energy_j_per_call", "power_w", "sm_clock_mhz", "mem_clock_mhz", "temp_c",
                           "rel_err", "torch_rel_err"})
REQUIRED = ("impl", "kind", "B", "H", "N", "D", "dtype", "causal", "status")

RUNS_CSV = "runs.csv"
ENV_JSON = "env.json"


class ResultsError(ValueError):
    """A results file is missing, malformed or does not follow the schema."""


def cell_key(row: dict) -> tuple:
    """What identifies a measurement cell, for ``--resume``: impl, variant, shape, dtype, masking."""
    return (str(row["impl"]), str(row.get("variant") or ""), int(row["B"]), int(row["H"]), int(row["N"]),
            int(row["D"]), str(row["dtype"]), int(row["causal"]))


class RowWriter:
    """Appends rows to ``runs.csv``, writing the header when the file is new; flushes each row."""

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / RUNS_CSV
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                header = next(csv.reader(f), [])
            if tuple(header) != COLUMNS:
                raise ResultsError(
                    f"{self.path}: its header does not match this harness's columns; "
                    f"write to another --out directory or move the old file away")
            new = False
        else:
            new = True
        self._file = self.path.open("a", newline="")
        self._csv = csv.DictWriter(self._file, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            self._csv.writeheader()
            self._file.flush()

    def write(self, row: dict) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ResultsError(f"unknown result columns {sorted(unknown)}")
        self._csv.writerow({c: _format(row.get(c)) for c in COLUMNS})
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def load_rows(path: str | os.PathLike) -> list[dict]:
    """Read a ``runs.csv`` (or the directory holding one) and type its columns.

    Raises :class:`ResultsError` naming the file and the line for a missing file, a wrong header,
    a missing required value or a number that does not parse.
    """
    path = Path(path)
    if path.is_dir():
        path = path / RUNS_CSV
    if not path.exists():
        raise ResultsError(f"{path}: no such results file (run `python -m harness sweep` or `compare` first)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = tuple(reader.fieldnames or ())
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise ResultsError(f"{path}: missing columns {missing}")
        rows = []
        for lineno, raw in enumerate(reader, start=2):
            rows.append(_parse(raw, path, lineno))
    return rows


def _parse(raw: dict, path: Path, lineno: int) -> dict:
    row: dict = {}
    for c in COLUMNS:
        text = (raw.get(c) or "").strip()
        if c in REQUIRED and not text:
            raise ResultsError(f"{path}:{lineno}: column {c!r} is empty")
        try:
            if not text:
                row[c] = None
            elif c in INT_COLUMNS:
                row[c] = int(float(text))
            elif c in FLOAT_COLUMNS:
                row[c] = float(text)
            else:
                row[c] = text
        except ValueError:
            raise ResultsError(f"{path}:{lineno}: column {c!r} should be a number, got {text!r}") from None
    row["variant"] = row["variant"] or ""
    return row


def done_cells(out_dir: str | os.PathLike) -> set[tuple]:
    """Cells already measured in ``out_dir`` (any status: an OOM is a result too), for ``--resume``."""
    path = Path(out_dir) / RUNS_CSV
    if not path.exists():
        return set()
    return {cell_key(r) for r in load_rows(path)}


def latest_rows(rows: Iterable[dict]) -> list[dict]:
    """Keep the last row of each cell (a re-measured cell replaces the older one), in first-seen order."""
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key[cell_key(r)] = r
    return list(by_key.values())


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """The checkout's commit, with ``-dirty`` when tracked files outside ``results/`` differ from it
    (a kernel measured before it was committed; the results a sweep appends to do not count)."""
    cwd = cwd or Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ":(top)", ":(top,exclude)results")
        return commit + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_id_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_env(out_dir: str | os.PathLike, env: dict) -> Path:
    """Write (merge into) ``env.json``: provenance of the runs in this directory.

    Each harness invocation adds one entry under ``runs`` keyed by its run_id, so a file that
    accumulates several sweeps keeps the provenance of each.
    """
    path = Path(out_dir) / ENV_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update({k: v for k, v in env.items() if k != "run_id"})
    data.setdefault("runs", {})[env["run_id"]] = {"command": env.get("command"), "date": env.get("date"),
                                                   "git_commit": env.get("git_commit")}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def load_env(out_dir: str | os.PathLike) -> dict:
    path = Path(out_dir) / ENV_JSON
    if not path.exists():
        raise ResultsError(f"{path}: no provenance file next to the results")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON ({e})") from None


def base_env(run_id: str) -> dict:
    """Provenance every run records; the GPU part is added by harness.device_info."""
    import torch
    import triton

    return {
        "run_id": run_id,
        "date": run_id,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_runtime": torch.version.cuda,
        "host": platform.node(),
    }


@dataclass
class Cell:
    """One measurement cell of a sweep."""

    B: int
    H: int
    N: int
    D: int
    dtype: str
    causal: bool

    def row_fields(self) -> dict:
        return {"B": self.B, "H": self.H, "N": self.N, "D": self.D, "dtype": self.dtype, "causal": int(self.causal)}


def iter_cells(Bs, Hs, Ns, Ds, dtypes, causals) -> Iterator[Cell]:
    for dtype in dtypes:
        for D in Ds:
            for causal in causals:
                for N in Ns:
                    for B in Bs:
                        for H in Hs:
                            yield Cell(B, H, N, D, dtype, causal)
