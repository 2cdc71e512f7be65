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
cell                   the named cell of a suite (``gpt2``, ``decode-gqa``, ... see ``harness/suites.py``);
                       empty for grid cells
B, H, N, D             problem shape: batch, query heads (Hq), query rows (Nq), head dim
Hkv                    key/value heads (GQA: H is a multiple of it; old files: = H)
Nk                     key/value rows (old files: = N)
dtype                  ``fp16``, ``bf16`` or ``fp32``
causal                 ``0`` or ``1`` (bottom-right aligned when N != Nk)
pass                   ``fwd`` (forward), ``bwd`` (backward alone, given a saved forward) or ``fwd_bwd``
                       (one training step: forward then backward); old files: ``fwd``
device                 ``gpu`` or ``interpreter`` (CPU, Triton interpreter: times are not GPU times)
ms_median              median time of one call, ms
ms_p20, ms_p80         20th / 80th percentile, ms (the spread)
ms_gpu                 median time of the same call replayed from a CUDA graph, ms: the GPU's time alone,
                       without the host path (empty on a CPU, or when the call cannot be captured)
tflops                 FLOPs / ms_median; FLOPs = 4·B·H·N·Nk·D forward (causal: visible pairs only),
                       2.5x that for ``bwd``, 3.5x for ``fwd_bwd``
gbps_model             modelled HBM bytes / median time, GB/s
dram_read_model        modelled bytes read (the stage's traffic model; ``bwd``: its backward model;
                       ``fwd_bwd``: both)
dram_write_model       modelled bytes written
dram_read_measured     Nsight Compute dram__bytes_read.sum over the impl's kernels, bytes
dram_write_measured    Nsight Compute dram__bytes_write.sum, bytes
l2_hit_rate_pct        Nsight Compute lts__t_sector_hit_rate.pct (mean over kernels)
smem_bank_conflicts    Nsight Compute shared-memory bank conflicts (ld + st), count
peak_mem_model         modelled extra device memory of one call (workspace + output), bytes; ``bwd`` and
                       ``fwd_bwd`` rows: of one training step (train workspace + o + dq, dk, dv)
peak_mem_measured      max_memory_allocated during one call (bwd, fwd_bwd: one forward + backward) minus
                       what was allocated before, bytes
energy_j_per_call      NVML total-energy delta over a >= 2 s loop / calls, J
power_w                average power over that loop, W
sm_clock_mhz           SM clock read after the loop, MHz
mem_clock_mhz          memory clock read after the loop, MHz
temp_c                 GPU temperature after the loop, deg C
throttle_reasons       NVML clocks-event reasons active after the loop (names joined by ``|``)
rel_err                ||o - ref|| / ||ref|| against a float64 reference (bwd, fwd_bwd: the largest of
                       the three gradients' errors, dq, dk, dv)
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
    "run_id", "impl", "kind", "variant", "cell", "B", "H", "Hkv", "N", "Nk", "D", "dtype", "causal", "pass",
    "device", "ms_median", "ms_p20", "ms_p80", "ms_gpu", "tflops", "gbps_model",
    "dram_read_model", "dram_write_model", "dram_read_measured", "dram_write_measured",
    "l2_hit_rate_pct", "smem_bank_conflicts",
    "peak_mem_model", "peak_mem_measured",
    "energy_j_per_call", "power_w", "sm_clock_mhz", "mem_clock_mhz", "temp_c", "throttle_reasons",
    "rel_err", "torch_rel_err", "status", "note",
)

INT_COLUMNS = frozenset({"B", "H", "Hkv", "N", "Nk", "D", "causal", "dram_read_model", "dram_write_model",
                         "dram_read_measured", "dram_write_measured", "smem_bank_conflicts",
                         "peak_mem_model", "peak_mem_measured"})
FLOAT_COLUMNS = frozenset({"ms_median", "ms_p20", "ms_p80", "ms_gpu", "tflops", "gbps_model", "l2_hit_rate_pct",
                           "energy_j_per_call", "power_w", "sm_clock_mhz", "mem_clock_mhz", "temp_c",
                           "rel_err", "torch_rel_err"})
REQUIRED = ("impl", "kind", "B", "H", "N", "D", "dtype", "causal", "status")

#: the passes a row can time (the ``pass`` column): the forward, the backward alone given a saved
#: forward, and one training step (forward then backward).
PASSES: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")

#: Columns added after the first results files were written. A file without them still loads: each
#: gets the value that the older files meant (the same heads and rows for K/V as for Q, a forward
#: pass, no suite name, no CUDA-graph time).
LATER_COLUMNS: tuple[str, ...] = ("cell", "Hkv", "Nk", "pass", "ms_gpu")


def _later_default(column: str, row: dict):
    """What an older file's row means for a column it does not have (``row`` holds the rest)."""
    return {"Hkv": row.get("H"), "Nk": row.get("N"), "pass": "fwd"}.get(column)

RUNS_CSV = "runs.csv"
ENV_JSON = "env.json"


class ResultsError(ValueError):
    """A results file is missing, malformed or does not follow the schema."""


def cell_key(row: dict) -> tuple:
    """What identifies a measurement cell, for ``--resume``: impl, variant, shape (with the K/V heads
    and rows), dtype, masking and pass. A row without Hkv/Nk/pass (an older file) means Hkv = H,
    Nk = N, pass = fwd, so it keys the same as the new row of that cell."""
    H, N = int(row["H"]), int(row["N"])
    return (str(row["impl"]), str(row.get("variant") or ""), int(row["B"]), H, int(row.get("Hkv") or H), N,
            int(row.get("Nk") or N), int(row["D"]), str(row["dtype"]), int(row["causal"]),
            str(row.get("pass") or "fwd"))


class RowWriter:
    """Appends rows to ``runs.csv``, writing the header when the file is new; flushes each row.

    A file written before the :data:`LATER_COLUMNS` existed keeps its header: rows are written in
    its columns as long as they fit (Hkv = H, Nk = N, pass fwd, no suite name, no CUDA-graph time),
    so today's grid rows still append to an older file. A row that does not fit (a GQA cell, a
    backward, an ``ms_gpu``) raises :class:`ResultsError` instead of losing the value silently;
    :func:`upgrade_results_file` rewrites an older file with the current header.
    """

    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / RUNS_CSV
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.columns = COLUMNS
        if self.path.exists() and self.path.stat().st_size > 0:
            with self.path.open(newline="") as f:
                header = tuple(next(csv.reader(f), []))
            older = tuple(c for c in COLUMNS if c not in LATER_COLUMNS or c in header)
            if header == older and header != COLUMNS:
                self.columns = header  # an older schema: append in its columns
            elif header != COLUMNS:
                raise ResultsError(
                    f"{self.path}: its header does not match this harness's columns; "
                    f"write to another --out directory or move the old file away")
            new = False
        else:
            new = True
        self._file = self.path.open("a", newline="")
        if not new:
            self._file.write(_fresh_line_prefix(self.path))
        self._csv = csv.DictWriter(self._file, fieldnames=self.columns, extrasaction="raise")
        if new:
            self._csv.writeheader()
            self._file.flush()

    def write(self, row: dict) -> None:
        unknown = set(row) - set(COLUMNS)
        if unknown:
            raise ResultsError(f"unknown result columns {sorted(unknown)}")
        lost = [c for c in COLUMNS if c not in self.columns
                and _format(row.get(c)) not in ("", _format(_later_default(c, row)))]
        if lost:
            raise ResultsError(
                f"{self.path} was written by an older harness without the columns {lost}, which this row "
                f"needs ({', '.join(f'{c}={row.get(c)!r}' for c in lost)}); {self._upgrade_hint()}")
        self._csv.writerow({c: _format(row.get(c)) for c in self.columns})
        self._file.flush()
        os.fsync(self._file.fileno())

    def require(self, columns) -> None:
        """Raise :class:`ResultsError` now, before anything is measured, when the file lacks
        ``columns`` that the coming rows will fill (an older file: see the class docstring)."""
        missing = [c for c in columns if c not in self.columns]
        if missing:
            raise ResultsError(f"{self.path} was written by an older harness without the columns {missing}, "
                               f"which this run fills; {self._upgrade_hint()}")

    def _upgrade_hint(self) -> str:
        return (f"upgrade the file in place with `python -c \"from harness.results import upgrade_results_file "
                f"as u; u('{self.path}')\"` or write to another --out directory")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RowWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fresh_line_prefix(path: Path) -> str:
    """What to write before appending to ``path`` so the next row starts a record of its own.

    Every row the harness writes ends with a line break, so a file that does not end with one was
    cut mid-row (a crash, a full disk). Appending straight on would glue the new row to the broken
    one and lose both; a line break first keeps the new row whole. If the cut fell inside a quoted
    field (an odd number of quote characters: a CSV doubles the quotes inside a field), the quote is
    closed first, or the line break would stay inside the field and swallow the new row too. The
    broken row stays in the file, where :func:`load_rows` names it and ``harness repair`` moves it.
    """
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return ""
    return ('"' if data.count(b'"') % 2 else "") + "\r\n"


def repair_hint(path: Path) -> str:
    """How to get past a row of ``path`` that does not parse; the row errors end with it."""
    return (f"to move unparseable lines aside (into {path.name}.bad, keeping a backup), run "
            f"`python -m harness repair {path}`")


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
        missing = [c for c in COLUMNS if c not in header and c not in LATER_COLUMNS]
        if missing:
            raise ResultsError(f"{path}: missing columns {missing}")
        rows = []
        lineno = reader.line_num + 1  # the line the next record starts on (a quoted field may span lines)
        for raw in reader:
            try:
                rows.append(_parse(raw, path, lineno))
            except ResultsError as e:
                raise ResultsError(f"{e}; {repair_hint(path)}") from None
            lineno = reader.line_num + 1
    return rows


def _check_field_count(raw: dict, path: Path, lineno: int) -> None:
    """A record with fewer or more fields than the header: ``csv.DictReader`` fills the missing ones
    with None and keeps the extra ones under the key None."""
    extra = raw.get(None) or []
    present = sum(1 for k, v in raw.items() if k is not None and v is not None)
    if extra or present < len(raw) - (None in raw):
        raise ResultsError(f"{path}:{lineno}: the row has {present + len(extra)} fields, the header "
                           f"{len(raw) - (None in raw)}: a row cut off (a crash mid-write?) or edited by hand")


def _parse(raw: dict, path: Path, lineno: int) -> dict:
    _check_field_count(raw, path, lineno)
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
    for c in LATER_COLUMNS:  # an older file (or an empty value) means what older files meant
        if row[c] is None:
            row[c] = _later_default(c, row)
    if row["pass"] not in PASSES:
        raise ResultsError(f"{path}:{lineno}: column 'pass' must be one of {list(PASSES)}, got {row['pass']!r}")
    return row


def upgrade_results_file(path: str | os.PathLike) -> Path:
    """Rewrite a ``runs.csv`` written by an older harness with the current header, filling the
    :data:`LATER_COLUMNS` with what the old rows meant (Hkv = H, Nk = N, pass = fwd). The new file
    is written beside the old one and renamed over it, so a crash leaves one or the other whole."""
    path = Path(path)
    if path.is_dir():
        path = path / RUNS_CSV
    rewrite_csv(path, COLUMNS, ({c: _format(r.get(c)) for c in COLUMNS} for r in load_rows(path)))
    return path


def rewrite_csv(path: str | os.PathLike, columns: tuple, rows: Iterable[dict]) -> None:
    """Replace the CSV at ``path`` with ``rows`` (values as they are to be written; a missing one
    empty) under the header ``columns``: what a results file written before some column existed is
    upgraded with. Written beside the old file, synced and renamed over it, so a crash leaves the
    old file or the new one whole, never half of either."""
    path = Path(path)
    tmp = path.with_name(path.name + ".upgrade")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in columns})
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Repair:
    """What :func:`repair_results_file` did: rows kept, unparseable lines moved and where to."""

    kept: int
    moved: int
    bad_path: Path | None = None
    backup_path: Path | None = None


def repair_results_file(path: str | os.PathLike) -> Repair:
    """Move the records of a ``runs.csv`` that do not parse (a row cut off by a crash, a hand edit)
    to ``runs.csv.bad`` (appended, with the line they were on), after copying the file to
    ``runs.csv.bak`` (``.bak.1``, ... when that exists). The good records stay, byte for byte; a
    file with nothing to move is left untouched. The header itself must be readable."""
    import shutil

    path = Path(path)
    if path.is_dir():
        path = path / RUNS_CSV
    if not path.exists():
        raise ResultsError(f"{path}: no such results file")
    with path.open(newline="") as f:
        lines = f.readlines()  # the lines csv.reader sees in load_rows, line ends untouched
    reader = csv.reader(lines)
    header = next(reader, [])
    if [c for c in COLUMNS if c not in header and c not in LATER_COLUMNS]:
        raise ResultsError(f"{path}: line 1 is not a results header; nothing to repair by rows "
                           "(restore the file from a backup or move it away)")
    good, bad = lines[:reader.line_num], []
    start = reader.line_num
    for record in reader:
        chunk, lineno = lines[start:reader.line_num], start + 1
        start = reader.line_num
        if not record:  # a blank line: nothing to keep
            continue
        raw = dict(zip(header, record + [None] * (len(header) - len(record))))
        if len(record) > len(header):
            raw[None] = record[len(header):]
        try:
            _parse(raw, path, lineno)
        except ResultsError as e:
            bad.append(f"# line {lineno}: {e}\n" + "".join(chunk).rstrip("\r\n") + "\n")
            continue
        good += chunk
    if good and not good[-1].endswith("\n"):
        good[-1] += "\r\n"  # a whole last row that only lost its line break keeps its place
    if not bad:
        return Repair(kept=len(good) - 1, moved=0)
    backup = path.with_name(path.name + ".bak")
    n = 0
    while backup.exists():
        n += 1
        backup = path.with_name(f"{path.name}.bak.{n}")
    shutil.copy2(path, backup)
    bad_path = path.with_name(path.name + ".bad")
    with bad_path.open("a", newline="") as f:
        f.writelines(bad)
    tmp = path.with_name(path.name + ".repair")
    tmp.write_text("".join(good), newline="")
    os.replace(tmp, path)  # a crash now leaves the old file or the new one, whole
    return Repair(kept=len(good) - 1, moved=len(bad), bad_path=bad_path, backup_path=backup)


def ensure_writable_dir(path: str | os.PathLike, what: str = "--out") -> Path:
    """Create the folder ``path`` (and its parents) and check that a file can be written in it, so a
    bad output folder fails at once with one line naming it (a :class:`ResultsError`), not after
    minutes of measuring with a traceback."""
    import tempfile

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise ResultsError(f"{what} {path}: a file of that name exists; give a folder") from None
    except NotADirectoryError:
        raise ResultsError(f"{what} {path}: part of the path is a file, not a folder") from None
    except OSError as e:
        raise ResultsError(f"{what} {path}: cannot create or write this folder ({e.strerror or e})") from None
    return path


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


_last_run_id = ""


def run_id_now() -> str:
    """A new run id: the UTC time to the microsecond, ``2026-01-31T12:00:00.123456Z``. Two runs
    started in the same second get different ids; within one process each id is later than the one
    before. Ids sort by time (older files' ids, without microseconds, still load: an id is text)."""
    global _last_run_id
    run_id = _last_run_id
    while run_id <= _last_run_id:  # the clock may not have moved on since the last call
        run_id = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    _last_run_id = run_id
    return run_id


def _six_digits(value):
    return f"{value:.6g}" if isinstance(value, float) else value


def append_rows(path: str | os.PathLike, columns: tuple, rows: list[dict], defaults: dict | None = None,
                fmt=_six_digits) -> Path:
    """Append ``rows`` to the CSV at ``path`` with these ``columns`` (the header when the file is new;
    each value as ``fmt`` writes it, by default floats to 6 significant digits; missing values empty):
    the small result files beside runs.csv. A file written before some of ``columns`` existed gets them
    first (:func:`ensure_columns`, each older row the value ``defaults`` says it meant); a file cut
    mid-row by a crash gets a line break before the new rows, so they stay whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        ensure_columns(path, columns, defaults)
    with path.open("a", newline="") as f:
        if not new:
            f.write(_fresh_line_prefix(path))
        w = csv.DictWriter(f, fieldnames=columns)
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({c: fmt(r.get(c)) for c in columns})
    return path


def ensure_columns(path: str | os.PathLike, columns: tuple, defaults: dict | None = None) -> None:
    """Make the existing CSV at ``path`` have the header ``columns`` before rows are appended to it.
    A file written before some of them existed is rewritten with them (:func:`rewrite_csv`), each of
    its rows taking the value ``defaults`` gives the column (what an older row meant). Any other
    header, one with columns this version does not write or lacking one with no default, raises
    :class:`ResultsError` naming the file: appending under it would put values in the wrong columns."""
    path = Path(path)
    defaults = defaults or {}
    with path.open(newline="") as f:
        header = tuple(next(csv.reader(f), []))
    if header == tuple(columns):
        return
    missing = [c for c in columns if c not in header]
    if set(header) - set(columns) or any(c not in defaults for c in missing):
        raise ResultsError(f"{path}: its columns {list(header)} are not this version's {list(columns)}; "
                           f"write to another --out directory or move the old file away")
    with path.open(newline="") as f:
        old = list(csv.DictReader(f))
    rewrite_csv(path, tuple(columns), ({**{c: defaults[c] for c in missing}, **row} for row in old))


def write_env(out_dir: str | os.PathLike, env: dict) -> Path:
    """Write (merge into) ``env.json``: provenance of the runs in this directory.

    Each harness invocation adds one entry under ``runs`` keyed by its run_id, so a file that
    accumulates several sweeps keeps the provenance of each.
    """
    path = Path(out_dir) / ENV_JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update({k: v for k, v in env.items() if k not in ("run_id", "switches")})
    run = {"command": env.get("command"), "date": env.get("date"), "git_commit": env.get("git_commit")}
    if env.get("switches"):  # the stages' environment switches this run had set (LAB_*)
        run["switches"] = env["switches"]
    data.setdefault("runs", {})[env["run_id"]] = run
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


#: Environment variables that change which kernels the stages run (``LAB_WS_PADDED_HEAD_DIMS``,
#: ``LAB_DECODE_MERGE``, ...): a run records the ones set, since its command line does not show them.
SWITCH_PREFIX = "LAB_"


def switches_set() -> dict[str, str]:
    """The stages' environment switches set in this process, by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SWITCH_PREFIX)}


def base_env(run_id: str) -> dict:
    """Provenance every run records; the GPU part is added by harness.device_info."""
    import torch
    import triton

    return {
        "run_id": run_id,
        "date": run_id,
        "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "git_commit": git_commit(),
        "switches": switches_set(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_runtime": torch.version.cuda,
        "host": platform.node(),
    }


@dataclass
class Cell:
    """One measurement cell of a sweep: the problem (``H``/``N`` are the query heads and rows,
    ``Hkv``/``Nk`` the key/value ones, defaulting to H and N), the pass to time (``pass_``: ``fwd``,
    ``bwd`` or ``fwd_bwd``; ``pass`` is a Python keyword) and, for a suite's cells, its ``name``."""

    B: int
    H: int
    N: int
    D: int
    dtype: str
    causal: bool
    Hkv: int | None = None
    Nk: int | None = None
    pass_: str = "fwd"
    name: str = ""

    def __post_init__(self) -> None:
        if self.Hkv is None:
            self.Hkv = self.H
        if self.Nk is None:
            self.Nk = self.N
        if self.pass_ not in PASSES:
            raise ValueError(f"pass must be one of {list(PASSES)}, got {self.pass_!r}")

    def row_fields(self) -> dict:
        return {"cell": self.name or None, "B": self.B, "H": self.H, "Hkv": self.Hkv, "N": self.N, "Nk": self.Nk,
                "D": self.D, "dtype": self.dtype, "causal": int(self.causal), "pass": self.pass_}


def iter_cells(Bs, Hs, Ns, Ds, dtypes, causals, Hkvs=None, Nks=None, passes=("fwd",)) -> Iterator[Cell]:
    """Every combination; ``Hkvs``/``Nks`` None means K/V heads and rows equal to the query's."""
    for dtype in dtypes:
        for D in Ds:
            for causal in causals:
                for N in Ns:
                    for B in Bs:
                        for H in Hs:
                            for Hkv in (Hkvs or [H]):
                                for Nk in (Nks or [N]):
                                    for pass_ in passes:
                                        yield Cell(B, H, N, D, dtype, causal, Hkv, Nk, pass_)
