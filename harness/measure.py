"""One impl on one cell -> one results row; and the loop over cells that ``compare``/``sweep`` share.

Order of one measurement, and why:

1. a warm call: compiles (and autotunes) the kernels; its output gives the numerical error, so
   compilation is never timed and the error costs no extra call;
2. peak memory over one more call (GPU);
3. time with do_bench (GPU) or perf_counter (interpreter);
4. energy over a >= 2 s loop (optional, GPU with NVML);
5. DRAM bytes from Nsight Compute in a child process (optional, ``--ncu``).

Faults become statuses, never lost rows: ``torch.cuda.OutOfMemoryError`` -> ``oom`` (memory is
freed and the run goes on), a backend or stage that refuses the problem (``PeerUnsupported``,
``ValueError``/``NotImplementedError`` from the first call: the stages' documented way of saying
"not this shape/dtype") -> ``unsupported: <why>``, anything else -> ``error: <type>: <message>``.
Rows are written (and flushed) one at a time, so Ctrl-C keeps everything already measured.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from stages.contract import Problem

from . import energy as energy_mod
from . import memory, reference, timing
from .impls import Impl
from .inputs import make_inputs
from .peers import PeerUnsupported
from .results import Cell, RowWriter, cell_key


@dataclass
class CellData:
    """Inputs, reference and PyTorch's same-precision error for one cell, shared by all its impls."""

    problem: Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor | None
    torch_rel_err: float | None
    note: str = ""


def problem_of(cell: Cell) -> Problem:
    return Problem(cell.B, cell.H, cell.N, cell.D, cell.dtype, bool(cell.causal))


def prepare_cell(problem: Problem, device: torch.device, seed: int = 0) -> CellData:
    q, k, v = make_inputs(problem, device, seed)
    note = ""
    try:
        ref = reference.reference_attention(q, k, v, causal=problem.causal)
        torch_err = reference.rel_err(reference.torch_same_precision(q, k, v, causal=problem.causal), ref)
    except torch.cuda.OutOfMemoryError:
        ref, torch_err, note = None, None, "reference: out of memory, error not measured"
        _free_memory()
    return CellData(problem, q, k, v, ref, torch_err, note)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]


def base_row(impl: Impl, problem: Problem, run_id: str, on_gpu: bool) -> dict:
    row = {"run_id": run_id, "impl": impl.name, "kind": impl.kind, "variant": impl.variant,
           "B": problem.B, "H": problem.H, "N": problem.N, "D": problem.D, "dtype": problem.dtype,
           "causal": int(problem.causal), "device": "gpu" if on_gpu else "interpreter"}
    if impl.hbm_bytes is not None:
        try:
            traffic = impl.hbm_bytes(problem)
            row["dram_read_model"], row["dram_write_model"] = int(traffic.read), int(traffic.write)
        except Exception as e:  # a model that cannot handle the problem leaves the column empty
            row["note"] = f"traffic model failed: {type(e).__name__}: {first_line(e)}"
    if impl.workspace_bytes is not None:
        try:
            row["peak_mem_model"] = memory.peak_mem_model(impl.workspace_bytes(problem), problem)
        except Exception:
            pass
    return row


def measure_impl(impl: Impl, cell: CellData, *, run_id: str, on_gpu: bool, energy: bool = False,
                 ncu: Callable[[Impl, Problem], dict] | None = None) -> dict:
    """Measure ``impl`` on ``cell``; always returns a row (status says what happened)."""
    p = cell.problem
    row = base_row(impl, p, run_id, on_gpu)
    row["torch_rel_err"] = cell.torch_rel_err
    notes = [n for n in (row.pop("note", ""), cell.note) if n]

    def fn():
        return impl.attention(cell.q, cell.k, cell.v, causal=p.causal)

    try:
        try:
            out = fn()  # warm call: compile / autotune
            if on_gpu:
                torch.cuda.synchronize()
        except (PeerUnsupported, ValueError, NotImplementedError) as e:
            row["status"] = f"unsupported: {first_line(e)}" if isinstance(e, PeerUnsupported) else \
                f"unsupported: {type(e).__name__}: {first_line(e)}"
            return _finish(row, notes)
        if cell.ref is not None:
            row["rel_err"] = reference.rel_err(out, cell.ref)
            if cell.torch_rel_err and row["rel_err"] > 2 * cell.torch_rel_err:
                notes.append(f"rel_err {row['rel_err'] / cell.torch_rel_err:.1f}x PyTorch's same-precision error")
        del out
        if on_gpu:
            row["peak_mem_measured"] = memory.measure_peak_extra_bytes(fn)
        t = timing.bench(fn, on_gpu)
        row.update(ms_median=t.ms_median, ms_p20=t.ms_p20, ms_p80=t.ms_p80)
        row["tflops"] = p.flops / (t.ms_median * 1e-3) / 1e12
        if row.get("dram_read_model") is not None:
            row["gbps_model"] = (row["dram_read_model"] + row["dram_write_model"]) / (t.ms_median * 1e-3) / 1e9
        if not on_gpu:
            notes.append("CPU time (Triton interpreter)" if impl.kind != "peer" else "CPU time (PyTorch CPU kernel)")
        if energy and on_gpu:
            e = energy_mod.measure_energy(fn, est_ms=t.ms_median)
            if e is None:
                notes.append(energy_mod.energy_unavailable_reason() or "energy not measured")
            else:
                row.update(energy_j_per_call=e.j_per_call, power_w=e.power_w, sm_clock_mhz=e.sm_clock_mhz,
                           mem_clock_mhz=e.mem_clock_mhz, temp_c=e.temp_c, throttle_reasons=e.throttle_reasons)
        if ncu is not None:
            measured = ncu(impl, p)
            extra_note = measured.pop("note", "")
            row.update(measured)
            if extra_note:
                notes.append(extra_note)
        row["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        row["status"] = "oom"
        _free_memory()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        row["status"] = f"error: {type(e).__name__}: {first_line(e)}"
        _free_memory()
    return _finish(row, notes)


def _finish(row: dict, notes: list[str]) -> dict:
    if notes:
        row["note"] = "; ".join(notes)
    return row


def run_cells(cells: Iterable[Cell], impls: list[Impl], writer: RowWriter, *, run_id: str,
              device: torch.device, energy: bool = False, ncu: Callable | None = None,
              skip: set | None = None, on_row: Callable[[dict], None] | None = None,
              on_skip: Callable[[int], None] | None = None, seed: int = 0) -> list[dict]:
    """Measure every impl on every cell, writing each row as soon as it exists; returns the rows.

    ``skip``: cell keys (:func:`harness.results.cell_key`) already measured (``--resume``).
    ``on_row`` is called after each written row, ``on_skip(n)`` for n skipped measurements
    (progress bars).
    """
    on_gpu = device.type == "cuda"
    skip = skip or set()
    rows: list[dict] = []
    for cell in cells:
        problem = problem_of(cell)
        todo = [i for i in impls if cell_key({"impl": i.name, "variant": i.variant, **cell.row_fields()}) not in skip]
        if on_skip and len(todo) < len(impls):
            on_skip(len(impls) - len(todo))
        if not todo:
            continue
        data = prepare_cell(problem, device, seed)
        stage_rows: dict[str, dict] = {}
        for impl in todo:
            if impl.kind == "ablation" and impl.variant == "all" and impl.name in stage_rows:
                # the all-on variant *is* the stage: reuse that measurement instead of repeating it
                row = dict(stage_rows[impl.name], kind="ablation", variant="all")
                row["note"] = "; ".join(n for n in (row.get("note"), "same measurement as the stage row") if n)
            else:
                row = measure_impl(impl, data, run_id=run_id, on_gpu=on_gpu, energy=energy, ncu=ncu)
            if impl.kind == "stage":
                stage_rows[impl.name] = row
            writer.write(row)
            rows.append(row)
            if on_row:
                on_row(row)
        del data
        _free_memory()
    return rows
