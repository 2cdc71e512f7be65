"""Figures and the README report, from a synthetic results directory (CPU, a few seconds)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from harness import plots, report
from harness.results import COLUMNS, ResultsError

try:
    from fixtures_results import _row, build_results, build_rows
except ImportError:  # tests/ imported as a package
    from tests.fixtures_results import _row, build_results, build_rows

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
README = """# the lab

intro text

<!-- results:begin -->
old table
<!-- results:end -->

## reading path
"""


@pytest.fixture
def results(tmp_path) -> Path:
    return build_results(tmp_path / "results" / "h200")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    plots.add_parser(sub)
    report.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


# ------------------------------------------------------------------------------------- figures

def test_plot_all_writes_every_figure(results):
    paths = plots.plot_all(results)  # forward rows only: the backward and suite figures skip (see test_report_new_rows)
    assert [p.name for p in paths] == list(plots.FORWARD_FIGURES)
    for p in paths:
        assert p.parent == results / "figures"
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, p


def test_plot_without_optional_data_skips_with_a_message(tmp_path, capsys):
    # stages only, no peers, no DRAM bytes, no energy, no ablation, no ceilings: draw what is there
    rows = [r for r in build_rows() if r["kind"] == "stage"]
    for r in rows:
        for c in ("dram_read_model", "dram_write_model", "dram_read_measured", "dram_write_measured",
                  "energy_j_per_call", "power_w"):
            r.pop(c, None)
    d = build_results(tmp_path, rows=rows, ceilings=False, total_memory=False)
    names = [p.name for p in plots.plot_all(d)]
    assert names == ["waterfall.png", "throughput.png", "peak_memory.png"]
    out = capsys.readouterr().out
    for skipped in ("dram_bytes.png", "roofline.png", "energy.png"):
        assert f"skipped {skipped}" in out
    assert "python -m harness" in out


def test_plot_tolerates_env_without_ceilings_or_memory(tmp_path):
    d = build_results(tmp_path, ceilings=False, total_memory=False)
    assert len(plots.plot_all(d)) == len(plots.FORWARD_FIGURES)


def test_plot_without_env_json_still_draws(results):
    (results / "env.json").unlink()
    assert len(plots.plot_all(results)) == len(plots.FORWARD_FIGURES)


def test_waterfall_cell_flag(results):
    cell = plots.parse_cell("N=2048,D=128,causal=yes")
    assert cell == {"N": 2048, "D": 128, "causal": 1}
    rows, env = plots.views.load(results)
    steps = plots.waterfall_steps(rows, plots.resolve_cell(rows, cell))
    assert [s[1] for s in steps] == ["a", "b", "c"]  # no ablation rows there
    steps = plots.waterfall_steps(rows, plots.resolve_cell(rows, {}))
    assert [s[0] for s in steps] == ["A naive", "B tiled", "C kernel, all switches off", "+ tuned tiles",
                                     "+ pipelining", "+ tma", "+ exp2", "+ causal skip", "C optimized"]
    assert plots.plot_waterfall(rows, env, results / "figures", cell=cell).exists()


def test_env_keys_in_either_form():
    views = plots.views
    flat = {"ceilings": {"copy_gbps": 4300.0, "matmul_fp16_tflops": 740.0}, "memory_bytes": 150}
    nested = {"ceilings": {"copy_bandwidth_gbps": 4300.0, "matmul_tflops": {"fp16": 740.0}},
              "total_memory_bytes": 150}
    for env in (flat, nested):
        assert views.ceilings(env) == (4300.0, {"fp16": 740.0})
        assert views.device_memory(env) == 150
    assert views.ceilings({}) == (None, {}) and views.device_memory({}) is None
    assert views.ceilings({"ceilings": None}) == (None, {})


@pytest.mark.parametrize("bad", ["N=abc", "X=1", "D", "causal=maybe"])
def test_parse_cell_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="--cell"):
        plots.parse_cell(bad)


def test_plot_cli(results, capsys):
    assert _cli(["plot", str(results), "--cell", "N=4096,D=64"]) == 0
    assert "waterfall.png" in capsys.readouterr().out
    assert _cli(["plot", str(results / "nowhere")]) == 2
    assert "no such results file" in capsys.readouterr().err


# ------------------------------------------------------------------------------ malformed input

def _write_csv(path: Path, header, lines) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "runs.csv").write_text(",".join(header) + "\n" + "".join(",".join(l) + "\n" for l in lines))
    return path


def _good_line() -> list[str]:
    values = {"impl": "a", "kind": "stage", "B": "1", "H": "2", "N": "128", "D": "64", "dtype": "fp16",
              "causal": "0", "status": "ok", "ms_median": "1.5"}
    return [values.get(c, "") for c in COLUMNS]


def test_missing_results_file(tmp_path):
    with pytest.raises(ResultsError, match="no such results file"):
        plots.plot_all(tmp_path)
    with pytest.raises(ResultsError, match="no such results file"):
        report.render_block(tmp_path)


def test_bad_header(tmp_path):
    d = _write_csv(tmp_path, ["impl", "kind", "bogus"], [["a", "stage", "1"]])
    with pytest.raises(ResultsError, match="missing columns"):
        plots.plot_all(d)


def test_missing_column(tmp_path):
    header = [c for c in COLUMNS if c != "tflops"]
    line = [v for c, v in zip(COLUMNS, _good_line()) if c != "tflops"]
    d = _write_csv(tmp_path, header, [line])
    with pytest.raises(ResultsError, match="tflops"):
        report.render_block(d)


def test_non_numeric_value(tmp_path):
    line = _good_line()
    line[COLUMNS.index("ms_median")] = "fast"
    d = _write_csv(tmp_path, COLUMNS, [_good_line(), line])
    with pytest.raises(ResultsError, match=r"runs.csv:3: column 'ms_median' should be a number, got 'fast'"):
        plots.plot_all(d)


def test_empty_required_value(tmp_path):
    line = _good_line()
    line[COLUMNS.index("impl")] = ""
    d = _write_csv(tmp_path, COLUMNS, [line])
    with pytest.raises(ResultsError, match="'impl' is empty"):
        report.render_block(d)


# ------------------------------------------------------------------------------------- report

def test_render_table_has_headline_cells_and_impls(results):
    rows, env = plots.views.load(results)
    md = report.render_table(rows, env)
    assert "NVIDIA H200" in md and "2026-11-29" in md
    for D in (64, 128):
        for masking in ("non-causal", "causal"):
            assert f"#### N = 4096, D = {D}, fp16, {masking}" in md
    for name in ("A naive", "B tiled", "C optimized", "SDPA FLASH (FA2)", "SDPA CUDNN", "SDPA EFFICIENT",
                 "SDPA MATH"):
        assert f"| {name} |" in md
    assert "| A naive | 15.3 | 36 | 1.00× |" in md
    assert "C optimized vs SDPA CUDNN" in md and "| 64 | no |" in md
    assert "interpreter" not in md


def test_render_table_small_interpreter_run(tmp_path):
    # a CPU run: small N only, no N=4096: the table falls back to the largest N and says times are CPU times
    rows = [dict(r, device="interpreter") for r in build_rows() if r["N"] in (512, 1024) and r["kind"] != "ablation"]
    d = build_results(tmp_path, rows=rows)
    md = report.render_table(*plots.views.load(d))
    assert "#### N = 1024, D = 64, fp16, non-causal" in md
    assert "not GPU times" in md


def test_render_table_shows_oom(tmp_path):
    rows = [r for r in build_rows() if r["N"] == 16384]
    md = report.render_table(*plots.views.load(build_results(tmp_path, rows=rows)))
    assert "| A naive | — | — | — |" in md and "| oom |" in md


def test_update_readme_round_trip_and_check(results, tmp_path, capsys):
    plots.plot_all(results)
    readme = tmp_path / "README.md"
    readme.write_text(README)
    assert report.check_readme(readme, results)  # stale: "old table"
    assert report.update_readme(readme, results) is True
    text = readme.read_text()
    assert text.startswith("# the lab\n\nintro text\n\n<!-- results:begin -->\n")
    assert text.endswith("<!-- results:end -->\n\n## reading path\n")
    assert "old table" not in text and "| C optimized |" in text
    assert "](results/h200/figures/waterfall.png)" in text
    assert report.check_readme(readme, results) == ""
    assert report.update_readme(readme, results) is False
    assert _cli(["report", str(results), "--readme", str(readme), "--check"]) == 0

    readme.write_text(text.replace("| C optimized |", "| C (hand-edited) |"))
    assert _cli(["report", str(results), "--readme", str(readme), "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert _cli(["report", str(results), "--readme", str(readme)]) == 0
    assert readme.read_text() == text


@pytest.mark.parametrize("text", ["# no markers\n", "<!-- results:end -->\n<!-- results:begin -->\n",
                                  "<!-- results:begin -->\n<!-- results:begin -->\n<!-- results:end -->\n"])
def test_update_readme_needs_markers(results, tmp_path, text):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    with pytest.raises(report.ReadmeError, match="results:"):
        report.update_readme(readme, results)
    assert readme.read_text() == text


def test_report_cli_prints_markdown(results, capsys):
    assert _cli(["report", str(results)]) == 0
    assert "| SDPA CUDNN |" in capsys.readouterr().out


def test_ratio_summary_takes_the_median_of_an_even_number_of_cells(tmp_path):
    """Four cells with C/cuDNN = 0.8, 0.9, 1.0, 1.3: the median is 0.95, not the upper middle 1.0."""
    rows = []
    for N, ratio in zip((1024, 2048, 4096, 8192), (0.8, 0.9, 1.0, 1.3)):
        rows.append(_row("sdpa_cudnn", "peer", N, 64, 0, tflops=400.0))
        rows.append(_row("c", "stage", N, 64, 0, tflops=400.0 * ratio))
    block = report.render_ratio_block(build_results(tmp_path, rows=rows))
    assert "Over N ≥ 1024 (4 cells, fp16): min 0.80, median 0.95, max 1.30." in block, block


def test_run_history_lists_each_run_and_the_cells_that_fell_below(tmp_path):
    """Three runs of C and cuDNN over two cells, plus an ablation run (C only, so not a run that timed
    both): one line per run with its cell count, how many at or above 1.0 and min/median/max, and the
    cell that read below 1.0 in one of them with its ratio run by run."""
    runs = {"2026-11-30T01:00:00Z": (1.02, 1.10), "2026-11-30T02:00:00Z": (0.99, 1.08),
            "2026-11-30T03:00:00Z": (1.01, 1.12)}
    rows = []
    for run, ratios in runs.items():
        for N, ratio in zip((1024, 4096), ratios):
            rows.append(_row("sdpa_cudnn", "peer", N, 64, 1, tflops=400.0) | {"run_id": run})
            rows.append(_row("c", "stage", N, 64, 1, tflops=400.0 * ratio) | {"run_id": run})
    rows.append(_row("c", "ablation", 4096, 64, 0, tflops=500.0, variant="all") | {"run_id": "2026-11-30T04:00:00Z"})
    table = report.run_history_table(rows, {"2026-11-30T02:00:00Z": "abc1234"})
    assert "| 2026-11-30T02:00:00Z | abc1234 | 2 | 1 | 0.990 | 1.035 | 1.080 |" in table, table
    assert "| 2026-11-30T01:00:00Z | ? | 2 | 2 | 1.020 | 1.060 | 1.100 |" in table
    assert "04:00" not in table
    assert "- fp16, D = 64, causal, N = 1024: 1.020, 0.990, 1.010" in table
    assert "N = 4096:" not in table  # never below 1.0
    assert report.run_history_table(rows, last=1).count("| 2026-11-30T") == 1
    assert report.run_history_table([r for r in rows if r["impl"] == "c"]) == ""
    assert "(N ≥ 1024, fp16)" in table
    results = build_results(tmp_path, rows=rows)
    block = report.render_ratio_block(results)
    assert "#### Run to run" in block and "| 2026-11-30T03:00:00Z |" in block
    (results / "env.json").unlink()  # the table needs no provenance file, only its commit column does
    assert "| 2026-11-30T03:00:00Z | ? |" in report.render_ratio_block(results)


# ------------------------------------------------------- the landing page's headline, the results page

def _headline_lines(block: str) -> dict[str, list[str]]:
    return {cells[0]: cells for line in block.splitlines() if line.startswith("| ")
            and (cells := [c.strip() for c in line.strip("|").split("|")])[0] not in ("step",)}


def test_headline_block_is_a_to_c_to_cudnn_at_the_headline_cell(results, tmp_path):
    """One table at HEADLINE_CELL: A, B, C, cuDNN in that order with ms, TFLOPS, DRAM bytes measured
    and modelled, speedup over A; a sentence reading it; the waterfall and the results page, linked
    relative to the README that holds the block."""
    plots.plot_all(results)
    (results / "README.md").write_text(report.results_page(results))
    block = report.render_headline_block(results, tmp_path)  # the landing page sits two folders above
    assert report.HEADLINE_CELL == {"N": 4096, "D": 64, "dtype": "fp16", "causal": 0}
    assert "N = 4096, D = 64, fp16, non-causal (B = 4, H = 32)" in block
    lines = _headline_lines(block)
    assert list(lines) == ["A naive", "B tiled", "C optimized", "SDPA CUDNN"]
    assert lines["A naive"][2:] == ["15.3", "36", "16.7 GB", "17.4 GB", "1.00×"]
    assert lines["C optimized"][2:] == ["1.81", "304", "2.46 GB", "4.43 GB", "8.44×"]
    assert all(len(cells) == 7 for cells in lines.values())  # no status column: every row is ok
    assert ("A → B is 4.7× faster and moves 3× fewer DRAM bytes (16.7 GB → 4.83 GB); "
            "B → C adds another 1.81×; stage C runs at 0.81× cuDNN's throughput on this cell.") in block
    assert "](results/h200/figures/waterfall.png)" in block
    assert "[`results/h200/README.md`](results/h200/README.md)" in block
    inside = report.render_headline_block(results, results)  # in the results folder itself: no self-link
    assert "](./figures/waterfall.png)" in inside and "README.md)" not in inside


def test_headline_block_shows_dram_bytes_and_a_status_when_a_row_failed(tmp_path):
    rows = [r for r in build_rows() if r["kind"] in ("stage", "peer")]
    a = next(r for r in rows if r["impl"] == "a" and r["N"] == 4096 and r["D"] == 64 and not r["causal"])
    rows[rows.index(a)] = dict(a, status="oom", tflops=0)
    block = report.render_headline_block(build_results(tmp_path / "r", rows=rows), tmp_path)
    lines = _headline_lines(block)
    assert lines["A naive"][2:4] == ["—", "—"] and lines["A naive"][-1] == "oom"
    assert lines["B tiled"][-2] == "—" and lines["B tiled"][-1] == "ok"  # no speedup without A
    assert "A → B is" not in block
    measured, model = lines["C optimized"][4:6]
    assert measured.endswith("B") and model.endswith("B"), (measured, model)


def test_headline_block_without_rows_names_the_command(tmp_path):
    rows = [r for r in build_rows() if r["D"] == 128]
    block = report.render_headline_block(build_results(tmp_path / "r", rows=rows), tmp_path)
    assert "run `python -m harness sweep`" in block and "|" not in block


def test_ablation_block_walks_from_stage_b_and_says_what_is_missing(tmp_path):
    """The ablation table starts at stage B's row of the same cell: with C's ablation rows but no B
    row (a GPU where only ``--stages c --ablation`` ran) the block asks for stage B, not for the
    ablation run that is already there; with neither, for the ablation run."""
    rows = build_rows()
    full = report.render_ablation_block(build_results(tmp_path / "full", rows=rows), tmp_path)
    assert "| stage B |" in full and "share of the B → C gain" in full
    no_b = [r for r in rows if r["impl"] != "b"]
    block = report.render_ablation_block(build_results(tmp_path / "no_b", rows=no_b), tmp_path)
    assert "|" not in block and "no stage B row" in block and "--stages b " in block
    bare = [r for r in no_b if r["kind"] != "ablation"]
    block = report.render_ablation_block(build_results(tmp_path / "bare", rows=bare), tmp_path)
    assert "No ablation rows yet" in block and "--stages c --ablation" in block


def test_report_update_writes_the_results_page_from_its_template(results, tmp_path, capsys):
    """`report RESULTS --update` on a folder without a README writes one section per block, fills it,
    and leaves a landing page alone unless --readme names it; --check alone checks the results page."""
    landing = tmp_path / "README.md"
    landing.write_text("# lab\n\n<!-- headline:begin -->\nold\n<!-- headline:end -->\n")
    assert _cli(["report", str(results), "--check"]) == 2  # no results page yet
    assert _cli(["report", str(results), "--update"]) == 0
    page = (results / "README.md").read_text()
    assert "wrote" in capsys.readouterr().out
    for name, heading, _what, command in report.RESULTS_PAGE_SECTIONS:
        assert f"## {heading}" in page and report.markers(name)[0] in page and command in page
    assert "| C optimized |" in page and "Not measured yet: run `python -m harness generate`" in page
    assert landing.read_text().endswith("old\n<!-- headline:end -->\n")
    assert _cli(["report", str(results), "--check"]) == 0
    assert _cli(["report", str(results), "--update", "--readme", str(landing)]) == 0
    assert "| SDPA CUDNN |" in landing.read_text() and "old" not in landing.read_text()
    assert _cli(["report", str(results), "--update", "--readme", str(landing), "--check"]) == 0
    (results / "README.md").write_text(page.replace("## The backward pass", "## The backward pass, by hand"))
    assert _cli(["report", str(results), "--update"]) == 0  # prose outside the markers is kept
    assert "## The backward pass, by hand" in (results / "README.md").read_text()


# ------------------------------------------------------------------------ the committed results

#: Every committed file with generated blocks: the landing page (its headline), the results page (every
#: other table), stage C's README (ablation, twins) and the race against cuDNN (ratio).
GENERATED_READMES = ["README.md", "results/h200/README.md", "stages/c_optimized/README.md",
                     "docs/stage-c-details.md", "docs/performance-log/race-against-cudnn.md"]


@pytest.mark.parametrize("readme_name", GENERATED_READMES)
def test_committed_h200_readme_blocks_are_current(readme_name):
    """Every generated block in the committed READMEs is what `report` makes of results/h200."""
    results = ROOT / "results" / "h200"
    readme = ROOT / readme_name
    assert (results / "runs.csv").exists(), "results/h200/runs.csv is committed and the READMEs quote it"
    assert any(report.markers(name)[0] in readme.read_text() for name in report.BLOCKS), readme_name
    diff = report.check_readme(readme, results)
    assert diff == "", (f"{readme_name}'s generated blocks are stale; run `python -m harness report results/h200 "
                        f"--readme {readme_name}`\n{diff}")


def test_committed_h200_figures_regenerate(tmp_path):
    """`plot` on the committed results writes every figure (on a CPU: plotting never needs a GPU)."""
    written = plots.plot_all(ROOT / "results" / "h200", out_dir=tmp_path)
    names = {p.name for p in written}
    assert set(plots.FORWARD_FIGURES) <= names <= set(plots.FIGURE_NAMES)
    assert all(p.stat().st_size > 10_000 for p in written)


def test_ratios_pair_the_two_impls_within_one_run():
    """A later run that re-measures only stage C (an ablation run) must not be divided by an older
    run's cuDNN time: the ratio comes from the latest run that timed both side by side."""
    rows = [r for r in build_rows() if r["N"] == 4096 and r["D"] == 64 and not r["causal"]
            and r["kind"] in ("stage", "peer")]
    both = {r["impl"]: r for r in rows}
    first = report.throughput_ratios(rows)[64, 0, 4096]
    assert first == pytest.approx(both["c"]["tflops"] / both["sdpa_cudnn"]["tflops"])
    later_c = dict(both["c"], run_id="2026-11-30T09:00:00Z", tflops=both["c"]["tflops"] * 3)
    assert report.throughput_ratios(rows + [later_c])[64, 0, 4096] == pytest.approx(first)
    later_pair = [later_c, dict(both["sdpa_cudnn"], run_id="2026-11-30T09:00:00Z")]
    assert report.throughput_ratios(rows + later_pair)[64, 0, 4096] == pytest.approx(3 * first)


def test_ratio_table_flags_noisy_cells():
    """A cell whose timing samples spread more than NOISY_SPREAD (20th to 80th percentile over the
    median) on either side gets a † and the table a footnote; a clean table gets neither."""
    rows = [r for r in build_rows() if r["kind"] in ("stage", "peer")]
    clean = report.ratio_table(rows)
    assert clean and "†" not in clean
    pairs = report.paired_rows(rows)
    (D, causal, N), (_, cudnn) = next(iter(pairs.items()))
    noisy_peer = dict(cudnn, ms_p20=cudnn["ms_median"] * 0.9, ms_p80=cudnn["ms_median"] * 1.05)
    table = report.ratio_table([r for r in rows if r is not cudnn] + [noisy_peer])
    line = next(ln for ln in table.splitlines() if ln.startswith(f"| {D} | {'yes' if causal else 'no'} |"))
    assert line.count("†") == 1 and table.count("†") == 2  # the cell and the footnote
    assert report.sample_spread(noisy_peer) == pytest.approx(0.15)
    assert report.sample_spread(dict(cudnn, ms_p80=None)) is None


def test_committed_roofline_places_measured_points_under_the_roof_and_model_points_left_of_them():
    """The roofline's filled (measured-byte) points obey the ceilings; a hollow (model-byte) point is at
    or left of its cell's measured point, because the model counts requests and the L2 serves part of
    them. (Model points alone may sit above the bandwidth line: the figure says so and draws the arrow.)"""
    from harness import views

    rows, env = views.load(ROOT / "results" / "h200")
    bw, rates = views.ceilings(env)
    points, _ = plots.roofline_points(rows, dtype="fp16")
    measured = [p for p in points if p[4]]
    assert measured, "the headline cells have Nsight Compute bytes"
    for impl, D, causal, x_model, x_meas, tflops in measured:
        assert tflops <= min(rates["fp16"], x_meas * bw / 1e3), (impl, D, causal)
        if x_model:
            assert x_model <= x_meas * 1.01, (impl, D, causal, x_model, x_meas)
