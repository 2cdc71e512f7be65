"""The table ``compare`` prints (rich), and the speedup arithmetic behind it.

TFLOPS count visible (query, key) pairs, the backward 2.5× the forward (:data:`FOOTER` says it
under the table). Speedup columns are derived, not stored: ``×prev`` is the previous stage's median time over this
row's (for ``+`` ablation steps: the previous step, the first step against stage B; for other
ablation rows: the ``all`` row of the same stage), ``×A`` is stage A's median over this row's.
"""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

INTERPRETER_NOTE = "times are CPU-interpreter times, not GPU times"

#: printed under every table: how TFLOPS are counted (the convention of ``harness.views.flops``)
FOOTER = ("TFLOPS count the FLOPs of one call: forward 4·B·Hq·Nq·Nk·D, causal counting only the visible "
          "(query, key) pairs (about half); backward 2.5× the forward's, forward + backward 3.5×. "
          "DRAM model = bytes the kernels request (no cache); ×prev/×A = time ratios.")
GRAPH_NOTE = ("ms = the eager call, host path included (TFLOPS use it); ms GPU = the same call replayed from a "
              "CUDA graph, the GPU's work alone: the gap is the launch overhead.")


def _ok_ms(row: dict | None) -> float | None:
    if row and row.get("status") == "ok" and row.get("ms_median"):
        return float(row["ms_median"])
    return None


def _ratio(base: dict | None, row: dict) -> float | None:
    a, b = _ok_ms(base), _ok_ms(row)
    return a / b if a and b else None


def speedups(rows: list[dict]) -> list[tuple[float | None, float | None]]:
    """(×prev, ×A) for each row, in order (None where not defined)."""
    out = []
    stage_a = next((r for r in rows if r["impl"] == "a" and r["kind"] == "stage"), None)
    by_stage = {r["impl"]: r for r in rows if r["kind"] == "stage"}
    prev_stage = None
    last_plus: dict[str, dict] = {}
    for r in rows:
        prev = None
        if r["kind"] == "stage":
            prev, prev_stage = prev_stage, r
        elif r["kind"] == "ablation":
            variant = r.get("variant") or ""
            if variant.startswith("+"):
                prev = last_plus.get(r["impl"]) or by_stage.get("b")
                last_plus[r["impl"]] = r
            elif variant != "all":
                prev = next((x for x in rows if x["impl"] == r["impl"] and x.get("variant") == "all"), None)
        out.append((_ratio(prev, r), _ratio(stage_a, r)))
    return out


def _mb(value) -> str:
    return "" if value is None or value == "" else f"{value / 1e6:,.2f}"


def _num(value, fmt: str) -> str:
    return "" if value is None or value == "" else format(value, fmt)


def _x(value) -> str:
    return "" if value is None else f"{value:.2f}×"


def compare_table(rows: list[dict], title: str = "") -> Table:
    with_ncu = any(r.get("dram_read_measured") is not None for r in rows)
    with_energy = any(r.get("energy_j_per_call") is not None for r in rows)
    with_mem = any(r.get("peak_mem_measured") is not None for r in rows)
    with_graph = any(r.get("ms_gpu") is not None for r in rows)
    table = Table(title=title, header_style="bold", show_lines=False)
    table.add_column("impl", no_wrap=True)
    table.add_column("ms median\n(p20–p80)", justify="right")
    if with_graph:
        table.add_column("ms GPU\n(graph)", justify="right")
    table.add_column("TFLOPS", justify="right")
    table.add_column("×prev", justify="right")
    table.add_column("×A", justify="right")
    table.add_column("DRAM MB\nmodel", justify="right")
    if with_ncu:
        table.add_column("DRAM MB\nncu", justify="right")
        table.add_column("L2 hit\n%", justify="right")
        table.add_column("bank confl.\nmeasured", justify="right")
    table.add_column("peak MB\nmodel", justify="right")
    if with_mem:
        table.add_column("peak MB\nmeasured", justify="right")
    if with_energy:
        table.add_column("J/call", justify="right")
        table.add_column("W", justify="right")
    table.add_column("rel err", justify="right")
    table.add_column("torch err", justify="right")
    table.add_column("status")
    for r, (x_prev, x_a) in zip(rows, speedups(rows)):
        ms = ""
        if r.get("ms_median") is not None:
            ms = f"{r['ms_median']:.3f} ({r['ms_p20']:.3f}–{r['ms_p80']:.3f})"
        model = None
        if r.get("dram_read_model") is not None:
            model = r["dram_read_model"] + r["dram_write_model"]
        cells = [r["impl"] + (f" {r['variant']}" if r.get("variant") else ""), ms]
        if with_graph:
            cells.append(_num(r.get("ms_gpu"), ".3f"))
        cells += [_tflops(r.get("tflops")), _x(x_prev), _x(x_a), _mb(model)]
        if with_ncu:
            meas = None
            if r.get("dram_read_measured") is not None:
                meas = r["dram_read_measured"] + (r.get("dram_write_measured") or 0)
            cells += [_mb(meas), _num(r.get("l2_hit_rate_pct"), ".1f"), _num(r.get("smem_bank_conflicts"), ",d")]
        cells.append(_mb(r.get("peak_mem_model")))
        if with_mem:
            cells.append(_mb(r.get("peak_mem_measured")))
        if with_energy:
            cells += [_num(r.get("energy_j_per_call"), ".4f"), _num(r.get("power_w"), ".0f")]
        status = r.get("status", "")
        style = "" if status == "ok" else ("yellow" if status.startswith(("unsupported", "oom")) else "red")
        cells += [_num(r.get("rel_err"), ".2e"), _num(r.get("torch_rel_err"), ".2e"),
                  f"[{style}]{status}[/{style}]" if style else status]
        table.add_row(*cells)
    return table


def print_compare(rows: list[dict], console: Console, *, title: str, interpreted: bool, footer: list[str]) -> None:
    console.print(compare_table(rows, title))
    console.print(FOOTER)
    if any(r.get("ms_gpu") is not None for r in rows):
        console.print(GRAPH_NOTE)
    if interpreted:
        console.print(f"[bold yellow]Note: {INTERPRETER_NOTE}[/bold yellow] (Triton interpreter on the CPU; "
                      "errors and models are real, speed is not).")
    for line in footer:
        console.print(line)


def _tflops(value) -> str:
    if value is None or value == "":
        return ""
    return f"{value:.1f}" if value >= 10 else f"{value:.3g}"
