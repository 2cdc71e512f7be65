"""The results tables of a results folder, generated from its CSV files, never typed by hand.

    python -m harness report results/h200                        # print the forward tables
    python -m harness report results/h200 --update               # rewrite results/h200/README.md's tables
    python -m harness report results/h200 --update --readme README.md           # ... and the landing page's
    python -m harness report results/h200 --update --readme README.md --check   # exit 1 if either is stale

A file holds generated text between two marker lines, which stay in place::

    <!-- NAME:begin -->
    ... generated ...
    <!-- NAME:end -->

and ``report`` refills every block whose markers the file holds (:data:`BLOCKS`), with links
relative to that file. Two files are made from one results folder:

* the landing page (the top README) holds one block, ``headline`` (:func:`render_headline_block`):
  A → B → C → cuDNN at :data:`HEADLINE_CELL` (time, TFLOPS, DRAM bytes measured and modelled,
  speedup), a sentence reading it, the waterfall figure and a link to the results folder's README;
* the results folder's README (``--update`` writes it from :func:`results_page` when it does not
  exist, one section per :data:`RESULTS_PAGE_SECTIONS` entry, then only refills its blocks) holds
  the rest: ``results`` (:func:`render_block`: for each headline cell, N = 4096, D = 64 and 128,
  fp16, causal no/yes, every stage and peer with time, TFLOPS, speedup over A, DRAM bytes, peak
  extra memory, error, status; stage C's throughput over cuDNN's across N; a reading of the numbers;
  the figures), ``ablation`` (each optimization's measured share), ``backward`` (the ``pass = bwd``
  rows: stage C against SDPA FLASH and CUDNN), ``models`` (``sweep --suite models``,
  ``<results>/models/runs.csv``: stage C against the fastest SDPA backend per named cell, eager and
  CUDA-graph times), ``shapes`` (``<results>/shapes/runs.csv``: GQA prefill, head dims 80/96 and
  decode, decode's GB/s against the measured copy bandwidth), ``latency`` (``<results>/latency.csv``:
  host µs per call beside an empty Triton kernel), ``generate`` (``<results>/generate/runs.csv``:
  small transformers models decoding and training with each attention) and ``decode``
  (``<results>/decode.csv``: a decode loop whose cache grows by one key per call, against a fixed
  cache). ``generate`` and ``decode`` are refilled only when their file exists (:data:`BLOCK_DATA`).

Other files hold other blocks, filled by the same command with ``--readme``: ``ablation``
(docs/stage-c-details.md), ``twins`` (stage C's README: the Triton stages beside their CUDA C++ twins,
the bank-conflict model against Nsight Compute) and ``ratio`` (the race against cuDNN in docs/performance-log: C against cuDNN
over the whole grid, fp16 and bf16, and the latest runs side by side). A block whose data is not
there says which command produces it.

Every table keyed by (N, D, dtype, causal) reads :func:`harness.views.forward_grid` rows (or, for
the backward, :func:`harness.views.grid_rows` of ``bwd``), so backward, GQA and suite rows in the
same results file leave the forward tables as they were.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import statistics
import sys
from pathlib import Path

from . import views
from .results import ResultsError, load_env, load_rows
from .views import dram_bytes, fmt_bytes, fmt_num, is_ok, label, select

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

INLINE_FIGURES = ("waterfall.png", "throughput.png")

FIGURE_CAPTIONS = (
    ("waterfall.png", "A → B → C at the headline cell, stage C's optimizations one by one"),
    ("throughput.png", "TFLOPS vs N, stages and SDPA backends"),
    ("dram_bytes.png", "DRAM bytes vs N: traffic model and Nsight Compute measurement"),
    ("peak_memory.png", "peak extra memory vs N, OOM points"),
    ("roofline.png", "roofline with the device's measured ceilings"),
    ("energy.png", "energy per call and TFLOP per joule"),
    ("bandwidth_share.png", "achieved DRAM bandwidth as a share of the copy bandwidth, beside time"),
)


class ReadmeError(ValueError):
    """The README lacks the results markers (or has them twice, or out of order)."""


def _cell_title(N: int, D: int, dtype: str, causal: int, B: int | None = None, H: int | None = None) -> str:
    shape = f" (B = {B}, H = {H})" if B is not None else ""
    return f"N = {N}, D = {D}, {dtype}, {'causal' if causal else 'non-causal'}{shape}"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _speedup(row: dict, base: dict | None) -> str:
    if base is None or not (is_ok(base) and is_ok(row)) or not base["ms_median"] or not row["ms_median"]:
        return "—"
    return f"{base['ms_median'] / row['ms_median']:.2f}×"


def _measured_model(measured, model) -> str:
    if measured is None and model is None:
        return "—"
    if model is None:
        return fmt_bytes(measured)
    if measured is None:
        return f"— ({fmt_bytes(model)})"
    return f"{fmt_bytes(measured)} ({fmt_bytes(model)})"


def _row_label(row: dict) -> str:
    """The impl's label; on a CPU, PyTorch's FLASH backend is its own CPU kernel, not FlashAttention-2."""
    if row["impl"] == "sdpa_flash" and row.get("device") == "interpreter":
        return "SDPA FLASH (CPU kernel)"
    return label(row["impl"])


def _measured_on(env: dict, rows: list[dict]) -> str:
    """Where the rows were measured: the GPU's name, or the CPU when every row ran interpreted."""
    if env.get("gpu_name"):
        return env["gpu_name"]
    if rows and all(r.get("device") == "interpreter" for r in rows):
        return "a CPU (Triton interpreter)"
    return "an unknown GPU"


#: The rows the forward tables are about (forward passes of self-attention, Hkv = H, Nk = N, no suite
#: cell): one filter, in ``views``, shared with the figures.
forward_grid = views.forward_grid


def cell_table(rows: list[dict], *, N: int, D: int, dtype: str, causal: int) -> str:
    """One headline cell as a Markdown table (heading included); '' when the cell has no rows."""
    at = views.plain(views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal))
    if not at:
        return ""
    at.sort(key=lambda r: views.impl_sort_key(r["impl"]))
    base = next((r for r in at if r["impl"] == "a"), None)
    lines = [f"#### {_cell_title(N, D, dtype, causal, at[0]['B'], at[0]['H'])}", "",
             "| impl | ms | TFLOPS | speedup vs A | DRAM bytes measured (model) | peak extra memory (model) "
             "| rel err | status |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in at:
        ok = is_ok(r)
        lines.append("| " + " | ".join([
            _md(_row_label(r)),
            fmt_num(r["ms_median"], ".3g") if ok else "—",
            fmt_num(r["tflops"], ".0f") if ok else "—",
            _speedup(r, base),
            _measured_model(dram_bytes(r, "measured"), dram_bytes(r, "model")),
            _measured_model(r["peak_mem_measured"], r["peak_mem_model"]),
            fmt_num(r["rel_err"], ".1e"),
            _md(r["status"]),
        ]) + " |")
    return "\n".join(lines)


def paired_rows(rows: list[dict], *, dtype: str = "fp16", impl: str = "c",
                peer: str = "sdpa_cudnn") -> dict[tuple[int, int, int], tuple[dict, dict]]:
    """``impl``'s and ``peer``'s row in every (D, causal, N) cell that has both, same dtype.

    Pass all rows (``results.load_rows``), not only the latest per cell: the pair is taken from
    the latest run that measured *both* impls in the cell, so the two sides were timed side by side
    (a later run of only one of them, such as an ablation run, does not pair with an older run of
    the other). A cell no run measured both in falls back to the latest row of each."""
    data = [r for r in views.plain(rows) if r["dtype"] == dtype and is_ok(r) and r["tflops"]]
    pairs: dict[tuple[int, int, int], tuple[dict, dict]] = {}
    for D, causal, N in sorted({(r["D"], int(r["causal"]), r["N"]) for r in data}):
        at = views.cell_rows(data, N=N, D=D, dtype=dtype, causal=causal)
        mine, theirs = select(at, impl=impl), select(at, impl=peer)
        if not (mine and theirs):
            continue
        common = {r["run_id"] for r in mine} & {r["run_id"] for r in theirs}
        if common:
            run = max(common)
            mine, theirs = select(mine, run_id=run), select(theirs, run_id=run)
        pairs[D, causal, N] = (mine[-1], theirs[-1])
    return pairs


def _ratio(mine: dict, theirs: dict) -> float:
    return mine["tflops"] / theirs["tflops"]


def throughput_ratios(rows: list[dict], *, dtype: str = "fp16", impl: str = "c",
                      peer: str = "sdpa_cudnn") -> dict[tuple[int, int, int], float]:
    """``impl``'s TFLOPS over ``peer``'s in every cell of :func:`paired_rows`."""
    return {cell: _ratio(*pair) for cell, pair in paired_rows(rows, dtype=dtype, impl=impl, peer=peer).items()}


#: A timing whose 20th and 80th percentiles lie further apart than this fraction of its median is
#: flagged in the ratio table: most cells on the H200 stay within a few percent, and a cell whose
#: samples spread 0.16–0.22 ms around a 0.19 ms median read 0.87 in one run and 1.00 in the next.
NOISY_SPREAD = 0.10


def sample_spread(row: dict) -> float | None:
    """(80th − 20th percentile) / median of a timed row; None when a value is missing."""
    med, p20, p80 = row.get("ms_median"), row.get("ms_p20"), row.get("ms_p80")
    if not (med and p20 is not None and p80 is not None):
        return None
    return (p80 - p20) / med


def ratio_table(rows: list[dict], *, dtype: str = "fp16", impl: str = "c", peer: str = "sdpa_cudnn") -> str:
    """``impl``'s throughput as a fraction of ``peer``'s over N, one line per (D, causal); '' without data.
    A ratio with † has a timing whose samples spread more than :data:`NOISY_SPREAD` on either side."""
    return _format_ratio_table(paired_rows(forward_grid(rows), dtype=dtype, impl=impl, peer=peer), dtype=dtype,
                               impl=impl, peer=peer)


def _format_ratio_table(pairs: dict[tuple[int, int, int], tuple[dict, dict]], *, dtype: str, impl: str,
                        peer: str, what: str = "") -> str:
    """:func:`ratio_table` from the pairs :func:`paired_rows` found; ``what`` (e.g. ``"backward "``)
    goes before "TFLOPS" in the heading."""
    ratios: dict[tuple, dict[int, str]] = {}
    noisy = False
    for (D, causal, N), (mine, theirs) in pairs.items():
        spreads = [sample_spread(mine), sample_spread(theirs)]
        flag = any(x is not None and x > NOISY_SPREAD for x in spreads)
        noisy |= flag
        ratios.setdefault((D, causal), {})[N] = f"{_ratio(mine, theirs):.2f}" + ("†" if flag else "")
    if not ratios:
        return ""
    Ns = sorted({n for line in ratios.values() for n in line})
    lines = [f"#### {label(impl)} vs {label(peer)}: {what}TFLOPS ratio over N ({dtype}; above 1: {label(impl)} is "
             "faster)",
             "",
             "| D | causal | " + " | ".join(f"N = {n}" for n in Ns) + " |",
             "|--:|---|" + "--:|" * len(Ns)]
    for (D, causal), line in ratios.items():
        cells = [line.get(n, "—") for n in Ns]
        lines.append(f"| {D} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    if noisy:
        lines += ["", f"† Noisy: the 20th and 80th percentiles of {label(impl)}'s or {label(peer)}'s samples "
                      f"lie more than {NOISY_SPREAD:.0%} of the median apart."]
    return "\n".join(lines)


def render_table(rows: list[dict], env: dict, *, dtype: str = "fp16", all_rows: list[dict] | None = None) -> str:
    """The README's results tables (Markdown) from de-duplicated rows and ``env.json``'s contents."""
    rows = forward_grid(rows)  # a caller's rows may hold backward, GQA or suite rows: not this table's
    all_rows = forward_grid(all_rows) if all_rows is not None else None
    gpu = _measured_on(env, rows)
    date = str(env.get("date") or "")[:10] or "undated"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "driver", "cuda_runtime") if env.get(k))
    parts = [f"Measured on **{_md(gpu)}**, {date}" + (f" ({_md(versions)})" if versions else "") + ". "
             f"{views.FLOP_CONVENTION}; these tables: the forward pass. DRAM bytes: Nsight Compute "
             "`dram__bytes_read.sum + dram__bytes_write.sum` over the impl's kernels, its traffic model in "
             "parentheses. Peak extra memory: `max_memory_allocated` during one call beyond the inputs "
             "(workspace model in parentheses). Decimal units: 1 GB = 10⁹ bytes. "
             "rel err: ‖o − ref‖/‖ref‖ against a float64 reference."]
    if views.interpreted(rows):
        parts.append("> **Note:** some rows ran in the Triton interpreter on a CPU: their times are not GPU times.")
    any_cell = False
    for D in views.HEADLINE_DS:
        for causal in (0, 1):
            N = views.headline_n(rows, D=D, dtype=dtype, causal=causal)
            if N is None:
                continue
            table = cell_table(rows, N=N, D=D, dtype=dtype, causal=causal)
            if table:
                parts.append(table)
                any_cell = True
    if not any_cell:
        parts.append(f"_No {dtype} rows at D = {' or '.join(map(str, views.HEADLINE_DS))} yet: "
                     f"run `{views.HINTS['rows']}`._")
    ratio = ratio_table(all_rows if all_rows is not None else rows, dtype=dtype)
    if ratio:
        parts.append(ratio)
    return "\n\n".join(parts) + "\n"


def _posix_rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def render_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """What goes between the results markers: a do-not-edit note, :func:`render_table`, a reading of
    the numbers, the waterfall and throughput figures, and links (relative to ``readme_dir``) to the
    other figures present in ``<results_dir>/figures``."""
    results_dir, readme_dir = Path(results_dir), Path(readme_dir)
    rows, env = views.load(results_dir)
    rows, all_rows = forward_grid(rows), forward_grid(load_rows(results_dir))
    rel = _posix_rel(results_dir, readme_dir)
    parts = [_generated_note(rel), render_table(rows, env, dtype=dtype, all_rows=all_rows).rstrip("\n")]
    reading = render_reading(rows, dtype=dtype, all_rows=all_rows)
    if reading:
        parts.append(reading)
    figures = [(name, caption) for name, caption in FIGURE_CAPTIONS if (results_dir / "figures" / name).exists()]
    inline = [f for f in figures if f[0] in INLINE_FIGURES]
    linked = [f for f in figures if f[0] not in INLINE_FIGURES]
    if inline:
        parts.append("\n\n".join(f"![{caption}]({rel}/figures/{name})" for name, caption in inline))
    if linked:
        parts.append("More figures: " + ", ".join(f"[{caption}]({rel}/figures/{name})" for name, caption in linked)
                     + ".")
    return "\n\n".join(parts) + "\n"


def _generated_note(rel: str, source: str = "runs.csv") -> str:
    """The do-not-edit line a generated block starts with: ``rel`` the results folder as the README
    sees it, ``source`` the file in it that the block is made from."""
    return (f"<!-- generated by `python -m harness report {rel} --readme <this file>` from {rel}/{source}; "
            "edit the results, not this block -->")


def _tflops_at(rows: list[dict], impl: str, **cell) -> float | None:
    at = [r for r in views.cell_rows(rows, **cell) if r["impl"] == impl and is_ok(r) and r["tflops"]]
    return at[-1]["tflops"] if at else None


def render_reading(rows: list[dict], *, dtype: str = "fp16", all_rows: list[dict] | None = None) -> str:
    """Three sentences that read the headline numbers, computed from the rows (so they cannot go
    stale): what fusion bought, how far C is from the best vendor kernel, and where stages lose."""
    data = [r for r in views.plain(rows) if r["dtype"] == dtype]
    D = HEADLINE_CELL["D"]
    N = views.headline_n(data, D=D, dtype=dtype, causal=False)
    if N is None:
        return ""
    cell = dict(N=N, D=D, dtype=dtype, causal=False)
    t = {impl: _tflops_at(data, impl, **cell) for impl in ("a", "b", "c", "sdpa_cudnn", "b_cuda")}
    if not (t["a"] and t["b"] and t["c"]):
        return ""
    at = {r["impl"]: r for r in views.cell_rows(data, **cell)}
    out = [f"**Reading the numbers.** At N = {N}, D = {D}, fusing the three kernels into one (A → B) is worth "
           f"{t['b'] / t['a']:.1f}×"]
    a_bytes, b_bytes = dram_bytes(at["a"], "measured"), dram_bytes(at["b"], "measured")
    if a_bytes and b_bytes:
        out[-1] += f" and cuts the DRAM traffic {a_bytes / b_bytes:.0f}-fold ({fmt_bytes(a_bytes)} → {fmt_bytes(b_bytes)})"
    out[-1] += f"; the optimizations of stage C add another {t['c'] / t['b']:.2f}× on top."
    paired = throughput_ratios(all_rows if all_rows is not None else data, dtype=dtype)
    ratios = sorted((ratio, D, bool(causal), n) for (D, causal, n), ratio in paired.items()
                    if D in views.HEADLINE_DS and n >= 1024)
    if ratios:
        lo, hi = ratios[0], ratios[-1]
        med = statistics.median(r[0] for r in ratios)
        out.append(f"Against PyTorch's cuDNN attention, the fastest kernel on this machine, stage C reaches "
                   f"{lo[0]:.2f}–{hi[0]:.2f}× of its throughput for N ≥ 1024 (median {med:.2f}), weakest at "
                   f"D = {lo[1]}{' causal' if lo[2] else ''}, N = {lo[3]} and best at "
                   f"D = {hi[1]}{' causal' if hi[2] else ''}, N = {hi[3]}.")
    loses = []
    smallest_n = min((n for _, _, n in paired), default=None)
    weakest = min(((ratio, D, bool(causal), n) for (D, causal, n), ratio in paired.items()
                   if D in views.HEADLINE_DS and n == smallest_n), default=None)
    if weakest and weakest[0] < 1 and weakest[3] < 1024:
        ratio, D, causal, n = weakest
        loses.append(f"at N = {n} stage C drops to {ratio:.2f}× of cuDNN (D = {D}{' causal' if causal else ''}; "
                     "its fixed costs weigh more there: each block of query rows walks only a few K/V tiles, and "
                     "a call's GPU work is short enough that the host-side launch path, several times cuDNN's, can "
                     "set the pace)")
    if t["b_cuda"]:
        loses.append(f"the hand-written B (CUDA C++), whose scores run on the CUDA cores instead of the tensor "
                     f"cores, is {t['a'] / t['b_cuda']:.1f}× *slower* than stage A")
    if loses:
        out.append("Where the lesson's kernels lose: " + "; ".join(loses) + ".")
    return " ".join(out)


# ------------------------------------------------------------------ the landing page's headline

#: The one cell the landing page (the top README) shows, and the cell every other forward block,
#: the reading of the numbers and the waterfall figure lead with: long enough (N = 4096) that
#: stage A's N² traffic dominates; D = 64, fp16, non-causal as in the FlashAttention papers' grid.
#: ``--dtype`` replaces the dtype; a run without N = 4096 (a CPU run) falls back to its largest N.
HEADLINE_CELL = {"N": views.HEADLINE_N, "D": views.HEADLINE_DS[0], "dtype": "fp16", "causal": 0}

#: The headline table's rows, in order, with what each one changes, in a learner's words.
HEADLINE_STEPS = (
    ("a", "three kernels: S and P written to HBM and read back"),
    ("b", "one fused, tiled kernel: S and P stay on chip"),
    ("c", "B plus latency hiding (loads overlapped with math) and tuned tiles"),
    ("sdpa_cudnn", "NVIDIA's cuDNN kernel, called through PyTorch's SDPA"),
)


def headline_table(rows: list[dict], *, N: int, D: int, dtype: str, causal: int) -> str:
    """A → B → C → cuDNN at one cell as Markdown: what each step changes, ms, TFLOPS, DRAM bytes
    (Nsight Compute measured; the traffic model), speedup over stage A; a status column only when a
    row is not ``ok``. '' when the cell has none of these rows."""
    at = {r["impl"]: r for r in views.plain(views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal))}
    steps = [(at[impl], what) for impl, what in HEADLINE_STEPS if impl in at]
    if not steps:
        return ""
    base = at.get("a")
    with_status = any(not is_ok(r) for r, _ in steps)
    head = "| step | what changes | ms | TFLOPS | DRAM bytes, measured | DRAM bytes, model | speedup vs A |"
    rule = "|---|---|--:|--:|--:|--:|--:|"
    lines = [head + (" status |" if with_status else ""), rule + ("---|" if with_status else "")]
    for r, what in steps:
        ok = is_ok(r)
        measured, model = dram_bytes(r, "measured"), dram_bytes(r, "model")
        cells = [_md(_row_label(r)), _md(what), fmt_num(r["ms_median"], ".3g") if ok else "—",
                 fmt_num(r["tflops"], ".0f") if ok else "—", fmt_bytes(measured) if measured else "—",
                 fmt_bytes(model) if model else "—", _speedup(r, base)]
        if with_status:
            cells.append(_md(r["status"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def headline_reading(rows: list[dict], *, N: int, D: int, dtype: str, causal: int) -> str:
    """One sentence computed from the headline rows: what A → B buys (time and DRAM bytes), what
    B → C adds, and C's throughput against cuDNN's; '' when A, B or C is missing."""
    at = {r["impl"]: r for r in views.plain(views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal))
          if is_ok(r) and r["ms_median"]}
    if not all(impl in at for impl in ("a", "b", "c")):
        return ""
    a, b, c = at["a"], at["b"], at["c"]
    kind = "measured"
    a_bytes, b_bytes = dram_bytes(a, kind), dram_bytes(b, kind)
    if not (a_bytes and b_bytes):
        kind = "model"
        a_bytes, b_bytes = dram_bytes(a, kind), dram_bytes(b, kind)
    text = f"A → B is {a['ms_median'] / b['ms_median']:.1f}× faster"
    if a_bytes and b_bytes:
        text += (f" and moves {a_bytes / b_bytes:.0f}× fewer DRAM bytes ({fmt_bytes(a_bytes)} → {fmt_bytes(b_bytes)}"
                 f"{', ' + kind if kind == 'model' else ''})")
    c_bytes = dram_bytes(c, kind)
    same = c_bytes and b_bytes and abs(c_bytes - b_bytes) <= 0.05 * b_bytes
    text += (f"; B → C adds another {b['ms_median'] / c['ms_median']:.2f}×"
             + (" with the same bytes" if same else ""))
    cudnn = at.get("sdpa_cudnn")
    if cudnn and c.get("tflops") and cudnn.get("tflops"):
        text += f"; stage C runs at {c['tflops'] / cudnn['tflops']:.2f}× cuDNN's throughput on this cell"
    return text + "."


def render_headline_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The landing page's one table (:func:`headline_table` at :data:`HEADLINE_CELL`), a sentence
    reading it, the waterfall figure, and a link to the results folder's README, which holds every
    other table (links relative to ``readme_dir``)."""
    results_dir, readme_dir = Path(results_dir), Path(readme_dir)
    rel = _posix_rel(results_dir, readme_dir)
    rows, env = views.load(results_dir)
    rows = forward_grid(rows)
    cell = {**HEADLINE_CELL, "dtype": dtype}
    if not any(r["N"] == cell["N"] for r in views.cell_rows(rows, **cell)):
        cell["N"] = views.headline_n(rows, D=cell["D"], dtype=dtype, causal=cell["causal"]) or cell["N"]
    parts = [_generated_note(rel)]
    table = headline_table(rows, **cell)
    if not table:
        parts.append(f"_No {dtype} rows at N = {cell['N']}, D = {cell['D']} yet: run `{views.HINTS['rows']}`._")
        return "\n\n".join(parts) + "\n"
    at = [r for r in views.cell_rows(rows, **cell) if r["impl"] in dict(HEADLINE_STEPS)]
    dates = sorted({str(r["run_id"])[:10] for r in at})
    flops = "4·B·H·N²·D" + (" × the visible share (about half, causal)" if cell["causal"] else "")
    parts.append(
        f"**{_md(_measured_on(env, rows))}**, forward pass, {_cell_title(**cell, B=at[0]['B'], H=at[0]['H'])}, "
        f"measured {' to '.join(dict.fromkeys((dates[0], dates[-1])))}. ms: median time per call; TFLOPS: {flops} "
        "FLOPs per call "
        "over that time. DRAM bytes: measured by Nsight Compute, and predicted by the stage's traffic model, "
        "which counts every load a kernel issues: the L2 cache serves re-reads before they reach DRAM, so "
        "the measurement can be lower. 1 GB = 10⁹ bytes.")
    if views.interpreted(at):
        parts.append("> **Note:** these rows ran in the Triton interpreter on a CPU: their times are not GPU times.")
    parts.append(table)
    reading = headline_reading(rows, **cell)
    if reading:
        parts.append(reading)
    if (results_dir / "figures" / "waterfall.png").exists():
        parts.append(f"![The waterfall at this cell: time, DRAM bytes and peak memory from A to B, then stage C's "
                     f"optimizations switched on one at a time]({rel}/figures/waterfall.png)")
    if (results_dir / "README.md").exists() and results_dir.resolve() != readme_dir.resolve():
        parts.append(f"Every other table (head dim 128, causal, the backward pass, model shapes, decoding, host "
                     f"overhead) is in [`{rel}/README.md`]({rel}/README.md).")
    return "\n\n".join(parts) + "\n"


#: How many of the latest runs the run-to-run table lists.
RUN_HISTORY = 6


def run_ratios(rows: list[dict], *, impl: str = "c", peer: str = "sdpa_cudnn",
               min_N: int = 1024) -> dict[str, dict[tuple[str, int, int, int], float]]:
    """For every run that timed ``impl`` and ``peer`` side by side: ``impl``'s TFLOPS over ``peer``'s in
    each (dtype, D, causal, N) cell with N ≥ ``min_N`` that run measured both in; runs in time order."""
    found: dict[str, dict[tuple[str, int, int, int], dict[str, dict]]] = {}
    for r in views.plain(rows):
        if r["impl"] in (impl, peer) and is_ok(r) and r["tflops"] and r["N"] >= min_N:
            cell = (r["dtype"], r["D"], int(r["causal"]), r["N"])
            found.setdefault(r["run_id"], {}).setdefault(cell, {})[r["impl"]] = r  # a cell's last row wins
    return {run: {cell: _ratio(pair[impl], pair[peer]) for cell, pair in sorted(cells.items()) if len(pair) == 2}
            for run, cells in sorted(found.items()) if any(len(pair) == 2 for pair in cells.values())}


def run_history_table(rows: list[dict], commits: dict[str, str] | None = None, *, impl: str = "c",
                      peer: str = "sdpa_cudnn", last: int = RUN_HISTORY) -> str:
    """The latest ``last`` runs of :func:`run_ratios`, one line each (cells, how many at or above 1.0,
    min/median/max), then every cell that read below 1.0 in any of them with its ratio in each run:
    how far one run's verdict can be trusted. '' without such runs."""
    runs = list(run_ratios(rows, impl=impl, peer=peer).items())[-last:]
    if not runs:
        return ""
    commits = commits or {}
    order = {"fp16": 0, "bf16": 1}
    dtypes = " and ".join(sorted({cell[0] for _run, ratios in runs for cell in ratios},
                                 key=lambda d: (order.get(d, 2), d)))
    lines = [f"#### Run to run: {label(impl)} / {label(peer)} in the latest {len(runs)} runs that timed both "
             f"(N ≥ 1024, {dtypes})", "",
             "| run | commit | cells | at or above 1.0 | min | median | max |", "|---|---|--:|--:|--:|--:|--:|"]
    for run, ratios in runs:
        values = sorted(ratios.values())
        lines.append(f"| {run} | {_md(commits.get(run, '?'))} | {len(values)} | {sum(v >= 1.0 for v in values)} | "
                     f"{values[0]:.3f} | {statistics.median(values):.3f} | {values[-1]:.3f} |")
    below = sorted({cell for _run, ratios in runs for cell, v in ratios.items() if v < 1.0})
    if below:
        lines += ["", "Cells below 1.0 in any of these runs, run by run (— : not measured in that run):", ""]
        for dt, D, causal, N in below:
            series = ", ".join(f"{ratios[dt, D, causal, N]:.3f}" if (dt, D, causal, N) in ratios else "—"
                               for _run, ratios in runs)
            lines.append(f"- {dt}, D = {D}, {'causal' if causal else 'non-causal'}, N = {N}: {series}")
    return "\n".join(lines)


def render_ratio_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """Stage C against SDPA CUDNN over the FlashAttention grid's head dims (D 64 and 128; the
    head-dim sweep has a block of its own), fp16 and bf16, with min/median/max, then the same ratio
    over the latest runs (:func:`run_history_table`)."""
    # all runs: ratios pair the two impls within one run
    rows = [r for r in forward_grid(load_rows(results_dir)) if r["D"] in views.HEADLINE_DS]
    parts = [_generated_note(_posix_rel(Path(results_dir), Path(readme_dir)))]
    for dt in ("fp16", "bf16"):
        pairs = paired_rows(rows, dtype=dt)  # once per dtype: the table and the summary line share it
        table = _format_ratio_table(pairs, dtype=dt, impl="c", peer="sdpa_cudnn")
        if not table:
            continue
        ratios = sorted(_ratio(*pair) for (_D, _causal, n), pair in pairs.items() if n >= 1024)
        parts.append(table)
        if ratios:
            parts.append(f"Over N ≥ 1024 ({len(ratios)} cells, {dt}): min {ratios[0]:.2f}, "
                         f"median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}.")
    if len(parts) == 1:
        parts.append(f"_No stage C and SDPA CUDNN rows yet: run `{views.HINTS['rows']}`._")
    else:
        try:
            runs = load_env(results_dir).get("runs", {})
        except ResultsError:  # no env.json: the table goes without commits
            runs = {}
        parts.append(run_history_table(rows, {run: meta.get("git_commit", "?") for run, meta in runs.items()}))
    return "\n\n".join(parts) + "\n"


def ablation_table(rows: list[dict], *, N: int, D: int, dtype: str, causal: int, impl: str = "c") -> str:
    """Stage B, then stage C's cumulative steps ('+x' variants in order), then the leave-one-out
    rows ('-x'): time, TFLOPS, the step's speedup and its share of the whole B → C gain."""
    at = views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal)
    b = [r for r in at if r["impl"] == "b" and r["kind"] == "stage" and is_ok(r)]
    steps = [r for r in at if r["impl"] == impl and r["kind"] == "ablation" and r["variant"].startswith("+")
             and is_ok(r)]
    full = [r for r in at if r["impl"] == impl and r["kind"] == "ablation" and r["variant"] == "all" and is_ok(r)]
    if not (b and steps and full):
        return ""
    import math

    steps = views.walk_order(steps)

    b_ms, c_ms = b[-1]["ms_median"], full[-1]["ms_median"]
    total = math.log(b_ms / c_ms) if b_ms > c_ms else None
    lines = [_cell_title(N, D, dtype, causal, b[-1]["B"], b[-1]["H"]), "",
             "| step | ms | TFLOPS | × over the row above | share of the B → C gain |", "|---|--:|--:|--:|--:|",
             f"| stage B | {b_ms:.3g} | {b[-1]['tflops']:.0f} | | |"]
    prev = b_ms
    for r in steps:
        ms = r["ms_median"]
        share = f"{math.log(prev / ms) / total:+.0%}" if total else ""
        name = "C, every switch off" if r["variant"] == "+none" else r["variant"].replace("_", " ")
        lines.append(f"| {name} | {ms:.3g} | {r['tflops']:.0f} | {prev / ms:.2f}× | {share} |")
        prev = ms
    lines += ["", "| leave one out (all on but) | ms | slowdown vs all on |", "|---|--:|--:|"]
    for r in at:
        if r["impl"] == impl and r["kind"] == "ablation" and r["variant"].startswith("-") and is_ok(r):
            lines.append(f"| {r['variant'][1:].replace('_', ' ')} | {r['ms_median']:.3g} | "
                         f"{r['ms_median'] / c_ms:.2f}× |")
    return "\n".join(lines)


def render_ablation_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    rows, _env = views.load(results_dir)
    rows = forward_grid(rows)
    parts = [_generated_note(_posix_rel(Path(results_dir), Path(readme_dir))),
             "Shares are of the logarithm of the B → C speedup, so they add up to 100% along the cumulative "
             "steps; a negative share is a step that slowed the kernel down *at that point of the walk* "
             "(the leave-one-out table says what each switch is worth with all the others on)."]
    for D in views.HEADLINE_DS:
        for causal in (0, 1):
            N = views.headline_n(rows, D=D, dtype=dtype, causal=causal)
            table = ablation_table(rows, N=N, D=D, dtype=dtype, causal=causal) if N else ""
            if table:
                parts.append(table)
    if len(parts) == 2:
        if any(r["impl"] == "c" and r["kind"] == "ablation" and r["dtype"] == dtype and r["pass"] == "fwd"
               for r in rows):
            # The table's first row is stage B at the same cell: ablation rows alone do not make one.
            parts.append(f"_Stage C's ablation rows are here, but no stage B row at their cells to start the walk "
                         f"from: run `python -m harness sweep --stages b --N 4096 --D 64,128 --dtype {dtype}`._")
        else:
            parts.append("_No ablation rows yet: run `python -m harness sweep --stages c --ablation --N 4096`._")
    return "\n\n".join(parts) + "\n"


def render_twins_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The Triton stages beside their CUDA C++ twins at the headline N, and the bank-conflict model
    against Nsight Compute for each shared-memory layout."""
    rows, _env = views.load(results_dir)
    rows = forward_grid(rows)
    parts = [_generated_note(_posix_rel(Path(results_dir), Path(readme_dir)))]
    impls = ("b", "b_cuda", "c", "c_cuda")
    lines = ["| D | causal | N | " + " | ".join(f"{label(i)} TFLOPS" for i in impls) + " |",
             "|--:|---|--:|" + "--:|" * len(impls)]
    for D in views.HEADLINE_DS:
        for causal in (0, 1):
            N = views.headline_n(rows, D=D, dtype=dtype, causal=causal)
            if N is None:
                continue
            vals = [_tflops_at(views.plain(rows), i, N=N, D=D, dtype=dtype, causal=bool(causal)) for i in impls]
            if any(vals):
                lines.append(f"| {D} | {'yes' if causal else 'no'} | {N} | "
                             + " | ".join(fmt_num(v, '.0f') if v else "—" for v in vals) + " |")
    if len(lines) > 2:
        parts.append(f"Throughput, {dtype}, FA-paper shapes (B·N = 16384, H·D = 2048):\n\n" + "\n".join(lines))
    conflicts = [r for r in rows if r["impl"] in ("b_cuda", "c_cuda") and r["smem_bank_conflicts"] is not None
                 and r["kind"] == "ablation"]
    if conflicts:
        from .ncu import predicted_bank_conflicts

        import stages

        table = ["| impl | layout | N | D | predicted conflicts (ld + st) | Nsight Compute (ld + st) |",
                 "|---|---|--:|--:|--:|--:|"]
        for r in conflicts:
            stage = stages.get_stage(r["impl"])
            kwargs = {} if r["variant"] == "all" else dict(stage.variants.get(r["variant"], {}))
            from stages.contract import Problem

            problem = Problem(r["B"], r["H"], r["N"], r["D"], r["dtype"], bool(r["causal"]))
            pred = predicted_bank_conflicts(r["impl"], problem, kwargs)
            pred_text = f"{pred['ld'] + pred['st']:,}" if pred else "—"
            layout = "default" if r["variant"] == "all" else r["variant"]
            table.append(f"| {label(r['impl'])} | {layout} | {r['N']} | {r['D']} | {pred_text} | "
                         f"{r['smem_bank_conflicts']:,} |")
        parts.append("Shared-memory bank conflicts of one call, the model of `stages/bank_model.py` against "
                     "`l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum`:\n\n" + "\n".join(table))
    return "\n\n".join(parts) + "\n"

# ------------------------------------------------------------------ the model suite, backward, latency

def _shape_summary(r: dict) -> str:
    """``B 32 · H 32/8 · N 1/8192 · D 128 · causal · bf16``: heads and rows as query/key where they differ."""
    heads = f"{r['H']}/{r['Hkv']}" if r.get("Hkv") not in (None, r["H"]) else f"{r['H']}"
    lengths = f"{r['N']}/{r['Nk']}" if r.get("Nk") not in (None, r["N"]) else f"{r['N']}"
    return (f"B {r['B']} · H {heads} · N {lengths} · D {r['D']} · {'causal' if r['causal'] else 'non-causal'} "
            f"· {r['dtype']}")


def _ms(row: dict | None, column: str = "ms_median") -> str:
    return fmt_num(row.get(column), ".3g") if row is not None and is_ok(row) and row.get(column) else "—"


def _x(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}"


def _suite_status(line: dict) -> str:
    c = line["c"]
    if c is None:
        return "no stage C row"
    if not is_ok(c):
        return _md(c["status"])
    if line["vs_best"] is None:
        return "no SDPA backend ran it"
    behind = [what for what, r in (("eager", line["vs_best"]), ("GPU", line["vs_best_gpu"]), ("vs B", line["vs_b"]))
              if r is not None and r < 1.0]
    return "ok" if not behind else "behind: " + ", ".join(behind)


def suite_table(lines: list[dict]) -> str:
    """The model suite, one line per named cell (:func:`harness.views.suite_lines`); '' without cells."""
    if not lines:
        return ""
    out = ["| cell | shape (H, N: query/key where they differ) | C ms | C ms GPU | best SDPA | its ms "
           "| C / best | C / best, GPU | C / B | status |",
           "|---|---|--:|--:|---|--:|--:|--:|--:|---|"]
    for line in lines:
        best = line["best"]
        out.append("| " + " | ".join([
            _md(line["cell"]), _shape_summary(line["shape"]), _ms(line["c"]), _ms(line["c"], "ms_gpu"),
            label(best["impl"]) if best else "—", _ms(best), _x(line["vs_best"]), _x(line["vs_best_gpu"]),
            _x(line["vs_b"]), _suite_status(line)]) + " |")
    return "\n".join(out)


def suite_runs_table(runs: dict[str, list[dict]]) -> str:
    """One line per suite run (:func:`harness.views.suite_runs`): cells, how many had C at or above the
    best SDPA backend (eager, GPU-only) and at or above stage B, and the lowest ratios."""
    if not runs:
        return ""
    out = ["| run | cells | C ≥ best (eager) | C ≥ best (GPU) | C ≥ B | lowest C / best (eager) "
           "| lowest C / best (GPU) |", "|---|--:|--:|--:|--:|--:|--:|"]
    for run, lines in runs.items():
        cols = []
        for key in ("vs_best", "vs_best_gpu", "vs_b"):
            vals = [line[key] for line in lines if line[key] is not None]
            cols.append((f"{sum(v >= 1.0 for v in vals)} of {len(vals)}", min(vals) if vals else None))
        low = [line for line in lines if line["vs_best"] is not None]
        low_gpu = [line for line in lines if line["vs_best_gpu"] is not None]
        lowest = min(low, key=lambda x: x["vs_best"]) if low else None
        lowest_gpu = min(low_gpu, key=lambda x: x["vs_best_gpu"]) if low_gpu else None
        out.append(f"| {run} | {len(lines)} | {cols[0][0]} | {cols[1][0]} | {cols[2][0]} | "
                   + (f"{lowest['vs_best']:.2f} ({_md(lowest['cell'])})" if lowest else "—") + " | "
                   + (f"{lowest_gpu['vs_best_gpu']:.2f} ({_md(lowest_gpu['cell'])})" if lowest_gpu else "—") + " |")
    return "\n".join(out)


def render_models_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The model-shape suite (``results_dir/models/runs.csv``): stage C against the fastest SDPA
    backend in each named cell, eager and GPU-only, and how each suite run went. ``dtype`` is not
    used: each cell has its own."""
    results_dir = Path(results_dir)
    rel = _posix_rel(results_dir, Path(readme_dir))
    all_rows = views.load_suite(results_dir)
    lines = views.suite_lines(all_rows)
    backward = views.suite_lines(all_rows, "bwd")
    note = _generated_note(rel, f"{views.SUITE_DIR}/runs.csv")
    if not lines and not backward:
        return note + f"\n\n_No model-suite rows yet: run `{views.HINTS['models']}` on a GPU._\n"
    parts = [note,
             "Each cell from the latest run that timed stage C in it, C and the SDPA backends taking turns. "
             "ms: the eager call as a program makes it (median); ms GPU: the same call replayed from a CUDA "
             "graph, the GPU's work alone. Best SDPA: the fastest backend that accepts the cell (by eager "
             "time; the GPU-only ratio takes the fastest by GPU time). Ratios are time ratios, above 1 when "
             "stage C is faster; C / B is against stage B, eager."]
    if lines:
        parts.append(suite_table(lines))
        runs = suite_runs_table(views.suite_runs(all_rows))
        if runs:
            parts += ["Suite run by suite run:", runs]
    else:
        parts.append(f"_No forward rows yet: run `{views.HINTS['models']}` on a GPU._")
    if backward:
        parts += ["**The backward** of the same cells (`--pass bwd`: the gradients of q, k and v given a saved "
                  "forward, each impl's own), read the same way:", suite_table(backward)]
        runs = suite_runs_table(views.suite_runs(all_rows, "bwd"))
        if runs:
            parts += ["Backward, suite run by suite run:", runs]
    return "\n\n".join(parts) + "\n"


def _shape_kind(r: dict) -> str:
    """Which part of the shape contract a cell exercises: decode (one query row), GQA prefill (fewer
    K/V heads than query heads), a head dim that is not a power of two (which the kernels pad: how far
    depends on the kernel and its version), or plain prefill."""
    if r["N"] == 1:
        return "decode"
    if (r.get("Hkv") or r["H"]) != r["H"]:
        return "GQA prefill"
    if r["D"] & (r["D"] - 1):
        return f"head dim {r['D']} (not a power of two)"
    return "prefill"


def _copy_bandwidth(results_dir: Path, rel: str) -> tuple[float | None, str]:
    """(copy GB/s, where it comes from) for the decode bandwidth: ``shapes/env.json``'s ceilings if
    that run measured them, else the results folder's ``env.json`` (``harness device`` writes
    them there); (None, '') when neither has them."""
    for folder, name in ((results_dir / views.SHAPES_DIR, f"{rel}/{views.SHAPES_DIR}/env.json"),
                         (results_dir, f"{rel}/env.json")):
        try:
            env = load_env(folder)
        except ResultsError:
            continue
        copy_gbps, _ = views.ceilings(env)
        if copy_gbps:
            return copy_gbps, (f"`copy_gbps` in {name}: `{views.HINTS['ceilings']}` times a large device-to-device "
                               "copy and counts the bytes read and written")
    return None, ""


def shapes_table(lines: list[dict], copy_gbps: float | None) -> str:
    """The shape-contract cells, one line per shape (:func:`harness.views.shape_lines`): C's time,
    the fastest SDPA backend and its time, their ratio, and for decode cells (Nq = 1) the bytes that
    must move, C's achieved GB/s and its share of ``copy_gbps``; '' without cells."""
    if not lines:
        return ""
    out = ["| cell | shape (H, N: query/key where they differ) | C ms | best SDPA | its ms | best / C "
           "| bytes moved | C GB/s | % of copy |",
           "|---|---|--:|---|--:|--:|--:|--:|--:|"]
    for line in lines:
        c, best, shape = line["c"], line["best"], line["shape"]
        moved = gbps = share = "—"
        bandwidth = views.decode_bandwidth(c) if shape["N"] == 1 else None
        if bandwidth is not None:
            moved, gbps = fmt_bytes(bandwidth[0]), f"{bandwidth[1]:,.0f}"
            share = f"{bandwidth[1] / copy_gbps:.0%}" if copy_gbps else "—"
        out.append("| " + " | ".join([
            _md(_shape_kind(shape)), _shape_summary(shape), _ms(c), label(best["impl"]) if best else "—",
            _ms(best), _x(line["vs_best"]), moved, gbps, share]) + " |")
    return "\n".join(out)


def shapes_reading(lines: list[dict], copy_gbps: float | None) -> str:
    """One sentence from the numbers: in how many cells C is at or above the best SDPA backend (and
    the lowest ratio), and the range of the decode cells' share of the copy bandwidth."""
    ratios = [line for line in lines if line["vs_best"] is not None]
    if not ratios:
        return ""
    lowest = min(ratios, key=lambda line: line["vs_best"])
    text = (f"Stage C is at or above the fastest SDPA backend in {sum(x['vs_best'] >= 1.0 for x in ratios)} of "
            f"{len(ratios)} cells (lowest {lowest['vs_best']:.2f}: {_md(_shape_summary(lowest['shape']))}).")
    shares = [b[1] / copy_gbps for line in lines if line["shape"]["N"] == 1 and copy_gbps
              and (b := views.decode_bandwidth(line["c"])) is not None]
    if shares:
        text += f" The decode cells move their bytes at {min(shares):.0%} to {max(shares):.0%} of the copy bandwidth"
        if max(shares) > 1.0:
            # worth a word, or a reader suspects an error: a stream of reads alone beats a copy, whose
            # DRAM keeps turning around between reading and writing
            text += " (above 100%: a decode step only reads, bar its tiny output, while the copy mixes reads and writes)"
        text += "."
    return text


def render_shapes_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The shape-contract cells (``results_dir/shapes/runs.csv``: GQA prefill, head dims
    80 and 96, decode): stage C against the fastest SDPA backend per shape, and for decode the
    achieved bandwidth against the measured copy bandwidth. ``dtype`` is not used: each cell has its own."""
    results_dir = Path(results_dir)
    rel = _posix_rel(results_dir, Path(readme_dir))
    note = _generated_note(rel, f"{views.SHAPES_DIR}/runs.csv")
    lines = views.shape_lines(views.load_shapes(results_dir))
    if not lines:
        return note + f"\n\n_No shape-contract rows yet: run `{views.HINTS['shapes']}` on a GPU._\n"
    copy_gbps, source = _copy_bandwidth(results_dir, rel)
    copy_text = (f"the copy bandwidth, {copy_gbps:,.0f} GB/s ({source})" if copy_gbps else
                 f"the copy bandwidth (not measured yet: `{views.HINTS['ceilings']}`)")
    parts = [note,
             "Each shape from the latest run that timed stage C in it, C and the SDPA backends taking turns; "
             "ms: the eager call's median. Best SDPA: the fastest backend of that run that accepts the shape; "
             "best / C: its time over C's, above 1 when stage C is faster. A decode step (Nq = 1) reads the "
             "whole K/V cache once, so it is a bandwidth problem: bytes moved = Q, K and V read once and O "
             f"written once; C GB/s = those bytes / C's time (1 GB = 10⁹ bytes), and % of {copy_text}.",
             shapes_table(lines, copy_gbps)]
    reading = shapes_reading(lines, copy_gbps)
    if reading:
        parts.append(reading)
    return "\n\n".join(parts) + "\n"


#: the peers the backward table sets stage C against: FlashAttention-2 (the floor) and cuDNN (the goal)
BACKWARD_PEERS = ("sdpa_flash", "sdpa_cudnn")


def backward_summary(rows: list[dict], *, dtypes, impl: str = "c", peers=BACKWARD_PEERS) -> str:
    """Per dtype and peer, ``impl``'s backward TFLOPS over the peer's across every (D, causal, N) cell
    that has both (pairs from one run, :func:`paired_rows`): cells, at or above 1.0, min, median,
    max. ``rows`` are backward grid rows; '' when no cell has a pair."""
    lines = []
    for dtype in dtypes:
        for peer in peers:
            ratios = sorted(_ratio(*pair) for pair in paired_rows(rows, dtype=dtype, impl=impl, peer=peer).values())
            if ratios:
                lines.append(f"| {dtype} | {label(peer)} | {len(ratios)} | {sum(r >= 1.0 for r in ratios)} | "
                             f"{ratios[0]:.2f} | {statistics.median(ratios):.2f} | {ratios[-1]:.2f} |")
    if not lines:
        return ""
    return "\n".join([f"| dtype | {label(impl)} vs | cells | at or above 1.0 | min | median | max |",
                      "|---|---|--:|--:|--:|--:|--:|", *lines])


def deterministic_costs(rows: list[dict]) -> dict[tuple[str, int, int, int], float]:
    """Per (dtype, D, causal, N): the time stage C's deterministic backward (``--ablation
    deterministic``: dQ summed in a fixed order) takes beyond the default's, as a fraction, from the
    latest run that timed both side by side."""
    runs: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["impl"] == "c" and is_ok(r) and r.get("ms_median") and (r.get("variant") or "") in ("", "deterministic"):
            runs.setdefault((r["dtype"], r["D"], int(r["causal"]), r["N"], r["run_id"]), {})[r.get("variant") or ""] = r
    costs: dict[tuple[str, int, int, int], float] = {}
    for (dt, D, causal, N, _), pair in sorted(runs.items(), key=lambda kv: kv[0][4]):  # the latest run last
        if "" in pair and "deterministic" in pair:
            costs[dt, D, causal, N] = pair["deterministic"]["ms_median"] / pair[""]["ms_median"] - 1
    return costs


def deterministic_table(rows: list[dict]) -> str:
    """:func:`deterministic_costs` as a sentence (their range) and a table per dtype over D × causal × N;
    '' where no run timed both."""
    costs = deterministic_costs(rows)
    if not costs:
        return ""

    def pct(x):
        return f"{x:+.0%}".replace("-0%", "+0%")  # (a cost rounding to zero from below is no saving)

    values = sorted(costs.values())
    out = [f"**Deterministic** (`{views.HINTS['bwd']} --ablation deterministic`: dQ summed in a fixed order, so "
           "the gradients are the same bits run after run): the extra time over the default backward, timed in "
           f"the same run, {pct(values[0])} to {pct(values[-1])} (median {pct(statistics.median(values))})."]
    for dt in sorted({k[0] for k in costs}):
        Ns = sorted({k[3] for k in costs if k[0] == dt})
        out += ["", f"| {_md(dt)}: D | causal | " + " | ".join(f"N = {n}" for n in Ns) + " |",
                "|--:|---|" + "--:|" * len(Ns)]
        for D, causal in sorted({(k[1], k[2]) for k in costs if k[0] == dt}):
            out.append(f"| {D} | {'yes' if causal else 'no'} | "
                       + " | ".join(pct(costs[dt, D, causal, n]) if (dt, D, causal, n) in costs else "—"
                                    for n in Ns) + " |")
    return "\n".join(out)


def render_backward_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """Stage C's backward pass (``pass = bwd`` rows of ``results_dir/runs.csv``, the grid only)
    against SDPA FLASH and CUDNN: min/median/max of the TFLOPS ratio per peer and dtype, then the
    ratio to cuDNN over D × causal × N for each dtype. ``dtype`` is not used: every dtype measured
    is shown."""
    results_dir = Path(results_dir)
    parts = [_generated_note(_posix_rel(results_dir, Path(readme_dir)))]
    path = results_dir / "runs.csv"
    rows = views.grid_rows(load_rows(path), "bwd") if path.exists() else []
    order = ("fp16", "bf16", "fp32")
    dtypes = sorted({r["dtype"] for r in rows}, key=lambda d: (order.index(d) if d in order else len(order), d))
    summary = backward_summary(rows, dtypes=dtypes)
    if not summary:
        parts.append(f"_No stage C backward rows beside SDPA FLASH or CUDNN yet: run "
                     f"`{views.HINTS['bwd']} --peers flash,cudnn`._")
        return "\n\n".join(parts) + "\n"
    parts += ["The backward alone, given a saved forward (`torch.autograd.grad` of the output), on the FA-paper "
              f"grid; {views.FLOP_CONVENTION}. Ratios pair rows timed in the same run, above 1 when stage C is "
              "faster.", summary]
    for dt in dtypes:
        table = _format_ratio_table(paired_rows(rows, dtype=dt, impl="c", peer="sdpa_cudnn"), dtype=dt, impl="c",
                                    peer="sdpa_cudnn", what="backward ")
        if table:
            parts.append(table)
    deterministic = deterministic_table(rows)
    if deterministic:
        parts.append(deterministic)
    return "\n\n".join(parts) + "\n"


FLOOR_IMPL = "triton_empty_kernel"


#: the latency table's column heads per pass
LATENCY_PASS_TITLES = {"fwd": "forward", "bwd": "backward", "fwd_bwd": "forward + backward"}


def latency_table(rows: list[dict]) -> str:
    """``harness latency``'s rows as Markdown, one line per impl: µs per call and the multiple of the
    floor (an empty Triton kernel's launch) for each pass the run timed, then the status (each pass's
    where they differ); the floor first, then stages and peers in display order."""
    from .latency import LATENCY_PASSES

    passes = [p for p in LATENCY_PASSES if any(r.get("pass") == p for r in rows)] or ["fwd"]
    by_impl: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_impl.setdefault(r["impl"], {})[r.get("pass") or ""] = r
    ordered = sorted(by_impl, key=lambda impl: (impl != FLOOR_IMPL, views.impl_sort_key(impl)))
    titles = [LATENCY_PASS_TITLES[p] for p in passes]
    head = "| impl | " + " | ".join(f"{t}, µs per call | × floor" for t in titles) + " | status |"
    out = [head, "|---|" + "--:|--:|" * len(passes) + "---|"]
    for impl in ordered:
        cells = by_impl[impl]
        if impl == FLOOR_IMPL:  # one launch, the floor of every pass
            floor = next(iter(cells.values()))
            us = f"{floor['us_per_call']:,.1f}" if floor.get("us_per_call") is not None else "—"
            line = [us, "1.0×"] * len(passes)
            out.append(f"| empty Triton kernel (the floor) | {' | '.join(line)} | {_md(floor['status'])} |")
            continue
        line = []
        for p in passes:
            r = cells.get(p, {})
            us, floor_x = r.get("us_per_call"), r.get("x_floor")
            line += ["—" if us is None else f"{us:,.1f}", "—" if floor_x is None else f"{floor_x:.1f}×"]
        statuses = {p: cells[p]["status"] for p in passes if p in cells}
        status = (next(iter(statuses.values())) if len(set(statuses.values())) == 1
                  else "; ".join(f"{LATENCY_PASS_TITLES[p]}: {st}" for p, st in statuses.items()))
        out.append(f"| {_md(label(impl))} | {' | '.join(line)} | {_md(status)} |")
    return "\n".join(out)


def render_latency_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The latest run of ``results_dir/latency.csv`` (``harness latency``): host µs per call of each
    impl on a tiny problem beside an empty Triton kernel's launch. ``dtype`` is not used."""
    results_dir = Path(results_dir)
    rel = _posix_rel(results_dir, Path(readme_dir))
    note = _generated_note(rel, "latency.csv")
    rows = views.load_latency(results_dir)
    if not rows:
        return note + f"\n\n_No latency rows yet: run `{views.HINTS['latency']}` on a GPU._\n"
    r0 = rows[0]
    where = "a CPU (Triton interpreter: not GPU host times)" if r0.get("device") == "interpreter" else "the GPU"
    text = (f"Run {_md(r0['run_id'])} on {where}: B = {r0['B']}, H = {r0['H']}, N = {r0['N']}, D = {r0['D']}, "
            f"{_md(r0['dtype'])}{', causal' if r0['causal'] else ''}, {r0['calls']} calls back to back per impl, "
            "one synchronize at the end: CPU wall time per call, nothing subtracted. The floor is an empty "
            "`@triton.jit` kernel with no arguments.")
    meanings = {"fwd": "forward: the attention call",
                "bwd": "backward: `torch.autograd.grad` of its output on one saved forward (the impl's autograd "
                       "node and its kernels)",
                "fwd_bwd": "forward + backward: both, a training call"}
    timed = [p for p in meanings if any(r.get("pass") == p for r in rows)]
    if timed != ["fwd"] and timed:
        said = "; ".join(meanings[p] for p in timed)
        text += f" {said[0].upper()}{said[1:]}."
    return "\n\n".join([note, text, latency_table(rows)]) + "\n"


def render_generate_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """``harness generate``'s latest run (``results_dir/generate/runs.csv``): decode tokens/s and
    training step time of small transformers models with each attention, against transformers'
    SDPA (harness/generate.py renders it). ``dtype`` is not used: the rows carry their own."""
    from .generate import render_block as render

    return render(results_dir, readme_dir)


def render_train_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """``harness train``'s latest run per compile mode (``results_dir/train/summary.csv``): a small GPT's
    training step with each stage, eager and compiled (harness/train.py renders it)."""
    from .train import render_block as render

    return render(results_dir, readme_dir)


def render_decode_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """``harness decode``'s latest run (``results_dir/decode.csv``): attention in a decode loop whose
    cache grows by one key per call, against a fixed cache (harness/decode_loop.py renders it)."""
    from .decode_loop import DECODE_CSV, render_block as render

    return render(Path(results_dir) / DECODE_CSV, readme_dir) + "\n"


# ------------------------------------------------------------------ the head-dim sweep

#: what the head-dim sweep sets against each other, in display order: stage C, cuDNN (the goal), FA2
HEAD_DIM_IMPLS = ("c", "sdpa_cudnn", "sdpa_flash")
#: a sweep needs stage C timed at this many head dims of one (N, dtype): below it the figure is skipped
#: and the README block is not refilled (the grid's two head dims, 64 and 128, are not a sweep)
HEAD_DIM_MIN = 4
#: the head dims of the sweep: every multiple of 8 from 32 to 256 (the stage contract's, from 32 up)
HEAD_DIM_SWEEP = tuple(range(32, 257, 8))
#: the script that measures the sweep on a GPU, and its one sweep command (the script runs it in parts)
HEAD_DIM_SCRIPT = "experiments/head_dims_gpu.sh"
HEAD_DIM_COMMAND = ("python -m harness sweep --stages c --peers flash,cudnn --N 4096 --D "
                    + ",".join(map(str, HEAD_DIM_SWEEP)) + " --causal both --dtype bf16")
#: stage C's variant without warp specialization: its row at D 64 or 128 is the tl kernel's rate at
#: the width a head dim between powers of two is padded to, the bound for such a head dim where it
#: runs the tl kernel (with ``LAB_WS_PADDED_HEAD_DIMS=0``; by default the warp-specialized kernel runs
#: D 40-248 in its padded width's tiles, and stage C's own row at that width is the bound)
HEAD_DIM_TL_VARIANT = "-warp_specialization"


def _ws_runs(dtype: str, D: int) -> bool:
    """Whether stage C runs head dim ``D`` in ``dtype`` with its warp-specialized kernel on a Hopper GPU
    (the code's rule, ``hopper_ws.supported``; the rows do not record which kernel ran)."""
    from stages.c_optimized import hopper_ws
    from stages.contract import DTYPES

    return dtype in DTYPES and hopper_ws.supported(DTYPES[dtype], D, 90)


def _is_timed(row: dict | None) -> bool:
    return row is not None and is_ok(row) and bool(row.get("tflops"))


def head_dim_kernel_note(env: dict, dtype: str, rows: list[dict]) -> str:
    """Which kernel stage C runs at which head dim, where the rows say it: GPU rows of fp16 or bf16 on
    a Hopper GPU (``compute_capability`` 9.0 in ``env.json``); '' elsewhere (a CPU run, fp32, another GPU)."""
    if views.interpreted(rows) or dtype not in ("fp16", "bf16") or str(env.get("compute_capability")) != "9.0":
        return ""
    ds = sorted({r["D"] for r in rows})
    ws = [D for D in ds if _ws_runs(dtype, D)]
    tl = [D for D in ds if D not in ws]
    if not ws:
        return ""
    text = (f"D {_d_ranges(ws, ds)} run stage C's warp-specialized Hopper kernel (a head dim between powers of two in tiles "
            "of its padded width, or of half that and a narrow tail)")
    if tl:
        text += f"; D {_d_ranges(tl, ds)} {'runs' if len(tl) == 1 else 'run'} its tl kernel"
    tuned = _tuned_head_dims(env.get("gpu_slug"), dtype)
    if tuned:
        held = _d_ranges(tuned, sorted(set(ds) | set(tuned)))
        text += (f"; each head dim takes the tuning table's winner for the width of its tiles where the table "
                 f"holds one (it holds widths {held}), else the first tile configuration of that width")
    return text


def _tuned_head_dims(slug: str | None, dtype: str) -> list[int]:
    """The head dims ``stages/c_optimized/tuned/<slug>.json`` holds winners for in ``dtype``."""
    from stages.c_optimized import configs

    table = configs.tuned_table(slug)
    return sorted({int(key.split("/")[1][1:]) for key in table if key.startswith(dtype + "/")})


def head_dim_family(rows: list[dict]) -> tuple[int, str] | None:
    """(N, dtype) of the head-dim sweep in ``rows``: of the forward grid's (N, dtype) pairs, the one
    where stage C has timed rows at the most distinct head dims (ties: N = 4096 first, then the larger
    N, then bf16, the sweep script's dtype, then the dtype's name); None when no pair reaches
    :data:`HEAD_DIM_MIN` head dims."""
    dims: dict[tuple[int, str], set[int]] = {}
    for r in views.plain(forward_grid(rows)):
        if r["impl"] == "c" and _is_timed(r):
            dims.setdefault((r["N"], r["dtype"]), set()).add(r["D"])
    if not dims:
        return None
    best = max(dims, key=lambda k: (len(dims[k]), k[0] == views.HEADLINE_N, k[0], k[1] == "bf16", k[1]))
    return best if len(dims[best]) >= HEAD_DIM_MIN else None


def _head_dim_cell(rows: list[dict], *, N: int, D: int, dtype: str, causal: int) -> dict[str, dict]:
    """Stage C's, cuDNN's and FA2's row at one cell (at the (B, H) most impls ran), taken from the latest
    run that timed stage C beside a peer there (else the latest that ran C), so a ratio compares rows
    measured side by side; an impl that run lacks contributes its latest row. Rows of any status."""
    at = [r for r in views.cell_rows(views.plain(rows), N=N, D=D, dtype=dtype, causal=causal)
          if r["impl"] in HEAD_DIM_IMPLS]
    runs_c = {r["run_id"] for r in at if r["impl"] == "c"}
    with_peer = runs_c & {r["run_id"] for r in at if r["impl"] != "c"}
    run = max(with_peer or runs_c, default=None)
    out = {}
    for impl in HEAD_DIM_IMPLS:
        mine = [r for r in at if r["impl"] == impl]
        same_run = [r for r in mine if r["run_id"] == run]
        if same_run or mine:
            out[impl] = (same_run or mine)[-1]
    return out


def _kernel_width(D: int) -> int:
    """The columns stage C computes at head dim ``D`` on an H100/H200: the warp-specialized kernel's
    tiles where it takes D (``hopper_ws.tile_width``: the next power of two, or a main part and a
    narrow tail), else the tl kernel's next power of two."""
    import torch

    from stages.c_optimized import hopper_ws
    from stages.contract import padded_head_dim

    return hopper_ws.tile_width(D) if hopper_ws.supported(torch.bfloat16, D, 90) else padded_head_dim(D)


def head_dim_points(rows: list[dict], *, N: int, dtype: str) -> dict[int, list[dict]]:
    """The head-dim sweep at (N, dtype), per causal setting (0, 1): one dict per head dim that has a
    stage C row, in order of D: ``D``, ``padded`` (the columns stage C's kernel computes at D:
    ``hopper_ws.tile_width``, the next power of two or a main part and a narrow tail), the rows ``c``, ``sdpa_cudnn``, ``sdpa_flash`` (None where absent; any
    status), ``vs_cudnn`` and ``vs_flash`` (C's TFLOPS over the peer's where both are timed, else
    None), and ``padded_rate``: where D is padded and stage C was timed at the padded width, the
    TFLOPS stage C would reach at D if it ran at that width's rate (its TFLOPS there × D / padded),
    with ``padded_rate_kernel`` saying whose rate it is: ``"tl"`` (stage C's
    :data:`HEAD_DIM_TL_VARIANT` row at that width, where D runs the tl kernel and the width the
    warp-specialized one) or ``"c"`` (stage C's own row there: D and its padded width run the same
    kernel, or no tl row was measured). Forward grid rows only."""
    grid = forward_grid(rows)
    out: dict[int, list[dict]] = {}
    for causal in (0, 1):
        ds = sorted({r["D"] for r in views.plain(grid) if r["impl"] == "c" and r["N"] == N and r["dtype"] == dtype
                     and int(r["causal"]) == causal})
        cells = {D: _head_dim_cell(grid, N=N, D=D, dtype=dtype, causal=causal) for D in ds}
        points = []
        for D in ds:
            found = cells[D]
            c, cudnn, flash = found.get("c"), found.get("sdpa_cudnn"), found.get("sdpa_flash")
            point = {"D": D, "padded": _kernel_width(D), "c": c, "sdpa_cudnn": cudnn, "sdpa_flash": flash,
                     "vs_cudnn": _ratio(c, cudnn) if _is_timed(c) and _is_timed(cudnn) else None,
                     "vs_flash": _ratio(c, flash) if _is_timed(c) and _is_timed(flash) else None,
                     "padded_rate": None, "padded_rate_kernel": None}
            P = point["padded"]
            if P != D:
                # the padded width's rate of the kernel D runs: stage C's own row at P when D runs the
                # kernel P runs, else (the tl kernel at D, the warp-specialized one at P) the tl row at P
                same_kernel = _ws_runs(dtype, D) == _ws_runs(dtype, P)
                tl = [] if same_kernel else [
                    r for r in select(grid, impl="c", kind="ablation", variant=HEAD_DIM_TL_VARIANT, N=N, D=P,
                                      dtype=dtype, causal=causal) if _is_timed(r)]
                own = cells.get(P, {}).get("c")
                if tl:
                    point["padded_rate"], point["padded_rate_kernel"] = tl[-1]["tflops"] * D / P, "tl"
                elif _is_timed(own):
                    point["padded_rate"], point["padded_rate_kernel"] = own["tflops"] * D / P, "c"
            points.append(point)
        if points:
            out[causal] = points
    return out


def _d_ranges(ds: list[int], among: list[int]) -> str:
    """``ds`` (a subset of the sorted head dims ``among``) as runs of neighbours in ``among``:
    ``"32–56, 128 and 256"``."""
    runs: list[list[int]] = []
    for D in ds:
        if runs and among.index(D) == among.index(runs[-1][-1]) + 1:
            runs[-1].append(D)
        else:
            runs.append([D])
    parts = [f"{r[0]}–{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _head_dim_value(row: dict | None) -> str:
    """A TFLOPS cell: the number, the status's first word where the row is not ``ok``, — where absent."""
    if row is None:
        return "—"
    if not is_ok(row):
        return _md(row["status"].split(":")[0])
    t = row.get("tflops")
    return fmt_num(t, ".0f" if t is not None and t >= 10 else ".2g")


def head_dim_table(points: list[dict]) -> str:
    """One causal setting of the sweep (:func:`head_dim_points`) as Markdown: D, the three impls'
    TFLOPS, C's ratio to each peer (``†``: a timing whose samples spread more than
    :data:`NOISY_SPREAD`), the padded width and its ratio to D; '' without points."""
    if not points:
        return ""
    lines = ["| D | C TFLOPS | cuDNN | FA2 | C / cuDNN | C / FA2 | padded D |", "|--:|--:|--:|--:|--:|--:|--:|"]
    for p in points:
        ratios = []
        for peer, key in (("sdpa_cudnn", "vs_cudnn"), ("sdpa_flash", "vs_flash")):
            spreads = [sample_spread(p["c"]), sample_spread(p[peer])] if p[key] is not None else []
            noisy = any(s is not None and s > NOISY_SPREAD for s in spreads)
            ratios.append("—" if p[key] is None else f"{p[key]:.2f}" + ("†" if noisy else ""))
        padded = f"{p['padded']} (×{p['padded'] / p['D']:.2f})" if p["padded"] != p["D"] else "—"
        lines.append(f"| {p['D']} | {_head_dim_value(p['c'])} | {_head_dim_value(p['sdpa_cudnn'])} | "
                     f"{_head_dim_value(p['sdpa_flash'])} | {ratios[0]} | {ratios[1]} | {padded} |")
    if any("†" in line for line in lines):
        lines += ["", f"† Noisy: the 20th and 80th percentiles of a side's samples lie more than {NOISY_SPREAD:.0%} "
                      "of the median apart."]
    return "\n".join(lines)


def head_dim_reading(points_by_causal: dict[int, list[dict]]) -> str:
    """One sentence from the ratios: C / cuDNN's min, median and max over every head dim and mask,
    the medians at the power-of-two and at the padded head dims, and per mask the head dims where
    stage C is at or above cuDNN; the head dims cuDNN refused. '' without a ratio."""
    every = [p for pts in points_by_causal.values() for p in pts]
    ratios = sorted(p["vs_cudnn"] for p in every if p["vs_cudnn"] is not None)
    if not ratios:
        return ""
    text = (f"Stage C reaches {ratios[0]:.2f}–{ratios[-1]:.2f}× of cuDNN's throughput over the {len(ratios)} "
            f"(head dim, mask) cells (median {statistics.median(ratios):.2f}")
    medians = []
    for what, padded in (("unpadded", False), ("padded", True)):
        vals = [p["vs_cudnn"] for p in every if p["vs_cudnn"] is not None and (p["padded"] != p["D"]) == padded]
        if vals:
            medians.append(f"{statistics.median(vals):.2f} at the {what} head dims")
    text += ("; " + ", ".join(medians) if medians else "") + ")"
    wins = []
    for causal, pts in sorted(points_by_causal.items()):
        among = [p["D"] for p in pts if p["vs_cudnn"] is not None]
        if not among:
            continue
        ahead = [p["D"] for p in pts if p["vs_cudnn"] is not None and p["vs_cudnn"] >= 1.0]
        where = ("at no head dim" if not ahead else "at every head dim" if len(ahead) == len(among)
                 else f"at D {_d_ranges(ahead, among)}")
        wins.append(f"{where} {'causal' if causal else 'non-causal'}")
    text += ", and is at or above cuDNN " + " and ".join(wins)
    refused = [p for p in every if p["sdpa_cudnn"] is not None and not is_ok(p["sdpa_cudnn"])]
    if refused:
        ds = sorted({p["D"] for p in refused})
        statuses = sorted({_md(p["sdpa_cudnn"]["status"].split(":")[0]) for p in refused})
        text += (f"; cuDNN gave no time at D {_d_ranges(ds, sorted({p['D'] for p in every}))} "
                 f"({', '.join(statuses)})")
    return text + "."


def head_dims_present(results_dir) -> bool:
    """Whether ``results_dir/runs.csv`` holds a head-dim sweep (:func:`head_dim_family`): the block's data gate."""
    path = Path(results_dir) / "runs.csv"
    return path.exists() and head_dim_family(load_rows(results_dir)) is not None


def render_head_dims_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """The head-dim sweep (``results_dir/runs.csv``): at the (N, dtype) of :func:`head_dim_family`, per
    causal setting, stage C, cuDNN and FA2 at every head dim measured, C's ratio to each, and the
    width stage C pads D to; a sentence reading it (:func:`head_dim_reading`) and the figure.
    ``dtype`` is not used: the sweep's own is shown."""
    results_dir = Path(results_dir)
    rel = _posix_rel(results_dir, Path(readme_dir))
    parts = [_generated_note(rel)]
    path = results_dir / "runs.csv"
    rows = forward_grid(load_rows(results_dir)) if path.exists() else []
    family = head_dim_family(rows)
    if family is None:
        parts.append(f"_No head-dim sweep yet (stage C at {HEAD_DIM_MIN} or more head dims of one N and dtype): run "
                     f"`{HEAD_DIM_SCRIPT}` on a GPU (`{HEAD_DIM_COMMAND}`)._")
        return "\n\n".join(parts) + "\n"
    N, dt = family
    points = head_dim_points(rows, N=N, dtype=dt)
    c_rows = [p["c"] for pts in points.values() for p in pts if p["c"] is not None]
    tokens = sorted({r["B"] * r["N"] for r in c_rows})
    hidden = sorted({r["H"] * r["D"] for r in c_rows})
    ds = sorted({p["D"] for pts in points.values() for p in pts})
    try:
        env = load_env(results_dir)
    except ResultsError:
        env = {}
    span = (lambda v: f"{v[0]}" if len(v) == 1 else f"{v[0]}–{v[-1]}")
    kernels = head_dim_kernel_note(env, dt, c_rows)
    parts.append(
        f"Measured on **{_md(_measured_on(env, c_rows))}**: stage C, SDPA CUDNN and SDPA FLASH (FA2) at N = {N}, "
        f"{dt}, forward, at {len(ds)} head dims from {ds[0]} to {ds[-1]}; B·N = {span(tokens)} tokens and "
        f"H·D = {span(hidden)} (the FlashAttention-paper setting: the harness takes B = tokens / N and H = hidden / D "
        "rounded down). TFLOPS: 4·B·H·N²·D FLOPs (causal: the visible pairs) over the median time, with the true "
        "D: the columns stage C pads are not counted. Stage C's kernel runs D in tiles of the next power of two, "
        "or, where narrower, of half that and a tail of 16, 32 or 64 columns (D 136 as 128 + 16; the extra "
        "columns are zeros), so a padded head dim does the multiply-adds of its padded width: padded D, and in "
        "parentheses that width over D. "
        + (kernels + ". " if kernels else "")
        + "Ratios: TFLOPS ratios, above 1 when stage C is faster, of the rows of the latest run that timed stage C "
        "beside a peer at that head dim; an impl that gave no time there shows its status.")
    if views.interpreted(c_rows):
        parts.append("> **Note:** these rows ran in the Triton interpreter on a CPU: their times are not GPU times.")
    for causal, pts in sorted(points.items()):
        parts.append(f"#### {'Causal' if causal else 'Non-causal'}\n\n" + head_dim_table(pts))
    reading = head_dim_reading(points)
    if reading:
        parts.append(reading)
    # The same sweep in the other dtypes, where it ran (its tables are in runs.csv): one sentence each.
    for other in sorted({r["dtype"] for r in rows if r["N"] == N and r["dtype"] != dt}):
        other_points = head_dim_points(rows, N=N, dtype=other)
        if len({p["D"] for pts in other_points.values() for p in pts}) >= HEAD_DIM_MIN:
            other_reading = head_dim_reading(other_points)
            if other_reading:
                parts.append(f"In {other}, the same sweep: " + other_reading[0].lower() + other_reading[1:])
    if (results_dir / "figures" / "head_dims.png").exists():
        parts.append(f"![TFLOPS vs head dim: stage C, cuDNN and FA2, the head dims stage C pads shaded]"
                     f"({rel}/figures/head_dims.png)")
    return "\n\n".join(parts) + "\n"


#: The blocks a file may hold, by marker name.
BLOCKS = {"headline": render_headline_block, "results": render_block, "ratio": render_ratio_block,
          "ablation": render_ablation_block,
          "twins": render_twins_block, "models": render_models_block, "shapes": render_shapes_block,
          "backward": render_backward_block,
          "latency": render_latency_block, "generate": render_generate_block, "train": render_train_block,
          "decode": render_decode_block,
          "head_dims": render_head_dims_block}

#: Blocks refilled only when their data is there: without it a file keeps the block it has (the
#: generate runs are measured separately, and a results folder without them says nothing about them).
BLOCK_DATA = {"generate": lambda results_dir: (Path(results_dir) / "generate" / "runs.csv").exists(),
              "train": lambda results_dir: (Path(results_dir) / "train" / "summary.csv").exists(),
              "decode": lambda results_dir: (Path(results_dir) / "decode.csv").exists(),
              "head_dims": head_dims_present}


#: The README a results folder gets (``report RESULTS --update`` writes it from :func:`results_page`
#: when it does not exist yet; later runs refill only its blocks, so its prose may be edited):
#: one section per block, each (block, heading, what the table shows, the command that measures it).
RESULTS_PAGE_SECTIONS = (
    ("results", "The forward pass at N = 4096",
     "Every stage and every SDPA backend at the headline cells (head dim 64 and 128, causal and not), then "
     "stage C's throughput as a fraction of cuDNN's over the sequence length N, a reading of the numbers "
     "and the figures.", "python -m harness sweep"),
    ("ablation", "Stage C's optimizations, one at a time",
     "Stage C's kernel started from stage B's settings, then one optimization switched on per row "
     "(cumulative), and each one switched off with all others on (leave one out).",
     "python -m harness sweep --stages c --ablation --N 4096"),
    ("backward", "The backward pass",
     "Stage C's backward against FlashAttention-2 and cuDNN through SDPA, over the same grid.",
     views.HINTS["bwd"]),
    ("models", "The shapes real models run",
     "Stage C against the fastest SDPA backend on named cells of real models (GPT-2, BERT, ViT, Llama, "
     "long contexts, decode steps), timed eagerly and replayed from a CUDA graph.", views.HINTS["models"]),
    ("shapes", "Grouped-query attention, head dims 80 and 96, decode steps",
     "The cells of the stage contract that the FlashAttention-paper grid leaves out; for a decode step, "
     "the bandwidth it reaches against a device-to-device copy.", views.HINTS["shapes"]),
    ("head_dims", "Every head dim from 32 to 256",
     "Stage C, cuDNN and FlashAttention-2 at every multiple of 8 from 32 to 256 (N = 4096, bf16, causal and "
     "not; the same in fp16 where it ran): what padding D costs stage C, to the next power of two or to half "
     "that plus a narrow tail.", HEAD_DIM_SCRIPT),
    ("latency", "The host path",
     "What one call costs the CPU on a tiny problem, forward and backward, beside the launch of an empty "
     "Triton kernel.",
     views.HINTS["latency"]),
    ("generate", "Inside a model",
     "Small GPT-2- and Llama-shaped transformers models with random weights, decoding with their KV cache "
     "and training, with each stage as the model's attention beside transformers' own SDPA.",
     "python -m harness generate"),
    ("train", "Training a small GPT, eager and compiled",
     "A small GPT (the lab's own, grouped-query attention) trained with each stage and with SDPA from the same "
     "weights on the same batches: the step time, eager and through `torch.compile` (with and without CUDA "
     "graphs), and whether the loss curves agree.",
     views.HINTS["train"]),
    ("decode", "A decode step's attention, the cache growing",
     "Attention in a decode loop whose KV cache grows by one key per call, against a cache of fixed length.",
     "python -m harness decode"),
)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lowercase, letters, digits, '_', '-' and spaces kept, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def contents_line() -> str:
    """The results page's sections as one line of links."""
    links = (f"[{heading}](#{_anchor(heading)})" for _name, heading, _what, _command in RESULTS_PAGE_SECTIONS)
    return "Sections: " + " · ".join(links) + "."


def results_page(results_dir) -> str:
    """A results folder's README before its blocks are filled: a title naming the GPU, how the page
    is regenerated, and one section per :data:`RESULTS_PAGE_SECTIONS` entry with empty markers."""
    results_dir = Path(results_dir)
    try:
        gpu = load_env(results_dir).get("gpu_name") or results_dir.name
    except ResultsError:
        gpu = results_dir.name
    folder = results_dir.as_posix()
    lines = [f"# Results on {gpu}", "",
             f"Everything measured in this folder, as tables generated from its CSV files by "
             f"`python -m harness report {folder} --update` (figures: `python -m harness plot {folder}`). "
             "Edit the results, not the tables: the text between a section's markers is rewritten every time.",
             "", contents_line(), ""]
    for name, heading, what, command in RESULTS_PAGE_SECTIONS:
        begin, end = markers(name)
        lines += [f"## {heading}", "", f"{what} Measured by `{command}`.", "", begin,
                  f"_Not measured yet: run `{command}`, then `python -m harness report {folder} --update`._",
                  end, ""]
    return "\n".join(lines)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _split(text: str, path, name: str = "results") -> tuple[str, str, str]:
    """README text -> (text up to and including the begin marker, the old block, text from the end marker on)."""
    begin, end = markers(name)
    nb, ne = text.count(begin), text.count(end)
    if nb != 1 or ne != 1:
        raise ReadmeError(
            f"{path}: expected exactly one '{begin}' and one '{end}' line (found {nb} and {ne}); "
            "put them where the generated results should go")
    b, e = text.index(begin), text.index(end)
    if e < b:
        raise ReadmeError(f"{path}: '{end}' comes before '{begin}'")
    head_end = b + len(begin)
    return text[:head_end], text[head_end:e], text[e:]


def readme_with_block(readme_text: str, block: str, path="README", name: str = "results") -> str:
    """``readme_text`` with the text between the ``name`` markers replaced by ``block``."""
    head, _old, tail = _split(readme_text, path, name)
    return head + "\n" + block.strip("\n") + "\n" + tail


def expected_readme(readme_path, results_dir, *, dtype: str = "fp16") -> tuple[str, str]:
    """(current text, text with every block whose markers the file holds freshly generated)."""
    readme_path = Path(readme_path)
    if not readme_path.exists():
        raise ReadmeError(f"{readme_path}: no such README")
    current = new = readme_path.read_text()
    present = [name for name in BLOCKS if markers(name)[0] in current or markers(name)[1] in current]
    if not present:
        _split(current, readme_path, "results")  # raises, naming the results markers
    for name in present:
        if name in BLOCK_DATA and not BLOCK_DATA[name](results_dir):
            continue
        block = BLOCKS[name](results_dir, readme_path.parent, dtype=dtype)
        new = readme_with_block(new, block, readme_path, name)
    return current, new


def update_readme(readme_path, results_dir, *, dtype: str = "fp16") -> bool:
    """Rewrite the README's results block from ``results_dir``; True if the file changed."""
    current, new = expected_readme(readme_path, results_dir, dtype=dtype)
    if new == current:
        return False
    Path(readme_path).write_text(new)
    return True


def check_readme(readme_path, results_dir, *, dtype: str = "fp16") -> str:
    """'' when the README's block is what :func:`update_readme` would write, else a unified diff."""
    current, new = expected_readme(readme_path, results_dir, dtype=dtype)
    if new == current:
        return ""
    return "".join(difflib.unified_diff(current.splitlines(True), new.splitlines(True),
                                        f"{readme_path} (committed)", f"{readme_path} (generated)"))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``report RESULTS_DIR [--update] [--readme FILE ...] [--check] [--dtype fp16]``."""
    p = subparsers.add_parser("report", help="the results tables of a results folder, printed or written into READMEs",
                              description="Print the results tables, or rewrite/check the generated blocks "
                                          "('<!-- NAME:begin -->' ... '<!-- NAME:end -->', NAME one of "
                                          f"{', '.join(BLOCKS)}) of the files named. --update writes "
                                          "RESULTS_DIR/README.md (every table; created if missing); "
                                          "--readme adds a file (repeatable), e.g. the landing page README.md, "
                                          "whose headline block is filled from the same folder.")
    p.add_argument("results_dir", help="a results/<gpu>/ directory holding runs.csv and env.json")
    p.add_argument("--update", action="store_true",
                   help="rewrite RESULTS_DIR/README.md's blocks (written from a template first if it does not exist)")
    p.add_argument("--readme", action="append", default=None,
                   help="a file whose generated blocks to rewrite (repeatable; e.g. README.md, results/h200/README.md "
                        "and the stage READMEs)")
    p.add_argument("--check", action="store_true",
                   help="do not write: exit 1 if a file's blocks differ from what would be generated (the files of "
                        "--update and --readme; RESULTS_DIR/README.md when neither is given)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="dtype of the tables")
    p.set_defaults(func=run)
    return p


def _targets(args) -> list[Path]:
    """The files ``report`` writes or checks: the results folder's README first (``--update``, or
    ``--check`` alone), then every ``--readme`` in the order given, each once."""
    own = Path(args.results_dir) / "README.md"
    targets = [own] if getattr(args, "update", False) or (args.check and not args.readme) else []
    for readme in args.readme or []:
        if Path(readme).resolve() not in {t.resolve() for t in targets}:
            targets.append(Path(readme))
    return targets


def run(args) -> int:
    try:
        targets = _targets(args)
        if args.check:
            stale = 0
            for readme in targets:
                diff = check_readme(readme, args.results_dir, dtype=args.dtype)
                if diff:
                    print(diff, end="")
                    print(f"report: {readme}'s generated blocks are stale; regenerate them with "
                          f"`python -m harness report {args.results_dir} --readme {readme}`", file=sys.stderr)
                    stale += 1
                else:
                    print(f"report: {readme}'s generated blocks are up to date")
            return 1 if stale else 0
        if targets:
            own = Path(args.results_dir) / "README.md"
            if getattr(args, "update", False) and not own.exists():
                own.write_text(results_page(args.results_dir))
                print(f"report: wrote {own} from the template")
            for readme in targets:
                changed = update_readme(readme, args.results_dir, dtype=args.dtype)
                print(f"report: {'updated' if changed else 'unchanged'} {readme}")
            return 0
        print(render_block(args.results_dir, ".", dtype=args.dtype), end="")
        return 0
    except (ResultsError, ReadmeError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a README that cannot be read or written: one line naming it
        print(f"report: error: {e.filename}: {e.strerror}" if e.filename else f"report: error: {e}",
              file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
