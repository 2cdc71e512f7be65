"""The head-dim sweep (``experiments/head_dims_gpu.sh``): its figure (``plots.plot_head_dims``) and its
README block (``report.render_head_dims_block``) from synthetic results (CPU, a few seconds, no stages run).

The synthetic sweep is shaped like the one the script measures: bf16, N = 4096, every multiple of 8 from
32 to 256, causal both, at the FA-paper sizes (B = 16384 / N, H = 2048 / D), stage C's rate set by its
padded width (power-of-two head dims at full rate, the others at that rate × D / padded D), cuDNN refusing
two head dims, and stage C's tl-kernel rows (``-warp_specialization``) at 64 and 128.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import matplotlib.mathtext
import pytest

from harness import plots, report, views
from stages.c_optimized import hopper_ws
from stages.contract import padded_head_dim

try:
    from fixtures_results import _row, build_backward_rows, build_results, build_rows
except ImportError:  # tests/ imported as a package
    from tests.fixtures_results import _row, build_backward_rows, build_results, build_rows

ROOT = Path(__file__).resolve().parents[1]
RUN = "2026-12-03T10:00:00Z"
#: stage C's invented TFLOPS at each padded width, non-causal: the kernel it runs there by default (the
#: warp-specialized one at 64 and 128) and its tl kernel (what a padded head dim runs)
C_RATE = {32: 300.0, 64: 420.0, 128: 480.0, 256: 330.0}
TL_RATE = {64: 330.0, 128: 380.0}
CUDNN_REFUSES = (232, 248)
CAUSAL_FACTOR = 0.85


def c_tflops(D: int, causal: int) -> float:
    P = padded_head_dim(D)
    rate = C_RATE[P] if P == D else TL_RATE.get(P, C_RATE[P]) * D / P * 0.97
    return rate * (CAUSAL_FACTOR if causal else 1.0)


def cudnn_tflops(D: int, causal: int) -> float:
    return (250.0 + 1.5 * D if D <= 128 else 400.0) * (CAUSAL_FACTOR if causal else 1.0)


def flash_tflops(D: int, causal: int) -> float:
    return (280.0 + 0.3 * D) * (CAUSAL_FACTOR if causal else 1.0)


def _bf16(row: dict, run: str = RUN) -> dict:
    return row | {"dtype": "bf16", "run_id": run}


def sweep_rows(ds=report.HEAD_DIM_SWEEP, *, tl: bool = True) -> list[dict]:
    rows = []
    for D in ds:
        for causal in (0, 1):
            rows.append(_bf16(_row("c", "stage", 4096, D, causal, tflops=c_tflops(D, causal))))
            if D in CUDNN_REFUSES:
                rows.append(_bf16(_row("sdpa_cudnn", "peer", 4096, D, causal, tflops=0,
                                       status="unsupported: cuDNN refuses this head dim (invented)")))
            else:
                rows.append(_bf16(_row("sdpa_cudnn", "peer", 4096, D, causal, tflops=cudnn_tflops(D, causal))))
            rows.append(_bf16(_row("sdpa_flash", "peer", 4096, D, causal, tflops=flash_tflops(D, causal))))
    if tl:
        for P, rate in TL_RATE.items():
            for causal in (0, 1):
                rows.append(_bf16(_row("c", "ablation", 4096, P, causal, variant=report.HEAD_DIM_TL_VARIANT,
                                       tflops=rate * (CAUSAL_FACTOR if causal else 1.0))))
    return rows


def _results(path: Path, rows: list[dict]) -> Path:
    d = build_results(path, rows=rows)
    env = (d / "env.json").read_text().replace('"gpu_name"', '"compute_capability": "9.0", "gpu_name"', 1)
    (d / "env.json").write_text(env)
    return d


@pytest.fixture
def sweep(tmp_path) -> Path:
    """The grid (fp16, D 64/128 at every N), backward rows at a few head dims, and the bf16 sweep."""
    bwd = [_bf16(r) for r in build_backward_rows(dtypes=("bf16",), Ns=(4096,))]
    bwd += [_bf16(_row(impl, kind, 4096, D, 0, tflops=100.0, pass_="bwd")) for D in (40, 80, 96, 256)
            for impl, kind in (("c", "stage"), ("sdpa_cudnn", "peer"))]
    return _results(tmp_path / "results" / "h200", build_rows() + bwd + sweep_rows())


def _table_lines(block: str, heading: str) -> dict[int, list[str]]:
    """The rows of the table under ``#### heading``, by D."""
    part = block.split(f"#### {heading}\n", 1)[1].split("####", 1)[0]
    return {int(cells[0]): cells for line in part.splitlines() if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[0].isdigit()}


# ------------------------------------------------------------------------------------ the data

def test_the_family_is_the_n_and_dtype_with_the_most_head_dims(sweep):
    rows = views.load(sweep, forward_only=False)[0]
    assert report.head_dim_family(rows) == (4096, "bf16")  # not the fp16 grid (two head dims at each N)
    assert report.head_dim_family(build_rows()) is None
    # backward rows at many head dims are not a forward sweep
    bwd = [_row("c", "stage", 4096, D, 0, tflops=100.0, pass_="bwd") for D in report.HEAD_DIM_SWEEP]
    assert report.head_dim_family(bwd) is None
    # three head dims are not enough, four are
    assert report.head_dim_family(sweep_rows((32, 40, 48))) is None
    assert report.head_dim_family(sweep_rows((32, 40, 48, 56))) == (4096, "bf16")


def test_points_pad_and_pair_within_one_run(sweep, monkeypatch):
    # D 72 in the tl kernel (the warp-specialized kernel's padded head dims switched off)
    monkeypatch.setattr(hopper_ws, "PADDED_HEAD_DIMS", False)
    rows = views.load(sweep, forward_only=False)[0]
    points = report.head_dim_points(rows, N=4096, dtype="bf16")
    assert sorted(points) == [0, 1]
    assert [p["D"] for p in points[0]] == list(report.HEAD_DIM_SWEEP)
    at = {p["D"]: p for p in points[1]}
    assert at[72]["padded"] == 128 and at[64]["padded"] == 64 and at[136]["padded"] == 256
    assert at[72]["vs_cudnn"] == pytest.approx(c_tflops(72, 1) / cudnn_tflops(72, 1), rel=1e-4)
    assert at[72]["vs_flash"] == pytest.approx(c_tflops(72, 1) / flash_tflops(72, 1), rel=1e-4)
    # padding alone: the tl kernel's rate at 128 (not the warp-specialized kernel's) × 72 / 128
    assert at[72]["padded_rate_kernel"] == "tl"
    assert at[72]["padded_rate"] == pytest.approx(TL_RATE[128] * CAUSAL_FACTOR * 72 / 128, rel=1e-4)
    assert at[136]["padded_rate_kernel"] == "c"  # 256 runs the tl kernel anyway: C's own row there
    assert at[136]["padded_rate"] == pytest.approx(c_tflops(256, 1) * 136 / 256, rel=1e-4)
    assert at[64]["padded_rate"] is None  # not padded
    # cuDNN refused: a row with its status, no ratio
    assert at[232]["sdpa_cudnn"]["status"].startswith("unsupported") and at[232]["vs_cudnn"] is None
    # without the tl rows, the bound falls back to stage C's own row at the padded width
    no_tl = report.head_dim_points(sweep_rows(tl=False), N=4096, dtype="bf16")
    p72 = next(p for p in no_tl[0] if p["D"] == 72)
    assert p72["padded_rate_kernel"] == "c"
    assert p72["padded_rate"] == pytest.approx(C_RATE[128] * 72 / 128, rel=1e-4)
    # with the padded head dims on, D 72 runs the kernel D 128 runs: stage C's own row at 128 is its bound
    monkeypatch.setattr(hopper_ws, "PADDED_HEAD_DIMS", True)
    ws72 = next(p for p in report.head_dim_points(rows, N=4096, dtype="bf16")[1] if p["D"] == 72)
    assert ws72["padded_rate_kernel"] == "c"
    # ... in tiles of 64 + 16 columns (hopper_ws.tile_widths): stage C's own row at 80 is its bound
    assert ws72["padded"] == 80
    assert ws72["padded_rate"] == pytest.approx(c_tflops(80, 1) * 72 / 80, rel=1e-4)
    # a later run that re-measured stage C alone does not pair with the older run's cuDNN
    later = _bf16(_row("c", "stage", 4096, 64, 0, tflops=4000.0), run="2026-12-04T10:00:00Z")
    again = report.head_dim_points(rows + [later], N=4096, dtype="bf16")
    assert next(p for p in again[0] if p["D"] == 64)["vs_cudnn"] == pytest.approx(
        C_RATE[64] / cudnn_tflops(64, 0), rel=1e-4)


# ------------------------------------------------------------------------------------ the block

def test_block_numbers_come_from_the_rows(sweep):
    block = report.render_head_dims_block(sweep, sweep)
    assert "at N = 4096, bf16, forward, at 29 head dims from 32 to 256" in block
    hidden = [D * (2048 // D) for D in report.HEAD_DIM_SWEEP]  # H = 2048 // D heads: H·D up to 2048
    assert f"B·N = 16384 tokens and H·D = {min(hidden)}–{max(hidden)}" in block
    assert "warp-specialized Hopper kernel" in block  # env.json says compute capability 9.0
    non_causal, causal = _table_lines(block, "Non-causal"), _table_lines(block, "Causal")
    assert sorted(non_causal) == list(report.HEAD_DIM_SWEEP) == sorted(causal)
    c, cu, fa = c_tflops(72, 0), cudnn_tflops(72, 0), flash_tflops(72, 0)
    assert non_causal[72] == ["72", f"{c:.0f}", f"{cu:.0f}", f"{fa:.0f}", f"{c / cu:.2f}", f"{c / fa:.2f}",
                              "80 (×1.11)"]  # 64 + 16 columns (hopper_ws.tile_widths)
    assert non_causal[64][-1] == "—" and non_causal[136][-1] == "144 (×1.06)" and non_causal[200][-1] == "256 (×1.28)"
    assert causal[232][2] == "unsupported" and causal[232][4] == "—"  # cuDNN refused: no ratio
    assert causal[232][5] == f"{c_tflops(232, 1) / flash_tflops(232, 1):.2f}"
    # the sentence: min/median/max over every cell with a ratio, computed here from the same numbers
    ratios = sorted(round(c_tflops(D, k) / cudnn_tflops(D, k), 6) for D in report.HEAD_DIM_SWEEP for k in (0, 1)
                    if D not in CUDNN_REFUSES)
    assert (f"Stage C reaches {ratios[0]:.2f}–{ratios[-1]:.2f}× of cuDNN's throughput over the {len(ratios)} "
            f"(head dim, mask) cells (median {statistics.median(ratios):.2f}") in block
    ahead = [D for D in report.HEAD_DIM_SWEEP if D not in CUDNN_REFUSES and c_tflops(D, 0) >= cudnn_tflops(D, 0)]
    assert ahead == [32, 64, 128]  # the synthetic numbers: C ahead only where it does not pad
    assert "is at or above cuDNN at D 32, 64 and 128 non-causal and at D 32, 64 and 128 causal" in block
    assert "cuDNN gave no time at D 232 and 248 (unsupported)." in block
    assert "head_dims.png" not in block  # the figure is linked once it is drawn


def test_reading_names_ranges_exactly():
    """Five head dims, C / cuDNN = 1.2, 1.1, 0.9, 1.0, 0.5 non-causal and below 1 everywhere causal."""
    ratios = {0: (1.2, 1.1, 0.9, 1.0, 0.5), 1: (0.8,) * 5}
    rows = []
    for causal, rs in ratios.items():
        for D, ratio in zip((32, 40, 48, 56, 64), rs):
            rows.append(_bf16(_row("sdpa_cudnn", "peer", 4096, D, causal, tflops=400.0)))
            rows.append(_bf16(_row("c", "stage", 4096, D, causal, tflops=400.0 * ratio)))
    text = report.head_dim_reading(report.head_dim_points(rows, N=4096, dtype="bf16"))
    assert text == ("Stage C reaches 0.50–1.20× of cuDNN's throughput over the 10 (head dim, mask) cells (median "
                    "0.80; 0.80 at the unpadded head dims, 0.85 at the padded head dims), and is at or above "
                    "cuDNN at D 32–40 and 56 non-causal and at no head dim causal."), text
    assert report._d_ranges([32, 40, 48, 64], [32, 40, 48, 56, 64]) == "32–48 and 64"
    assert report._d_ranges([40], [32, 40]) == "40"
    assert report.head_dim_reading({}) == ""


def test_block_is_data_gated_and_names_the_command_without_a_sweep(tmp_path):
    grid = build_results(tmp_path / "grid", rows=build_rows())
    assert not report.head_dims_present(grid) and not report.head_dims_present(tmp_path / "nowhere")
    block = report.render_head_dims_block(grid, grid)
    assert "No head-dim sweep yet" in block and report.HEAD_DIM_SCRIPT in block and "|" not in block
    assert "--D 32,40,48," in report.HEAD_DIM_COMMAND and report.HEAD_DIM_COMMAND.endswith("--dtype bf16")
    # a file holding the block keeps it until the data is there; the other blocks are refilled
    readme = tmp_path / "README.md"
    begin, end = report.markers("head_dims")
    r_begin, r_end = report.markers("results")
    readme.write_text(f"{r_begin}\nold\n{r_end}\n\n{begin}\nkept as it is\n{end}\n")
    assert report.update_readme(readme, grid) is True
    text = readme.read_text()
    assert "kept as it is" in text and "| C optimized |" in text
    assert report.check_readme(readme, grid) == ""
    # the results page a new folder gets has the section, its markers and its command
    page = report.results_page(grid)
    assert begin in page and end in page and f"`{report.HEAD_DIM_SCRIPT}`" in page
    assert "head_dims" in report.BLOCKS and "head_dims" in report.BLOCK_DATA


def test_block_is_filled_once_the_sweep_is_there(sweep, tmp_path):
    readme = tmp_path / "README.md"
    begin, end = report.markers("head_dims")
    readme.write_text(f"# lab\n\n{begin}\nstale\n{end}\n")
    assert report.head_dims_present(sweep)
    assert report.check_readme(readme, sweep)  # stale
    assert report.update_readme(readme, sweep) is True
    text = readme.read_text()
    assert "stale" not in text and "#### Non-causal" in text and "| 72 |" in text
    assert report.check_readme(readme, sweep) == ""


# ------------------------------------------------------------------------------------ the figure

def test_figure_is_drawn_from_the_sweep_without_mathtext(sweep, monkeypatch):
    def no_mathtext(self, s, *args, **kwargs):
        raise AssertionError(f"mathtext used for {s!r}")

    monkeypatch.setattr(matplotlib.mathtext.MathTextParser, "parse", no_mathtext)
    paths = plots.plot_all(sweep)
    names = [p.name for p in paths]
    assert names[-1] == "head_dims.png" and plots.HEAD_DIM_FIGURES == ("head_dims.png",)
    path = paths[-1]
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 20_000
    # once drawn, the block links it, relative to the README that holds it
    assert "](./figures/head_dims.png)" in report.render_head_dims_block(sweep, sweep)


def test_figure_skips_with_the_command_without_a_sweep(tmp_path, capsys):
    rows, env = views.load(build_results(tmp_path / "r"), forward_only=False)
    assert plots.plot_head_dims(rows, env, tmp_path / "figs") is None
    out = capsys.readouterr().out
    assert "skipped head_dims.png" in out and f"`{report.HEAD_DIM_COMMAND}`" in out
    assert report.HEAD_DIM_SCRIPT in out
    assert not (tmp_path / "figs").exists()


# ------------------------------------------------------------------------------------ the script

def test_the_script_runs_the_one_command_over_every_head_dim():
    """experiments/head_dims_gpu.sh measures the sweep in parts: together they are HEAD_DIM_SWEEP, each
    with the flags of HEAD_DIM_COMMAND (the command the skip message and the block name); the
    experiments README lists it."""
    text = (ROOT / report.HEAD_DIM_SCRIPT).read_text()
    parts = re.findall(r"then sweep ([\d,]+); fi", text)
    assert [int(d) for part in parts for d in part.split(",")] == list(report.HEAD_DIM_SWEEP)
    body = " ".join(re.search(r"^sweep\(\) \{.*?^\}", text, re.S | re.M).group(0).replace("\\\n", " ").split())
    ds = ",".join(map(str, report.HEAD_DIM_SWEEP))
    assert report.HEAD_DIM_COMMAND.replace("python -m", "$py -m").replace(ds, '"$1"') in body, body
    assert f"`{report.HEAD_DIM_SCRIPT}`" in (ROOT / "experiments" / "README.md").read_text()


def test_the_other_dtype_gets_a_sentence_and_a_tie_keeps_bf16(tmp_path):
    """The same sweep in fp16 beside the bf16 one (as many head dims): the tables stay bf16's (the
    sweep script's dtype wins a tie) and fp16 gets the reading sentence of its own numbers."""
    bf16 = sweep_rows()
    fp16 = [r | {"dtype": "fp16"} | ({"tflops": r["tflops"] / 2, "ms_median": r["ms_median"] * 2}
                                     if r["impl"] == "c" and "tflops" in r else {}) for r in bf16]
    results = _results(tmp_path / "results" / "h200", bf16 + fp16)
    rows = views.load(results, forward_only=False)[0]
    assert report.head_dim_family(rows) == (4096, "bf16")
    block = report.render_head_dims_block(results, results)
    assert "at N = 4096, bf16, forward" in block
    half = report.head_dim_reading(report.head_dim_points(rows, N=4096, dtype="fp16"))
    assert half.startswith("Stage C reaches") and "In fp16, the same sweep: stage C reaches" + half[len("Stage C reaches"):] in block
