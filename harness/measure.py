"""One impl on one cell -> one results row; and the loop over cells that ``compare``/``sweep`` share.

Order of one measurement, and why:

1. a warm call: compiles (and autotunes) the kernels; its output gives the numerical error, so
   compilation is never timed and the error costs no extra call;
2. peak memory over one more call (GPU);
3. time with do_bench (GPU) or perf_counter (interpreter); in ``run_cells`` every impl of a cell
   is timed in turns with the others (``TIMING_ROUNDS`` turns of ~100 ms on a GPU, forward and
   back), and its median is over all its turns' samples;
4. energy over a >= 2 s loop (optional, GPU with NVML);
5. DRAM bytes from Nsight Compute in a child process (optional, ``--ncu``).

Faults become statuses, never lost rows: ``torch.cuda.OutOfMemoryError`` -> ``oom`` (memory is
freed and the run goes on), a backend or stage that refuses the problem (``PeerUnsupported``,
``ValueError``/``NotImplementedError`` from the first call: the stages' documented way of saying
"not this shape/dtype") -> ``unsupported: <why>``, anything else -> ``error: <type>: <message>``.
Rows are written (and flushed) a cell at a time, so Ctrl-C keeps every cell already measured.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from stages.contract import Problem

from . import energy as energy_mod
from . import memory, reference, timing
from .impls import Impl
from .inputs import make_inputs
from .peers import PeerUnsupported
from .results import Cell, RowWriter, cell_key


#: Turns of timing per impl and cell on a GPU (``time_in_turns``).
TIMING_ROUNDS = 3


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


@dataclass
class Measurement:
    """One impl on one cell, while it is being measured: its row so far, and what is left to do."""

    impl: Impl
    problem: Problem
    row: dict
    notes: list[str]
    fn: Callable[[], object] | None = None  # set once the warm call passed: the call to time
    times_ms: list[float] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return "status" in self.row


def start_measurement(impl: Impl, cell: CellData, *, run_id: str, on_gpu: bool) -> Measurement:
    """Steps 1–2: the warm call (and its error against the reference), then peak memory."""
    p = cell.problem
    row = base_row(impl, p, run_id, on_gpu)
    row["torch_rel_err"] = cell.torch_rel_err
    m = Measurement(impl, p, row, [n for n in (row.pop("note", ""), cell.note) if n])

    def fn():
        return impl.attention(cell.q, cell.k, cell.v, causal=p.causal)

    def warm():
        try:
            out = fn()  # warm call: compile / autotune
            if on_gpu:
                torch.cuda.synchronize()
        except (PeerUnsupported, ValueError, NotImplementedError) as e:
            row["status"] = f"unsupported: {first_line(e)}" if isinstance(e, PeerUnsupported) else \
                f"unsupported: {type(e).__name__}: {first_line(e)}"
            return
        if cell.ref is not None:
            row["rel_err"] = reference.rel_err(out, cell.ref)
            if cell.torch_rel_err and row["rel_err"] > 2 * cell.torch_rel_err:
                m.notes.append(f"rel_err {row['rel_err'] / cell.torch_rel_err:.1f}x PyTorch's same-precision error")
        del out
        if on_gpu:
            row["peak_mem_measured"] = memory.measure_peak_extra_bytes(fn)
        m.fn = fn

    _guarded(m, warm)
    return m


def time_in_turns(measurements: list[Measurement], *, on_gpu: bool, rounds: int) -> None:
    """Step 3: time every measurement still going, in ``rounds`` turns: A B C, then C B A, A B C, ...
    Each turn adds one :func:`timing.samples` (on a GPU ~100 ms of repetitions) to the impl's pool.
    On a GPU held at its power cap a kernel's time moves by up to ~10 % within seconds (NOTES.md of stage
    C, item 26): taking turns spreads that drift over every impl of the cell, so their ratio does
    not depend on which one happened to run in a slow second."""
    for r in range(rounds):
        for m in (measurements if r % 2 == 0 else measurements[::-1]):
            if m.fn is not None and not m.failed:
                _guarded(m, lambda m=m: m.times_ms.extend(timing.samples(m.fn, on_gpu)))


def finish_measurement(m: Measurement, *, on_gpu: bool, energy: bool = False,
                       ncu: Callable[[Impl, Problem], dict] | None = None) -> dict:
    """Steps 3–5: the pooled time and what follows from it, energy, DRAM bytes; returns the row."""
    row, p = m.row, m.problem

    def rest():
        t = timing.summarize(m.times_ms, on_gpu)
        row.update(ms_median=t.ms_median, ms_p20=t.ms_p20, ms_p80=t.ms_p80)
        row["tflops"] = p.flops / (t.ms_median * 1e-3) / 1e12
        if row.get("dram_read_model") is not None:
            row["gbps_model"] = (row["dram_read_model"] + row["dram_write_model"]) / (t.ms_median * 1e-3) / 1e9
        if not on_gpu:
            m.notes.append("CPU time (Triton interpreter)" if m.impl.kind != "peer" else "CPU time (PyTorch CPU kernel)")
        if energy and on_gpu:
            e = energy_mod.measure_energy(m.fn, est_ms=t.ms_median)
            if e is None:
                m.notes.append(energy_mod.energy_unavailable_reason() or "energy not measured")
            else:
                row.update(energy_j_per_call=e.j_per_call, power_w=e.power_w, sm_clock_mhz=e.sm_clock_mhz,
                           mem_clock_mhz=e.mem_clock_mhz, temp_c=e.temp_c, throttle_reasons=e.throttle_reasons)
        if ncu is not None:
            measured = ncu(m.impl, p)
            extra_note = measured.pop("note", "")
            row.update(measured)
            if extra_note:
                m.notes.append(extra_note)
        row["status"] = "ok"

    if not m.failed:
        _guarded(m, rest)
    return _finish(row, m.notes)


def _guarded(m: Measurement, step: Callable[[], None]) -> None:
    """Run one step of a measurement; a fault becomes the row's status (never a lost row)."""
    try:
        step()
    except torch.cuda.OutOfMemoryError:
        m.row["status"] = "oom"
        _free_memory()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        m.row["status"] = f"error: {type(e).__name__}: {first_line(e)}"
        _free_memory()


def measure_impl(impl: Impl, cell: CellData, *, run_id: str, on_gpu: bool, energy: bool = False,
                 ncu: Callable[[Impl, Problem], dict] | None = None) -> dict:
    """Measure ``impl`` on ``cell`` alone (one turn of timing); always returns a row (status says
    what happened)."""
    m = start_measurement(impl, cell, run_id=run_id, on_gpu=on_gpu)
    time_in_turns([m], on_gpu=on_gpu, rounds=1)
    return finish_measurement(m, on_gpu=on_gpu, energy=energy, ncu=ncu)


def _finish(row: dict, notes: list[str]) -> dict:
    if notes:
        row["note"] = "; ".join(notes)
    return row


def run_cells(cells: Iterable[Cell], impls: list[Impl], writer: RowWriter, *, run_id: str,
              device: torch.device, energy: bool = False, ncu: Callable | None = None,
              skip: set | None = None, on_row: Callable[[dict], None] | None = None,
              on_skip: Callable[[int], None] | None = None, seed: int = 0,
              timing_rounds: int | None = None) -> list[dict]:
    """Measure every impl on every cell, writing each cell's rows as soon as they exist; returns the
    rows. The impls of a cell are timed in turns (:func:`time_in_turns`): ``timing_rounds`` turns
    each, by default ``TIMING_ROUNDS`` on a GPU and one on a CPU.

    ``skip``: cell keys (:func:`harness.results.cell_key`) already measured (``--resume``).
    ``on_row`` is called after each written row, ``on_skip(n)`` for n skipped measurements
    (progress bars).
    """
    on_gpu = device.type == "cuda"
    rounds = timing_rounds or (TIMING_ROUNDS if on_gpu else 1)
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
        stage_names = {i.name for i in todo if i.kind == "stage"}
        # The all-on ablation variant *is* the stage: it reuses the stage row instead of repeating it.
        reused = [i for i in todo if i.kind == "ablation" and i.variant == "all" and i.name in stage_names]
        measured = [start_measurement(i, data, run_id=run_id, on_gpu=on_gpu) for i in todo if i not in reused]
        time_in_turns(measured, on_gpu=on_gpu, rounds=rounds)
        done = {id(m.impl): finish_measurement(m, on_gpu=on_gpu, energy=energy, ncu=ncu) for m in measured}
        stage_rows = {m.impl.name: done[id(m.impl)] for m in measured if m.impl.kind == "stage"}
        for impl in todo:
            if impl in reused:
                row = dict(stage_rows[impl.name], kind="ablation", variant="all")
                row["note"] = "; ".join(n for n in (row.get("note"), "same measurement as the stage row") if n)
            else:
                row = done[id(impl)]
            writer.write(row)
            rows.append(row)
            if on_row:
                on_row(row)
        del data
        _free_memory()
    return rows
