"""Every number the lessons state is what the committed results say (CPU, no GPU, about a second).

Each :class:`harness.claims.Claim` below quotes a sentence of a stage README, a notebook or a docs
page, with ``{}`` where its numbers stand, and computes those numbers from ``results/h200/``. Reword
a sentence and its claim must follow; re-measure the results and a sentence that no longer holds
fails here, naming the file, the words and the new value. Numbers a notebook prints are computed
when it runs and need no claim; only the prose's are listed.

Beside the claims: the lessons cite public sources, never a tracker a reader cannot open, and every
link into ``docs/glossary.md`` lands on one of its headings.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness.claims import Claim, Data, agrees, check, fold, prose_of
from stages.contract import Problem

ROOT = Path(__file__).resolve().parents[1]
A_README, B_README, C_README = ("stages/a_naive/README.md", "stages/b_tiled/README.md",
                                "stages/c_optimized/README.md")
C_DETAILS = "docs/stage-c-details.md"
PERF_MODELS = "docs/performance-log/model-shapes.md"
TWINS = "stages/CUDA_TWINS.md"
GLOSSARY = "docs/glossary.md"
NB = {p.name.split("_")[0]: f"notebooks/{p.name}" for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb"))}

#: the headline cell of the README and the waterfall (views.HEADLINE_N, D = 64, non-causal, fp16)
HEAD = dict(N=4096, D=64, causal=False)
CELLS = {"D64": dict(N=4096, D=64, causal=False), "D64c": dict(N=4096, D=64, causal=True),
         "D128": dict(N=4096, D=128, causal=False), "D128c": dict(N=4096, D=128, causal=True)}


# ------------------------------------------------------------------------------ what the claims compute

def model_ratio(num: str, den: str, problem: Problem) -> float:
    """One stage's traffic model over another's for ``problem`` (the models need no results)."""
    from stages import STAGES

    return STAGES[num].hbm_bytes(problem).total / STAGES[den].hbm_bytes(problem).total


def atomic_over_separate(problem: Problem) -> float:
    from stages import STAGES

    bwd = STAGES["b"].bwd_hbm_bytes
    return bwd(problem, dq_method="atomic").total / bwd(problem, dq_method="separate").total


def train_steps(d: Data, model: str) -> list[dict]:
    """Each impl's latest training-step row of one model in generate/runs.csv: what the tables of the
    results page and notebook 08 show (``generate.generate_tables``)."""
    from harness.generate import latest_rows

    return [r for r in latest_rows(d.generate_rows)
            if r["model"] == model and r["pass"] == "train" and r["status"] == "ok"]


def train_order(d: Data, model: str) -> list[str]:
    return [r["impl"] for r in sorted(train_steps(d, model), key=lambda r: float(r["ms_median"]))]


def bwd_pairs(d: Data, impl: str, peer: str, head_dims=None) -> list[tuple[float, float]]:
    from harness import views

    rows = [r for r in views.grid_rows(d.all_rows, "bwd") if views.is_ok(r) and r["dtype"] == "fp16"
            and not r.get("variant") and r.get("tflops") and (head_dims is None or int(r["D"]) in head_dims)]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["D"], r["causal"], r["N"]), {})[r["impl"]] = r["tflops"]
    pairs = [(c[impl], c[peer]) for c in cells.values() if impl in c and peer in c]
    assert pairs, f"no backward cells with both {impl} and {peer}"
    return pairs


def profiled(d: Data) -> dict[str, dict]:
    """The five-metric profiler rows the notebooks display ({impl: row}), at the cell they display."""
    from harness import profiler_table

    rows, cell, _text = profiler_table.table_for_reading(d.dir / "profile", out="profile")
    assert cell == dict(N=4096, D=64, dtype="fp16", causal=0), cell
    return {r["impl"]: r for r in rows}


def energy_cell(d: Data) -> dict[str, dict]:
    """{impl: the latest row that measured energy} at the energy figure's cell (N = 4096, D = 64, fp16)."""
    from harness import views
    from harness.results import load_rows

    rows = views.latest_energy_rows(views.forward_grid(load_rows(d.dir))).values()
    at = [r for r in rows if r["kind"] in ("stage", "peer") and r["dtype"] == "fp16"]
    return {r["impl"]: r for r in views.cell_rows(at, N=4096, D=64, dtype="fp16", causal=False)}


def power_span(d: Data, exclude: str) -> tuple[float, float]:
    watts = [r["power_w"] for impl, r in energy_cell(d).items() if impl != exclude]
    return min(watts), max(watts)


def a_workspace(n: int) -> int:
    from stages import STAGES

    return STAGES["a"].workspace_bytes(Problem(1, 32, n, 64))


def last_n_below_host(d: Data) -> int:
    """The largest N (one sequence, 32 heads of 64) whose stage A model bytes cross DRAM at the copy
    bandwidth faster than one stage A call's host path (the latest latency run)."""
    from stages import STAGES

    host_us = list(d.latency_runs.values())[-1]["a"]
    ns = (128, 256, 512, 1024, 2048, 4096, 16384)
    below = [n for n in ns if STAGES["a"].hbm_bytes(Problem(1, 32, n, 64)).total / (d.copy_gbps * 1e3) < host_us]
    assert below == list(ns[:len(below)]), "not one crossover"
    return below[-1]


def b_over_minimum(problem: Problem) -> float:
    from stages import STAGES

    return STAGES["b"].hbm_bytes(problem).total / problem.qkvo_bytes


def per_head_n2(d: Data, nbytes: float, **cell) -> float:
    """Bytes per (batch, head) in units of N²·e (fp16: e = 2)."""
    r = d.row("a", **cell)
    return nbytes / (r["B"] * r["H"]) / (r["N"] ** 2 * 2)


def a_measured_over_model(d: Data) -> list[float]:
    return [d.measured_bytes("a", N=n, D=64) / d.model_bytes("a", N=n, D=64)
            for n in d.ns("a", D=64) if d.row("a", N=n, D=64)["dram_read_measured"] is not None]


def twin_ratios(d: Data, impl: str, slow: str, fast: str) -> list[float]:
    """Time of the ``slow`` variant over the ``fast`` one at the four N = 4096 cells."""
    return [d.row(impl, variant=slow, **c)["ms_median"] / d.row(impl, variant=fast, **c)["ms_median"]
            for c in CELLS.values()]


def bank_conflicts(d: Data, *, predicted_zero: bool, keyed: bool = False) -> list[tuple]:
    """(measured, predicted) bank conflicts of the twins' profiled ablation rows whose prediction is
    (or is not) zero, as the stage C README's generated table pairs them; ``keyed`` adds the row's
    (impl, N, D) in front."""
    import stages
    from harness.ncu import predicted_bank_conflicts

    out = []
    for r in d.rows:
        if r["impl"] in ("b_cuda", "c_cuda") and r["kind"] == "ablation" and r["smem_bank_conflicts"] is not None:
            stage = stages.get_stage(r["impl"])
            kwargs = {} if r["variant"] == "all" else dict(stage.variants.get(r["variant"], {}))
            pred = predicted_bank_conflicts(r["impl"], Problem(r["B"], r["H"], r["N"], r["D"], r["dtype"],
                                                               bool(r["causal"])), kwargs)
            total = pred["ld"] + pred["st"]
            if (total == 0) == predicted_zero:
                key = (r["impl"], r["N"], r["D"])
                out.append((key, r["smem_bank_conflicts"], total) if keyed else (r["smem_bank_conflicts"], total))
    assert out, "no profiled twin rows"
    return out


def residues(d: Data) -> list[tuple[int, int]]:
    """(measured conflicts of a layout the model calls conflict-free, the unpadded layout's at the same
    impl, N and D) for every such pair profiled."""
    unpadded = {key: m for key, m, _ in bank_conflicts(d, predicted_zero=False, keyed=True)}
    pairs = [(m, unpadded[key]) for key, m, _ in bank_conflicts(d, predicted_zero=True, keyed=True) if key in unpadded]
    assert pairs, "no zero-predicted layout profiled beside its unpadded one"
    return pairs


def host_path_us(d: Data, label: str) -> float:
    """One line of experiments/host_path.py's committed output: µs of host time per call."""
    text = (d.dir / "experiments" / "2026-12-01_host_path.txt").read_text()
    return float(re.search(re.escape(label) + r"\s+([0-9.]+)", text).group(1))


def tuning_ms(d: Data, file: str, D: int, causal: int, kind: str) -> float:
    """One whole-backward (or kernel) time of a committed backward tuning CSV: the row of ``kind``."""
    import csv

    with (d.dir / "experiments" / file).open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["D"]) == D and int(r["causal"]) == causal and r["kind"] == kind]
    assert len(rows) == 1, (file, D, causal, kind, rows)
    return float(rows[0]["ms"])


def fused_dq_ms(d: Data, causal: int, compact: bool) -> float:
    """The fused D 128 dK/dV kernel alone (``ws-M64-c2-s2``), compact row statistics off or on:
    ``2026-12-05_fused_dq_compact.csv`` (performance-log entry 70)."""
    import csv

    config = "ws-M64-c2-s2+fused" + ("+compact" if compact else "")
    with (d.dir / "experiments" / "2026-12-05_fused_dq_compact.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["causal"]) == causal and r["config"] == config]
    assert len(rows) == 1, (causal, config, rows)
    return float(rows[0]["ms"])


def program_order_ms(d: Data, cell: str, chunk: str) -> float:
    """Stage C's whole causal backward at one cell of ``experiments/program_order.py``'s committed run,
    its programs in one launch order (``chunk``: 0 head by head, k chunks of k tiles; entry 76)."""
    import csv

    with (d.dir / "experiments" / "2026-12-05_program_order.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r["cell"] == cell and r["chunk"] == chunk and r["status"] == "ok"]
    assert len(rows) == 1, (cell, chunk, rows)
    return float(rows[0]["ms"])


def decode_backward_ms(cell: str, candidate: str) -> float:
    """The median of one candidate's rounds at one cell of ``experiments/decode_backward.py``'s committed
    H100 run (entry 77): ``split``, ``ordinary``, ``cudnn`` or ``flash``."""
    import csv
    import statistics

    path = ROOT / "results" / "h100-80gb-hbm3" / "experiments" / "2026-12-05_decode_backward.csv"
    with path.open() as f:
        ms = [float(r["ms"]) for r in csv.DictReader(f)
              if r["cell"] == cell and r["candidate"] == candidate and r["status"] == "ok"]
    assert ms, (cell, candidate)
    return statistics.median(ms)


def h100_experiment_rows(file: str) -> list[dict]:
    """Every row of a committed H100 experiment file (``results/h100-80gb-hbm3/experiments/``)."""
    import csv

    with (ROOT / "results" / "h100-80gb-hbm3" / "experiments" / file).open() as f:
        return list(csv.DictReader(f))


def h100_experiment_us(file: str, cell: str, candidate: str, block_n: str = "", num_stages: str = "",
                       first: bool = False) -> float:
    """The median (or, ``first``, the first) ``ms_gpu`` as µs of one candidate at one cell of a committed
    H100 experiment CSV (``decode_tiles.py``, ``suite_configs.py``: entries 78-80)."""
    import statistics

    ms = [float(r["ms_gpu"]) for r in h100_experiment_rows(file)
          if r["cell"] == cell and r["candidate"] == candidate and r["status"] == "ok"
          and (not block_n or r["block_n"] == block_n) and (not num_stages or r["num_stages"] == num_stages)]
    assert ms, (file, cell, candidate)
    return 1000 * (ms[0] if first else statistics.median(ms))


def decode_h100_us(name: str, cell: str, candidate: str, block_n: str = "", num_stages: str = "") -> float:
    """:func:`h100_experiment_us` of a 2026-12-06 ``decode_tiles.py`` run: ``name`` ``merges``,
    ``one_chunk`` (its first timing) or ``plans``."""
    return h100_experiment_us(f"2026-12-06_decode_{name}.csv", cell, candidate, block_n, num_stages,
                              first=name == "one_chunk")


def plans_row(cell: str) -> tuple:
    """Entry 79's row for one cell: the waves and deep plans and cuDNN (graph replay), cuDNN / deep,
    then deep and cuDNN eagerly."""
    waves, deep, cudnn = (decode_h100_us("plans", cell, c) for c in ("plan-waves", "plan-deep", "cudnn"))
    return (waves, deep, cudnn, cudnn / deep, decode_h100_us("plans", cell, "plan-deep eager"),
            decode_h100_us("plans", cell, "cudnn eager"))


#: entry 80's three consecutive H100 suite runs (results/h100-80gb-hbm3/models/runs.csv)
def switch_row(cell: str) -> tuple:
    """Entry 82's row for one cell: the kernel before (µs) and cuDNN's backward (µs) from the
    first-early run, then each switch's time over the kernel one step before it in its own run."""
    def load(name: str) -> dict:
        return {r["variant"]: float(r["ms"]) for r in h100_experiment_rows(f"2026-12-06_backward_{name}.csv")
                if r["cell"] == cell and r["status"] == "ok"}

    j, p, f = load("joined_early"), load("prefetch"), load("first_early")
    return (1000 * f["off"], 1000 * f["cudnn"], j["+joined_row_stats"] / j["off"],
            j["+joined_row_stats+early_slot_release"] / j["+joined_row_stats"], p["+prefetch_row_stats"] / p["off"],
            f["+first_row_stats_early"] / f["off"])


def bwd_ncu_d64() -> tuple:
    """Entry 82's profile: the fused dK/dV kernel's and cuDNN's main kernel's ms, tensor pipe busy %,
    barrier and long-scoreboard stalls per issued instruction."""
    rows = h100_experiment_rows("2026-12-06_backward_ncu_d64_n512.csv")
    c = next(r for r in rows if r["case"] == "fused")
    n = next(r for r in rows if r["case"] == "cudnn" and r["kernel"].startswith("cudnn_generated"))
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    metric = lambda key: tuple(float(r[key]) for r in (c, n))  # noqa: E731
    return (*(t / 1e6 for t in metric("gpu__time_duration.sum")),
            *metric("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"),
            *metric(stall.format("barrier")), *metric(stall.format("long_scoreboard")))


def tiny_tma_row(run: int) -> tuple:
    """Entry 83's row for one of its two runs: eager and GPU-only µs of B, C, C ``-tma`` and cuDNN."""
    rows = h100_experiment_rows("2026-12-06_tiny_tma.csv")
    first = sorted({r["run_id"] for r in rows})[run]
    by = {(r["impl"], r["variant"]): r for r in rows if r["run_id"] == first}
    return tuple(1000 * float(by[key][col]) for key in (("b", ""), ("c", ""), ("c", "-tma"), ("sdpa_cudnn", ""))
                 for col in ("ms_median", "ms_gpu"))


def ncu_duration_us(cell_n: str, impl: str) -> float:
    """A kernel's duration (µs) in entry 83's Nsight Compute summaries (``N`` names the cell)."""
    return next(float(r["Duration"]) / 1000 for r in h100_experiment_rows("2026-12-06_tiny_short_ncu_sections.csv")
                if r["N"] == cell_n and r["impl"] == impl)


H100_SUITE_RUNS = ("2026-12-06T05:11:15.917081Z", "2026-12-06T05:27:27.253172Z", "2026-12-06T05:29:48.060461Z")


def h100_suite_ratios(cell: str, runs: tuple = H100_SUITE_RUNS) -> tuple:
    """C / the fastest SDPA backend at one cell, eager then GPU-only, in each of ``runs`` (entry 80's
    forward runs by default; a backward run's rows compare the backward)."""
    from harness.results import load_rows

    rows = load_rows(ROOT / "results" / "h100-80gb-hbm3" / "models" / "runs.csv")
    out = ()
    for run in runs:
        here = {r["impl"]: r for r in rows if r["run_id"] == run and r["cell"] == cell}
        peers = [r for impl, r in here.items() if impl.startswith("sdpa")]
        out += tuple(min(p[key] for p in peers) / here["c"][key] for key in ("ms_median", "ms_gpu"))
    return out


def h100_suite_us(cell: str, impl: str, run: str) -> tuple:
    """(eager µs, GPU-only µs) of one impl at one cell in one H100 suite run."""
    from harness.results import load_rows

    rows = load_rows(ROOT / "results" / "h100-80gb-hbm3" / "models" / "runs.csv")
    row = next(r for r in rows if r["run_id"] == run and r["cell"] == cell and r["impl"] == impl)
    return row["ms_median"] * 1e3, row["ms_gpu"] * 1e3


def host_descriptor_us(label: str) -> tuple:
    """Entry 84's µs per call for one line of ``backward_host.py``, before, before, after, after (the
    file holds the runs in turns: before, after, before, after)."""
    text = (ROOT / "results" / "h100-80gb-hbm3" / "experiments" / "2026-12-06_host_descriptors.txt").read_text()
    values = [float(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip().startswith(label + ":")]
    assert len(values) == 4, (label, values)
    return values[0], values[2], values[1], values[3]


def group_order_row(cell: str) -> tuple:
    """Entry 85's table row: cuDNN's ms, entry 76's order's ms, the groups' ms, the time saved in percent, and
    C / cuDNN before and after (``program_order.py --chunks autog0,auto`` on an H100)."""
    rows = {r["chunk"]: r for r in h100_experiment_rows("2026-12-06_program_order_auto_groups.csv") if r["cell"] == cell}
    before, after = float(rows["autog0"]["ms"]), float(rows["auto"]["ms"])
    return (float(rows["auto"]["cudnn_ms"]), before, after, 100 * (1 - after / before),
            float(rows["autog0"]["c_over_cudnn"]), float(rows["auto"]["c_over_cudnn"]))


def ncu_order(cell: str, order_starts: str, metric: str) -> float:
    """One metric of the dK/dV kernel (or cuDNN's main kernel) in entry 85's Nsight Compute file."""
    rows = [r for r in h100_experiment_rows("2026-12-06_backward_ncu_orders.csv")
            if r["cell"] == cell and r["order"].startswith(order_starts)
            and ("ws_bwd_dkdv" in r["kernel"] or "sdpa_sm90" in r["kernel"])]
    assert len(rows) == 1, (cell, order_starts, len(rows))
    return float(rows[0][metric])


def flush_cell_us(cell: str) -> tuple:
    """µs of stage C (read, zero, no flush), then cuDNN's and the copy's, at one cell of
    ``2026-12-06_l2_flush_cells.txt``."""
    import re

    text = (ROOT / "results" / "h100-80gb-hbm3" / "experiments" / "2026-12-06_l2_flush_cells.txt").read_text()
    block = text.split(f"\n{cell}:", 1)[1].split("\n\n", 1)[0]
    out = ()
    for impl in ("c", "cudnn", "copy"):
        line = next(line for line in block.splitlines() if line.split()[:1] == [impl])
        us = dict(re.findall(r"(zero|read|none)\s+([0-9.]+) us", line))
        out += tuple(float(us[k]) for k in ("read", "zero", "none"))
    return out


#: the forward suite run with ``kernels.one_key_tile`` (entry 83's follow-up)
ONE_KEY_TILE_SUITE_RUN = "2026-12-06T10:31:57.383750Z"


def split_fp32_spill_bytes() -> int:
    """The largest spill of the split kernel in entry 81's fp32 walk."""
    import csv

    with (ROOT / "results" / "compiled" / "2026-12-06_resource_check_fp32_split.csv").open() as f:
        return max(int(r["spill_bytes"] or 0) for r in csv.DictReader(f) if r["kernel"] == "split_kv_attention_kernel")


def deterministic_costs(d: Data) -> dict:
    """The deterministic backward's extra time per grid cell, as the results page's backward block
    computes it (``report.deterministic_costs``)."""
    from harness import report, views
    from harness.results import load_rows

    return report.deterministic_costs(views.grid_rows(load_rows(d.dir / "runs.csv"), "bwd"))


def ordered_dq_costs(way: str, cells: str, files=("ordered_dq_writer", "ordered_dq_writer_more_cells"),
                     causal: str | None = None) -> list[float]:
    """Percent over the default plan of one way of ``experiments/ordered_dq.py`` at the cells whose names
    start with ``cells`` (``causal``: "0" or "1" only), over its committed H100 runs (entries 94-98)."""
    return [100 * float(r["cost_over_default"]) for f in files for r in h100_experiment_rows(f"2026-12-07_{f}.csv")
            if r["way"] == way and r["cell"].startswith(cells) and r["status"] == "ok"
            and (causal is None or r["causal"] == causal)]


#: the runs of a writer warp per column slice (entry 98)
PER_SLICE_RUNS = ("ordered_dq_writer_per_slice", "ordered_dq_writer_per_slice_again")


def long_d128_costs(way: str) -> list[float]:
    """One way's costs in the per-slice runs at D 128 without a mask, N 4096 and 16384."""
    return [c for cell in ("grid-d128-n4096", "grid-d128-n16384")
            for c in ordered_dq_costs(way, cell, PER_SLICE_RUNS, causal="0")]


def first_stores_costs(way: str, cells: tuple[str, ...]) -> list[float]:
    """Percent over the default plan of one way of ``experiments/first_stores.py`` at these cells (entry 99)."""
    return [100 * (float(r["over_default"]) - 1) for r in h100_experiment_rows("2026-12-07_first_stores.csv")
            if r["way"] == way and r["cell"] in cells and r["status"] == "ok"]


def first_stores_gains() -> list[float]:
    """Points the first stores take off ordered dQ in each cell of that run (entry 99)."""
    rows = {(r["cell"], r["way"]): float(r["over_default"])
            for r in h100_experiment_rows("2026-12-07_first_stores.csv") if r["status"] == "ok"}
    return [100 * (rows[c, "ordered"] - rows[c, "ordered-first-stores"]) for c, w in rows if w == "ordered"]


def tune_whole_ms(file: str, D: int, causal: int, kind: str) -> float:
    """One whole-backward plan's ms at one cell of a committed H100 run of the backward tuner."""
    return next(float(r["ms"]) for r in h100_experiment_rows(file)
                if int(r["D"]) == D and int(r["causal"]) == causal and r["kind"] == kind and r["status"] == "ok")


def h100_suite_bwd_ms(cell: str, run_id: str, impl: str = "c") -> float:
    """One impl's backward ms_median at one suite cell in one run of results/h100-80gb-hbm3/models/runs.csv."""
    import csv

    with (ROOT / "results" / "h100-80gb-hbm3" / "models" / "runs.csv").open(newline="") as f:
        return next(float(r["ms_median"]) for r in csv.DictReader(f) if r["run_id"] == run_id and
                    r["cell"] == cell and r["impl"] == impl and r["pass"] == "bwd" and not r["variant"])


#: entry 100's suite runs of the backward: fused dQ at D 64 without a mask (before) and ordered dQ (after)
FUSED_SUITE_RUN, ORDERED_SUITE_RUN = "2026-12-06T11:06:36.962924Z", "2026-12-07T14:40:32.303227Z"


def dq_passes() -> dict:
    """Entry 100's ``dq_passes.py`` run: {cell: {part: ms}}."""
    out: dict = {}
    for r in h100_experiment_rows("2026-12-07_dq_passes.csv"):
        if r["status"] == "ok":
            out.setdefault(r["cell"], {})[r["part"]] = float(r["ms"])
    return out


def dq_passes_shares() -> list[float]:
    """Percent of the default backward that the zeroing and the cast take, per cell of that run."""
    return [100 * (p["backward"] - p["dkdv"] - p["delta_no_zero"]) / p["backward"] for p in dq_passes().values()]


def dq_passes_speeds(without: bool) -> list[float]:
    """Stage C's speed over cuDNN's per cell of that run: the whole backward, or (``without``) its kernels
    without the zeroing and the cast."""
    return [p["cudnn"] / ((p["dkdv"] + p["delta_no_zero"]) if without else p["backward"])
            for p in dq_passes().values()]


def ncu_cells_row(cell: str) -> tuple:
    """Entry 101's Nsight Compute table, one cell's row: stage C / cuDNN for the main kernel's ms, the other
    kernels' ms, DRAM GB read and written, tensor pipe and issue slots busy %, barrier and long-scoreboard
    stalls per issue, millions of instructions (``cell``: a suite cell's name, or "D {D}, N {N}")."""
    parts: dict = {}
    for r in h100_experiment_rows("2026-12-07_backward_ncu_cells.csv"):
        name = r["cell"] or f"D {r['D']}, N {r['N']}"
        if name != cell:
            continue
        d = parts.setdefault(r["case"], {"other": 0.0})
        ms = float(r["gpu__time_duration.sum"]) / 1e6
        if "dkdv" in r["kernel"] or "bprop" in r["kernel"]:
            d["row"] = (ms, float(r["dram__bytes_read.sum"]) / 1e9, float(r["dram__bytes_write.sum"]) / 1e9,
                        float(r["sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"]),
                        float(r["smsp__issue_active.avg.pct_of_peak_sustained_active"]),
                        float(r["smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"]),
                        float(r["smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"]),
                        float(r["smsp__inst_executed.sum"]) / 1e6)
        else:
            d["other"] += ms
    c, n = parts["default"], parts["cudnn"]
    columns = [c["row"][0], n["row"][0], c["other"], n["other"]]
    for i in range(1, 8):
        columns += [c["row"][i], n["row"][i]]
    return tuple(columns)


def ordered_default_costs(small: bool) -> list[float]:
    """Entry 100's ``ordered_default.py`` run: ordered dQ's time over fused dQ's, percent, on the grids below
    (``small``) or above 18 (query head, Q tile) pairs per SM; with the largest small and smallest large count."""
    rows = {}
    for r in h100_experiment_rows("2026-12-07_ordered_default.csv"):
        if r["status"] == "ok":
            rows.setdefault(r["cell"], {"pairs": float(r["pairs_per_sm"])})[r["way"]] = float(r["ms"])
    return [100 * (c["ordered"] / c["fused"] - 1) for c in rows.values() if (c["pairs"] < 18) == small]


def ordered_default_pairs(small: bool) -> float:
    rows = {r["cell"]: float(r["pairs_per_sm"]) for r in h100_experiment_rows("2026-12-07_ordered_default.csv")}
    return max(p for p in rows.values() if p < 18) if small else min(p for p in rows.values() if p >= 18)


def h100_deterministic_costs() -> list[float]:
    """The H100 results page's deterministic costs of the bf16 backward grid, percent."""
    return [100 * v for k, v in deterministic_costs(Data(ROOT / "results" / "h100-80gb-hbm3")).items()
            if k[0] == "bf16"]


def bwd_ratios(d: Data, dtype: str, head_dims) -> list[float]:
    """Stage C's backward TFLOPS over cuDNN's per grid cell of ``dtype`` at these head dims."""
    from harness import views

    rows = [r for r in views.grid_rows(d.all_rows, "bwd") if views.is_ok(r) and r["dtype"] == dtype
            and not r.get("variant") and r.get("tflops") and int(r["D"]) in head_dims]
    cells: dict[tuple, dict] = {}
    for r in rows:
        cells.setdefault((r["D"], r["causal"], r["N"]), {})[r["impl"]] = r["tflops"]
    ratios = [c["c"] / c["sdpa_cudnn"] for c in cells.values() if "c" in c and "sdpa_cudnn" in c]
    assert ratios, (dtype, head_dims)
    return ratios


def span(d: Data, f, *args) -> tuple[float, float]:
    """(lowest, highest) of ``f(d, cell, *args)`` over the four ablation cells, rounded as printed."""
    values = [f(d, c, *args) for c in CELLS]
    return round(min(values), 2), round(max(values), 2)


def left_out(d: Data, cell: str, switch: str) -> float:
    return d.leave_one_out(switch, **CELLS[cell])


def ws_whole(d: Data, cell: str) -> float:
    """Warp specialization's factor in the walk: every rung together, from '+causal_skip' to the full kernel."""
    at = dict(d.ablation_steps(**CELLS[cell]))
    return at["+causal_skip"] / at["+warp_specialization"]


def run_date(d: Data, impl: str, variant: str | None) -> tuple[int, int, int]:
    """(year, month, day) of the run that measured the headline cell's row of ``impl`` (every ablation cell
    from the same run, or NaNs)."""
    dates = {d.row(impl, variant=variant, **c)["run_id"][:10] for c in CELLS.values()}
    if len(dates) != 1:
        return (float("nan"),) * 3
    return tuple(int(x) for x in dates.pop().split("-"))


def steps(d: Data, cell: str, step: str) -> float:
    """The speedup of one cumulative ablation step over the step before it."""
    return d.step_speedups(**CELLS[cell])[step]


def shares(d: Data, cell: str, step: str) -> float:
    return d.step_shares(**CELLS[cell])[step]


def largest_step(d: Data, cell: str) -> str:
    sp = d.step_speedups(**CELLS[cell])
    return max(sp, key=sp.get)


def costliest_leave_out(d: Data, cell: str) -> str:
    from stages.c_optimized import SWITCHES

    return max(SWITCHES, key=lambda s: d.leave_one_out(s, **CELLS[cell]))


def same_everywhere(values: list[float], spread: float = 0.01) -> float:
    """The value all of ``values`` share (their mean), NaN (a failing claim) if they spread wider."""
    return sum(values) / len(values) if values and max(values) - min(values) <= spread else float("nan")


def b_measured_over_minimum(d: Data) -> list[float]:
    out = []
    for n in d.ns("b", D=64):
        r = d.row("b", N=n, D=64)
        if r["dram_read_measured"] is not None:
            out.append(d.measured_bytes("b", N=n, D=64) / Problem(r["B"], r["H"], n, 64).qkvo_bytes)
    return out


# ------------------------------------------------------------------------------ the claims

CLAIMS = [
    # ---------------------------------------------------------------- stage A
    Claim(A_README, "from {} TFLOPS at N = 512 to {} at N = 16384",
          lambda d: (d.tflops("a", N=512, D=64), d.tflops("a", N=16384, D=64))),
    Claim(A_README, "TFLOPS rise with N, then flatten",
          lambda d: d.tflops("a", N=512, D=64) < d.tflops("a", N=2048, D=64) < d.tflops("a", N=4096, D=64)
          and abs(d.tflops("a", N=16384, D=64) / d.tflops("a", N=4096, D=64) - 1) < 0.05,
          why="stage A's D = 64 TFLOPS over N"),
    Claim(A_README, "against a measured matmul rate of {}", lambda d: (d.matmul_tflops("fp16"),)),
    Claim(A_README, "read {} % of the copy bandwidth `python -m harness device` measures at N = 4096",
          lambda d: (100 * d.model_gbps("a", **HEAD) / d.copy_gbps,)),
    Claim(A_README, "are {} % of the copy bandwidth at N = 4096 and {} % at N = 16384",
          lambda d: (100 * d.measured_gbps("a", **HEAD) / d.copy_gbps,
                     100 * d.measured_gbps("a", N=16384, D=64) / d.copy_gbps)),
    Claim(A_README, "the measured bytes are {}–{} of the model",
          lambda d: (min(a_measured_over_model(d)), max(a_measured_over_model(d))), rel=0.02),
    Claim(A_README, "about {}·N²·e per head at N = 4096 ({}·N²·e at N = 16384) against the model's {}·N²·e",
          lambda d: (per_head_n2(d, d.measured_bytes("a", **HEAD), **HEAD),
                     per_head_n2(d, d.measured_bytes("a", N=16384, D=64), N=16384, D=64),
                     per_head_n2(d, d.model_bytes("a", **HEAD), **HEAD)), rel=0.05),
    Claim(A_README, "a causal call takes {}× the non-causal time at N = 4096",
          lambda d: (d.ms("a", **CELLS["D64c"]) / d.ms("a", **HEAD),)),
    Claim(A_README, "to {} GB at N = 16384",
          lambda d: (d.row("a", N=16384, D=64)["peak_mem_measured"] / 1e9,)),
    Claim(A_README, "the measured peak equals the workspace model",
          lambda d: all(r["peak_mem_measured"] == r["peak_mem_model"] for r in d.rows
                        if r["impl"] == "a" and r["kind"] == "stage" and r["status"] == "ok"
                        and r["peak_mem_measured"] is not None),
          why="stage A's peak_mem_measured against peak_mem_model"),
    # ---------------------------------------------------------------- stage B
    Claim(B_README, "B asks for about 4× fewer bytes ({}× at N = 4096)",
          lambda d: (d.model_bytes("a", **HEAD) / d.model_bytes("b", **HEAD),)),
    Claim(B_README, "against stage A's model of about {}·N²·e",
          lambda d: (per_head_n2(d, d.model_bytes("a", **HEAD), **HEAD),), rel=0.05),
    Claim(B_README, "Nsight Compute on the H200: {} of that minimum at every N it measured",
          lambda d: (same_everywhere(b_measured_over_minimum(d)),),
          why="stage B's measured DRAM bytes over Q, K, V and O once"),
    Claim(B_README, "B moves {} MB of DRAM traffic in {} ms: {} GB/s, {} % of the {} GB/s copy bandwidth",
          lambda d: (d.measured_bytes("b", **HEAD) / 1e6, d.ms("b", **HEAD), d.measured_gbps("b", **HEAD),
                     100 * d.measured_gbps("b", **HEAD) / d.copy_gbps, d.copy_gbps), rel=0.02),
    Claim(B_README, "It computes {} TFLOPS, {} % of the {} the tensor cores reach",
          lambda d: (d.tflops("b", **HEAD), 100 * d.tflops("b", **HEAD) / d.matmul_tflops(), d.matmul_tflops())),
    Claim(B_README, "It is {}× faster than A", lambda d: (d.ms("a", **HEAD) / d.ms("b", **HEAD),)),
    Claim(B_README, "so each of the {} tiles a program walks", lambda d: (HEAD["N"] / 64,), rel=0),
    # ---------------------------------------------------------------- stage C
    Claim(C_README, "it moves {} MB of DRAM traffic in {} ms, {} % of the copy bandwidth, at {} % of the matmul rate",
          lambda d: (d.measured_bytes("b", **HEAD) / 1e6, d.ms("b", **HEAD),
                     100 * d.measured_gbps("b", **HEAD) / d.copy_gbps,
                     100 * d.tflops("b", **HEAD) / d.matmul_tflops())),
    Claim(C_README, "C moves the same {} MB and runs {}× faster",
          lambda d: (d.measured_bytes("c", **HEAD) / 1e6, d.ms("b", **HEAD) / d.ms("c", **HEAD))),
    Claim(C_README, "in the walk tiles alone lose at D = 64 ({}× and {}×); left out of the full kernel they "
                    "cost {}–{}×",
          lambda d: (steps(d, "D64", "+tuned_tiles"), steps(d, "D64c", "+tuned_tiles"),
                     *span(d, left_out, "tuned_tiles"))),
    Claim(C_README, "in the walk tiles alone lose at D = 64",
          lambda d: [c for c in CELLS if steps(d, c, "+tuned_tiles") < 0.99] == ["D64", "D64c"],
          why="the +tuned_tiles steps"),
    Claim(C_README, "Left out: {}–{}×, the costliest switch in both non-causal cells. In the walk: {}–{}×",
          lambda d: (*span(d, left_out, "pipelining"), *span(d, steps, "+pipelining"))),
    Claim(C_README, "the costliest switch in both non-causal cells",
          lambda d: all(costliest_leave_out(d, c) == "pipelining" for c in ("D64", "D128")),
          why="leave-one-out, non-causal"),
    Claim(C_README, "In the walk, after the tiles and the pipeline, {}–{}×; left out, {}–{}×",
          lambda d: (*span(d, steps, "+tma"), *span(d, left_out, "tma"))),
    Claim(C_README, "in the walk {}× and {}× at D = 64, where the softmax weighs most, {}× and {}× at D = 128",
          lambda d: tuple(steps(d, c, "+exp2") for c in ("D64", "D64c", "D128", "D128c"))),
    Claim(C_README, "writes the loop bound): {}× and {}× in the walk, the largest step of both causal cells; "
                    "left out, {}× and {}×",
          lambda d: (steps(d, "D64c", "+causal_skip"), steps(d, "D128c", "+causal_skip"),
                     left_out(d, "D64c", "causal_skip"), left_out(d, "D128c", "causal_skip"))),
    Claim(C_README, "the largest step of both causal cells; left out, {}× and {}×, the costliest switch there",
          lambda d: ((left_out(d, "D64c", "causal_skip"), left_out(d, "D128c", "causal_skip"))
                     if all(largest_step(d, c) == "+causal_skip" and costliest_leave_out(d, c) == "causal_skip"
                            for c in ("D64c", "D128c")) else (float("nan"),) * 2)),
    Claim(C_README, "**Warp specialization** (next section): {}–{}× in the walk, left out {}–{}×",
          lambda d: (*span(d, ws_whole), *span(d, left_out, "warp_specialization"))),
    Claim(C_README, "issues `S_j = Q·K_jᵀ` with the previous tile's `O += P·V` | `_producer`, `_issue_tile` | "
                    "255 registers, no spills | {}–{}× |",
          lambda d: span(d, steps, "+ws1-producer")),
    Claim(C_README, "the producer gives its registers away | `PRODUCER_REGS` | `setmaxnreg.dec 24` / `.inc "
                    "240` | {}–{}× |",
          lambda d: span(d, steps, "+ws2-consumers")),
    Claim(C_README, "around all 66 `MUFU.EX2` | {}–{}× |", lambda d: span(d, steps, "+ws3-pingpong")),
    Claim(C_README, "the TMA store of O in the loop | {}–{}× |", lambda d: span(d, steps, "+ws4-persistent")),
    Claim(C_README, "lane shuffles per turn 8 → 4 | {}–{}× |", lambda d: span(d, steps, "+ws5-lane-sums")),
    Claim(C_README, "a branch over 32 `FMUL` | {}–{}× |", lambda d: span(d, steps, "+warp_specialization")),
    Claim(C_README, "One consumer alone is slower than the `tl` kernel; the ladder pays from rung 2",
          lambda d: max(steps(d, c, "+ws1-producer") for c in CELLS) < 1
          < min(steps(d, c, "+ws2-consumers") for c in CELLS),
          why="the +ws1 and +ws2 steps"),
    Claim(C_README, "runs the code of the row above and reads {}–{}×",
          lambda d: tuple(f(steps(d, c, "+causal_skip") for c in ("D64", "D128")) for f in (min, max))),
    Claim(C_README, "the \"every switch off\" row reads {}–{}× of B across them",
          lambda d: span(d, steps, "+none")),
    Claim(C_README, "Stage B's rows come from an earlier run than C's walk ({}-{}-{} against {}-{}-{}",
          lambda d: (*run_date(d, "b", None), *run_date(d, "c", "+none")), rel=0),
    # ---------------------------------------------------------------- stage C, the details page
    Claim(C_DETAILS, "The model table's `tiny` cell now takes\n{} µs of GPU time, {} µs eager",
          lambda d: (d.suite_row("tiny", "c")["ms_gpu"] * 1e3, d.suite_row("tiny", "c")["ms_median"] * 1e3)),
    Claim(C_DETAILS, "builds TMA descriptors from templates: {} → {} µs per call",
          lambda d: (host_path_us(d, "stage C default  ordinary launch"),
                     host_path_us(d, "stage C default  lean launch"))),
    Claim(C_DETAILS, "At D 256 the backward went from {} ms with the `tl` kernels to {}, level with cuDNN",
          lambda d: (tuning_ms(d, "2026-12-04_hopper_bwd_tuning_d256_shared.csv", 256, 0, "whole_tl"),
                     tuning_ms(d, "2026-12-04_hopper_bwd_tuning_d256_shared.csv", 256, 0, "whole_ws+ws_dq"))),
    Claim(C_DETAILS, "at D 64 it is what the tuner keeps ({} ms against {})",
          lambda d: (tuning_ms(d, "2026-12-04_hopper_bwd_tuning_d64_pair.csv", 64, 0, "whole_ws+fused"),
                     tuning_ms(d, "2026-12-04_hopper_bwd_tuning_d64_pair.csv", 64, 0, "whole_ws"))),
    Claim(C_DETAILS, "stage C runs at {}–{} of it at D 64 and 128, where it fuses dQ as cuDNN does (entry 70), "
          "at {}–{} at D 72–96, which run as 64 columns and a tail of 16 or 32 (the forward's mechanism, in both "
          "Hopper kernels: [entry 60](performance-log/backward.md)), and at {}–{} at D 40, 48 and 112",
          lambda d: tuple(f(bwd_ratios(d, "bf16", dims) + bwd_ratios(d, "fp16", dims))
                          for dims in ((64, 128), (72, 80, 88, 96), (40, 48, 112)) for f in (min, max))),
    Claim(C_DETAILS, "the fused kernel alone {} → {} ms causal,\n{} → {} non-causal",
          lambda d: tuple(fused_dq_ms(d, causal, compact) for causal in (1, 0) for compact in (False, True))),
    Claim(C_DETAILS, "ahead of cuDNN at D 32 and level with it at D 200 and 256",
          lambda d: min(bwd_ratios(d, "bf16", (32,))) > 1 and min(bwd_ratios(d, "bf16", (200, 256))) >= 0.95,
          why="the bf16 backward grid rows: C / cuDNN above 1 at D 32, at least 0.95 at D 200 and 256"),
    # ---------------------------------------------------------------- the CUDA twins
    Claim(TWINS, "padding buys c_cuda {}–{}×",
          lambda d: tuple(f(twin_ratios(d, "c_cuda", "unpadded", "all")) for f in (min, max))),
    Claim(TWINS, "the swizzle, with no wasted bytes, is {}–{}× faster still",
          lambda d: tuple(f(twin_ratios(d, "c_cuda", "all", "swizzled")) for f in (min, max))),
    Claim(TWINS, "In b_cuda, padding gains only {}–{} %",
          lambda d: tuple(100 * (f(twin_ratios(d, "b_cuda", "all", "padded")) - 1) for f in (min, max)), rel=0.1),
    Claim(TWINS, "read within 1 % of `predicted_conflicts`",
          lambda d: all(abs(m / p - 1) < 0.01 for m, p in bank_conflicts(d, predicted_zero=False)),
          why="the unpadded layouts' Nsight Compute bank conflicts against stages/bank_model.py"),
    Claim(TWINS, "a residue over 100× smaller than the same kernel's unpadded count at the same size",
          lambda d: all(100 * m < unpadded for m, unpadded in residues(d)),
          why="the zero-predicted layouts' measured conflicts against the unpadded layout's"),
    # ---------------------------------------------------------------- the glossary
    Claim(GLOSSARY, "measures ~{} TB/s with a large copy", lambda d: (d.copy_gbps / 1e3,)),
    Claim(GLOSSARY, "(~{} FLOPs per byte on the H200 at fp16)",
          lambda d: (d.matmul_tflops("fp16") * 1e3 / d.copy_gbps,)),
    Claim(GLOSSARY, "(60 MB on the H200)", lambda d: abs(d.env["l2_bytes"] / 2**20 - 60) < 0.5,
          why="env.json's l2_bytes"),
    Claim(GLOSSARY, "(132 on the H200)", lambda d: d.env.get("sm_count", 132) == 132, why="env.json's sm_count"),
    # ---------------------------------------------------------------- notebook 01
    Claim(NB["01"], "from N = 4096 on, stage A runs faster than its requested bytes could cross DRAM",
          lambda d: all(d.ms("a", N=n, D=64) < d.model_bytes("a", N=n, D=64) / (d.copy_gbps * 1e6)
                        for n in d.ns("a", D=64) if n >= 4096), why="stage A's time against model bytes / bandwidth"),
    Claim(NB["01"], "measures are half to two thirds of the model",
          lambda d: 0.5 <= min(a_measured_over_model(d)) and max(a_measured_over_model(d)) <= 2 / 3,
          why="stage A's measured DRAM bytes over its model"),
    Claim(NB["01"], "stage A's time sits above it, at {}–{} % of the copy bandwidth",
          lambda d: tuple(100 * f(d.measured_gbps("a", N=n, D=64) for n in (1024, 4096, 16384)) / d.copy_gbps
                          for f in (min, max))),
    Claim(NB["01"], "stage A moves right by about 2×, the tiled kernels by more than 10×",
          lambda d: abs(d.model_bytes("a", **HEAD) / d.measured_bytes("a", **HEAD) - 2) < 0.2
          and min(d.model_bytes(i, **HEAD) / d.measured_bytes(i, **HEAD) for i in ("b", "c")) > 10,
          why="model over measured DRAM bytes at the roofline's headline cell"),
    # ---------------------------------------------------------------- notebook 02
    Claim(NB["02"], "B's model sits about {}× below A's here",
          lambda d: (model_ratio("a", "b", Problem(1, 32, 4096, 64)),)),
    Claim(NB["02"], "DRAM bytes at half to two thirds of the model",
          lambda d: 0.5 <= min(a_measured_over_model(d)) and max(a_measured_over_model(d)) <= 2 / 3,
          why="stage A's measured DRAM bytes over its model"),
    Claim(NB["02"], "a memory peak equal to the model",
          lambda d: all(r["peak_mem_measured"] == r["peak_mem_model"] for r in d.rows
                        if r["impl"] == "a" and r["kind"] == "stage" and r["peak_mem_measured"] is not None),
          why="stage A's measured peak memory against the workspace model"),
    # ---------------------------------------------------------------- notebook 04
    Claim(NB["04"], "B at D = B_r = 64: 2·N²·e, about {}× less",
          lambda d: (model_ratio("a", "b", Problem(1, 32, 4096, 64)),)),
    Claim(NB["04"], "A constant factor of about four ({} at N = 4096)",
          lambda d: (model_ratio("a", "b", Problem(1, 32, 4096, 64)),)),
    Claim(NB["04"], "at N = 16k, B still asks for {}× more bytes than necessary",
          lambda d: (b_over_minimum(Problem(1, 32, 16384, 64)),), rel=0.01),
    Claim(NB["04"], "Stage B moves a few percent of what the bus could carry and computes at well under half "
                    "of the tensor cores' rate",
          lambda d: d.measured_gbps("b", **HEAD) / d.copy_gbps < 0.05
          and d.tflops("b", **HEAD) / d.matmul_tflops() < 0.5,
          why="stage B's measured bandwidth and TFLOPS against the ceilings at the headline cell"),
    Claim(NB["04"], "B's DRAM traffic is a few percent of the copy bandwidth and its TFLOPS well under half "
                    "the matmul rate",
          lambda d: d.measured_gbps("b", **HEAD) / d.copy_gbps < 0.05
          and d.tflops("b", **HEAD) / d.matmul_tflops() < 0.5,
          why="stage B's measured bandwidth and TFLOPS against the ceilings at the headline cell"),
    # ---------------------------------------------------------------- the profiler tables (02, 04, 05)
    Claim(NB["02"], "they take more than twice as long under it as in the timed sweep",
          lambda d: profiled(d)["a"]["duration_ms"] > 2 * d.ms("a", **HEAD), why="Nsight Compute's time of A"),
    Claim(NB["02"], "What the profile adds is the load transactions: about {}× the minimum",
          lambda d: (profiled(d)["a"]["load_sectors_x_min"],), rel=0.05),
    Claim(NB["04"], "Fusing the kernels shows up as a DRAM throughput a fraction of A's",
          lambda d: profiled(d)["b"]["dram_pct"] < 0.2 * profiled(d)["a"]["dram_pct"], why="DRAM % of B and A"),
    Claim(NB["04"], "about {}× the minimum in load transactions", lambda d: (profiled(d)["b"]["load_sectors_x_min"],)),
    Claim(NB["04"], "B and C read about the same while C takes half the time",
          lambda d: abs(profiled(d)["b"]["compute_pct"] - profiled(d)["c"]["compute_pct"]) < 3
          and abs(profiled(d)["c"]["duration_ms"] / profiled(d)["b"]["duration_ms"] - 0.5) < 0.05,
          why="SM throughput and time of B and C under Nsight Compute"),
    Claim(NB["05"], "The compute (SM) column does not separate C from B, though C takes half the time",
          lambda d: abs(profiled(d)["b"]["compute_pct"] - profiled(d)["c"]["compute_pct"]) < 3
          and abs(profiled(d)["c"]["duration_ms"] / profiled(d)["b"]["duration_ms"] - 0.5) < 0.05,
          why="SM throughput and time of B and C under Nsight Compute"),
    # ---------------------------------------------------------------- notebook 06
    Claim(NB["06"], "Fusion (A → B) is the larger factor in three of the four cells; in the causal D = 128 "
                    "cell B → C is",
          lambda d: [c for c in CELLS if d.ms("a", **CELLS[c]) / d.ms("b", **CELLS[c])
                     < d.ms("b", **CELLS[c]) / d.ms("c", **CELLS[c])] == ["D128c"],
          why="A → B against B → C at the four N = 4096 cells"),
    Claim(NB["06"], "an empty Triton kernel's launch at {}–{} µs and a whole stage A call (its checks and "
                    "three launches) at {}–{} µs",
          lambda d: (*d.latency_range("triton_empty_kernel"), *d.latency_range("a")), rel=0.05),
    Claim(NB["06"], "in its two runs", lambda d: len(d.latency_runs) == 2, why="the runs of results/h200/latency.csv"),
    Claim(NB["06"], "Up to N = 1024, moving all of stage A's N² bytes at full bandwidth takes less time than "
                    "the host path of one stage A call",
          lambda d: last_n_below_host(d) == 1024,
          why="stage A's model bytes / bandwidth against its host µs per call"),
    Claim(NB["06"], "up to N = 512 its S and P fit in L2",
          lambda d: max(n for n in (128, 256, 512, 1024, 2048) if a_workspace(n) < d.env["l2_bytes"]) == 512,
          why="stage A's workspace model against env.json's l2_bytes"),
    Claim(NB["06"], "C's taller tiles cut the *modelled* K/V re-reads (to about a third at D = 64",
          lambda d: 0.3 < d.model_bytes("c", **HEAD) / d.model_bytes("b", **HEAD) < 0.4, why="C's model over B's"),
    Claim(NB["06"], "none did in the H200's sweep",
          lambda d: not any(r["status"] == "oom" for r in d.all_rows), why="oom rows in runs.csv"),
    Claim(NB["06"], "the kernels draw between {} and {} W, all but the CUDA C++ twin of B, a scalar loop, at "
                    "about {} W",
          lambda d: (*power_span(d, exclude="b_cuda"), energy_cell(d)["b_cuda"]["power_w"]), rel=0.05),
    # ---------------------------------------------------------------- notebook 07
    Claim(NB["07"], "(tensor-core rate ÷ memory bandwidth, notebook 01) is ~{} FLOPs per byte",
          lambda d: (d.matmul_tflops("bf16") * 1e3 / d.copy_gbps,)),
    # ---------------------------------------------------------------- notebook 08
    Claim(NB["08"], "fp32 atomics (fewer FLOPs, but about {}× the requested bytes",
          lambda d: (atomic_over_separate(Problem(1, 32, 4096, 64, "fp16", True)),)),
    Claim(NB["08"], "In both models the training step is fastest with transformers' SDPA, then stage C, then "
                    "B, then A",
          lambda d: all(train_order(d, m) == ["sdpa", "c", "b", "a"] for m in ("gpt2", "llama")),
          why="each impl's latest training steps in results/h200/generate/runs.csv"),
    Claim(NB["08"], "so its step also needs the most memory",
          lambda d: all(max(train_steps(d, m), key=lambda r: float(r["peak_mem_bytes"]))["impl"] == "a"
                        for m in ("gpt2", "llama")), why="the training steps' peak memory"),
    Claim(NB["08"], "C's backward runs at {}–{}× of cuDNN's at D 64 and 128 in the figure above",
          lambda d: tuple(f(c / n for c, n in bwd_pairs(d, "c", "sdpa_cudnn", (64, 128))) for f in (min, max))),
    Claim(NB["08"], "took a quarter of the loop's\ninstructions away and the fused kernel from {} to {} ms (D 128, causal)",
          lambda d: (fused_dq_ms(d, 1, False), fused_dq_ms(d, 1, True))),
    Claim(C_DETAILS, "Bitwise reproducible gradients cost {}–{} % more time than the default backward on the H200's bf16 grid",
          lambda d: tuple(100 * f(v for k, v in deterministic_costs(d).items() if k[0] == "bf16") for f in (min, max))),
    Claim(C_DETAILS, "Taken by the consumers themselves, the turns cost {}–{} % on an H100",
          lambda d: (min(ordered_dq_costs("ordered", "", ("ordered_dq",))),
                     max(ordered_dq_costs("ordered", "", ("ordered_dq",))))),
    Claim(C_DETAILS, "go on: +{} % to +{} % over fused dQ on\nthe D 64 grid cells (an odd-sized fp16 cell +{} %, "
                     "GPT-2's short causal one +{}–{} %), where the dQ kernel of its\nown costs up to {} %",
          lambda d: (min(ordered_dq_costs("ordered-writer", "grid-d64")),
                     max(ordered_dq_costs("ordered-writer", "grid-d64")),
                     *ordered_dq_costs("ordered-writer", "odd-n"),
                     min(ordered_dq_costs("ordered-writer", "gpt2")), max(ordered_dq_costs("ordered-writer", "gpt2")),
                     max(ordered_dq_costs("deterministic", "grid-d64")))),
    Claim(C_DETAILS, "one writer took both slices' turns in a row (+{}–{} %, the\ngrouped Llama 3 8B cell +{}–{} %",
          lambda d: (min(ordered_dq_costs("ordered-writer", "grid-d128")),
                     max(ordered_dq_costs("ordered-writer", "grid-d128")),
                     min(ordered_dq_costs("ordered-writer", "llama3-8b")),
                     max(ordered_dq_costs("ordered-writer", "llama3-8b")))),
    Claim(C_DETAILS, "takes D 128 to +{}–{} % and the Llama cell to +{}–{} %",
          lambda d: (min(ordered_dq_costs("ordered-writer-per-slice", "grid-d128", PER_SLICE_RUNS)),
                     max(ordered_dq_costs("ordered-writer-per-slice", "grid-d128", PER_SLICE_RUNS)),
                     min(ordered_dq_costs("ordered-writer-per-slice", "llama3-8b", PER_SLICE_RUNS)),
                     max(ordered_dq_costs("ordered-writer-per-slice", "llama3-8b", PER_SLICE_RUNS)))),
    Claim(C_DETAILS, "Without a mask at N 4096 and 16384 that is ahead of the dQ kernel of its own (+{}–{} % in the "
                     "same runs)",
          lambda d: (min(long_d128_costs("deterministic")), max(long_d128_costs("deterministic")))
          if all(w < k for w, k in zip(long_d128_costs("ordered-writer-per-slice"), long_d128_costs("deterministic")))
          else (None, None),
          why="in each run and cell the writer per slice's cost below the dQ kernel's"),
    Claim(C_DETAILS, "at N 1024 the dQ kernel of its own was ahead\n(+{} % against +{} %)",
          lambda d: (*ordered_dq_costs("deterministic", "grid-d128-n1024", PER_SLICE_RUNS),
                     *ordered_dq_costs("ordered-writer-per-slice", "grid-d128-n1024", PER_SLICE_RUNS))),
    Claim(C_DETAILS, "causal and grouped it stays the plan (+{}–{} %)",
          lambda d: (min(ordered_dq_costs("deterministic", "", PER_SLICE_RUNS, causal="1")),
                     max(ordered_dq_costs("deterministic", "", PER_SLICE_RUNS, causal="1")))),
    Claim(C_DETAILS, "the bf16\ngrid's deterministic cost on the H100 is −{} % to +{} %",
          lambda d: (-min(h100_deterministic_costs()), max(h100_deterministic_costs()))),
    Claim(C_DETAILS, "kernel: {}–{} points off each deterministic cell timed on an H100",
          lambda d: (min(first_stores_gains()), max(first_stores_gains())),
          why="2026-12-07_first_stores.csv: ordered dQ's cost over the default minus the first stores' (rounded to "
              "whole points)"),
    Claim(C_DETAILS, "(−{} % to −{} % without a mask and at GPT-2's shape, +{} % causal at N 4096",
          lambda d: (-min(first_stores_costs("ordered-first-stores", ("grid-d64-n1024", "grid-d64-n4096",
                                                                       "grid-d64-n16384", "gpt2"))),
                     -max(first_stores_costs("ordered-first-stores", ("grid-d64-n1024", "grid-d64-n4096",
                                                                       "grid-d64-n16384", "gpt2"))),
                     *first_stores_costs("ordered-first-stores", ("grid-d64-n4096-causal", )))),
    Claim(C_DETAILS, "now takes ordered dQ\nat D 64 without a mask ({} against fused dQ's {} ms at N 4096)",
          lambda d: tuple(tune_whole_ms("2026-12-07_tune_backward_first_stores.csv", 64, 0, f"whole_ws+{k}")
                          for k in ("ordered", "fused"))),
    Claim(C_DETAILS, "Two heads of 8k tokens, {} pairs per SM, ran {} ms with fused dQ and\n{} ordered",
          lambda d: (2 * 2 * 8192 / 64 / 132, h100_suite_bwd_ms("few-heads", FUSED_SUITE_RUN),
                     h100_suite_bwd_ms("few-heads", ORDERED_SUITE_RUN)),
          why="the pairs: B 2 · H 2 · 8192/64 Q tiles over the H100's 132 SMs"),
    Claim(C_DETAILS, "grids of up to {} pairs per SM lost {}–{} % with the order and\ngrids of {} or more won "
                     "{}–{} %",
          lambda d: (ordered_default_pairs(True), min(ordered_default_costs(True)), max(ordered_default_costs(True)),
                     ordered_default_pairs(False), -max(ordered_default_costs(False)),
                     -min(ordered_default_costs(False)))),
    Claim(NB["08"], "(the zeroing and the cast were {}–{} % of the default\nbackward",
          lambda d: (min(dq_passes_shares()), max(dq_passes_shares()))),
    Claim(NB["08"], "the two cross\nbetween {} and {} pairs per SM",
          lambda d: (ordered_default_pairs(True), ordered_default_pairs(False))),
    Claim(C_DETAILS, "the zeroing and the cast are {}–{} % of the default backward",
          lambda d: (min(dq_passes_shares()), max(dq_passes_shares()))),
    Claim(C_DETAILS, "would run at {}–{}× cuDNN's speed there instead of {}–{}×",
          lambda d: (min(dq_passes_speeds(True)), max(dq_passes_speeds(True)), min(dq_passes_speeds(False)),
                     max(dq_passes_speeds(False)))),
    Claim(C_DETAILS, "took the grouped Llama 3\n8B cell from {} to {} ms",
          lambda d: (program_order_ms(d, "llama3-8b", "0"), program_order_ms(d, "llama3-8b", "8"))),
    Claim(C_DETAILS, "twice cuDNN's DRAM bytes at the grid's causal D 128\ncell",
          lambda d: 1.8 < ncu_order("", "chunks of 8", "dram__bytes_read.sum") / ncu_order("", "cuDNN",
                                                                                           "dram__bytes_read.sum") < 2.2,
          why="entry 85's Nsight Compute file: the dK/dV kernel's DRAM reads in entry 76's order over cuDNN's"),
    Claim(NB["08"], "the head-by-head order ends late (the grouped Llama 3 8B cell {} → {} ms)",
          lambda d: (program_order_ms(d, "llama3-8b", "0"), program_order_ms(d, "llama3-8b", "8"))),
    Claim(NB["08"], "and lost a few percent where it\nsaid there was nothing to gain (16 heads of 16k tokens",
          lambda d: 1.01 < program_order_ms(d, "grid-d128-n16384", "8") / program_order_ms(d, "grid-d128-n16384", "0")
          < 1.1, why="chunk 8 against head by head at B 1, H 16, N 16384, D 128 in 2026-12-05_program_order.csv"),
    Claim(C_DETAILS, "took the suite's `decode-long` backward (B 4, 32 heads, one row against 32k keys) from {} to {} "
                     "ms (cuDNN {}) and the grouped `decode-gqa` from {} to {} ms, {}× faster than cuDNN's",
          lambda d: (decode_backward_ms("decode-long", "ordinary"), decode_backward_ms("decode-long", "split"),
                     decode_backward_ms("decode-long", "cudnn"), decode_backward_ms("decode-gqa", "ordinary"),
                     decode_backward_ms("decode-gqa", "split"),
                     decode_backward_ms("decode-gqa", "cudnn") / decode_backward_ms("decode-gqa", "split"))),
    Claim(PERF_MODELS, "| B 1 · Nk 32768 (64 splits) | {} | {} | {} | {} |",
          lambda d: tuple(decode_h100_us("merges", "b1-gqa-32k", c)
                          for c in ("merge-after", "merge-early", "merge-fused", "cudnn"))),
    Claim(PERF_MODELS, "| decode-gqa (4 splits) | {} | {} | {} | {} |",
          lambda d: tuple(decode_h100_us("merges", "decode-gqa", c)
                          for c in ("merge-after", "merge-early", "merge-fused", "cudnn"))),
    Claim(PERF_MODELS, "| decode-gqa: B 16 · H 32/8 · 8k (128 KV heads) | {} | **{}** | {} | {} |",
          lambda d: (decode_h100_us("one_chunk", "decode-gqa", "default"),
                     decode_h100_us("one_chunk", "decode-gqa", "chunks-1", "128", "3"),
                     decode_h100_us("one_chunk", "decode-gqa", "chunks-2", "128", "3"),
                     decode_h100_us("one_chunk", "decode-gqa", "cudnn")), rel=0.002),
    Claim(PERF_MODELS, "| B 4 · H 32 · 32k (128) | {} | **{}** | {} | {} |",
          lambda d: (decode_h100_us("one_chunk", "decode-long", "default"),
                     decode_h100_us("one_chunk", "decode-long", "chunks-1", "128", "3"),
                     decode_h100_us("one_chunk", "decode-long", "chunks-2", "128", "3"),
                     decode_h100_us("one_chunk", "decode-long", "cudnn")), rel=0.002),
    *[Claim(PERF_MODELS, f"| {label} | {{}} | **{{}}** | {{}} | {{}} | {{}} | {{}} |",
            lambda d, cell=cell: plans_row(cell), rel=0.002)
      for label, cell in (("B 1 · H 32/8 · 4k", "b1-gqa-4k"), ("B 1 · H 32/8 · 128k", "b1-gqa-128k"),
                          ("B 1 · H 32 · 32k", "b1-mha-32k"), ("decode-gqa: B 16 · H 32/8 · 8k", "decode-gqa"),
                          ("decode-long: B 4 · H 32 · 32k", "decode-long"))],
    *[Claim(PERF_MODELS, f"| {cell} | {{}} / {{}} | {{}} / {{}} | {{}} / {{}} |",
            lambda d, cell=cell: h100_suite_ratios(cell), rel=0.0005)
      for cell in ("decode-gqa", "decode-long", "long-context", "short")],
    Claim(PERF_MODELS, "the chosen tiles at one, two and three stages took {}, {} and {} µs of GPU time",
          lambda d: tuple(h100_experiment_us("2026-12-06_suite_configs_tiny_short.csv", "tiny", c)
                          for c in ("M64-N64-w4-s1", "M64-N64-w4-s2", "chosen")), rel=0.002),
    Claim("docs/performance-log/tuning.md", "distinct kernels): the split kernel spills at most {} B anywhere",
          lambda d: (split_fp32_spill_bytes(),), rel=0),
    *[Claim("docs/performance-log/backward.md", f"| {label} ({{}}; {{}}) | {{}} | {{}} | {{}} | {mark} |",
            lambda d, cell=cell: switch_row(cell), rel=0.002)
      for label, cell, mark in (("bert-base: B 64 · H 12 · N 512 · D 64", "bert-base", "**{}**"),
                                ("vit-l: B 32 · H 16 · N 257 · D 64", "vit-l", "**{}**"),
                                ("short: B 128 · H 16 · N 128 · D 64", "short", "**{}**"),
                                ("few-heads: B 2 · H 2 · N 8192 · D 64", "few-heads", "**{}**"),
                                ("FA grid: B 4 · H 32 · N 4096 · D 64", "fa-d64", "**{}**"),
                                ("the same, causal", "fa-d64-causal", "{}"),
                                ("llama2-7b: D 128, causal", "llama2-7b", "{}"))],
    Claim("docs/performance-log/backward.md",
          "stage C's fused dK/dV kernel took {} ms against cuDNN's main kernel's {}, with its tensor pipe {} % "
          "busy against {} %, and {} warps stalled at a barrier per issued instruction against cuDNN's {}, {} on a "
          "long scoreboard (a global or local load) against {}.", lambda d: bwd_ncu_d64(), rel=0.002),
    Claim("docs/performance-log/backward.md",
          "bert-base {} → {} of cuDNN, vit-l {} → {}, few-heads {} → {}, short {} → {}",
          lambda d: tuple(h100_suite_ratios(cell, (run,))[0] for cell in ("bert-base", "vit-l", "few-heads", "short")
                          for run in ("2026-12-06T05:32:01.095872Z", "2026-12-06T08:21:03.850182Z")), rel=0.006),
    *[Claim(PERF_MODELS, f"| {label} | {{}} / {{}} | {{}} / {{}} | **{{}} / {{}}** | {{}} / {{}} |",
            lambda d, run=run: tiny_tma_row(run), rel=0.002) for run, label in enumerate(("first", "second"))],
    *[Claim("docs/performance-log/measurement.md", f"| {row} | {{}}, {{}} | {after} |",
            lambda d, label=label: host_descriptor_us(label), rel=0.001)
      for row, label, after in (
          ("stage C's backward called directly (Δ, then dK/dV with fused dQ: seven descriptors)",
           "stage C attention_backward, direct", "**{}, {}**"),
          ("the same on another thread (where autograd runs it)", "stage C attention_backward, direct, on another thread",
           "{}, {}"),
          ("`autograd.grad` through stage C", "autograd.grad, stage c", "{}, {}"),
          ("`autograd.grad` through SDPA's cuDNN backend", "autograd.grad, SDPA CUDNN_ATTENTION", "{}, {}"))],
    *[Claim("docs/performance-log/backward.md",
            f"| {label} | {{}} | {{}} ({before}) | {{}} ({after}) | -{{}} % | {{}} → {mark} |",
            lambda d, cell=cell: group_order_row(cell), rel=0.003)
      for label, cell, before, after, mark in (
          ("llama3-8b", "llama3-8b", "8, 8", "1g2, 6", "**{}**"), ("llama2-7b", "llama2-7b", "8, 18", "1g8, 16", "{}"),
          ("odd-n", "odd-n", "8, 34", "1g32, 60", "{}"), ("grid D 64, N 4096", "grid-d64-n4096", "8, 18", "1g4, 8", "{}"),
          ("grid D 128, N 4096", "grid-d128-n4096", "8, 18", "1g4, 8", "{}"))],
    Claim("docs/performance-log/backward.md",
          "The dK/dV kernel read {} MB from DRAM and wrote {} where cuDNN's read {} and wrote {}.",
          lambda d: tuple(ncu_order("", order, f"dram__bytes_{rw}.sum") / 1e6
                          for order in ("chunks of 8", "cuDNN") for rw in ("read", "write")), rel=0.003),
    Claim("docs/performance-log/backward.md",
          "the grid cell's dK/dV kernel read {} MB and wrote {} (cuDNN {} and {}), {} ms against {} (cuDNN's main "
          "kernel {}); Llama 3 8B's read {} GB, {} ms against {} (cuDNN {})",
          lambda d: (ncu_order("", "chunks of 1", "dram__bytes_read.sum") / 1e6,
                     ncu_order("", "chunks of 1", "dram__bytes_write.sum") / 1e6,
                     ncu_order("", "cuDNN", "dram__bytes_read.sum") / 1e6,
                     ncu_order("", "cuDNN", "dram__bytes_write.sum") / 1e6,
                     ncu_order("", "chunks of 1", "gpu__time_duration.sum") / 1e6,
                     ncu_order("", "chunks of 8", "gpu__time_duration.sum") / 1e6,
                     ncu_order("", "cuDNN", "gpu__time_duration.sum") / 1e6,
                     ncu_order("llama3-8b", "chunks of 1", "dram__bytes_read.sum") / 1e9,
                     ncu_order("llama3-8b", "chunks of 1", "gpu__time_duration.sum") / 1e6,
                     ncu_order("llama3-8b", "chunks of 8", "gpu__time_duration.sum") / 1e6,
                     ncu_order("llama3-8b", "cuDNN", "gpu__time_duration.sum") / 1e6), rel=0.005),
    Claim("docs/performance-log/backward.md",
          "llama3-8b from 0.91–0.92 to {} / {} of the fastest SDPA backward (eager / GPU-only)",
          lambda d: h100_suite_ratios("llama3-8b", ("2026-12-06T11:06:36.962924Z",)), rel=0.006),
    Claim(PERF_MODELS, "C {}, {}\nand {} µs, cuDNN {}, {} and {}, a copy of the same bytes {}, {} and {}",
          lambda d: flush_cell_us("short"), rel=0.002),
    Claim(PERF_MODELS, "`tiny` took {} µs eager and {} µs GPU-only against stage B's {} and {}",
          lambda d: h100_suite_us("tiny", "c", ONE_KEY_TILE_SUITE_RUN) + h100_suite_us("tiny", "b", ONE_KEY_TILE_SUITE_RUN),
          rel=0.005),
    Claim(PERF_MODELS, "`short` read {} / {} of cuDNN (eager / GPU-only), as before, and `decode-long` {} / {}",
          lambda d: h100_suite_ratios("short", (ONE_KEY_TILE_SUITE_RUN,))
          + h100_suite_ratios("decode-long", (ONE_KEY_TILE_SUITE_RUN,)), rel=0.006),
    Claim(PERF_MODELS, "{} µs for B's, {} for C's",
          lambda d: (ncu_duration_us("64", "b"), ncu_duration_us("64", "c")), rel=0.002),
    *[Claim("docs/performance-log/backward.md", f"| {cell} | " + " | ".join(["{} / {}"] * 9) + " |",
            lambda d, cell=cell: ncu_cells_row(cell), rel=0.002)
      for cell in ("D 128, N 4096", "llama3-8b", "few-heads", "D 64, N 1024")],
    Claim(NB["08"], "counted {} warps waiting at a barrier per issued instruction, against cuDNN's {}",
          lambda d: bwd_ncu_d64()[4:6], rel=0.002),
    Claim(NB["08"], "the dK/dV kernel (at D 32 it is ahead",
          lambda d: all(c > n for c, n in bwd_pairs(d, "c", "sdpa_cudnn", (32,))), why="the bwd fp16 grid rows"),
]


@pytest.fixture(scope="module")
def data() -> Data:
    d = Data(ROOT / "results" / "h200")
    if not (d.dir / "runs.csv").exists():
        pytest.skip("results/h200/runs.csv is not committed")
    return d


def _claim_id(c: Claim) -> str:
    where = c.path.replace("stages/", "").replace("/README.md", "").replace("notebooks/", "")
    return f"{where.split('_')[0] if where.endswith('.ipynb') else where}:{c.quote[:40]}"


@pytest.mark.parametrize("claim", CLAIMS, ids=[_claim_id(c) for c in CLAIMS])
def test_claim_matches_the_results(claim: Claim, data: Data):
    verdict = check(claim, data, ROOT)
    assert verdict.ok, verdict.message


def test_moved_generated_blocks_are_current():
    """The ablation block moved from the stage C README to docs/stage-c-details.md: still generated,
    still what `harness report` makes of results/h200 (tests/test_plots_report.py checks the others)."""
    from harness import report

    for name in (C_DETAILS,):
        diff = report.check_readme(ROOT / name, ROOT / "results" / "h200")
        assert diff == "", f"{name}: run `python -m harness report results/h200 --readme {name}`\n{diff}"


# ------------------------------------------------------------------------------ the checker itself

def test_agrees_reads_the_printed_precision():
    assert agrees("3.9", 3.947, rel=0.0) and agrees("82", 81.56, rel=0.0)
    assert not agrees("2.5", 3.947, rel=0.03)
    assert agrees("1,879", 1879.4, rel=0.0) and agrees("119", 119.5, rel=0.0)


def test_check_finds_a_wrapped_quote_and_names_a_wrong_number(tmp_path):
    (tmp_path / "r.md").write_text("B moves 261 MB\nin 1.97 ms.\n")
    data = object()
    good = Claim("r.md", "moves {} MB in {} ms", lambda d: (260.96, 1.970))
    bad = Claim("r.md", "moves {} MB in {} ms", lambda d: (260.96, 2.5))
    missing = Claim("r.md", "moves {} GB", lambda d: (1,))
    assert check(good, data, tmp_path).ok
    verdict = check(bad, data, tmp_path)
    assert not verdict.ok and "1.97" in verdict.message and "2.5" in verdict.message
    assert "not in the text" in check(missing, data, tmp_path).message


def test_notebook_prose_is_its_markdown_cells(tmp_path):
    import json

    nb = {"cells": [{"cell_type": "markdown", "source": ["TFLOPS rise\n", "with N"]},
                    {"cell_type": "code", "source": "print('12 µs')", "outputs": []}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (tmp_path / "x.ipynb").write_text(json.dumps(nb))
    assert prose_of(tmp_path / "x.ipynb") == fold("TFLOPS rise with N")


# ------------------------------------------------------------------------------ sources and links

#: the lessons and their records: what this file holds to public sources and working links
LESSON_FILES = [A_README, B_README, C_README, TWINS, C_DETAILS, GLOSSARY, "notebooks/README.md",
                *(p for n, p in NB.items() if n < "09"),
                *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs" / "performance-log").glob("*.md"))]
#: anchors the top-level README links to (docs/glossary.md#...): headings must keep them
GLOSSARY_ANCHORS = ("tma", "warp-specialization", "cpasync", "gluon", "warpgroup", "ping-pong", "hbm",
                    "sram--shared-memory")


def github_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-' (``cp.async`` -> ``cpasync``, ``SRAM / shared memory`` -> ``sram--shared-memory``)."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = re.match(r"#{1,6} (.+)", line)
        if m and not in_code:
            a = github_anchor(m.group(1))
            out.add(a if a not in seen else f"{a}-{seen[a]}")
            seen[a] = seen.get(a, 0) + 1
    return out


def links_of(rel: str) -> list[str]:
    """The link targets of a lesson file (a notebook's markdown cells), http(s) ones left out."""
    text = prose_of(ROOT / rel) if rel.endswith(".ipynb") else (ROOT / rel).read_text()
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code: `kernel[grid](...)` is no link
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("rel", LESSON_FILES)
def test_lessons_cite_public_sources(rel):
    """No "seed article" a reader cannot find, no tracker issue numbers a reader does not have."""
    text = prose_of(ROOT / rel) if rel.endswith(".ipynb") else (ROOT / rel).read_text()
    if rel.endswith(".ipynb"):  # code comments and strings count too
        import json

        text += "\n".join("".join(c["source"]) for c in json.loads((ROOT / rel).read_text())["cells"])
    for pattern in (r"seed article", r"\bthe seed\b", r"\bseed example", r"\bissues?\s+#?\d+(?![.\d])"):
        found = re.search(pattern, text, re.IGNORECASE)
        assert not found, f"{rel}: {found.group(0)!r}; cite a public source or say it in the project's words"


@pytest.mark.parametrize("rel", LESSON_FILES)
def test_lesson_links_resolve(rel):
    """Every relative link of a lesson names a file that exists, and an anchor into a Markdown file
    names one of its headings (the glossary's above all)."""
    base = (ROOT / rel).parent
    for target in links_of(rel):
        path_part, _, anchor = target.partition("#")
        dest = (base / path_part).resolve() if path_part else ROOT / rel
        assert dest.exists(), f"{rel}: link to {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors_of(dest), f"{rel}: link to {target}: no heading with that anchor"


def test_glossary_keeps_the_anchors_others_link_to():
    anchors = anchors_of(ROOT / GLOSSARY)
    assert set(GLOSSARY_ANCHORS) <= anchors, set(GLOSSARY_ANCHORS) - anchors
    assert github_anchor("cp.async") == "cpasync" and github_anchor("SRAM / shared memory") == "sram--shared-memory"


def test_every_glossary_link_in_the_repo_lands_on_a_heading():
    """Links into docs/glossary.md from anywhere (the top README included) name one of its headings."""
    anchors = anchors_of(ROOT / GLOSSARY)
    files = [p for p in ROOT.rglob("*") if p.suffix in (".md", ".ipynb") and ".venv" not in p.parts
             and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    bad = []
    for p in files:
        for anchor in re.findall(r"glossary\.md#([\w\-]+)", p.read_text(errors="replace")):
            if anchor not in anchors:
                bad.append(f"{p.relative_to(ROOT)}: #{anchor}")
    assert not bad, "links to glossary anchors that do not exist:\n" + "\n".join(sorted(set(bad)))
