"""One impl on one cell -> one results row; and the loop over cells that ``compare``/``sweep`` share.

Order of one measurement, and why:

1. a warm call: compiles (and autotunes) the kernels; its output gives the numerical error, so
   compilation is never timed and the error costs no extra call;
2. peak memory over one more call (GPU);
3. time with CUDA events (GPU, ``timing.samples_gpu``) or perf_counter (interpreter); in ``run_cells`` every impl of a cell
   is timed in turns with the others (``TIMING_ROUNDS`` turns of ~100 ms on a GPU, forward and
   back), and its median is over all its turns' samples;
4. energy over a >= 2 s loop (optional, GPU with NVML);
5. DRAM bytes from Nsight Compute in a child process (optional, ``--ncu``).

Beside the eager time (``ms_median``: what a user's program sees, host path included), each turn on
a GPU also times the same call replayed from a CUDA graph (``ms_gpu``: the GPU's work alone).

Passes (the ``pass`` column): ``fwd`` times the forward call. ``bwd`` times the backward alone: a
forward with inputs that require gradients is run once per turn, untimed, and the timed call is
``torch.autograd.grad(o, (q, k, v), dO, retain_graph=True)``. ``fwd_bwd`` times a whole training
step, forward then backward. Their error columns are the largest relative error of dq, dk, dv
against float64 autograd; an impl whose output has no ``grad_fn`` (no backward) is
``unsupported``.

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
from .inputs import make_grad_output, make_inputs
from .peers import PeerUnsupported
from .results import Cell, RowWriter, cell_key


#: Turns of timing per impl and cell on a GPU (``time_in_turns``).
TIMING_ROUNDS = 3


@dataclass
class CellData:
    """Inputs, reference and PyTorch's same-precision error for one cell, shared by all its impls.

    For the backward passes ``do`` is the output gradient and ``ref`` the float64 gradients
    (dq, dk, dv); ``torch_rel_err`` is then the largest of the three same-precision errors."""

    problem: Problem
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    ref: torch.Tensor | tuple[torch.Tensor, ...] | None
    torch_rel_err: float | None
    note: str = ""
    pass_: str = "fwd"
    do: torch.Tensor | None = None
    name: str = ""  # the suite cell's name ("" for grid cells)


def problem_of(cell: Cell) -> Problem:
    return Problem(cell.B, cell.H, cell.N, cell.D, cell.dtype, bool(cell.causal), cell.Hkv, cell.Nk)


def max_rel_err(outputs, refs) -> float:
    """The largest relative error of several tensors (the gradients dq, dk, dv) against theirs."""
    return max(reference.rel_err(o, r) for o, r in zip(outputs, refs, strict=True))


def _per_kv_head(gradients, q, k, v, do, causal: bool) -> tuple[torch.Tensor, ...]:
    """``gradients(q, k, v, do, causal=)`` one (batch, K/V head) slice at a time, put back together.

    The gradient references run autograd of the textbook formula, which holds several Nq×Nk
    matrices per query head (float64 for the reference); for a whole GPU-sized cell at once that
    would not fit in memory, one K/V head and its query group at a time does. A slice is a whole
    GQA group, so the dk, dv sums over the group stay inside it."""
    B, H, Hkv = q.shape[0], q.shape[1], k.shape[1]
    group = H // Hkv
    parts = [[gradients(q[b:b + 1, h * group:(h + 1) * group], k[b:b + 1, h:h + 1], v[b:b + 1, h:h + 1],
                        do[b:b + 1, h * group:(h + 1) * group], causal=causal)
              for h in range(Hkv)] for b in range(B)]
    return tuple(torch.cat([torch.cat([p[i] for p in row], dim=1) for row in parts], dim=0) for i in range(3))


def prepare_cell(problem: Problem, device: torch.device, seed: int = 0, pass_: str = "fwd",
                 name: str = "") -> CellData:
    q, k, v = make_inputs(problem, device, seed)
    do = make_grad_output(problem, device, seed) if pass_ != "fwd" else None
    note = ""
    try:
        if do is None:
            ref = reference.reference_attention(q, k, v, causal=problem.causal)
            torch_err = reference.rel_err(reference.torch_same_precision(q, k, v, causal=problem.causal), ref)
        else:
            ref = _per_kv_head(reference.reference_gradients, q, k, v, do, problem.causal)
            torch_err = max_rel_err(
                _per_kv_head(reference.torch_same_precision_gradients, q, k, v, do, problem.causal), ref)
    except torch.cuda.OutOfMemoryError:
        ref, torch_err, note = None, None, "reference: out of memory, error not measured"
        _free_memory()
    return CellData(problem, q, k, v, ref, torch_err, note, pass_, do, name)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]


def base_row(impl: Impl, problem: Problem, run_id: str, on_gpu: bool, pass_: str = "fwd",
             name: str = "") -> dict:
    """The row's identity and its models (traffic, peak memory) for ``pass_``, before measuring."""
    row = {"run_id": run_id, "impl": impl.name, "kind": impl.kind, "variant": impl.variant, "cell": name or None,
           "B": problem.B, "H": problem.H, "Hkv": problem.Hkv, "N": problem.N, "Nk": problem.Nk, "D": problem.D,
           "dtype": problem.dtype, "causal": int(problem.causal), "pass": pass_,
           "device": "gpu" if on_gpu else "interpreter"}
    # the traffic of a pass: the forward's model, the backward's, or both for a training step; a
    # pass whose model is missing leaves the columns empty
    models = {"fwd": [impl.hbm_bytes], "bwd": [impl.bwd_hbm_bytes],
              "fwd_bwd": [impl.hbm_bytes, impl.bwd_hbm_bytes]}[pass_]
    if all(m is not None for m in models):
        try:
            traffic = [m(problem) for m in models]
            row["dram_read_model"] = sum(int(t.read) for t in traffic)
            row["dram_write_model"] = sum(int(t.write) for t in traffic)
        except Exception as e:  # a model that cannot handle the problem leaves the column empty
            row["note"] = f"traffic model failed: {type(e).__name__}: {first_line(e)}"
    try:
        if pass_ == "fwd" and impl.workspace_bytes is not None:
            row["peak_mem_model"] = memory.peak_mem_model(impl.workspace_bytes(problem), problem)
        elif pass_ != "fwd" and impl.train_workspace_bytes is not None:
            row["peak_mem_model"] = memory.train_peak_mem_model(impl.train_workspace_bytes(problem), problem)
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
    #: set once the warm call passed: ``make_call()`` returns the call to time (for ``bwd`` it first
    #: runs the untimed forward the timed backward needs)
    make_call: Callable[[], Callable[[], object]] | None = None
    times_ms: list[float] = field(default_factory=list)       # eager calls
    gpu_times_ms: list[float] = field(default_factory=list)   # CUDA-graph replays
    graph_failed: bool = False                                 # capture failed once: not tried again

    @property
    def failed(self) -> bool:
        return "status" in self.row


class NoBackward(Exception):
    """The impl's output is not differentiable (no ``grad_fn``): it has no backward pass."""


def _pass_calls(impl: Impl, cell: CellData):
    """``(run, make_call)`` for the cell's pass: ``run()`` does the whole pass once and returns what
    the error is taken from (o, or the gradients dq, dk, dv); ``make_call()`` returns the call to time."""
    p = cell.problem

    def forward():
        return impl.attention(cell.q, cell.k, cell.v, causal=p.causal)

    if cell.pass_ == "fwd":
        return forward, lambda: forward

    def saved_forward():
        """A forward whose inputs require gradients: o and the leaves to differentiate by."""
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_(True) for t in (cell.q, cell.k, cell.v))
            o = impl.attention(*leaves, causal=p.causal)
        if o.grad_fn is None:
            raise NoBackward(f"{impl.label} has no backward (its output has no grad_fn)")
        return o, leaves

    def training_step():
        o, leaves = saved_forward()
        return torch.autograd.grad(o, leaves, cell.do)

    if cell.pass_ == "fwd_bwd":
        return training_step, lambda: training_step

    def make_backward_call():
        o, leaves = saved_forward()
        return lambda: torch.autograd.grad(o, leaves, cell.do, retain_graph=True)

    return training_step, make_backward_call


def start_measurement(impl: Impl, cell: CellData, *, run_id: str, on_gpu: bool) -> Measurement:
    """Steps 1–2: the warm call (and its error against the reference), then peak memory. For the
    backward passes the warm call is a training step (it compiles the forward and backward kernels),
    and peak memory is that of a training step."""
    p = cell.problem
    row = base_row(impl, p, run_id, on_gpu, cell.pass_, cell.name)
    row["torch_rel_err"] = cell.torch_rel_err
    m = Measurement(impl, p, row, [n for n in (row.pop("note", ""), cell.note) if n])
    run, make_call = _pass_calls(impl, cell)

    def warm():
        try:
            out = run()  # warm call: compile / autotune
            if on_gpu:
                torch.cuda.synchronize()
        except (PeerUnsupported, ValueError, NotImplementedError, NoBackward) as e:
            row["status"] = f"unsupported: {first_line(e)}" if isinstance(e, (PeerUnsupported, NoBackward)) else \
                f"unsupported: {type(e).__name__}: {first_line(e)}"
            return
        if cell.ref is not None:
            row["rel_err"] = reference.rel_err(out, cell.ref) if cell.pass_ == "fwd" else max_rel_err(out, cell.ref)
            if cell.torch_rel_err and row["rel_err"] > 2 * cell.torch_rel_err:
                m.notes.append(f"rel_err {row['rel_err'] / cell.torch_rel_err:.1f}x PyTorch's same-precision error")
        del out
        if on_gpu:
            row["peak_mem_measured"] = memory.measure_peak_extra_bytes(run)
        m.make_call = make_call

    _guarded(m, warm)
    return m


def time_in_turns(measurements: list[Measurement], *, on_gpu: bool, rounds: int) -> None:
    """Step 3: time every measurement still going, in ``rounds`` turns: A B C, then C B A, A B C, ...
    Each turn adds one :func:`timing.samples` (on a GPU ~100 ms of repetitions) to the impl's pool,
    and on a GPU one :func:`timing.samples_graph` of the same call replayed from a CUDA graph.
    On a GPU held at its power cap a kernel's time moves by up to ~10 % within seconds, as the SM
    clock follows the power draw (docs/performance-log/power-cap.md, entry 26): taking turns spreads that drift over every impl of the cell, so their ratio does
    not depend on which one happened to run in a slow second. The call (and the graph) is made
    afresh each turn and dropped after it, so no impl holds memory (a saved forward, a graph's
    pool) while the others are timed."""
    for r in range(rounds):
        for m in (measurements if r % 2 == 0 else measurements[::-1]):
            if m.make_call is not None and not m.failed:
                _guarded(m, lambda m=m: m.times_ms.extend(timing.samples(m.make_call(), on_gpu)))
                if on_gpu and not m.failed and not m.graph_failed:
                    _time_graph(m)


def _time_graph(m: Measurement) -> None:
    """One turn of CUDA-graph replays; a call that cannot be captured leaves ``ms_gpu`` empty and
    says why in the note (the eager time is still valid)."""
    try:
        m.gpu_times_ms.extend(timing.samples_graph(m.make_call))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        m.graph_failed = True
        m.gpu_times_ms.clear()
        m.notes.append(f"ms_gpu not measured: CUDA graph capture failed: {type(e).__name__}: {first_line(e)}")
        _free_memory()


def finish_measurement(m: Measurement, *, on_gpu: bool, energy: bool = False,
                       ncu: Callable[[Impl, Problem], dict] | None = None) -> dict:
    """Steps 3–5: the pooled time and what follows from it, energy, DRAM bytes; returns the row."""
    row, p = m.row, m.problem

    def rest():
        t = timing.summarize(m.times_ms, on_gpu)
        row.update(ms_median=t.ms_median, ms_p20=t.ms_p20, ms_p80=t.ms_p80)
        if m.gpu_times_ms and not m.graph_failed:
            row["ms_gpu"] = timing.summarize(m.gpu_times_ms, on_gpu).ms_median
        row["tflops"] = p.pass_flops(row["pass"]) / (t.ms_median * 1e-3) / 1e12
        if row.get("dram_read_model") is not None:
            row["gbps_model"] = (row["dram_read_model"] + row["dram_write_model"]) / (t.ms_median * 1e-3) / 1e9
        if not on_gpu:
            m.notes.append("CPU time (Triton interpreter)" if m.impl.kind != "peer" else "CPU time (PyTorch CPU kernel)")
        if energy and on_gpu:
            e = energy_mod.measure_energy(m.make_call(), est_ms=t.ms_median)
            if e is None:
                m.notes.append(energy_mod.energy_unavailable_reason() or "energy not measured")
            else:
                row.update(energy_j_per_call=e.j_per_call, power_w=e.power_w, sm_clock_mhz=e.sm_clock_mhz,
                           mem_clock_mhz=e.mem_clock_mhz, temp_c=e.temp_c, throttle_reasons=e.throttle_reasons)
        if ncu is not None and (row["pass"] != "fwd" or p.Hkv != p.H or p.Nk != p.N):
            # the ncu child process profiles a forward of a multi-head self-attention cell only
            m.notes.append("ncu: not measured (the profiler child runs forward cells with Hkv = H, Nk = N only)")
        elif ncu is not None:
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
    if on_gpu:  # every GPU row has a CUDA-graph time: an older file that cannot hold it fails now
        writer.require(["ms_gpu"])
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
        data = prepare_cell(problem, device, seed, cell.pass_, cell.name)
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
