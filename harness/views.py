"""Selecting and summarising result rows: what the figures (``harness.plots``) and the README table
(``harness.report``) both need, written once.

Everything here is plain data work on the typed rows of :func:`harness.results.load_rows`; no
matplotlib, no torch. Units: bytes, ms, FLOPs, as in the CSV.
"""

from __future__ import annotations

from .results import ResultsError, latest_rows, load_env, load_rows

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


def load(results_dir) -> tuple[list[dict], dict]:
    """The de-duplicated rows of ``results_dir/runs.csv`` and its ``env.json``.

    A missing or malformed CSV raises :class:`ResultsError`; a missing ``env.json`` does not (the
    figures then carry no GPU name), because the rows alone are enough to draw from.
    """
    all_rows = load_rows(results_dir)
    rows = merge_profile(merge_energy(latest_rows(all_rows), all_rows), results_dir)
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

    from .results import cell_key

    path = Path(results_dir) / "profile" / "runs.csv"
    if not path.exists():
        return rows
    profiled = {cell_key(r): r for r in latest_rows(load_rows(path)) if is_ok(r)}
    merged = []
    for row in rows:
        prof = profiled.pop(cell_key(row), None)
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
    """Per cell (``results.cell_key``), the latest ``ok`` row that has energy measured, whatever
    came after it. ``all_rows`` in file order (the order ``load_rows`` returns)."""
    from .results import cell_key

    found: dict[tuple, dict] = {}
    for r in all_rows:
        if has_energy(r):
            found[cell_key(r)] = r
    return found


def merge_energy(rows: list[dict], all_rows: list[dict]) -> list[dict]:
    """Give each latest row of a cell the energy of that cell's latest run that measured it.

    The views keep the latest row of each cell, so a sweep without ``--energy`` would otherwise hide
    the energy an earlier sweep measured. A row whose own run measured energy keeps it; a row that
    borrows it gets ``energy_run_id`` = the run it came from (its own run_id otherwise), so a figure
    or table can say which run its energy shows. Energy is per call at that run's clocks: it is
    not rescaled to the borrowing row's time.
    """
    from .results import cell_key

    measured = latest_energy_rows(all_rows)
    out = []
    for row in rows:
        source = row if has_energy(row) else measured.get(cell_key(row))
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


def flops(row: dict) -> float:
    """Forward FLOPs of the row's problem: 4·B·H·N²·D, half of it for causal."""
    full = 4.0 * row["B"] * row["H"] * row["N"] ** 2 * row["D"]
    return full / 2 if row["causal"] else full


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
