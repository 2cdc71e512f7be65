"""The figures, drawn from a results directory: ``python -m harness plot results/h200``.

Each ``plot_*`` function takes the de-duplicated rows and ``env.json`` of one results directory
(see :func:`harness.views.load`) and the folder to write into, and returns the PNG's path, or None
after printing why it drew nothing (which command would produce the missing data). ``plot_all``
writes every figure into ``<results_dir>/figures/``:

==================  ==========================================================================
``waterfall.png``   time, DRAM bytes, peak memory at one cell: A → B → C's optimizations → C
``throughput.png``  TFLOPS vs N per (D, causal), stages and SDPA peers
``dram_bytes.png``  DRAM bytes per (batch, head) vs N: traffic model dashed, Nsight measured solid
``peak_memory.png`` extra device memory of one call vs N, device memory line, OOM points
``roofline.png``    measured ceilings and each impl by arithmetic intensity (measured DRAM bytes filled,
                    the traffic model hollow: requests, at or left of the true point) and TFLOPS
``energy.png``      joules per call and TFLOP per joule (= TFLOPS/W)
``bandwidth_share.png``  time beside the DRAM bandwidth achieved (Nsight bytes / time) as a share of the copy
                    bandwidth: A, B, C, SDPA CUDNN at the headline cell
``backward_throughput.png``  the same as ``throughput.png`` for the backward pass (``pass = bwd`` rows)
``backward_waterfall.png``   A → B → C's backward at the headline cell (time, DRAM, training-step memory)
``models.png``      stage C over the fastest SDPA backend per model-suite cell, eager and GPU-only
``head_dims.png``  TFLOPS vs head dim (32-256): stage C, cuDNN, FA2; where stage C pads D, and its cost
==================  ==========================================================================

The forward figures draw only forward rows of the self-attention grid (:func:`harness.views.forward_grid`:
Hkv = H, Nk = N, no suite cell), the backward ones only its ``bwd`` rows, so new kinds of row in a
results file never change a figure made for another.

No label uses matplotlib's mathtext (``$...$``, or the ``10^k`` tick labels of its log formatters):
mathtext loads the STIX and Computer Modern fonts even for the DejaVu font set, and where they are
missing every figure printed ``findfont`` warnings. Log axes get plain-text tick labels, and
:data:`RC` turns ``$`` parsing off while a figure is drawn.

Matplotlib is used through ``Figure`` objects and the Agg canvas directly (no pyplot), so drawing
here never changes the backend of a notebook that imports this module.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogFormatter, LogLocator, NullFormatter

from . import views
from .results import ResultsError, ensure_writable_dir
from .views import HINTS, dram_bytes, flops, is_ok, is_oom, label, select

DPI = 100          # 11-12 inch figures come out ~1100-1200 px wide; README shows them at ~900 px
WIDTH = 12.0       # inches
#: matplotlib settings while a figure is drawn: no mathtext (see the module docstring)
RC = {"text.parse_math": False, "mathtext.fontset": "dejavusans"}

COLORS = {"a": "#d62728", "b": "#ff7f0e", "c": "#2ca02c", "b_cuda": "#8c564b", "c_cuda": "#17becf",
          "sdpa_flash": "#1f77b4", "sdpa_cudnn": "#9467bd", "sdpa_efficient": "#bcbd22",
          "sdpa_math": "#7f7f7f"}
_EXTRA = ("#e377c2", "#393b79", "#637939", "#843c39")
FORWARD_FIGURES = ("waterfall.png", "throughput.png", "dram_bytes.png", "peak_memory.png",
                   "roofline.png", "energy.png", "bandwidth_share.png")
BACKWARD_FIGURES = ("backward_throughput.png", "backward_waterfall.png")
FIGURE_NAMES = FORWARD_FIGURES + BACKWARD_FIGURES + ("models.png", "head_dims.png")
STAGE_IMPLS = ("a", "b", "c", "b_cuda", "c_cuda")


# --------------------------------------------------------------------------------------- helpers

def _drawn_with_rc(plot):
    """Run a ``plot_*`` function under :data:`RC` (Text objects read ``text.parse_math`` when made)."""
    @functools.wraps(plot)
    def wrapper(*args, **kwargs):
        with matplotlib.rc_context(RC):
            return plot(*args, **kwargs)
    return wrapper


def color(impl: str) -> str:
    if impl in COLORS:
        return COLORS[impl]
    return _EXTRA[sum(map(ord, impl)) % len(_EXTRA)]


def _new_figure(height: float, nrows: int = 1, ncols: int = 1, **kw) -> tuple[Figure, list]:
    fig = Figure(figsize=(WIDTH, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, [ax for row in axes for ax in row]


def _save(fig: Figure, out_dir: Path, name: str, env: dict, rows: list[dict]) -> Path:
    # The provenance stamp sits just above the figure's top right corner; bbox_inches="tight" grows the canvas to hold it.
    fig.text(0.995, 1.0, views.provenance(env, rows), ha="right", va="bottom", fontsize=9, color="0.35")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=DPI, bbox_inches="tight", pad_inches=0.15, metadata={"Software": None})
    return path


def _skip(name: str, why: str, *commands: str) -> None:
    print(f"plot: skipped {name}: {why}; to produce it run " + " and ".join(f"`{c}`" for c in commands))


def _fmt_n(n: float, _pos=None) -> str:
    n = int(round(n))
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _fmt_bytes_tick(x: float, _pos=None) -> str:
    return views.fmt_bytes(x).replace(".0 ", " ")


class _PlainMinorLogFormatter(LogFormatter):
    """Labels minor log ticks where matplotlib's default would (an axis spanning about a decade or
    less), in plain text from ``text_of(value)`` instead of the default's mathtext."""

    def __init__(self, text_of):
        super().__init__(labelOnlyBase=False)
        self._text_of = text_of

    def _num_to_string(self, x, vmin, vmax):
        return self._text_of(x)


def _plain_log_labels(axis, text_of=None) -> None:
    """Plain-text tick labels on a log ``axis`` (``ax.xaxis``/``ax.yaxis``), major and minor alike:
    ``text_of(value)`` (default ``1``, ``10``, ``0.1``). The default labels are mathtext."""
    text_of = text_of or (lambda v: f"{v:g}")
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: text_of(v)))
    axis.set_minor_formatter(_PlainMinorLogFormatter(text_of))


def _log2_n_axis(ax, ns) -> None:
    ax.set_xscale("log", base=2)
    ns = sorted(set(ns))
    if ns:
        ax.set_xticks(ns)
    ax.xaxis.set_major_formatter(FuncFormatter(_fmt_n))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("sequence length N (tokens)")


def _log_bytes_axis(ax) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10))
    _plain_log_labels(ax.yaxis, _fmt_bytes_tick)


def _panel_title(D: int, causal: int) -> str:
    return f"D = {D}, {'causal' if causal else 'non-causal'}"


def _panels(rows: list[dict]) -> list[tuple[int, int]]:
    """The (D, causal) combinations present, D major."""
    return sorted({(r["D"], int(r["causal"])) for r in rows})


def _grid(panels: list) -> tuple[int, int]:
    ncols = 2 if len(panels) > 1 else 1
    return -(-len(panels) // ncols), ncols


def _hide_unused(axes: list, used: int) -> None:
    for ax in axes[used:]:
        ax.set_visible(False)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", fontsize=11, color="0.3",
            wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def parse_cell(text: str | None) -> dict:
    """``"N=4096,D=64,dtype=fp16,causal=0"`` (any subset) -> ``{"N": 4096, ...}``."""
    if not text:
        return {}
    cell: dict = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("N", "D", "dtype", "causal"):
            raise ValueError(f"--cell: expected comma-separated N=..,D=..,dtype=..,causal=.., got {part!r}")
        if key in ("N", "D"):
            try:
                cell[key] = int(value)
            except ValueError:
                raise ValueError(f"--cell: {key} must be an integer, got {value!r}") from None
        elif key == "causal":
            if value.lower() not in ("0", "1", "no", "yes", "false", "true"):
                raise ValueError(f"--cell: causal must be 0/1 (or yes/no), got {value!r}")
            cell[key] = int(value.lower() in ("1", "yes", "true"))
        else:
            cell[key] = value
    return cell


def resolve_cell(rows: list[dict], cell: dict | None = None) -> dict:
    """Fill a partial cell with the headline defaults: D=64, fp16, non-causal, N=4096 (or the
    largest N measured, for a small CPU run)."""
    cell = dict(cell or {})
    cell.setdefault("D", 64)
    cell.setdefault("dtype", "fp16")
    cell["causal"] = int(cell.get("causal", 0))
    if "N" not in cell:
        n = views.headline_n(rows, D=cell["D"], dtype=cell["dtype"], causal=cell["causal"])
        cell["N"] = n if n is not None else views.HEADLINE_N
    return cell


# ------------------------------------------------------------------------------ 1. the waterfall

def waterfall_steps(rows: list[dict], cell: dict) -> list[tuple[str, str, dict]]:
    """``(label, impl-for-colour, row)`` from A to C at ``cell``: A, B, then stage C's cumulative
    ablation rows (variants named ``+x``, in the stage's walk order), then C as registered."""
    at = views.cell_rows(rows, **cell)
    steps = []
    for impl in ("a", "b"):
        found = select(at, impl=impl, kind="stage")
        if found:
            steps.append((label(impl), impl, found[-1]))
    ablation = [r for r in at if r["kind"] == "ablation" and r["variant"].startswith("+")]
    impls = {r["impl"] for r in ablation}
    abl_impl = "c" if "c" in impls else (sorted(impls)[0] if impls else None)
    for r in views.walk_order(ablation):
        if r["impl"] == abl_impl:
            name = r["variant"][1:]
            text = "C kernel, all switches off" if name == "none" else "+ " + name.replace("_", " ")
            steps.append((text, "step", r))
    found = select(at, impl="c", kind="stage")
    if found:
        steps.append((label("c"), "c", found[-1]))
    return steps


@_drawn_with_rc
def plot_waterfall(rows: list[dict], env: dict, out_dir, *, cell: dict | None = None) -> Path | None:
    """Three panels, one bar per step from A to C: time (ms, p20–p80 whiskers, speedup over the
    step above), DRAM bytes (Nsight measured bars, model ◆), peak extra memory (measured, model ◆).
    A step without a measurement shows its model as a hatched bar, and the legend says so.
    Forward grid rows only (:func:`harness.views.forward_grid`)."""
    name = "waterfall.png"
    rows = views.forward_grid(rows)
    cell = resolve_cell(rows, cell)
    steps = waterfall_steps(rows, cell)
    if len(steps) < 2:
        _skip(name, f"fewer than two of A, B, C at N={cell['N']}, D={cell['D']}, {cell['dtype']}, "
                    f"causal={cell['causal']}", HINTS["rows"], HINTS["ablation"])
        return None
    return _draw_waterfall(steps, rows, env, Path(out_dir) / name, cell, pass_="fwd")


@_drawn_with_rc
def plot_backward_waterfall(rows: list[dict], env: dict, out_dir, *, cell: dict | None = None) -> Path | None:
    """:func:`plot_waterfall` for the backward pass (``pass = bwd`` grid rows): A → B → C's backward
    (and stage C's backward ablation steps where measured) at the headline cell; its memory panel is
    the peak of a training step. Needs a backward row of each of A, B and C there."""
    name = "backward_waterfall.png"
    rows = views.grid_rows(rows, "bwd")
    cell = resolve_cell(rows, cell)
    steps = waterfall_steps(rows, cell)
    have = {kind for _, kind, _ in steps}
    if not {"a", "b", "c"} <= have:
        missing = ", ".join(s.upper() for s in "abc" if s not in have)
        _skip(name, f"no backward row of {missing} at N={cell['N']}, D={cell['D']}, {cell['dtype']}, "
                    f"causal={cell['causal']}", HINTS["bwd"])
        return None
    return _draw_waterfall(steps, rows, env, Path(out_dir) / name, cell, pass_="bwd")


def _draw_waterfall(steps: list[tuple[str, str, dict]], rows: list[dict], env: dict, path: Path, cell: dict, *,
                    pass_: str) -> Path:
    """The waterfall figure of ``steps`` (:func:`waterfall_steps`) at ``cell``, written to ``path``."""
    n_steps = sum(1 for _, kind, _ in steps if kind == "step")
    greens = matplotlib.colormaps["Greens"]
    colors, k = [], 0
    for _, kind, _ in steps:
        if kind == "step":
            k += 1
            colors.append(greens(0.3 + 0.45 * k / max(1, n_steps)))
        else:
            colors.append(color(kind))
    labels = [s[0] for s in steps]
    y = list(range(len(steps)))
    fig, axes = _new_figure(2.2 + 0.5 * len(steps), 1, 3, sharey=True)
    ax_t, ax_d, ax_m = axes

    # time
    prev = None
    t_max = max((r["ms_median"] for _, _, r in steps if is_ok(r) and r["ms_median"]), default=1.0)
    for i, (_, _, r) in enumerate(steps):
        if not (is_ok(r) and r["ms_median"] is not None):
            ax_t.text(0, i, f" {r['status']}", va="center", fontsize=10, color="0.3")
            continue
        ms = r["ms_median"]
        err = None
        if r["ms_p20"] is not None and r["ms_p80"] is not None:
            err = [[max(0.0, ms - r["ms_p20"])], [max(0.0, r["ms_p80"] - ms)]]
        ax_t.barh(i, ms, color=colors[i], xerr=err, ecolor="0.2", capsize=3)
        text = f"{ms:.3g} ms"
        if prev is not None:
            text += f"  ×{prev / ms:.2f}"
        right = max(ms, r["ms_p80"] or ms)
        ax_t.text(right + 0.03 * t_max, i, text, va="center", fontsize=10)
        prev = ms
    ax_t.set_xlim(0, t_max * 1.45)
    ax_t.set_xlabel("time per call (ms, median; whiskers p20–p80)")
    ax_t.set_title("time  (×: speedup over the bar above)", fontsize=12)

    legend = {"measured": False, "model": False, "model_only": False}

    def bars(ax, measured_of, model_of, title, xlabel):
        # Log scale: stage A's N² bytes and the fused stages' O(N) bytes differ by 10-100x, and on a
        # linear axis the fused stages' bars would vanish. Bars start at a floor below every value.
        values = [v for _, _, r in steps for v in (measured_of(r), model_of(r)) if v]
        floor = min(values) / 4 if values else 1.0
        top = 0.0
        for i, (_, _, r) in enumerate(steps):
            meas, model = measured_of(r), model_of(r)
            if meas is not None:
                ax.barh(i, meas - floor, left=floor, color=colors[i])
                top = max(top, meas)
                legend["measured"] = True
            elif model is not None:
                ax.barh(i, model - floor, left=floor, color=colors[i], alpha=0.35, hatch="//", edgecolor="0.3")
                legend["model_only"] = True
            if model is not None:
                ax.plot([model], [i], marker="D", color="black", markersize=7, linestyle="none")
                legend["model"] = True
                top = max(top, model)
            shown = meas if meas is not None else model
            if shown is not None:
                right = max(v for v in (meas, model) if v is not None)
                ax.text(right, i, "    " + views.fmt_bytes(shown), va="center", fontsize=10)
            elif not is_ok(r):
                ax.text(0, i, f" {r['status']}", va="center", fontsize=10, color="0.3")
        ax.set_xscale("log")
        ax.set_xlim(floor, (top or 1) * 8)
        _plain_log_labels(ax.xaxis, _fmt_bytes_tick)
        ax.set_xlabel(xlabel + " (log scale)")
        ax.set_title(title, fontsize=12)

    bars(ax_d, lambda r: dram_bytes(r, "measured"), lambda r: dram_bytes(r, "model"),
         "DRAM traffic (read + write)", "bytes per call")
    bars(ax_m, lambda r: r["peak_mem_measured"], lambda r: r["peak_mem_model"],
         "peak extra memory (beyond inputs)" if pass_ == "fwd" else "peak extra memory of a training step",
         "bytes per call" if pass_ == "fwd" else "bytes per forward + backward")
    handles = []
    if legend["measured"]:
        handles.append(Patch(color="0.5", label="bar: measured (Nsight Compute; max_memory_allocated)"))
    if legend["model_only"]:
        handles.append(Patch(facecolor="0.85", hatch="//", edgecolor="0.3", label="hatched: not measured, model"))
    if legend["model"]:
        handles.append(Line2D([], [], marker="D", color="black", linestyle="none", label="model"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False, fontsize=10)
    ax_t.set_yticks(y, labels)
    ax_t.invert_yaxis()
    for ax in axes:
        ax.grid(axis="y", visible=False)
    r0 = steps[0][2]
    what = "A → B → C, one optimization at a time" if pass_ == "fwd" else "A → B → C, the backward pass"
    title = (f"{what}  —  N={cell['N']}, D={cell['D']}, B={r0['B']}, H={r0['H']}, {cell['dtype']}, "
             f"{'causal' if cell['causal'] else 'non-causal'}")
    if any(kind == "step" for _, kind, _ in steps):
        title += "\n'+ x' rows: stage C's kernel from B's settings, each adding one optimization to the row above"
    elif pass_ == "bwd":
        title += "\ntime of the backward alone, given a saved forward"
    fig.suptitle(title, fontsize=12)
    return _save(fig, path.parent, path.name, env, rows)


# ------------------------------------------------------------------------------ 2. throughput

@_drawn_with_rc
def plot_throughput(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """TFLOPS (the FLOPs of :data:`harness.views.FLOP_CONVENTION` over the median time) vs N, one
    panel per (D, causal); stages solid, SDPA peers dashed; the measured matmul ceiling dotted.
    Forward grid rows only."""
    name = "throughput.png"
    data = [r for r in views.plain(views.forward_grid(rows)) if r["dtype"] == dtype and is_ok(r)
            and r["tflops"] is not None]
    if not data:
        _skip(name, f"no timed {dtype} rows", HINTS["rows"])
        return None
    return _draw_throughput(data, rows, env, Path(out_dir) / name, dtype=dtype, pass_="fwd")


@_drawn_with_rc
def plot_backward_throughput(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """:func:`plot_throughput` of the backward pass (``pass = bwd`` grid rows; FLOPs 2.5× the forward's)."""
    name = "backward_throughput.png"
    data = [r for r in views.plain(views.grid_rows(rows, "bwd")) if r["dtype"] == dtype and is_ok(r)
            and r["tflops"] is not None]
    if not data:
        _skip(name, f"no timed {dtype} backward rows", HINTS["bwd"])
        return None
    return _draw_throughput(data, rows, env, Path(out_dir) / name, dtype=dtype, pass_="bwd")


def _draw_throughput(data: list[dict], rows: list[dict], env: dict, path: Path, *, dtype: str, pass_: str) -> Path:
    """The throughput figure of ``data`` (timed rows of one pass and dtype), written to ``path``. A
    figure over N draws the (D, causal) panels measured at more than one N, where there are any: a
    head dim timed at one N alone (a head-dim sweep's cell) is a point, not a curve, and its table
    says the same."""
    panels = _panels(data)
    curves = [(D, c) for D, c in panels if len({r["N"] for r in select(data, D=D, causal=c)}) > 1]
    panels = curves or panels
    nrows, ncols = _grid(panels)
    fig, axes = _new_figure(0.6 + 4.0 * nrows, nrows, ncols, sharey=True)
    ceiling = views.ceilings(env)[1].get(dtype)
    handles: dict[str, Line2D] = {}
    for ax, (D, causal) in zip(axes, panels):
        sub = select(data, D=D, causal=causal)
        for impl, rs in views.by_impl(sub).items():
            rs = views.one_per_n(rs)
            peer = rs[0]["kind"] == "peer"
            (line,) = ax.plot([r["N"] for r in rs], [r["tflops"] for r in rs], color=color(impl),
                              marker="s" if peer else "o", linestyle="--" if peer else "-",
                              linewidth=1.6 if peer else 2.4, markersize=5 if peer else 6, label=label(impl))
            handles.setdefault(impl, line)
        if ceiling:
            ax.axhline(ceiling, color="0.4", linestyle=":", linewidth=1.5)
            ax.text(0.01, ceiling, f"{dtype} matmul ceiling {ceiling:.0f} TFLOPS", va="bottom",
                    transform=ax.get_yaxis_transform(), fontsize=10, color="0.3")
        _log2_n_axis(ax, [r["N"] for r in sub])
        ax.set_title(_panel_title(D, causal))
        top = max([r["tflops"] for r in data] + ([ceiling] if ceiling else []))
        ax.set_ylim(0, top * 1.12)  # room for the ceiling's label
    for ax in axes[::ncols]:
        ax.set_ylabel("TFLOPS")
    _hide_unused(axes, len(panels))
    ordered = sorted(handles, key=views.impl_sort_key)
    fig.legend([handles[i] for i in ordered], [label(i) for i in ordered], loc="outside lower center",
               ncol=min(5, len(ordered)), frameon=False)
    if pass_ == "fwd":
        title = (f"Throughput vs sequence length, {dtype} forward  (FLOPs = 4·B·H·N²·D, causal: the visible pairs; "
                 "stages solid, SDPA dashed)")
    else:
        title = (f"Backward throughput vs sequence length, {dtype}, given a saved forward  (stages solid, SDPA dashed)"
                 "\nFLOPs = 2.5 × the forward's 4·B·H·N²·D, causal: the visible pairs")
    fig.suptitle(title, fontsize=12)
    return _save(fig, path.parent, path.name, env, rows)


# ------------------------------------------------------------------------------ 3. DRAM bytes

def _model_or_measured(ax, pts, impl: str, k: int, measured: bool) -> None:
    """Measured: solid with dots, thinner for each later impl so coinciding lines stay visible as
    nested stripes. Model: dashed, each impl's dashes shifted so that two impls with the same model
    (B and C run one algorithm) show as alternating colours instead of one hiding the other."""
    if measured:
        ax.plot(*zip(*pts), color=color(impl), linestyle="-", marker="o", markersize=5,
                linewidth=max(1.2, 3.2 - 0.5 * k))
    else:
        ax.plot(*zip(*pts), color=color(impl), linestyle=(4 * (k % 3), (4, 8)), linewidth=1.8)


@_drawn_with_rc
def plot_dram_bytes(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """DRAM bytes per (batch, head) vs N, log-log: each stage's traffic model dashed, Nsight Compute
    measurement solid (peers: measured only). Per head, so cells with different B·H compare; faint
    guides show the O(N²) and O(N) slopes."""
    name = "dram_bytes.png"
    rows = views.forward_grid(rows)  # the forward grid only: see the module docstring
    data = [r for r in views.plain(rows) if r["dtype"] == dtype
            and (dram_bytes(r, "model") is not None or dram_bytes(r, "measured") is not None)]
    if not data:
        _skip(name, f"no {dtype} rows with DRAM bytes", HINTS["rows"], HINTS["dram"])
        return None
    panels = _panels(data)
    nrows, ncols = _grid(panels)
    fig, axes = _new_figure(0.6 + 4.0 * nrows, nrows, ncols, sharey=True)
    impls_seen: set[str] = set()
    any_measured = False
    for ax, (D, causal) in zip(axes, panels):
        sub = select(data, D=D, causal=causal)
        lo_y = []
        for k, (impl, rs) in enumerate(views.by_impl(sub).items()):
            impls_seen.add(impl)
            for which in ("model", "measured"):
                pts = [(r["N"], dram_bytes(r, which) / (r["B"] * r["H"]))
                       for r in views.one_per_n([r for r in rs if dram_bytes(r, which) is not None])]
                if not pts:
                    continue
                any_measured |= which == "measured"
                _model_or_measured(ax, pts, impl, k, which == "measured")
                lo_y.append(min(p[1] for p in pts))
        ns = sorted({r["N"] for r in sub})
        if len(ns) >= 2 and lo_y:
            # slope guides through the panel's smallest value at the smallest N
            n0, y0 = ns[0], min(lo_y) / 3
            for power, text in ((2, "∝ N²"), (1, "∝ N")):
                ax.plot([n0, ns[-1]], [y0, y0 * (ns[-1] / n0) ** power], color="0.6", linewidth=1, linestyle=":")
                ax.text(ns[-1], y0 * (ns[-1] / n0) ** power, " " + text, fontsize=10, color="0.4", va="center")
        _log2_n_axis(ax, ns)
        _log_bytes_axis(ax)
        ax.set_title(_panel_title(D, causal))
    for ax in axes[::ncols]:
        ax.set_ylabel("DRAM bytes per (batch, head)")
    _hide_unused(axes, len(panels))
    ordered = sorted(impls_seen, key=views.impl_sort_key)
    handles = [Line2D([], [], color=color(i), linewidth=2.2, label=label(i)) for i in ordered]
    handles += [Line2D([], [], color="0.3", linestyle="--", label="traffic model"),
                Line2D([], [], color="0.3", linestyle="-", marker="o", label="Nsight Compute measured")]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)), frameon=False)
    title = f"DRAM traffic vs sequence length, {dtype} forward (read + write, per batch·head)"
    if not any_measured:
        title += f"\nno Nsight measurements yet: `{HINTS['dram']}`"
    fig.suptitle(title, fontsize=12)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ 4. peak memory

@_drawn_with_rc
def plot_peak_memory(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """Extra device memory of one call (beyond inputs) vs N, one panel per D: measured solid, the
    stage's workspace model dashed, the device's memory as a horizontal line, OOM cells as ✕."""
    name = "peak_memory.png"
    rows = views.forward_grid(rows)  # the forward grid only: see the module docstring
    data = [r for r in views.plain(rows) if r["dtype"] == dtype
            and (r["peak_mem_measured"] is not None or r["peak_mem_model"] is not None or is_oom(r))]
    if not data:
        _skip(name, f"no {dtype} rows with peak memory", HINTS["rows"])
        return None
    # memory hardly depends on masking: draw the non-causal rows where there are any
    Ds = sorted({r["D"] for r in data})
    panels = []
    for D in Ds:
        causals = sorted({int(r["causal"]) for r in data if r["D"] == D})
        panels.append((D, causals[0]))
    nrows, ncols = _grid(panels)
    fig, axes = _new_figure(0.6 + 4.2 * nrows, nrows, ncols, sharey=True)
    total = views.device_memory(env)
    impls_seen: set[str] = set()
    any_oom = False
    for ax, (D, causal) in zip(axes, panels):
        sub = select(data, D=D, causal=causal)
        for k, (impl, rs) in enumerate(views.by_impl(sub).items()):
            impls_seen.add(impl)
            for col in ("peak_mem_model", "peak_mem_measured"):
                pts = [(r["N"], r[col]) for r in views.one_per_n([r for r in rs if r[col] is not None and is_ok(r)])]
                if pts:
                    _model_or_measured(ax, pts, impl, k, col == "peak_mem_measured")
            for r in rs:
                if is_oom(r):
                    any_oom = True
                    y = r["peak_mem_model"] or total
                    if y:
                        ax.plot([r["N"]], [y], marker="X", markersize=13, color=color(impl),
                                markeredgecolor="black", linestyle="none", zorder=5)
                        ax.annotate("OOM", (r["N"], y), textcoords="offset points", xytext=(-8, 9),
                                    fontsize=10, ha="right", fontweight="bold")
        if total:
            ax.axhline(total, color="black", linewidth=1.4)
            ax.text(0.01, total, f" device memory {views.fmt_bytes(total)}", transform=ax.get_yaxis_transform(),
                    va="bottom", fontsize=10)
        _log2_n_axis(ax, [r["N"] for r in sub])
        _log_bytes_axis(ax)
        if total:
            ax.set_ylim(top=max(ax.get_ylim()[1], total * 4))  # room for the label above the line
        ax.set_title(f"D = {D}{', causal' if causal else ''}")
    for ax in axes[::ncols]:
        ax.set_ylabel("peak extra memory per call")
    _hide_unused(axes, len(panels))
    ordered = sorted(impls_seen, key=views.impl_sort_key)
    handles = [Line2D([], [], color=color(i), linewidth=2.2, label=label(i)) for i in ordered]
    handles += [Line2D([], [], color="0.3", linestyle="--", label="workspace model"),
                Line2D([], [], color="0.3", linestyle="-", marker="o", label="measured")]
    if any_oom:
        handles.append(Line2D([], [], marker="X", color="0.5", markeredgecolor="black", markersize=11,
                              linestyle="none", label="out of memory (at model)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(6, len(handles)), frameon=False)
    title = f"Peak extra device memory of one call, {dtype} (whole call, B and H as swept)"
    if not total:
        title += "\n(device memory unknown: env.json has no memory_bytes)"
    fig.suptitle(title, fontsize=12)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ 5. roofline

_CELL_MARKERS = {(0, 0): "o", (1, 0): "s", (0, 1): "^", (1, 1): "v"}  # (second D?, causal)


def roofline_points(rows: list[dict], *, dtype: str = "fp16") -> tuple[list[tuple], set[str]]:
    """The roofline's points: ([(impl, D, causal, model intensity, measured intensity, TFLOPS)], the
    impls left out for want of any DRAM bytes), at the headline cell of each (D, causal). An
    intensity is FLOPs per DRAM byte, None where those bytes are missing."""
    rows = views.forward_grid(rows)
    points, unplaced = [], set()
    for D in sorted({r["D"] for r in rows if r["dtype"] == dtype}):
        for causal in (0, 1):
            N = views.headline_n(rows, D=D, dtype=dtype, causal=causal)
            if N is None:
                continue
            for r in views.plain(views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal)):
                if not (is_ok(r) and r["tflops"]):
                    continue
                meas, model = dram_bytes(r, "measured"), dram_bytes(r, "model")
                if not (meas or model):
                    unplaced.add(r["impl"])
                    continue
                points.append((r["impl"], D, causal, flops(r) / model if model else None,
                               flops(r) / meas if meas else None, r["tflops"]))
    return points, unplaced


@_drawn_with_rc
def plot_roofline(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """Each impl at the headline cells (N=4096 or the largest N, D = 64/128, causal no/yes) by
    arithmetic intensity (FLOPs per DRAM byte) and achieved TFLOPS, under the device's measured
    ceilings (copy bandwidth, matmul rate).

    Filled markers use the DRAM bytes Nsight Compute measured: those are real roofline points and sit
    under the roof. Hollow markers use the stage's traffic model, the bytes its kernels *request*;
    the L2 cache serves part of those, so DRAM sees fewer (at most rounding more) and a hollow
    marker sits at or left of the kernel's true intensity. A hollow marker can therefore land above
    the bandwidth line without anything beating it: where a cell has both, a line joins its model
    point to its measured one; where it has only the model and lands above the line, a dotted arrow
    runs right to the least intensity its measured time allows (TFLOPS / bandwidth)."""
    name = "roofline.png"
    rows = views.forward_grid(rows)  # the forward grid only: see the module docstring
    points, unplaced = roofline_points(rows, dtype=dtype)
    if not points:
        _skip(name, f"no timed {dtype} rows with DRAM bytes at the headline cells", HINTS["rows"], HINTS["dram"])
        return None
    fig, (ax,) = _new_figure(6.5)
    bw, rates = views.ceilings(env)
    peak = rates.get(dtype)
    xs = [x for p in points for x in p[3:5] if x]
    x_lo, x_hi = min(xs) / 4, max(xs) * 4
    if bw and peak:
        x_lo = min(x_lo, peak * 1e3 / bw / 8)
        x_hi = max(x_hi, peak * 1e3 / bw * 4)
    if bw:
        ridge = peak * 1e3 / bw if peak else x_hi
        xe = [x_lo, min(ridge, x_hi)]
        ax.plot(xe, [x * bw / 1e3 for x in xe], color="black", linewidth=2)
        # the angle is given in data space (the line's slope) and turned into screen space at draw time
        ax.text(x_lo * 1.3, x_lo * 1.3 * bw / 1e3 * 1.15, f"copy bandwidth {bw / 1e3:.2f} TB/s", fontsize=10,
                rotation=math.degrees(math.atan(bw / 1e3)), transform_rotates_text=True,
                rotation_mode="anchor", va="bottom")
    if peak:
        start = peak * 1e3 / bw if bw else x_lo
        ax.plot([start, x_hi], [peak, peak], color="black", linewidth=2)
        ax.text(x_hi, peak * 1.05, f"{dtype} matmul {peak:.0f} TFLOPS ", ha="right", va="bottom", fontsize=10)
    if not (bw and peak):
        missing = [n for n, v in (("copy bandwidth", bw), (f"{dtype} matmul rate", peak)) if not v]
        ax.text(0.02, 0.97, f"ceiling not measured: {', '.join(missing)} (`{HINTS['ceilings']}`)",
                transform=ax.transAxes, fontsize=10, va="top", color="0.3")
    Ds = sorted({p[1] for p in points})
    above_roof = 0
    for impl, D, causal, x_model, x_meas, t in points:
        marker = _CELL_MARKERS[(int(D != Ds[0]), causal)]
        c = color(impl)
        if x_model and x_meas and x_model != x_meas:  # the model's point moves right once measured
            ax.plot([x_model, x_meas], [t, t], color=c, linewidth=1, alpha=0.6, zorder=1)
        if x_model:
            ax.plot([x_model], [t], marker=marker, markersize=8, linestyle="none", markeredgewidth=1.5,
                    markeredgecolor=c, markerfacecolor="none", alpha=0.8 if x_meas else 1.0, zorder=2)
        if x_meas:
            ax.plot([x_meas], [t], marker=marker, markersize=10, linestyle="none", markeredgewidth=2,
                    markeredgecolor=c, markerfacecolor=c, zorder=3)
        elif bw and t > x_model * bw / 1e3:  # above the bandwidth line: the model overcounts the bytes
            above_roof += 1
            ax.annotate("", xy=(t * 1e3 / bw, t), xytext=(x_model, t), zorder=1,
                        arrowprops=dict(arrowstyle="-|>", color=c, linestyle=":", linewidth=1.2,
                                        shrinkA=5, shrinkB=0, mutation_scale=10))
    ax.set_xscale("log")
    ax.set_yscale("log")
    for axis in (ax.xaxis, ax.yaxis):
        _plain_log_labels(axis)
    ax.set_xlim(x_lo, x_hi)
    ys = [p[5] for p in points] + ([peak] if peak else [])
    ax.set_ylim(min(ys) / 3, max(ys) * 2.5)
    ax.set_xlabel("arithmetic intensity (FLOPs per DRAM byte)")
    ax.set_ylabel("achieved TFLOPS")
    impls = sorted({p[0] for p in points}, key=views.impl_sort_key)
    h1 = [Line2D([], [], marker="o", color=color(i), linestyle="none", markersize=9, label=label(i)) for i in impls]
    cells = sorted({(p[1], p[2]) for p in points})
    h2 = [Line2D([], [], marker=_CELL_MARKERS[(int(D != Ds[0]), c)], color="0.3", linestyle="none", markersize=9,
                 label=_panel_title(D, c)) for D, c in cells]
    h2 += [Line2D([], [], marker="o", color="0.3", linestyle="none", markersize=9,
                  label="filled: DRAM bytes measured\n(Nsight Compute)"),
           Line2D([], [], marker="o", color="0.3", markerfacecolor="none", markeredgewidth=1.5, linestyle="none",
                  markersize=8, label="hollow: traffic model's bytes\n(requests, partly served by L2:\n"
                                      "the true point lies to the right)")]
    if any(p[3] and p[4] for p in points):
        h2.append(Line2D([], [], color="0.3", linewidth=1, label="model → measured, one cell"))
    if above_roof:
        h2.append(Line2D([], [], color="0.3", linewidth=1.2, linestyle=":", marker=">", markersize=5,
                         label="model point above the roof →\nthe least intensity its time allows"))
    leg = ax.legend(handles=h1, loc="upper left", bbox_to_anchor=(1.01, 1.0), title="impl", frameon=False)
    ax.add_artist(leg)
    ax.legend(handles=h2, loc="lower left", bbox_to_anchor=(1.01, 0.0), title="cell", frameon=False)
    Ns = sorted({views.headline_n(rows, D=D, dtype=dtype, causal=c) for D, c in cells})
    title = (f"Roofline at N={', '.join(map(str, Ns))}, {dtype} forward (FLOPs = 4·B·H·N²·D, causal: the visible "
             "pairs)")
    if unplaced:
        title += (f"\nnot placed where DRAM bytes are missing: "
                  f"{', '.join(label(i) for i in sorted(unplaced, key=views.impl_sort_key))}")
    ax.set_title(title, fontsize=12)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ 6. energy

@_drawn_with_rc
def plot_energy(rows: list[dict], env: dict, out_dir, *, dtype: str = "fp16") -> Path | None:
    """Joules per call and TFLOP per joule (FLOPs / energy; the same number as TFLOPS per watt)
    per impl at the headline N, one bar per (D, causal); from NVML's energy counter over a ≥ 2 s loop."""
    name = "energy.png"
    rows = views.forward_grid(rows)  # the forward grid only: see the module docstring
    data = [r for r in views.plain(rows) if r["dtype"] == dtype and is_ok(r) and r["energy_j_per_call"]]
    if not data:
        _skip(name, f"no {dtype} rows with energy", HINTS["energy"])
        return None
    Ns = {r["N"] for r in data}
    N = views.HEADLINE_N if views.HEADLINE_N in Ns else max(Ns)
    cells = sorted({(r["D"], int(r["causal"])) for r in data if r["N"] == N})
    picked = {}
    for D, causal in cells:
        for r in views.cell_rows(data, N=N, D=D, dtype=dtype, causal=causal):
            picked[(r["impl"], D, causal)] = r
    impls = sorted({k[0] for k in picked}, key=views.impl_sort_key)
    fig, axes = _new_figure(5.6, 1, 2)
    width = 0.8 / len(cells)
    shades = (1.0, 0.7, 0.5, 0.35)
    for ax, metric, ylabel in ((axes[0], "j", "energy per call (J)"),
                               (axes[1], "eff", "TFLOP per joule  (= TFLOPS/W)")):
        for j, (D, causal) in enumerate(cells):
            for i, impl in enumerate(impls):
                r = picked.get((impl, D, causal))
                if r is None:
                    continue
                value = r["energy_j_per_call"] if metric == "j" else flops(r) / r["energy_j_per_call"] / 1e12
                ax.bar(i - 0.4 + width * (j + 0.5), value, width, color=color(impl),
                       alpha=shades[j % len(shades)], edgecolor="0.2", hatch="//" if causal else None)
        ax.set_xticks(range(len(impls)), [label(i) for i in impls], rotation=30, ha="right")
        ax.set_ylabel(ylabel)
        ax.grid(axis="x", visible=False)
    axes[0].set_yscale("log")
    _plain_log_labels(axes[0].yaxis)
    handles = [Patch(facecolor="0.5", alpha=shades[j % len(shades)], edgecolor="0.2", hatch="//" if c else None,
                     label=_panel_title(D, c)) for j, (D, c) in enumerate(cells)]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), frameon=False)
    powers = [r["power_w"] for r in picked.values() if r["power_w"]]
    watts = f"; average power {min(powers):.0f}–{max(powers):.0f} W" if powers else ""
    runs = views.energy_runs(list(picked.values()))
    fig.suptitle(f"Energy at N={N}, {dtype} forward (NVML energy counter over a ≥ 2 s loop{watts})\n"
                 f"energy from run{'s' if len(runs) > 1 else ''} {', '.join(runs)}", fontsize=11)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ 7. the model suite

@_drawn_with_rc
def plot_models(suite_rows: list[dict], env: dict, out_dir) -> Path | None:
    """Stage C over the fastest SDPA backend in each named cell of the model suite
    (``<results>/models/runs.csv``, every run: :func:`harness.views.suite_lines` takes each cell from
    the latest run that timed C), two bars per cell: the eager call and the CUDA-graph replay
    (GPU time alone). A time ratio, above 1 when stage C is faster; a cell without a ratio says why."""
    name = "models.png"
    lines = views.suite_lines(suite_rows)
    if not lines:
        _skip(name, "no model-suite rows", HINTS["models"])
        return None
    fig, (ax,) = _new_figure(1.6 + 0.42 * len(lines))
    bar = 0.38
    values = [v for line in lines for v in (line["vs_best"], line["vs_best_gpu"]) if v is not None]
    right = max(values + [1.0]) * 1.18
    for i, line in enumerate(lines):
        for j, (key, shade, what) in enumerate((("vs_best", 1.0, "eager"), ("vs_best_gpu", 0.45, "GPU"))):
            v = line[key]
            y = i - bar / 2 + j * bar
            if v is None:
                continue
            ax.barh(y, v, bar, color=color("c"), alpha=shade, edgecolor="0.2" if v < 1.0 else None,
                    hatch="//" if v < 1.0 else None)
            # a white box, so the 1.0 line does not run through the digits of a ratio just below it
            ax.text(v + 0.01 * right, y, f"{v:.2f}", va="center", fontsize=9, zorder=3,
                    bbox=dict(facecolor="white", edgecolor="none", pad=0.3))
        if line["vs_best"] is None and line["vs_best_gpu"] is None:
            c = line["c"]
            why = "no stage C row" if c is None else (c["status"] if not is_ok(c) else "no SDPA backend ran it")
            ax.text(0.02 * right, i, why[:60], va="center", fontsize=9, color="0.3")
    ax.axvline(1.0, color="black", linewidth=1.2)
    ax.set_xlim(0, right)
    ax.set_yticks(range(len(lines)), [f"{line['cell']}  ({_suite_shape(line['shape'])})" for line in lines],
                  fontsize=10)
    ax.invert_yaxis()
    ax.grid(axis="y", visible=False)
    ax.set_xlabel("fastest SDPA backend's time / stage C's time  (above 1: stage C is faster)")
    handles = [Patch(color=color("c"), label="eager call (ms_median)"),
               Patch(color=color("c"), alpha=0.45, label="CUDA-graph replay, GPU time alone (ms_gpu)"),
               Patch(facecolor="white", hatch="//", edgecolor="0.2", label="hatched: stage C behind")]
    fig.legend(handles=handles, loc="outside lower center", ncol=3, frameon=False, fontsize=10)
    runs = sorted({line["run_id"] for line in lines if line["run_id"]})
    fig.suptitle("Stage C against the fastest SDPA backend on the shapes real models run "
                 f"(sweep --suite models)\nrun{'s' if len(runs) > 1 else ''} {', '.join(runs)}", fontsize=12)
    return _save(fig, Path(out_dir), name, env, [line["shape"] for line in lines])


def _suite_shape(r: dict) -> str:
    """``B32 H32/8 N1/8192 D128 causal bf16``: heads and rows as query/key where they differ."""
    heads = f"{r['H']}/{r['Hkv']}" if r.get("Hkv") not in (None, r["H"]) else f"{r['H']}"
    lengths = f"{r['N']}/{r['Nk']}" if r.get("Nk") not in (None, r["N"]) else f"{r['N']}"
    return f"B{r['B']} H{heads} N{lengths} D{r['D']}{' causal' if r['causal'] else ''} {r['dtype']}"


# ------------------------------------------------------------------------------ 8. bandwidth share

#: the impls of ``bandwidth_share.png``, top to bottom (each only where the cell has its row)
BANDWIDTH_SHARE_IMPLS = ("a", "b", "c", "sdpa_cudnn")


def bandwidth_shares(rows: list[dict], env: dict, cell: dict) -> list[dict]:
    """What ``bandwidth_share.png`` draws: per impl of :data:`BANDWIDTH_SHARE_IMPLS` timed at ``cell``
    (forward grid rows, as :func:`resolve_cell` fills it), a dict of ``impl``, ``row``, ``ms`` (median
    time per call), ``measured`` and ``model`` (DRAM bytes read + written, None where absent),
    ``gbps`` (measured bytes / time, decimal GB/s) and ``share`` (``gbps`` as a fraction of the
    copy bandwidth in ``env.json``), and ``model_gbps``/``model_share``, the same of the traffic
    model's bytes: requests, part of them served by L2, so they may exceed the copy bandwidth.
    A value that cannot be computed is None."""
    at = views.plain(views.cell_rows(views.forward_grid(rows), **cell))
    bw, _ = views.ceilings(env)
    out = []
    for impl in BANDWIDTH_SHARE_IMPLS:
        found = [r for r in at if r["impl"] == impl and is_ok(r) and r["ms_median"]]
        if not found:
            continue
        r = found[-1]
        ms = r["ms_median"]
        bar = {"impl": impl, "row": r, "ms": ms, "measured": dram_bytes(r, "measured"),
               "model": dram_bytes(r, "model")}
        for key in ("measured", "model"):
            gbps = bar[key] / (ms * 1e-3) / 1e9 if bar[key] else None
            prefix = "" if key == "measured" else "model_"
            bar[prefix + "gbps"] = gbps
            bar[prefix + "share"] = gbps / bw if gbps is not None and bw else None
        out.append(bar)
    return out


@_drawn_with_rc
def plot_bandwidth_share(rows: list[dict], env: dict, out_dir, *, cell: dict | None = None) -> Path | None:
    """Time per call beside the DRAM bandwidth it achieves, as a share of the measured copy bandwidth
    (``env.json`` ceilings), for A, B, C and SDPA CUDNN at the headline cell: A moves its N² bytes near
    the copy rate (memory-bound); the fused kernels move a few hundred MB in the same order of time,
    a few percent of it, so bandwidth no longer explains their time. Bars: DRAM bytes measured by
    Nsight Compute over the median time; hollow ◇: the traffic model's bytes over the same time
    (requests, partly L2 hits: not DRAM traffic, may pass 100 %). Without a copy-bandwidth ceiling
    the panel shows GB/s. Forward grid rows only."""
    name = "bandwidth_share.png"
    rows = views.forward_grid(rows)
    cell = resolve_cell(rows, cell)
    where = f"N={cell['N']}, D={cell['D']}, {cell['dtype']}, causal={cell['causal']}"
    bars = bandwidth_shares(rows, env, cell)
    if not bars:
        _skip(name, f"no timed row of A, B, C or SDPA CUDNN at {where}", HINTS["rows"])
        return None
    if not any(b["gbps"] for b in bars):
        _skip(name, f"no DRAM bytes measured (Nsight Compute) for A, B, C or SDPA CUDNN at {where}", HINTS["dram"])
        return None
    bw, _ = views.ceilings(env)
    fig, (ax_t, ax_b) = _new_figure(1.9 + 0.75 * len(bars), 1, 2, sharey=True, width_ratios=[1, 2])
    y = list(range(len(bars)))
    t_max = max(b["ms"] for b in bars)
    for i, b in enumerate(bars):
        ax_t.barh(i, b["ms"], color=color(b["impl"]), height=0.6)
        ax_t.text(b["ms"] + 0.02 * t_max, i, f"{b['ms']:.3g} ms", va="center", fontsize=10)
    ax_t.set_xlim(0, t_max * 1.3)
    ax_t.set_xlabel("time per call (ms, median)")
    ax_t.set_title("time", fontsize=12)

    # the bandwidth panel: a share of the copy bandwidth in %, or plain GB/s without the ceiling
    def x_of(gbps, share):
        return share * 100 if bw else gbps

    # the axis fits the measured bars and the ceiling; a model marker beyond it is drawn at its edge
    shown = [x_of(b["gbps"], b["share"]) for b in bars if b["gbps"]]
    right = max(shown + ([100.0] if bw else [])) * 1.6
    any_model = False
    for i, b in enumerate(bars):
        if b["gbps"]:
            x = x_of(b["gbps"], b["share"])
            ax_b.barh(i, x, color=color(b["impl"]), height=0.6)
            text = f"{views.fmt_bytes(b['measured'])} in {b['ms']:.3g} ms = {b['gbps']:,.0f} GB/s"
            if bw:
                text += f", {100 * b['share']:.1f} %"
            # a white box, so the 100 % line does not run through the numbers of a bar that ends near it
            ax_b.text(x + 0.01 * right, i, text, va="center", fontsize=10, zorder=3,
                      bbox=dict(facecolor="white", edgecolor="none", pad=0.3))
        else:
            ax_b.text(0.01 * right, i, f"DRAM bytes not measured (`{HINTS['dram']}`)", va="center", fontsize=10,
                      color="0.3")
        if b["model_gbps"]:
            any_model = True
            xm = x_of(b["model_gbps"], b["model_share"])
            x_draw = min(xm, 0.9 * right)
            ax_b.plot([x_draw], [i + 0.36], marker="D", markersize=7, markerfacecolor="none",
                      markeredgecolor=color(b["impl"]), markeredgewidth=1.5, linestyle="none")
            ax_b.text(x_draw + 0.012 * right, i + 0.36, f"model {xm:,.0f} {'%' if bw else 'GB/s'}", va="center",
                      fontsize=8, color="0.35")
    if bw:
        ax_b.axvline(100, color="black", linewidth=1.4)
        ax_b.text(99, -0.55, f"copy bandwidth {bw:,.0f} GB/s = 100 % (measured: device-to-device copy) ",
                  fontsize=9, va="center", ha="right")
        ax_b.set_xlabel("achieved DRAM bandwidth, % of the measured copy bandwidth")
        ax_b.set_title("DRAM bytes / time, as a share of the copy bandwidth (near 100 %: memory-bound)",
                       fontsize=12)
    else:
        ax_b.set_xlabel("achieved DRAM bandwidth (GB/s)")
        ax_b.set_title(f"DRAM bytes / time (copy bandwidth not measured: `{HINTS['ceilings']}`)", fontsize=12)
    ax_b.set_xlim(0, right)
    ax_t.set_yticks(y, [label(b["impl"]) for b in bars])
    ax_t.set_ylim(len(bars) - 0.4, -0.9)
    for ax in (ax_t, ax_b):
        ax.grid(axis="y", visible=False)
    handles = [Patch(color="0.5", label="bar: DRAM bytes measured by Nsight Compute (read + write) / median time")]
    if any_model:
        handles.append(Line2D([], [], marker="D", color="0.35", markerfacecolor="none", linestyle="none",
                              label="traffic model's bytes / the same time: requests, partly served by L2 "
                                    "(not DRAM traffic; may exceed the copy bandwidth)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=1, frameon=False, fontsize=10)
    r0 = bars[0]["row"]
    runs = sorted({b["row"]["run_id"] for b in bars if b["row"].get("run_id")})
    fig.suptitle(f"How much of the memory system each kernel uses: N={cell['N']}, D={cell['D']}, B={r0['B']}, "
                 f"H={r0['H']}, {cell['dtype']}, {'causal' if cell['causal'] else 'non-causal'}, forward\n"
                 f"time: median per call, sweep run{'s' if len(runs) > 1 else ''} {', '.join(runs)}\n"
                 "DRAM bytes: Nsight Compute's dram__bytes_read.sum + dram__bytes_write.sum, profiled apart from the "
                 "timing", fontsize=11)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ 9. head dims

HEAD_DIM_FIGURES = ("head_dims.png",)


@_drawn_with_rc
def plot_head_dims(rows: list[dict], env: dict, out_dir) -> Path | None:
    """TFLOPS vs head dim D for stage C, SDPA CUDNN and SDPA FLASH (FA2), one panel per causal setting,
    at the (N, dtype) with the most head dims measured (:func:`harness.report.head_dim_family`; the
    sweep of ``experiments/head_dims_gpu.sh``). Stage C pads D to the next power of two inside its
    kernel, so the figure shows where that costs: the head dims it pads are shaded per padded width,
    its markers there hollow, with the padded width's extra work (padded / true D) written under each;
    a grey dotted line is what stage C would reach at D if it ran at its padded width's rate
    (TFLOPS there × D / padded D: padding alone, nothing else lost), from the tl kernel's row at that
    width where measured (stage C without warp specialization, the kernel padded head dims run) and
    from stage C's own row there otherwise. An impl with no time at a head dim (a peer that refused it,
    ``unsupported``, or a failure) is an ✕ on the axis. Skipped, naming the sweep's command, with fewer than
    :data:`harness.report.HEAD_DIM_MIN` head dims. Forward grid rows only."""
    from .report import (HEAD_DIM_COMMAND, HEAD_DIM_IMPLS, HEAD_DIM_MIN, HEAD_DIM_SCRIPT, head_dim_family,
                         head_dim_kernel_note, head_dim_points)

    name = "head_dims.png"
    rows = views.forward_grid(rows)
    family = head_dim_family(rows)
    if family is None:
        _skip(name, f"stage C is timed at fewer than {HEAD_DIM_MIN} head dims of any one N and dtype "
                    f"({HEAD_DIM_SCRIPT} measures the sweep on a GPU)", HEAD_DIM_COMMAND)
        return None
    N, dtype = family
    points = head_dim_points(rows, N=N, dtype=dtype)
    panels = sorted(points)
    fig, axes = _new_figure(0.9 + 4.3 * len(panels), len(panels), 1, sharex=True)
    ds = sorted({p["D"] for pts in points.values() for p in pts})
    values = [r["tflops"] for pts in points.values() for p in pts for r in (p.get(i) for i in HEAD_DIM_IMPLS)
              if r is not None and is_ok(r) and r.get("tflops")]
    values += [p["padded_rate"] for pts in points.values() for p in pts if p["padded_rate"]]
    top = max(values, default=1.0)
    kernels_used: set[str] = set()
    refused_any = False
    for ax, causal in zip(axes, panels):
        pts = points[causal]
        # the head dims stage C pads, one band per padded width: (P/2, P) exclusive
        widths = sorted({p["padded"] for p in pts if p["padded"] != p["D"]})
        for k, P in enumerate(widths):
            inside = [p["D"] for p in pts if p["padded"] == P and p["D"] != P]
            ax.axvspan(min(inside) - 4, max(inside) + 4, color="0.5", alpha=0.10 if k % 2 == 0 else 0.16, lw=0)
            # (a band of one or two head dims is too narrow for the words: the width alone)
            band = f"C pads to {P}" if max(inside) - min(inside) >= 16 else f"→{P}"
            ax.text((min(inside) + max(inside)) / 2, top * 1.17, band, ha="center", va="top",
                    fontsize=10, color="0.25")
        for impl in HEAD_DIM_IMPLS:
            timed = [(p["D"], p[impl]["tflops"]) for p in pts if p[impl] is not None and is_ok(p[impl])
                     and p[impl].get("tflops")]
            failed = [p["D"] for p in pts if p[impl] is not None and not is_ok(p[impl])]
            peer = impl != "c"
            if timed:
                # a line broken where a head dim has no time, so a gap is not drawn over
                have = dict(timed)
                ax.plot(ds, [have.get(D, float("nan")) for D in ds], color=color(impl), linestyle="--" if peer else "-", linewidth=1.6 if peer else 2.4,
                        marker="s" if peer else None, markersize=4.5, zorder=3)
            if not peer:
                padded = {p["D"] for p in pts if p["padded"] != p["D"]}
                for D, t in timed:
                    ax.plot([D], [t], marker="o", markersize=7, linestyle="none", zorder=4,
                            markeredgecolor=color(impl), markeredgewidth=1.6,
                            markerfacecolor="white" if D in padded else color(impl))
            if failed:
                refused_any = True
                ax.plot(failed, [0] * len(failed), marker="X", markersize=9, linestyle="none", color=color(impl),
                        markeredgecolor="black", markeredgewidth=0.6, zorder=5, clip_on=False)
        bound = [p for p in pts if p["padded_rate"] is not None]
        kernels_used |= {p["padded_rate_kernel"] for p in bound}
        for P in widths:  # one segment per padded width: the bound falls off as D moves below P
            seg = [(p["D"], p["padded_rate"]) for p in bound if p["padded"] == P]
            if seg:
                ax.plot(*zip(*seg), color="0.35", linestyle=":", linewidth=1.8, marker=".", markersize=6, zorder=2)
        for p in pts:  # the extra work of each padded head dim, under its point
            if p["padded"] != p["D"]:
                ax.text(p["D"], top * 0.015, f"×{p['padded'] / p['D']:.2f}", rotation=90, ha="center", va="bottom",
                        fontsize=7.5, color="0.35")
        ax.set_ylim(0, top * 1.2)
        ax.set_ylabel("TFLOPS (true D)")
        ax.set_title(f"{'causal' if causal else 'non-causal'}", fontsize=12)
        ax.grid(axis="x", visible=False)
    axes[-1].set_xticks(ds, [str(D) for D in ds], fontsize=9)
    axes[-1].set_xlim(ds[0] - 6, ds[-1] + 6)
    axes[-1].set_xlabel("head dim D  (×: stage C's padded width / D, its tile work per useful multiply-add)")
    handles = [Line2D([], [], color=color("c"), linewidth=2.4, marker="o", markersize=7, label=label("c")),
               Line2D([], [], color=color("c"), linestyle="none", marker="o", markersize=7, markerfacecolor="white",
                      markeredgewidth=1.6, label="stage C at a padded head dim (hollow)")]
    handles += [Line2D([], [], color=color(i), linestyle="--", marker="s", markersize=4.5, linewidth=1.6,
                       label=label(i)) for i in HEAD_DIM_IMPLS if i != "c"]
    if kernels_used:
        # whose rate at the padded width: the tl kernel's (stage C without warp specialization, what a
        # padded head dim runs) or stage C's own row there (at 64 and 128 the warp-specialized kernel's)
        whose = {"tl": "the tl kernel's", "c": "stage C's default kernel's"}
        handles.append(Line2D([], [], color="0.35", linestyle=":", linewidth=1.8, marker=".",
                              label="padding alone: TFLOPS at the padded width × D / padded width\n("
                                    + " or ".join(whose[k] for k in sorted(kernels_used, reverse=True))
                                    + " rate there)"))
    handles.append(Patch(color="0.5", alpha=0.13, label="shaded: head dims stage C pads (to the next power of two,\nor to half that plus a 16-64-column tail)"))
    if refused_any:
        handles.append(Line2D([], [], marker="X", color="0.5", markeredgecolor="black", linestyle="none",
                              markersize=9, label="✕ on the axis: no time (unsupported, oom or error)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False, fontsize=10)
    c_rows = [p["c"] for pts in points.values() for p in pts if p["c"] is not None]
    hidden = sorted({r["H"] * r["D"] for r in c_rows})
    tokens = sorted({r["B"] * r["N"] for r in c_rows})
    span = (lambda v: f"{v[0]}" if len(v) == 1 else f"{v[0]}–{v[-1]}")
    runs = sorted({str(r["run_id"]) for r in c_rows if r.get("run_id")})
    note = head_dim_kernel_note(env, dtype, c_rows)
    fig.suptitle(f"Throughput vs head dim at N = {N}, {dtype} forward (B·N = {span(tokens)}, H·D = {span(hidden)}; "
                 "FLOPs = 4·B·H·N²·D with the true D, causal: the visible pairs)\n"
                 + (note.replace("; every", ";\nevery") + "\n" if note else "")
                 + f"stage C from run{'s' if len(runs) > 1 else ''} {', '.join(runs)}", fontsize=11)
    return _save(fig, Path(out_dir), name, env, rows)


# ------------------------------------------------------------------------------ all + CLI

def plot_all(results_dir, *, cell: dict | None = None, dtype: str = "fp16", out_dir=None) -> list[Path]:
    """Draw every figure from ``results_dir`` into ``out_dir`` (default ``<results_dir>/figures``);
    returns the paths written (a figure whose data is missing is skipped with a message). Raises
    :class:`ResultsError` for a missing or malformed runs.csv (or models/runs.csv)."""
    rows, env = views.load(results_dir, forward_only=False)
    suite_rows = views.load_suite(results_dir)
    out = Path(out_dir) if out_dir is not None else Path(results_dir) / "figures"
    # a folder that cannot be written fails here, naming itself, before any figure is drawn
    ensure_writable_dir(out, "plot: output folder" if out_dir is None else "--out")
    cell = {"dtype": dtype, **(cell or {})}
    written = [
        plot_waterfall(rows, env, out, cell=cell),
        plot_throughput(rows, env, out, dtype=dtype),
        plot_dram_bytes(rows, env, out, dtype=dtype),
        plot_peak_memory(rows, env, out, dtype=dtype),
        plot_roofline(rows, env, out, dtype=dtype),
        plot_energy(rows, env, out, dtype=dtype),
        plot_bandwidth_share(rows, env, out, cell=cell),
        plot_backward_throughput(rows, env, out, dtype=dtype),
        plot_backward_waterfall(rows, env, out, cell=cell),
        plot_models(suite_rows, env, out),
        plot_head_dims(rows, env, out),
    ]
    return [p for p in written if p is not None]


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``plot RESULTS_DIR [--cell ...] [--dtype ...] [--out DIR]``."""
    p = subparsers.add_parser("plot", help="draw the figures from a results directory",
                              description="Draw the figures of a results directory into <results_dir>/figures/.")
    p.add_argument("results_dir", help="a results/<gpu>/ directory holding runs.csv and env.json")
    p.add_argument("--cell", default=None, metavar="N=..,D=..,dtype=..,causal=..",
                   help="the waterfalls' cell, forward and backward (default N=4096, D=64, fp16, non-causal)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"),
                   help="dtype of the sweep figures (default fp16)")
    p.add_argument("--out", default=None, help="folder for the PNGs (default <results_dir>/figures)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        cell = parse_cell(args.cell)
        paths = plot_all(args.results_dir, cell=cell, dtype=args.dtype, out_dir=args.out)
    except (ResultsError, ValueError) as e:
        print(f"plot: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # writing a figure failed after all (disk full, ...): one line naming the file
        print(f"plot: error: {e.filename}: {e.strerror}" if e.filename else f"plot: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.plots")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(["plot", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
