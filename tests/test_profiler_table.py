"""The five-metric profiler table (harness.profiler_table), from synthetic ncu output.

No GPU and no ncu: the summary CSV is written the way ``harness profile --sections`` writes it
(ncu's CSV -> ``ncu.parse_ncu_csv`` -> ``ncu.section_summary`` -> ``cli._merge_section_summary``),
then read back into the table.
"""

from __future__ import annotations

import csv

import pytest

from stages.contract import Problem

from harness import cli, ncu, profiler_table as pt

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
          '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')

#: Stage A's three kernels of one call: (name, duration ns, DRAM %, SM %, occupancy %, conflicts ld, st,
#: L2 read sectors). Different durations, so a time-weighted mean differs from the plain one.
A_KERNELS = [("naive_scores_kernel", 3_000_000, 60.0, 40.0, 90.0, 5, 1, 2_000_000),
             ("naive_softmax_kernel", 1_000_000, 92.0, 10.0, 70.0, 0, 0, 8_000_000),
             ("naive_pv_kernel", 2_000_000, 70.0, 30.0, 80.0, 7, 2, 3_000_000)]
B_KERNELS = [("tiled_attention_kernel", 1_500_000, 5.0, 55.0, 25.0, 100, 20, 9_000_000)]
CELL = {"N": 4096, "D": 64, "dtype": "fp16", "causal": 0}
SHAPE = {"B": 4, "H": 32}


def _ncu_text(kernels) -> str:
    """ncu --csv output for ``kernels`` as the sections run prints it (numbers with thousands commas)."""
    lines = ['==PROF== Connected to process 1 (python3)', HEADER]
    for kid, (name, dur, dram, sm, occ, ld, st, sectors) in enumerate(kernels):
        for section, metric, value in (
                ("GPU Speed Of Light Throughput", "Duration", f"{dur:,}"),
                ("GPU Speed Of Light Throughput", "DRAM Throughput", str(dram)),
                ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", str(sm)),
                ("Occupancy", "Achieved Occupancy", str(occ)),
                ("Command line profiler metrics", pt.CONFLICTS_LD, f"{ld:,}"),
                ("Command line profiler metrics", pt.CONFLICTS_ST, f"{st:,}"),
                ("Command line profiler metrics", pt.LOAD_SECTORS, f"{sectors:,}")):
            lines.append(f'"{kid}","1","python3","h","{name}","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0",'
                         f'"{section}","{metric}","","{value}"')
    return "\n".join(lines) + "\n"


def _summary_rows(impl: str, kernels, cell=CELL, shape=SHAPE) -> list[dict]:
    """What cli._profile_sections hands to the merge for one impl and cell."""
    summary = ncu.section_summary(ncu.parse_ncu_csv(_ncu_text(kernels)))
    return [{"impl": impl, **cell, **shape, "file": f"{impl}.csv", **k} for k in summary]


@pytest.fixture
def profile_dir(tmp_path):
    path = tmp_path / pt.SUMMARY_CSV
    path.parent.mkdir(parents=True)
    other_cell = {**CELL, "N": 1024}
    cli._merge_section_summary(path, _summary_rows("a", A_KERNELS) + _summary_rows("b", B_KERNELS)
                               + _summary_rows("c", B_KERNELS, cell=other_cell))
    return tmp_path


def _weighted(kernels, index: int) -> float:
    return sum(k[index] * k[1] for k in kernels) / sum(k[1] for k in kernels)


def test_the_sections_run_collects_every_column_the_table_reads():
    cmd = ncu.ncu_command("/x/ncu", "a", "", Problem(1, 2, 64, 16, "fp16", False), sections=ncu.SECTIONS)
    requested = cmd[cmd.index("--metrics") + 1].split(",")
    for metric in (pt.CONFLICTS_LD, pt.CONFLICTS_ST, pt.LOAD_SECTORS):
        assert metric in requested and metric in ncu.SECTION_SUMMARY
    # The percentages come from the sections (SpeedOfLight, Occupancy), kept by the summary.
    assert {"SpeedOfLight", "Occupancy"} <= set(ncu.SECTIONS)
    assert {pt.DURATION, pt.DRAM_PCT, pt.COMPUTE_PCT, pt.OCCUPANCY_PCT} <= set(ncu.SECTION_SUMMARY)


def test_time_weighted_percentages_and_summed_counts(profile_dir):
    rows = pt.profiler_table(profile_dir, **CELL)
    assert [r["impl"] for r in rows] == ["a", "b"]  # c was profiled at another N only
    a, b = rows
    assert a["kernels"] == len(A_KERNELS) and (a["B"], a["H"]) == (SHAPE["B"], SHAPE["H"])
    assert a["duration_ms"] == pytest.approx(sum(k[1] for k in A_KERNELS) / 1e6)
    for key, index in (("dram_pct", 2), ("compute_pct", 3), ("occupancy_pct", 4)):
        assert a[key] == pytest.approx(_weighted(A_KERNELS, index))
        assert a[key] != pytest.approx(sum(k[index] for k in A_KERNELS) / len(A_KERNELS))  # not the plain mean
    assert a["bank_conflicts"] == sum(k[5] + k[6] for k in A_KERNELS)
    assert a["load_sectors"] == sum(k[7] for k in A_KERNELS)
    minimum = 3 * SHAPE["B"] * SHAPE["H"] * CELL["N"] * CELL["D"] * 2 / pt.SECTOR_BYTES
    assert a["load_sectors_x_min"] == pytest.approx(a["load_sectors"] / minimum)
    assert b["dram_pct"] == pytest.approx(B_KERNELS[0][2]) and b["label"] == "B tiled"


def test_metrics_not_collected_read_none(tmp_path):
    """A summary from before the counters were added has no bank-conflict or sector columns."""
    path = tmp_path / pt.SUMMARY_CSV
    path.parent.mkdir(parents=True)
    old = [{k: v for k, v in r.items() if k not in (pt.CONFLICTS_LD, pt.CONFLICTS_ST, pt.LOAD_SECTORS)}
           for r in _summary_rows("c", B_KERNELS)]
    cli._merge_section_summary(path, old)
    (row,) = pt.profiler_table(tmp_path, **CELL)
    assert row["bank_conflicts"] is None and row["load_sectors"] is None and row["load_sectors_x_min"] is None
    assert row["dram_pct"] == pytest.approx(B_KERNELS[0][2])
    assert "not collected" in pt.render_markdown([row], cell=CELL)


def test_markdown_names_columns_units_missing_impls_and_the_command(profile_dir):
    rows = pt.profiler_table(profile_dir, **CELL)
    text = pt.render_markdown(rows, cell=CELL)
    table_lines = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table_lines) == 2 + len(rows)  # heading, rule, one line per impl
    for _, heading in pt.COLUMNS:
        assert heading in table_lines[0]
    a_line = next(line for line in table_lines if line.startswith("| A naive"))
    assert f"{rows[0]['dram_pct']:.1f}" in a_line and f"{rows[0]['bank_conflicts']:,.0f}" in a_line
    missing = pt.missing_impls(rows)
    assert missing == [i for i in pt.EXPECTED_IMPLS if i not in ("a", "b")]
    assert "Not profiled at this cell yet: C optimized, B (CUDA C++)" in text
    assert pt.profile_command(CELL) in text and pt.READING_GUIDE in text


def test_no_rows_and_no_file(profile_dir, tmp_path, capsys):
    assert pt.profiler_table(profile_dir, **{**CELL, "causal": 1}) == []
    assert "No profiler data yet at this cell" in pt.render_markdown([], cell=CELL)
    with pytest.raises(pt.NoProfilerData, match="no profiler data yet.*harness profile --sections"):
        pt.profiler_table(tmp_path / "nowhere")
    assert pt.main([str(tmp_path / "nowhere")]) == 1
    assert "no profiler data yet" in capsys.readouterr().err
    # A cell with no rows lists the cells that have some.
    assert pt.main([str(profile_dir), "--N", str(CELL["N"]), "--causal", "1"]) == 1
    assert "--N 1024" in capsys.readouterr().out
    assert pt.main([str(profile_dir)]) == 0
    assert "| B tiled |" in capsys.readouterr().out


def test_the_profile_command_uses_flags_the_cli_has():
    """The printed command parses with harness profile's own parser, at the headline cell."""
    words = pt.profile_command().split()
    assert words[:4] == ["python", "-m", "harness", "profile"]
    args = cli.build_parser().parse_args(words[3:])
    assert args.sections and args.N == [CELL["N"]] and args.D == [CELL["D"]] and args.causal == "no"


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        pt.minimum_load_sectors(1, 1, 1, 8, "int8")
    path = tmp_path / pt.SUMMARY_CSV
    path.parent.mkdir(parents=True)
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([["impl", "kernel"], ["a", "k"]])
    with pytest.raises(ValueError, match="missing columns"):
        pt.profiler_table(tmp_path)


def test_table_for_reading_falls_back_to_the_fullest_cell(profile_dir, tmp_path):
    """What the notebooks show: the headline cell; else the profiled cell with the most impls; else
    a "no profiler data yet" line naming the command."""
    rows, cell, text = pt.table_for_reading(profile_dir)
    assert cell == pt.HEADLINE_CELL and [r["impl"] for r in rows] == ["a", "b"]
    only_other = tmp_path / "only_other"
    (only_other / pt.SUMMARY_CSV).parent.mkdir(parents=True)
    cli._merge_section_summary(only_other / pt.SUMMARY_CSV, _summary_rows("c", B_KERNELS, cell={**CELL, "N": 1024}))
    rows, cell, text = pt.table_for_reading(only_other, out="somewhere")
    assert cell["N"] == 1024 and [r["impl"] for r in rows] == ["c"]
    assert "No profiler data yet at this cell" in text and "Meanwhile" in text and "--out somewhere" in text
    rows, cell, text = pt.table_for_reading(tmp_path / "nowhere")
    assert rows == [] and text.startswith("no profiler data yet: run `python -m harness profile --sections")
