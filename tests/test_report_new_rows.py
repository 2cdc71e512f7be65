"""The rows the harness gained (backward passes, GQA and cross-length cells, the model suite, the host
latency) in the README blocks and figures, from synthetic results (CPU, no stages run).

Three kinds of check: the forward tables and figures ignore rows they were not made for; each new
block and figure renders from its data and says which command produces it when the data is
missing; ``report --check`` notices a stale new block.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

import matplotlib.mathtext
import pytest

from harness import plots, report, views
from harness.results import load_rows

try:
    from fixtures_results import (LATENCY_US, SUITE_RUNS, build_backward_rows, build_foreign_rows, build_results,
                                  build_rows, build_suite, build_suite_rows, write_latency)
except ImportError:  # tests/ imported as a package
    from tests.fixtures_results import (LATENCY_US, SUITE_RUNS, build_backward_rows, build_foreign_rows,
                                        build_results, build_rows, build_suite, build_suite_rows, write_latency)

NEW_BLOCKS = ("models", "shapes", "backward", "latency")


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    report.add_parser(sub)
    plots.add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def _readme_with_markers(path: Path, names=NEW_BLOCKS) -> Path:
    text = "# lab\n\n" + "".join(f"{report.markers(n)[0]}\nstale\n{report.markers(n)[1]}\n\n" for n in names)
    path.write_text(text)
    return path


# ------------------------------------------------------------------ 1. forward views ignore new rows

def test_forward_grid_keeps_only_forward_self_attention_grid_rows():
    grid = build_rows()
    foreign = build_foreign_rows()
    assert views.forward_grid(grid + foreign) == grid
    assert report.forward_grid is views.forward_grid  # one filter, shared by the tables and the figures
    bwd = build_backward_rows(dtypes=("fp16",), Ns=(1024,))
    plain_bwd = [r for r in foreign if r["pass"] == "bwd" and r.get("Hkv", r["H"]) == r["H"]
                 and r.get("Nk", r["N"]) == r["N"] and not r.get("cell")]
    assert plain_bwd and views.grid_rows(grid + bwd + foreign, "bwd") == bwd + plain_bwd


def test_forward_tables_and_figures_are_unchanged_by_foreign_rows(tmp_path):
    """The same grid with and without backward, GQA, Nq != Nk and suite rows at its headline cells:
    every forward block and every forward figure comes out identical (the figures byte for byte)."""
    plain = build_results(tmp_path / "plain" / "results" / "h200")
    mixed = build_results(tmp_path / "mixed" / "results" / "h200", rows=build_rows() + build_foreign_rows())
    for name in ("results", "ratio", "ablation"):
        assert report.BLOCKS[name](mixed, tmp_path / "mixed") == report.BLOCKS[name](plain, tmp_path / "plain"), name
    rows_plain, env = views.load(plain)
    rows_mixed, _ = views.load(mixed)
    assert rows_mixed == rows_plain
    # the functions themselves filter too (a notebook may pass every row, forward_only=False)
    every_row, _ = views.load(mixed, forward_only=False)
    assert len(every_row) > len(rows_plain)
    assert report.render_table(every_row, env) == report.render_table(rows_plain, env)
    assert report.ratio_table(load_rows(mixed)) == report.ratio_table(load_rows(plain))
    for draw in (plots.plot_waterfall, plots.plot_throughput, plots.plot_dram_bytes, plots.plot_peak_memory,
                 plots.plot_roofline, plots.plot_energy):
        a = draw(rows_plain, env, tmp_path / "figs_plain")
        b = draw(every_row, env, tmp_path / "figs_mixed")
        assert a.read_bytes() == b.read_bytes(), a.name


# ------------------------------------------------------------------ 2. the new README blocks

def test_models_block_renders_one_line_per_cell_from_the_latest_run(tmp_path):
    d = build_suite(build_results(tmp_path / "r"))
    block = report.render_models_block(d, tmp_path / "r")
    lines = {ln.split(" | ")[0][2:]: ln for ln in block.splitlines() if ln.startswith("| ") and " · " in ln}
    assert list(lines) == ["gpt2", "llama3-8b", "tiny", "decode-gqa"]  # suite order, not file order
    # gpt2, second run: C 0.50 ms, best SDPA cuDNN 0.55 ms (eager), cuDNN 0.50 GPU, B 0.90
    gpt2 = lines["gpt2"].split(" | ")
    assert gpt2[2:10] == ["0.5", "0.45", "SDPA CUDNN", "0.55", f"{0.55 / 0.50:.2f}", f"{0.50 / 0.45:.2f}",
                          f"{0.90 / 0.50:.2f}", "ok |"]
    assert "B 32 · H 12 · N 1024 · D 64 · causal · bf16" in lines["gpt2"]
    assert "H 32/8 · N 1/8192" in lines["decode-gqa"]  # query/key heads and rows where they differ
    tiny = lines["tiny"].split(" | ")
    assert tiny[4] == "SDPA FLASH (FA2)" and tiny[-1] == "behind: eager, GPU, vs B |"
    # the run-by-run tally: the first run had C slower everywhere
    first, second = (next(ln for ln in block.splitlines() if ln.startswith(f"| {run} |")) for run in SUITE_RUNS)
    assert "| 4 | 0 of 4 |" in first and "| 4 | 3 of 4 | 3 of 4 | 3 of 4 |" in second
    assert "(tiny)" in second


def test_models_block_has_a_backward_table_only_where_backward_rows_exist(tmp_path):
    d = build_suite(build_results(tmp_path / "r"))
    assert "**The backward**" not in report.render_models_block(d, tmp_path / "r")
    rows = build_suite_rows()
    # the same cells timed backward, stage C twice as slow as its forward: the ratios halve
    bwd = [r | {"pass": "bwd"} | ({"ms_median": r["ms_median"] * 2} if r["impl"] == "c" and "ms_median" in r else {})
           for r in rows]
    d = build_suite(build_results(tmp_path / "r2"), rows=rows + bwd)
    block = report.render_models_block(d, tmp_path / "r2")
    forward, backward = block.split("**The backward**")
    gpt2_fwd = next(ln for ln in forward.splitlines() if ln.startswith("| gpt2 |")).split(" | ")
    gpt2_bwd = next(ln for ln in backward.splitlines() if ln.startswith("| gpt2 |")).split(" | ")
    assert gpt2_fwd[6] == f"{0.55 / 0.50:.2f}" and gpt2_bwd[6] == f"{0.55 / 1.00:.2f}"
    assert "Backward, suite run by suite run:" in backward


def test_models_block_with_backward_rows_alone_shows_them_and_asks_for_the_forward(tmp_path):
    """A folder whose suite ran only ``--pass bwd`` (a second GPU's first run): its backward table, and
    the command that would measure the forward."""
    bwd = [r | {"pass": "bwd"} for r in build_suite_rows()]
    block = report.render_models_block(build_suite(build_results(tmp_path / "r"), rows=bwd), tmp_path / "r")
    assert "_No forward rows yet: run `python -m harness sweep --suite models` on a GPU._" in block
    assert "**The backward**" in block and "| gpt2 |" in block.split("**The backward**")[1]
    assert "No model-suite rows yet" not in block


def test_suite_lines_pair_within_one_run():
    """A later run that timed only SDPA in a cell does not pair with an older run's stage C."""
    rows = build_suite_rows()
    later = [dict(r, run_id="2026-12-02T09:00:00Z", ms_median=r["ms_median"] / 10) for r in rows
             if r["cell"] == "gpt2" and r["impl"] == "sdpa_cudnn"]
    gpt2 = next(x for x in views.suite_lines(rows + later) if x["cell"] == "gpt2")
    assert gpt2["run_id"] == SUITE_RUNS[-1]
    assert gpt2["vs_best"] == pytest.approx(0.55 / 0.50)


def test_backward_block_summary_and_grid(tmp_path):
    bwd = build_backward_rows()
    d = build_results(tmp_path / "r", rows=build_rows() + bwd)
    block = report.render_backward_block(d, tmp_path / "r")
    for dtype in ("fp16", "bf16"):
        for peer in ("sdpa_flash", "sdpa_cudnn"):
            c = {(r["D"], r["causal"], r["N"]): r["tflops"] for r in bwd if r["impl"] == "c" and r["dtype"] == dtype}
            p = {(r["D"], r["causal"], r["N"]): r["tflops"] for r in bwd if r["impl"] == peer and r["dtype"] == dtype}
            ratios = sorted(c[k] / p[k] for k in c)
            line = (f"| {dtype} | {views.label(peer)} | {len(ratios)} | {sum(x >= 1 for x in ratios)} | "
                    f"{ratios[0]:.2f} | {statistics.median(ratios):.2f} | {ratios[-1]:.2f} |")
            assert line in block, (line, block)
        assert f"#### C optimized vs SDPA CUDNN: backward TFLOPS ratio over N ({dtype};" in block
    assert "| 128 | yes | " in block and "N = 16384" in block
    assert "2.5×" in block  # the FLOP convention is stated where TFLOPS appear
    # forward tables are not touched by the backward rows
    plain = build_results(tmp_path / "plain", rows=build_rows())
    assert report.render_ratio_block(d, tmp_path) == report.render_ratio_block(plain, tmp_path).replace("plain", "r")


def test_backward_block_prices_the_deterministic_variant_from_runs_that_timed_both(tmp_path):
    """The deterministic backward's extra time per cell, paired within one run: a later run of the
    default alone (at another speed) does not pair with the older deterministic row."""
    bwd = build_backward_rows(dtypes=("bf16",))
    run = bwd[0]["run_id"]
    det = [dict(r, variant="deterministic", ms_median=r["ms_median"] * (1.10 if r["D"] == 64 else 1.04))
           for r in bwd if r["impl"] == "c"]
    later = [dict(r, run_id=run.replace("T", "T2"), ms_median=r["ms_median"] / 2) for r in bwd if r["impl"] == "c"]
    assert all(r["run_id"] > run for r in later)
    d = build_results(tmp_path / "r", rows=build_rows() + bwd + det + later)
    block = report.render_backward_block(d, tmp_path / "r")
    assert "**Deterministic**" in block and "+4% to +10% (median" in block
    assert "| 64 | yes | " + " | ".join(["+10%"] * len({r["N"] for r in det})) + " |" in block
    plain = build_results(tmp_path / "plain", rows=build_rows() + bwd)
    assert "**Deterministic**" not in report.render_backward_block(plain, tmp_path / "plain")
    assert report.deterministic_costs([dict(det[0], run_id="x"), dict(det[0], variant="")]) == {}


def test_latency_block_takes_the_latest_run(tmp_path):
    write_latency(tmp_path, {"triton_empty_kernel": 9.0, "c": 900.0}, run_id="2026-12-01T00:00:00Z")
    write_latency(tmp_path)
    block = report.render_latency_block(tmp_path, tmp_path)
    assert "| empty Triton kernel (the floor) | 5.0 | 1.0× | ok |" in block
    assert "| C optimized | 40.0 | 8.0× | ok |" in block
    assert "900" not in block and "B = 1, H = 8, N = 128, D = 64, fp16, 1000 calls" in block
    rows = views.load_latency(tmp_path)
    assert {r["run_id"] for r in rows} == {"2026-12-02T03:00:00Z"}
    write_latency(tmp_path, run_id="2026-12-03T00:00:00Z", device="interpreter")
    assert "not GPU host times" in report.render_latency_block(tmp_path, tmp_path)


def test_latency_block_puts_each_pass_in_columns_of_its_own(tmp_path):
    from harness.latency import write_rows

    write_latency(tmp_path)  # a forward-only run first: the block shows the latest run alone
    run = "2026-12-04T00:00:00Z"
    base = {"run_id": run, "B": 1, "H": 8, "N": 128, "D": 64, "dtype": "fp16", "causal": 0, "device": "gpu",
            "calls": 1000}
    rows = [dict(base, impl="triton_empty_kernel", kind="floor", us_per_call=10.0, x_floor=1.0, status="ok")]
    for impl, fwd, bwd in (("c", 40.0, 130.0), ("sdpa_cudnn", 50.0, 70.0)):
        for pass_, us in (("fwd", fwd), ("bwd", bwd)):
            rows.append(dict(base, impl=impl, kind="stage" if impl == "c" else "peer", **{"pass": pass_},
                             us_per_call=us, x_floor=us / 10, status="ok"))
    rows.append(dict(base, impl="b_cuda", kind="stage", **{"pass": "fwd"}, us_per_call=60.0, x_floor=6.0,
                     status="ok"))
    rows.append(dict(base, impl="b_cuda", kind="stage", **{"pass": "bwd"}, status="unsupported: no backward"))
    write_rows(tmp_path, rows)
    block = report.render_latency_block(tmp_path, tmp_path)
    assert "| impl | forward, µs per call | × floor | backward, µs per call | × floor | status |" in block
    assert "| empty Triton kernel (the floor) | 10.0 | 1.0× | 10.0 | 1.0× | ok |" in block
    assert "| C optimized | 40.0 | 4.0× | 130.0 | 13.0× | ok |" in block
    assert "| SDPA CUDNN | 50.0 | 5.0× | 70.0 | 7.0× | ok |" in block
    assert "| 60.0 | 6.0× | — | — | forward: ok; backward: unsupported: no backward |" in block
    assert "Backward: `torch.autograd.grad`" not in block and "backward: `torch.autograd.grad`" in block
    assert "forward + backward" not in block  # only the passes the run timed are explained


def test_latency_file_from_before_the_pass_column_gets_it(tmp_path):
    """An older latency.csv (no ``pass`` column: every run timed the forward) loads as forward rows, and
    appending a new run rewrites it with the column, its old rows ``fwd``, nothing lost."""
    from harness.latency import LATENCY_COLUMNS, write_rows

    old_columns = [c for c in LATENCY_COLUMNS if c != "pass"]
    path = tmp_path / "latency.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=old_columns)
        w.writeheader()
        for impl, us in (("triton_empty_kernel", 14.0), ("c", 46.0)):
            w.writerow({"run_id": "2026-12-01T00:00:00Z", "impl": impl, "kind": "stage", "B": 1, "H": 8, "N": 128,
                        "D": 64, "dtype": "fp16", "causal": 0, "device": "gpu", "calls": 1000, "us_per_call": us,
                        "x_floor": us / 14.0, "status": "ok"})
    assert {r["pass"] for r in views.load_latency(tmp_path)} == {"fwd"}
    assert "| C optimized | 46.0 | 3.3× | ok |" in report.render_latency_block(tmp_path, tmp_path)
    write_latency(tmp_path)
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == LATENCY_COLUMNS
        rows = list(reader)
    assert [(r["run_id"][:10], r["impl"], r["pass"]) for r in rows[:2]] == [
        ("2026-12-01", "triton_empty_kernel", "fwd"), ("2026-12-01", "c", "fwd")]
    assert len(rows) == 2 + len(LATENCY_US)
    with pytest.raises(report.ResultsError, match="latency.csv: its columns"):
        path.write_text("run_id,impl,speed\nx,c,1\n")
        write_rows(tmp_path, [{"run_id": "y", "impl": "c"}])


def test_latency_file_with_a_bad_number_names_the_file(tmp_path):
    path = write_latency(tmp_path)
    text = path.read_text().replace("40", "fast", 1)
    path.write_text(text)
    with pytest.raises(report.ResultsError, match=r"latency.csv:\d+: a number does not parse"):
        report.render_latency_block(tmp_path)


@pytest.mark.parametrize("name, hint", [("models", "sweep --suite models"), ("backward", "sweep --pass bwd"),
                                        ("latency", "latency")])
def test_new_blocks_say_which_command_produces_their_data(tmp_path, name, hint):
    empty = tmp_path / "empty"
    empty.mkdir()
    forward_only = build_results(tmp_path / "fwd")  # a runs.csv without backward rows
    for d in (empty, forward_only):
        block = report.BLOCKS[name](d, tmp_path)
        assert f"python -m harness {hint}" in block and "|" not in block, block


SHAPE_RUNS = ("2026-12-03T01:00:00Z", "2026-12-03T02:00:00Z", "2026-12-03T03:00:00Z")
#: (B, Hq, Hkv, Nq, Nk, D, causal, dtype) of a GQA prefill, a padded head dim and a decode cell
GQA_PREFILL = (1, 32, 8, 4096, 4096, 128, 1, "bf16")
HEAD_DIM_80 = (8, 32, 32, 2048, 2048, 80, 0, "fp16")
DECODE = (16, 32, 8, 1, 32768, 128, 0, "bf16")
NO_C = (2, 4, 4, 1, 512, 64, 0, "fp16")


def _shape_row(shape, impl: str, ms: float | None, run_id: str, pass_: str = "fwd") -> dict:
    B, H, Hkv, N, Nk, D, causal, dtype = shape
    row = {"run_id": run_id, "impl": impl, "kind": "stage" if impl in ("b", "c") else "peer", "B": B, "H": H,
           "Hkv": Hkv, "N": N, "Nk": Nk, "D": D, "dtype": dtype, "causal": causal, "pass": pass_, "device": "gpu"}
    if ms is None:
        return row | {"status": "unsupported: needs Hkv = H"}
    return row | {"status": "ok", "ms_median": ms, "ms_p20": ms, "ms_p80": ms}


def _shape_rows() -> list[dict]:
    """Three runs. Run 1: every cell, decode with C slow. Run 2: decode again, C and cuDNN only, C now
    fast. Run 3: SDPA alone at the GQA cell (10x faster) and a backward of the decode cell: neither
    may change a line, because each line comes from the latest run that timed stage C's forward."""
    first, second, third = SHAPE_RUNS
    rows = [_shape_row(GQA_PREFILL, impl, ms, first) for impl, ms in
            (("c", 0.50), ("sdpa_flash", 0.60), ("sdpa_cudnn", 0.55), ("sdpa_efficient", None))]
    rows += [_shape_row(HEAD_DIM_80, impl, ms, first) for impl, ms in (("c", 1.20), ("sdpa_cudnn", 0.90))]
    rows += [_shape_row(DECODE, impl, ms, first) for impl, ms in (("c", 4.0), ("sdpa_flash", 0.8), ("sdpa_cudnn", 1.0))]
    rows += [_shape_row(NO_C, "sdpa_cudnn", 0.01, first)]
    rows += [_shape_row(DECODE, impl, ms, second) for impl, ms in (("c", 0.50), ("sdpa_cudnn", 0.55))]
    rows += [_shape_row(GQA_PREFILL, "sdpa_cudnn", 0.055, third), _shape_row(DECODE, "c", 9.0, third, "bwd")]
    return rows


def _write_shapes(results_dir: Path, rows, env: dict | None = None) -> Path:
    from harness.results import RowWriter, write_env

    with RowWriter(results_dir / views.SHAPES_DIR) as w:
        for row in rows:
            w.write(row)
    if env is not None:
        write_env(results_dir, {"run_id": SHAPE_RUNS[0], **env})
    return results_dir


def _table_lines(block: str) -> list[list[str]]:
    return [ln.strip("| ").split(" | ") for ln in block.splitlines() if ln.startswith("| ") and " · " in ln]


def test_shapes_block_one_line_per_shape_with_decode_bandwidth(tmp_path):
    from stages.contract import Problem

    copy_gbps = 4000.0
    d = _write_shapes(tmp_path / "r", _shape_rows(), env={"ceilings": {"copy_gbps": copy_gbps}})
    block = report.render_shapes_block(d, tmp_path)
    lines = _table_lines(block)
    assert [ln[0] for ln in lines] == ["GQA prefill", "head dim 80 (not a power of two)", "decode"]  # NO_C: no line
    gqa, d80, decode = lines
    assert gqa[1] == "B 1 · H 32/8 · N 4096 · D 128 · causal · bf16"
    assert gqa[2:6] == ["0.5", "SDPA CUDNN", "0.55", f"{0.55 / 0.50:.2f}"]  # not run 3's SDPA-only 0.055
    assert gqa[6:] == ["—", "—", "—"]  # bandwidth only for decode
    assert d80[5] == f"{0.90 / 1.20:.2f}"
    # decode from run 2 (the latest forward of C), its best SDPA the fastest of that run
    moved = Problem(16, 32, 1, 128, "bf16", False, Hkv=8, Nk=32768).qkvo_bytes
    gbps = moved / 0.50e-3 / 1e9
    assert decode[2:] == ["0.5", "SDPA CUDNN", "0.55", f"{0.55 / 0.50:.2f}", views.fmt_bytes(moved),
                          f"{gbps:,.0f}", f"{gbps / copy_gbps:.0%}"]
    assert f"{copy_gbps:,.0f} GB/s (`copy_gbps` in r/env.json" in block
    assert "at or above the fastest SDPA backend in 2 of 3 cells (lowest 0.75" in block
    assert f"at {gbps / copy_gbps:.0%} to {gbps / copy_gbps:.0%} of the copy bandwidth" in block


def test_shapes_block_copy_bandwidth_sources(tmp_path):
    """shapes/env.json's own ceilings come first; without any, the block says how to measure them."""
    d = _write_shapes(tmp_path / "r", _shape_rows(), env={"ceilings": {"copy_gbps": 4000.0}})
    from harness.results import write_env

    write_env(d / views.SHAPES_DIR, {"run_id": SHAPE_RUNS[1], "ceilings": {"copy_gbps": 2000.0}})
    assert "2,000 GB/s (`copy_gbps` in r/shapes/env.json" in report.render_shapes_block(d, tmp_path)
    bare = _write_shapes(tmp_path / "bare", _shape_rows())
    block = report.render_shapes_block(bare, tmp_path)
    assert f"not measured yet: `{views.HINTS['ceilings']}`" in block
    assert _table_lines(block)[-1][-1] == "—" and _table_lines(block)[-1][-2] != "—"  # GB/s still shown


def test_shapes_block_without_data_names_the_command(tmp_path):
    forward_only = build_results(tmp_path / "fwd")  # a results folder without shapes/
    only_peers = _write_shapes(tmp_path / "peers", [r for r in _shape_rows() if r["impl"] != "c"])
    for d in (tmp_path, forward_only, only_peers):
        block = report.render_shapes_block(d, tmp_path)
        assert f"run `{views.HINTS['shapes']}` on a GPU" in block and "|" not in block, block
    assert views.HINTS["shapes"] == "results/publish.sh shapes"
    assert Path(report.__file__).parents[1].joinpath("results", "publish.sh").exists()


def test_report_check_notices_a_stale_new_block(tmp_path, capsys):
    d = build_results(tmp_path / "results" / "gpu", rows=build_rows() + build_backward_rows(dtypes=("fp16",)))
    build_suite(d)
    write_latency(d)
    readme = _readme_with_markers(tmp_path / "README.md")
    assert _cli(["report", str(d), "--readme", str(readme), "--check"]) == 1
    assert _cli(["report", str(d), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and "| gpt2 |" in text and "backward TFLOPS ratio" in text and "the floor" in text
    assert _cli(["report", str(d), "--readme", str(readme), "--check"]) == 0
    capsys.readouterr()
    write_latency(d, {"triton_empty_kernel": 5.0, "c": 30.0}, run_id="2026-12-04T00:00:00Z")  # a new run
    assert _cli(["report", str(d), "--readme", str(readme), "--check"]) == 1
    assert "stale" in capsys.readouterr().err


# ------------------------------------------------------------------ 3. the new figures

@pytest.fixture
def everything(tmp_path) -> Path:
    from .test_head_dims import sweep_rows

    d = build_results(tmp_path / "r", rows=build_rows() + build_backward_rows(dtypes=("fp16",)) + build_foreign_rows()
                      + sweep_rows())
    return build_suite(d)


def test_new_figures_are_drawn_without_mathtext(everything, monkeypatch):
    """Every figure, the new ones included, and none of them through mathtext (which loads the STIX
    and Computer Modern fonts and printed findfont warnings where they were missing)."""
    def no_mathtext(self, s, *args, **kwargs):
        raise AssertionError(f"mathtext used for {s!r}")

    monkeypatch.setattr(matplotlib.mathtext.MathTextParser, "parse", no_mathtext)
    paths = plots.plot_all(everything)
    assert [p.name for p in paths] == list(plots.FIGURE_NAMES)
    for p in paths:
        assert p.read_bytes().startswith(b"\x89PNG") and p.stat().st_size > 10_000, p
    # an axis spanning less than a decade: the default would label its minor ticks in mathtext
    rows, env = views.load(everything)
    narrow = [dict(r, energy_j_per_call=0.2 + 0.01 * i) for i, r in enumerate(rows) if r.get("energy_j_per_call")]
    assert plots.plot_energy(narrow, env, everything / "narrow") is not None


def test_backward_waterfall_has_a_b_c_and_the_backward_ablation_step(everything):
    rows, env = views.load(everything, forward_only=False)
    bwd = views.grid_rows(rows, "bwd")
    steps = plots.waterfall_steps(bwd, plots.resolve_cell(bwd, {}))
    assert [s[0] for s in steps] == ["A naive", "B tiled", "+ bwd only switch", "C optimized"]
    assert all(r["pass"] == "bwd" for _, _, r in steps)


def test_new_figures_skip_with_a_hint_without_their_data(tmp_path, capsys):
    rows, env = views.load(build_results(tmp_path / "r"), forward_only=False)  # forward rows only
    assert plots.plot_backward_throughput(rows, env, tmp_path) is None
    assert plots.plot_backward_waterfall(rows, env, tmp_path) is None
    assert plots.plot_models([], env, tmp_path) is None
    out = capsys.readouterr().out
    assert "skipped backward_throughput.png" in out and "`python -m harness sweep --pass bwd`" in out
    assert "skipped backward_waterfall.png" in out
    assert "skipped models.png" in out and "`python -m harness sweep --suite models`" in out
    assert not list(tmp_path.glob("*.png"))
    # backward rows without stage A: no waterfall (it needs A, B and C)
    no_a = [r for r in build_backward_rows(dtypes=("fp16",), Ns=(4096,)) if r["impl"] != "a"]
    assert plots.plot_backward_waterfall(no_a, env, tmp_path) is None
    assert "no backward row of A" in capsys.readouterr().out


def test_table_footer_states_the_flop_convention():
    from harness import table

    assert "visible" in table.FOOTER and "2.5×" in table.FOOTER and "3.5×" in table.FOOTER
    assert "N²" not in table.FOOTER
    rows = [dict(r, ms_gpu=r.get("ms_median")) for r in build_rows()[:3]]
    headers = [c.header for c in table.compare_table(rows).columns]
    assert any("GPU" in h for h in headers)
    assert not any("GPU" in h for h in (c.header for c in table.compare_table(build_rows()[:3]).columns))


def test_views_flops_counts_visible_pairs_and_passes():
    row = {"B": 2, "H": 4, "N": 8, "Nk": 8, "D": 16, "causal": 1, "pass": "fwd"}
    assert views.flops(row) == 4.0 * 2 * 4 * (8 * 9 // 2) * 16
    assert views.flops(dict(row, causal=0)) == 4.0 * 2 * 4 * 64 * 16
    assert views.flops(dict(row, **{"pass": "bwd"})) == 2.5 * views.flops(row)
    assert views.flops(dict(row, **{"pass": "fwd_bwd"})) == 3.5 * views.flops(row)
    # Nq = 1 against 8 keys, causal bottom-right: the one query sees every key
    assert views.flops(dict(row, N=1)) == 4.0 * 2 * 4 * 8 * 16
