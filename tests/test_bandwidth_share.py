"""``bandwidth_share.png``: time beside the DRAM bandwidth achieved (Nsight Compute's bytes over the
median time) as a share of the measured copy bandwidth, from synthetic results (CPU, no stages run),
and from the committed H200 results, whose numbers the stage B lesson quotes."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import plots, views

try:
    from fixtures_results import build_foreign_rows, build_results, build_rows
except ImportError:  # tests/ imported as a package
    from tests.fixtures_results import build_foreign_rows, build_results, build_rows

ROOT = Path(__file__).resolve().parents[1]
NAME = "bandwidth_share.png"
HEADLINE = {"N": 4096, "D": 64, "dtype": "fp16", "causal": 0}


def test_shares_are_measured_bytes_over_time_over_the_copy_bandwidth(tmp_path):
    rows, env = views.load(build_results(tmp_path / "r"))
    bars = plots.bandwidth_shares(rows, env, plots.resolve_cell(rows, {}))
    assert [b["impl"] for b in bars] == ["a", "b", "c", "sdpa_cudnn"]
    copy = env["ceilings"]["copy_gbps"]
    for b in bars:
        r = b["row"]
        assert (r["N"], r["D"], r["dtype"], r["causal"]) == (4096, 64, "fp16", 0)
        assert r["kind"] == ("peer" if b["impl"] == "sdpa_cudnn" else "stage")
        measured = r["dram_read_measured"] + r["dram_write_measured"]
        assert b["measured"] == measured and b["ms"] == r["ms_median"]
        assert b["gbps"] == pytest.approx(measured / (r["ms_median"] * 1e-3) / 1e9)
        assert b["share"] == pytest.approx(b["gbps"] / copy)
    # the traffic model's rate is given beside it (stages only: the fixture's peers have no model)
    assert all(b["model_share"] is not None for b in bars[:3]) and bars[3]["model_share"] is None


def test_plot_writes_the_figure_and_plot_all_lists_it(tmp_path):
    d = build_results(tmp_path / "r")
    rows, env = views.load(d)
    path = plots.plot_bandwidth_share(rows, env, tmp_path / "figs")
    assert path == tmp_path / "figs" / NAME
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    assert NAME in plots.FORWARD_FIGURES and NAME in plots.FIGURE_NAMES
    assert NAME in [p.name for p in plots.plot_all(d)]


def test_other_rows_at_the_cell_do_not_change_it(tmp_path):
    """Backward, GQA, Nq != Nk and suite rows of the same (N, D, dtype, causal) stay out."""
    plain = build_results(tmp_path / "plain")
    mixed = build_results(tmp_path / "mixed", rows=build_rows() + build_foreign_rows())
    rows_plain, env = views.load(plain)
    every_row, _ = views.load(mixed, forward_only=False)
    a = plots.plot_bandwidth_share(rows_plain, env, tmp_path / "fa")
    b = plots.plot_bandwidth_share(every_row, env, tmp_path / "fb")
    assert a.read_bytes() == b.read_bytes()


def test_without_measured_dram_bytes_it_skips_naming_the_profile_command(tmp_path, capsys):
    rows = build_rows()
    for r in rows:
        r.pop("dram_read_measured", None)
        r.pop("dram_write_measured", None)
    rows, env = views.load(build_results(tmp_path / "r", rows=rows))
    assert plots.plot_bandwidth_share(rows, env, tmp_path / "figs") is None
    out = capsys.readouterr().out
    assert f"skipped {NAME}" in out and "no DRAM bytes measured" in out and "`python -m harness profile`" in out
    assert not (tmp_path / "figs").exists()


def test_without_rows_at_the_cell_it_skips_naming_the_sweep(tmp_path, capsys):
    rows, env = views.load(build_results(tmp_path / "r"))
    assert plots.plot_bandwidth_share(rows, env, tmp_path / "figs", cell={"N": 3000}) is None
    out = capsys.readouterr().out
    assert f"skipped {NAME}" in out and "N=3000" in out and "`python -m harness sweep`" in out


def test_an_impl_without_measured_bytes_is_shown_as_not_measured(tmp_path):
    rows = build_rows()
    for r in rows:
        if r["impl"] == "b":
            r.pop("dram_read_measured", None)
            r.pop("dram_write_measured", None)
    rows, env = views.load(build_results(tmp_path / "r", rows=rows))
    bars = {b["impl"]: b for b in plots.bandwidth_shares(rows, env, plots.resolve_cell(rows, {}))}
    assert bars["b"]["gbps"] is None and bars["b"]["share"] is None and bars["b"]["model_share"] is not None
    assert bars["a"]["share"] is not None
    assert plots.plot_bandwidth_share(rows, env, tmp_path / "figs") is not None


def test_without_the_copy_ceiling_it_draws_gb_per_s(tmp_path):
    d = build_results(tmp_path / "r", ceilings=False)
    rows, env = views.load(d)
    bars = plots.bandwidth_shares(rows, env, plots.resolve_cell(rows, {}))
    assert bars and all(b["gbps"] and b["share"] is None for b in bars)
    assert plots.plot_bandwidth_share(rows, env, tmp_path / "figs") is not None
    (d / "env.json").unlink()  # no provenance at all: still drawn
    rows, env = views.load(d)
    assert plots.plot_bandwidth_share(rows, env, tmp_path / "figs2") is not None


def test_committed_h200_numbers_the_lessons_quote():
    """At the headline cell on the H200: A near the copy bandwidth (memory-bound), B and C a few
    percent of it, B moving about 261 MB in about 2 ms (stage B's README and notebook 04 say so)."""
    rows, env = views.load(ROOT / "results" / "h200")
    bars = {b["impl"]: b for b in plots.bandwidth_shares(rows, env, HEADLINE)}
    assert {"a", "b", "c"} <= set(bars)
    assert bars["a"]["share"] > 0.4
    assert bars["b"]["share"] < 0.1 and bars["c"]["share"] < 0.1
    assert 240e6 < bars["b"]["measured"] < 280e6 and 1.5 < bars["b"]["ms"] < 2.5
