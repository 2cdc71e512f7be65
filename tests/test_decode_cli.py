"""``python -m harness decode`` (harness/decode_loop.py): a decode step's attention with a growing KV cache
against a fixed one. On a CPU the stages run in the interpreter at a tiny shape; the README block
renders from a small fixture CSV."""

from __future__ import annotations

import csv

from harness import decode_loop as DL

from .helpers import run_cli


def test_cli_writes_a_growing_and_a_fixed_row_per_impl(tmp_path, capsys):
    code, out, err = run_cli(["decode", "--shape", "llama", "--stages", "c", "--peers", "math", "--calls", "3",
                              "--reps", "2", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    with open(tmp_path / DL.DECODE_CSV, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert tuple(reader.fieldnames) == DL.COLUMNS
    assert [(r["impl"], r["cache"]) for r in rows] == [("c", "fixed"), ("c", "growing"), ("sdpa_math", "fixed"),
                                                      ("sdpa_math", "growing")]
    assert all(r["status"] == "ok" and float(r["us_per_call"]) > 0 and r["reps"] == "2" for r in rows)
    growing = rows[1]
    assert int(growing["Nk_last"]) == int(growing["Nk_first"]) + 2  # one key more per call
    assert rows[0]["Nk_first"] == rows[0]["Nk_last"]                 # the fixed cache
    assert float(growing["x_fixed"]) > 0
    assert (tmp_path / "env.json").exists()


def test_bad_flags_name_themselves(capsys):
    code, _, err = run_cli(["decode", "--shape", "bert"], capsys)
    assert code == 2 and "--shape" in err and "gpt2" in err
    code, _, err = run_cli(["decode", "--Hq", "6", "--Hkv", "4"], capsys)
    assert code == 2 and "--Hkv" in err


def test_block_renders_the_latest_run(tmp_path):
    path = tmp_path / DL.DECODE_CSV
    base = dict(shape="gpt2", kind="stage", B=4, Hq=12, Hkv=12, D=64, dtype="bf16", device="gpu", calls=400, reps=5,
                status="ok")
    rows = [dict(base, run_id="old", impl="c", cache="fixed", Nk_first=510, Nk_last=510, us_per_call=999.0),
            dict(base, run_id="new", impl="c", cache="fixed", Nk_first=510, Nk_last=510, us_per_call=80.0),
            dict(base, run_id="new", impl="c", cache="growing", Nk_first=310, Nk_last=709, us_per_call=88.0,
                 us_gpu=10.0),
            dict(base, run_id="new", impl="sdpa_flash", kind="peer", cache="fixed", Nk_first=510, Nk_last=510,
                 us_per_call=70.0),
            dict(base, run_id="new", impl="sdpa_flash", kind="peer", cache="growing", Nk_first=310, Nk_last=709,
                 us_per_call=110.0),
            dict(base, run_id="new", impl="c_cuda", cache="fixed", Nk_first=510, Nk_last=510,
                 status="unsupported: c_cuda needs Nq == Nk"),
            dict(base, run_id="new", impl="c_cuda", cache="growing", Nk_first=310, Nk_last=709,
                 status="unsupported: c_cuda needs Nq == Nk")]
    DL.write_rows(tmp_path, rows)
    block = DL.render_block(path)
    assert "`new`" in block and "999" not in block and "Nk 310 → 709" in block
    assert "| gpt2 | c | 88.0 | 80.0 | 1.10 | 10.0 | 0.80 |" in block
    assert "c_cuda (gpt2)" in block and "| gpt2 | c_cuda" not in block


def test_a_file_without_the_columns_is_named(tmp_path):
    from harness.results import ResultsError
    import pytest

    path = tmp_path / DL.DECODE_CSV
    path.write_text("run_id,shape,impl\nx,gpt2,c\n")
    with pytest.raises(ResultsError, match="decode.csv: missing columns"):
        DL.render_block(path)
    good = ",".join(DL.COLUMNS)
    path.write_text(good + "\n" + ",".join("fast" if c == "us_per_call" else "x" if c in ("run_id", "shape", "impl",
                                            "cache", "status") else "" for c in DL.COLUMNS) + "\n")
    with pytest.raises(ResultsError, match=r"decode.csv:2: column 'us_per_call' should be a number, got 'fast'"):
        DL.render_block(path)
