"""Selecting and summarising result rows: what the figures (``harness.plots``) and the README table
(``harness.report``) both need, written once.

Everything here is plain data work on the typed rows of :func:`harness.results.load_rows`; no
matplotlib, no torch. Units: bytes, ms, FLOPs, as in the CSV.
"""

from __future__ import annotations

from .results import ResultsError, cell_key, load_env, load_rows

#: Display order and labels. Unknown impls (a learner's own kernel) sort after these, by name.
IMPL_ORDER: tuple[str, ...] = ("a", "b", "c", "b_cuda", "c_cuda",
                               "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")
IMPL_LABELS: dict[str, str] = {
    "a": "A naive", "b": "B tiled", "c": "C optimized",
    "b_cuda": "B (CUDA C++)", "c_cuda": "C (CUDA C++)",
    "sdpa_flash": "SDPA FLASH (FA2)", "sdpa_cudnn": "SDPA CUDNN",
    "sdpa_efficient": "SDPA EFFICIENT", "sdpa_math": "SDPA MATH",
}

#: The cell the README and the waterfall lead with: long enough that A's N² traffic dominates.
HEADLINE_N = 4096
HEADLINE_DS = (64, 128)

#: Which command produces which kind of data, for the "skipped: ..." messages. One place to fix
#: if the CLI's subcommand names change.
HINTS = {
    "rows": "python -m harness sweep",
    "bwd": "python -m harness sweep --pass bwd",
    "models": "python -m harness sweep --suite models",
    "shapes": "results/publish.sh shapes",
    "latency": "python -m harness latency --pass fwd,bwd",
    "train": "python -m harness train --stages c,sdpa --compile off|inductor|cudagraphs",
    "peers": "python -m harness compare",
    "dram": "python -m harness profile",
    "ablation": "python -m harness sweep --ablation",
    "energy": "python -m harness sweep --energy",
    "ceilings": "python -m harness device",
}


def label(impl: str) -> str:
    return IMPL_LABELS.get(impl, impl)


def impl_sort_key(impl: str) -> tuple:
    return (IMPL_ORDER.index(impl), "") if impl in IMPL_ORDER else (len(IMPL_ORDER), impl)


def row_key(row: dict) -> tuple:
    """What identifies a measured cell here: ``results.cell_key`` (impl, variant, shape, dtype,
    masking, pass) and the suite cell's name, so a suite cell of the same shape as a grid cell is a
    cell of its own rather than a re-measurement of the grid cell."""
    return cell_key(row) + (row.get("cell") or "",)


def latest_rows(rows) -> list[dict]:
    """The last row of each :func:`row_key` (a re-measured cell replaces the older one), in first-seen order."""
    by_key: dict[tuple, dict] = {}
    for r in rows:
        by_key[row_key(r)] = r
    return list(by_key.values())


def grid_rows(rows: list[dict], pass_: str = "fwd") -> list[dict]:
    """The rows of one pass (``fwd``, ``bwd`` or ``fwd_bwd``) on the self-attention grid: as many
    K/V heads as query heads (Hkv = H), as many keys as queries (Nk = N), and not a suite's named
    cell. Every table and figure keyed by (N, D, dtype, causal) draws from these, because a results
    folder may also hold backward rows, GQA or cross-length cells (``sweep --pass bwd``, ``--Hkv``,
    ``--Nk``) that share those four numbers with a grid cell and would otherwise be mixed into it.
    Rows of older files (without those columns) are forward grid rows."""
    return [r for r in rows if (r.get("pass") or "fwd") == pass_ and (r.get("Hkv") or r["H"]) == r["H"]
            and (r.get("Nk") or r["N"]) == r["N"] and not r.get("cell")]


def forward_grid(rows: list[dict]) -> list[dict]:
    """:func:`grid_rows` of the forward pass: what the forward figures and README tables are made of."""
    return grid_rows(rows, "fwd")


def load(results_dir, *, forward_only: bool = True) -> tuple[list[dict], dict]:
    """The de-duplicated rows of ``results_dir/runs.csv`` and its ``env.json``.

    ``forward_only`` (the default) keeps the :func:`forward_grid` rows, the ones the forward figures
    and tables are made for, so backward, GQA and suite rows in the same file change none of them;
    ``forward_only=False`` returns every row (the backward figures select theirs).
    A missing or malformed CSV raises :class:`ResultsError`; a missing ``env.json`` does not (the
    figures then carry no GPU name), because the rows alone are enough to draw from.
    """
    all_rows = load_rows(results_dir)
    if forward_only:
        all_rows = forward_grid(all_rows)
    rows = merge_profile(merge_energy(latest_rows(all_rows), all_rows), results_dir)
    if forward_only:
        rows = forward_grid(rows)  # profiled cells of other passes or shapes, added by merge_profile
    try:
        env = load_env(results_dir)
    except ResultsError as e:
        if "no provenance file" not in str(e):
            raise
        env = {}
    return rows, env


#: what ``harness profile`` measures; it writes to ``<results>/profile/runs.csv`` so that its rows
#: (which have no times) do not replace the timed rows of the same cell.
PROFILE_COLUMNS = ("dram_read_measured", "dram_write_measured", "l2_hit_rate_pct", "smem_bank_conflicts")


def merge_profile(rows: list[dict], results_dir) -> list[dict]:
    """Fill the Nsight Compute columns of ``rows`` from ``results_dir/profile/runs.csv`` where a
    profiled row of the same cell exists; profiled cells with no timed row are added as they are."""
    from pathlib import Path

    path = Path(results_dir) / "profile" / "runs.csv"
    if not path.exists():
        return rows
    profiled = {row_key(r): r for r in latest_rows(load_rows(path)) if is_ok(r)}
    merged = []
    for row in rows:
        prof = profiled.pop(row_key(row), None)
        if prof is not None:
            row = {**row, **{c: prof[c] for c in PROFILE_COLUMNS if prof[c] is not None}}
        merged.append(row)
    return merged + list(profiled.values())


#: what ``sweep --energy`` measures beside the time (NVML, over a >= 2 s loop). A later sweep of the
#: same cell without ``--energy`` leaves them empty; :func:`merge_energy` keeps the measured ones.
ENERGY_COLUMNS = ("energy_j_per_call", "power_w")


def has_energy(row: dict) -> bool:
    return is_ok(row) and row.get("energy_j_per_call") is not None


def latest_energy_rows(all_rows: list[dict]) -> dict[tuple, dict]:
    """Per cell (:func:`row_key`), the latest ``ok`` row that has energy measured, whatever
    came after it. ``all_rows`` in file order (the order ``load_rows`` returns)."""
    found: dict[tuple, dict] = {}
    for r in all_rows:
        if has_energy(r):
            found[row_key(r)] = r
    return found


def merge_energy(rows: list[dict], all_rows: list[dict]) -> list[dict]:
    """Give each latest row of a cell the energy of that cell's latest run that measured it.

    The views keep the latest row of each cell, so a sweep without ``--energy`` would otherwise hide
    the energy an earlier sweep measured. A row whose own run measured energy keeps it; a row that
    borrows it gets ``energy_run_id`` = the run it came from (its own run_id otherwise), so a figure
    or table can say which run its energy shows. Energy is per call at that run's clocks: it is
    not rescaled to the borrowing row's time.
    """
    measured = latest_energy_rows(all_rows)
    out = []
    for row in rows:
        source = row if has_energy(row) else measured.get(row_key(row))
        if source is None:
            out.append(row)
            continue
        out.append({**row, **{c: source.get(c) for c in ENERGY_COLUMNS}, "energy_run_id": source.get("run_id")})
    return out


def energy_runs(rows: list[dict]) -> list[str]:
    """The runs the energy of ``rows`` comes from (sorted), for a figure's caption."""
    return sorted({str(r.get("energy_run_id") or r.get("run_id")) for r in rows if has_energy(r)})


def is_ok(row: dict) -> bool:
    return row["status"] == "ok"


def is_oom(row: dict) -> bool:
    return row["status"] == "oom"


def plain(rows: list[dict]) -> list[dict]:
    """Stage and peer rows (no ablation variants)."""
    return [r for r in rows if r["kind"] in ("stage", "peer")]


def select(rows: list[dict], **match) -> list[dict]:
    """Rows whose columns equal every ``column=value`` given (``causal`` compares as 0/1)."""
    out = []
    for r in rows:
        if all((int(r[k]) == int(v)) if k == "causal" else (r[k] == v) for k, v in match.items()):
            out.append(r)
    return out


#: FLOPs of a pass as a multiple of the forward's (the FlashAttention papers' convention: the
#: backward does five matmuls to the forward's two; a training step is both).
#: how the README and the figures state the FLOP convention, written once
FLOP_CONVENTION = ("FLOPs = 4·B·Hq·Nq·Nk·D for the forward, causal counting only the visible (query, key) "
                   "pairs (about half); the backward 2.5× that, a training step 3.5×")


def flops(row: dict) -> float:
    """FLOPs of one call of the row's pass (:meth:`stages.contract.Problem.pass_flops`: 4·B·Hq·Nq·Nk·D
    forward, causal counting only the visible (query, key) pairs; backward 2.5×, training step 3.5×)."""
    from stages.contract import Problem

    # (the dtype does not change the count: a row without one is counted as fp16)
    problem = Problem(row["B"], row["H"], row["N"], row["D"], row.get("dtype") or "fp16", bool(row["causal"]),
                      row.get("Hkv") or row["H"], row.get("Nk") or row["N"])
    return problem.pass_flops(row.get("pass") or "fwd")


def dram_bytes(row: dict, which: str) -> int | None:
    """Read + write DRAM bytes, ``which`` = ``"model"`` or ``"measured"``; None unless both are there."""
    r, w = row.get(f"dram_read_{which}"), row.get(f"dram_write_{which}")
    return None if r is None or w is None else r + w


def by_impl(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["impl"], []).append(r)
    return dict(sorted(out.items(), key=lambda kv: impl_sort_key(kv[0])))


def one_per_n(rows: list[dict]) -> list[dict]:
    """One row per N, sorted by N: where a sweep holds several (B, H) at one N, the biggest problem
    (most tokens) represents it, because small problems under-fill the GPU and say less."""
    best: dict[int, dict] = {}
    for r in rows:
        old = best.get(r["N"])
        if old is None or r["B"] * r["H"] >= old["B"] * old["H"]:
            best[r["N"]] = r
    return [best[n] for n in sorted(best)]


def headline_n(rows: list[dict], *, D: int, dtype: str, causal: bool, preferred: int = HEADLINE_N) -> int | None:
    """``preferred`` if any stage/peer row is there, else the largest N with an ``ok`` row (a CPU run
    sweeps small N only), else None."""
    cand = select(plain(rows), D=D, dtype=dtype, causal=causal)
    if not cand:
        return None
    if any(r["N"] == preferred for r in cand):
        return preferred
    ok_ns = [r["N"] for r in cand if is_ok(r)]
    return max(ok_ns) if ok_ns else max(r["N"] for r in cand)


def cell_rows(rows: list[dict], *, N: int, D: int, dtype: str, causal: bool) -> list[dict]:
    """The rows of one (N, D, dtype, causal) cell at a single (B, H): the one most impls ran."""
    cand = select(rows, N=N, D=D, dtype=dtype, causal=causal)
    if not cand:
        return []
    shapes: dict[tuple, int] = {}
    for r in cand:
        shapes[(r["B"], r["H"])] = shapes.get((r["B"], r["H"]), 0) + 1
    B, H = max(shapes, key=lambda s: (shapes[s], s[0] * s[1]))
    return [r for r in cand if (r["B"], r["H"]) == (B, H)]


def walk_order(rows: list[dict]) -> list[dict]:
    """Ablation rows in their stage's walk order (the order of its ``variants``), not the order they
    were measured in: rungs measured in a later run still sit where they belong in the walk."""
    import stages

    orders = {impl: {name: i for i, name in enumerate(getattr(stages.STAGES.get(impl), "variants", None) or ())}
              for impl in {r["impl"] for r in rows}}

    def position(r: dict) -> int:
        order = orders[r["impl"]]
        return order.get(r["variant"], len(order))

    return sorted(rows, key=position)


def interpreted(rows: list[dict]) -> bool:
    return any(r.get("device") == "interpreter" for r in rows)


def provenance(env: dict, rows: list[dict]) -> str:
    """``'NVIDIA H200 · 2026-11-29'`` (+ a warning for interpreter rows): the corner stamp."""
    gpu = env.get("gpu_name") or "unknown GPU"
    date = str(env.get("date") or "")[:10] or "undated"
    text = f"{gpu} · {date}"
    if interpreted(rows):
        text += " · Triton interpreter rows: times are CPU times, not GPU times"
    return text


def ceilings(env: dict) -> tuple[float | None, dict[str, float]]:
    """(copy bandwidth in GB/s, {dtype: matmul TFLOPS}) from ``env.json``, whichever is recorded.

    Accepts ``harness.ceilings.measure_ceilings``'s flat keys (``copy_gbps``, ``matmul_fp16_tflops``)
    under ``env["ceilings"]`` or at the top level, and the nested form
    ``{"copy_bandwidth_gbps": .., "matmul_tflops": {"fp16": ..}}``; anything missing is left out.
    """
    found: dict = {}
    for source in (env, env.get("ceilings") if isinstance(env.get("ceilings"), dict) else {}):
        found.update({k: v for k, v in source.items() if v is not None})
    bw = found.get("copy_gbps") or found.get("copy_bandwidth_gbps")
    rates: dict[str, float] = {}
    nested = found.get("matmul_tflops")
    if isinstance(nested, dict):
        rates.update({k: float(v) for k, v in nested.items() if isinstance(v, (int, float))})
    for dtype in ("fp16", "bf16", "fp32"):
        v = found.get(f"matmul_{dtype}_tflops")
        if isinstance(v, (int, float)):
            rates[dtype] = float(v)
    return (float(bw) if isinstance(bw, (int, float)) else None), rates


def device_memory(env: dict) -> int | None:
    """The GPU's total memory in bytes (``memory_bytes`` or ``total_memory_bytes``), None if unrecorded."""
    v = env.get("memory_bytes") or env.get("total_memory_bytes")
    return int(v) if isinstance(v, (int, float)) else None


def fmt_bytes(n: float | None) -> str:
    """Decimal units (1 MB = 10⁶ bytes), three significant digits."""
    if n is None:
        return "—"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def fmt_num(x: float | None, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec)


# ------------------------------------------------------------------ the model suite and latency

#: where ``sweep --suite models`` writes, inside a results folder
SUITE_DIR = "models"


def load_suite(results_dir) -> list[dict]:
    """Every row of ``results_dir/models/runs.csv`` (all runs: :func:`suite_lines` pairs impls within
    one run); [] when the suite has not been run there. A malformed file raises :class:`ResultsError`."""
    from pathlib import Path

    path = Path(results_dir) / SUITE_DIR / "runs.csv"
    return load_rows(path) if path.exists() else []


def _best_peer(peers: list[dict], column: str) -> dict | None:
    timed = [r for r in peers if r.get(column)]
    return min(timed, key=lambda r: r[column]) if timed else None


def suite_cell_summary(rows: list[dict]) -> dict:
    """One suite cell's rows (of one run) summed up: ``c`` and ``b`` (the stage rows or None), the
    fastest ``ok`` SDPA backend by eager time (``best``) and by CUDA-graph time (``best_gpu``; may be
    another backend), and three throughput ratios, above 1 when stage C is faster:
    ``vs_best`` = best's ms_median / C's, ``vs_best_gpu`` = best_gpu's ms_gpu / C's ms_gpu,
    ``vs_b`` = B's ms_median / C's. A ratio is None where a side is missing or not ``ok``."""
    last = {r["impl"]: r for r in rows if r["kind"] in ("stage", "peer")}  # a run's last row of an impl wins
    c, b = last.get("c"), last.get("b")
    peers = [r for r in last.values() if r["kind"] == "peer" and is_ok(r)]
    best, best_gpu = _best_peer(peers, "ms_median"), _best_peer(peers, "ms_gpu")
    c_ok = c is not None and is_ok(c)

    def ratio(other: dict | None, column: str) -> float | None:
        if not (c_ok and other is not None and is_ok(other) and c.get(column) and other.get(column)):
            return None
        return other[column] / c[column]

    return {"cell": rows[0].get("cell") if rows else None, "shape": rows[0] if rows else None, "c": c, "b": b,
            "best": best, "best_gpu": best_gpu, "vs_best": ratio(best, "ms_median"),
            "vs_best_gpu": ratio(best_gpu, "ms_gpu"), "vs_b": ratio(b, "ms_median"),
            "run_id": rows[-1]["run_id"] if rows else None}


def _suite_order(names) -> list[str]:
    """Suite cell names in the order of ``harness.suites`` (the models suite first), then any others
    in the order first seen."""
    from .suites import SUITES

    known = [c.name for suite in SUITES.values() for c in suite]
    names = list(dict.fromkeys(names))
    return sorted(names, key=lambda n: (known.index(n), "") if n in known else (len(known), names.index(n)))


def _suite_rows(all_rows: list[dict], pass_: str):
    """The suite's stage and peer rows of one pass (a row without a pass is a forward one)."""
    return (r for r in all_rows
            if r.get("cell") and (r.get("pass") or "fwd") == pass_ and r["kind"] in ("stage", "peer"))


def suite_lines(all_rows: list[dict], pass_: str = "fwd") -> list[dict]:
    """:func:`suite_cell_summary` of each named cell, from the latest run that measured stage C in
    it (so C and its peers were timed in turns, side by side); a cell no run measured C in uses
    the latest run that measured it at all. Rows of one pass (``fwd``, ``bwd``), in suite order."""
    by_cell: dict[str, list[dict]] = {}
    for r in _suite_rows(all_rows, pass_):
        by_cell.setdefault(r["cell"], []).append(r)
    out = []
    for name in _suite_order(by_cell):
        rows = by_cell[name]
        runs_with_c = [r["run_id"] for r in rows if r["impl"] == "c"]
        run = max(runs_with_c) if runs_with_c else max(r["run_id"] for r in rows)
        out.append(suite_cell_summary([r for r in rows if r["run_id"] == run]))
    return out


def suite_runs(all_rows: list[dict], pass_: str = "fwd") -> dict[str, list[dict]]:
    """Per run (in time order): :func:`suite_cell_summary` of every cell that run measured stage C
    in, in suite order, rows of one pass: how each whole suite run went."""
    by_run: dict[str, dict[str, list[dict]]] = {}
    for r in _suite_rows(all_rows, pass_):
        by_run.setdefault(r["run_id"], {}).setdefault(r["cell"], []).append(r)
    out = {}
    for run in sorted(by_run):
        cells = by_run[run]
        lines = [suite_cell_summary(cells[n]) for n in _suite_order(cells)]
        lines = [line for line in lines if line["c"] is not None]
        if lines:
            out[run] = lines
    return out


#: where ``results/publish.sh shapes`` writes (the GQA prefill, head-dim 80/96 and decode cells of
#: the shape contract), inside a results folder
SHAPES_DIR = "shapes"


def load_shapes(results_dir) -> list[dict]:
    """Every row of ``results_dir/shapes/runs.csv`` (all runs: :func:`shape_lines` pairs impls within
    one run); [] when those cells have not been measured there. A malformed file raises
    :class:`ResultsError`."""
    from pathlib import Path

    path = Path(results_dir) / SHAPES_DIR / "runs.csv"
    return load_rows(path) if path.exists() else []


def shape_key(row: dict) -> tuple:
    """(B, Hq, Hkv, Nq, Nk, D, causal, dtype): what one shape-contract cell is."""
    return (row["B"], row["H"], row.get("Hkv") or row["H"], row["N"], row.get("Nk") or row["N"], row["D"],
            int(row["causal"]), row["dtype"])


def shape_lines(all_rows: list[dict]) -> list[dict]:
    """One :func:`suite_cell_summary` per shape (:func:`shape_key`), from the latest run that timed
    stage C there (so C and the SDPA backends were timed in turns), in the order the shapes first
    appear. Forward stage and peer rows only; shapes no run timed C in are left out. ``best`` is the
    fastest ``ok`` backend *of that run* (a run may have timed only some of them)."""
    by_shape: dict[tuple, list[dict]] = {}
    for r in all_rows:
        if (r.get("pass") or "fwd") == "fwd" and r["kind"] in ("stage", "peer"):
            by_shape.setdefault(shape_key(r), []).append(r)
    out = []
    for rows in by_shape.values():
        runs_with_c = [r["run_id"] for r in rows if r["impl"] == "c"]
        if runs_with_c:
            run = max(runs_with_c)
            out.append(suite_cell_summary([r for r in rows if r["run_id"] == run]))
    return out


def decode_bandwidth(row: dict) -> tuple[int, float] | None:
    """(bytes, GB/s) of a timed row: the bytes any kernel must move for its problem (Q, K and V read
    once, O written once: ``Problem.qkvo_bytes``) over its median time. Decimal GB (10⁹ bytes).
    None when the row is not ``ok`` or has no time."""
    from stages.contract import Problem

    if not (is_ok(row) and row.get("ms_median")):
        return None
    problem = Problem(row["B"], row["H"], row["N"], row["D"], row["dtype"], bool(row["causal"]),
                      Hkv=row.get("Hkv") or row["H"], Nk=row.get("Nk") or row["N"])
    moved = problem.qkvo_bytes
    return moved, moved / (row["ms_median"] * 1e-3) / 1e9


def load_latency(results_dir) -> list[dict]:
    """The rows of the latest run in ``results_dir/latency.csv`` (``python -m harness latency``),
    typed: ``us_per_call`` and ``x_floor`` floats (µs, multiple of the floor), ``calls`` and the
    shape ints; [] when there is no such file. A file without the expected columns, or with a
    number that does not parse, raises :class:`ResultsError` naming it and the line."""
    import csv
    from pathlib import Path

    from .latency import LATENCY_COLUMNS, LATENCY_CSV, LATENCY_DEFAULTS

    path = Path(results_dir) / LATENCY_CSV
    if not path.exists():
        return []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        # (a file from before a column existed lacks it: its rows mean LATENCY_DEFAULTS, the forward)
        missing = [c for c in LATENCY_COLUMNS if c not in (reader.fieldnames or ()) and c not in LATENCY_DEFAULTS]
        if missing:
            raise ResultsError(f"{path}: missing columns {missing}")
        rows = []
        for raw in reader:
            row = {**LATENCY_DEFAULTS, **raw}
            try:
                for c in ("us_per_call", "x_floor"):
                    row[c] = float(raw[c]) if raw.get(c) else None
                for c in ("B", "H", "N", "D", "causal", "calls"):
                    row[c] = int(raw[c]) if raw.get(c) else None
            except ValueError:
                raise ResultsError(f"{path}:{reader.line_num}: a number does not parse ({c}={raw.get(c)!r})") from None
            rows.append(row)
    if not rows:
        return []
    latest = max(r["run_id"] for r in rows)
    return [r for r in rows if r["run_id"] == latest]
