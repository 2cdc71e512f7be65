"""``python -m harness generate`` (harness/generate.py): small transformers models decoding and training
with each attention. On a CPU, in the Triton interpreter, with the tiny default sizes and one timed
call per impl; the report block from a small fixture CSV.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is the optional [hf] extra")

from harness import generate as G  # noqa: E402
from harness import report  # noqa: E402

from .helpers import fake_stage, run_cli  # noqa: E402

#: the interpreter's sizes, fp32, one timed call and no warm-up: the same small run on a GPU as on a CPU
FAST = ["--tiny", "--dtype", "fp32", "--reps", "1", "--warmup", "0"]
DEVICE = "gpu" if torch.cuda.is_available() else "interpreter"


def read_rows(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_cli_writes_rows_with_the_columns_and_status_ok(tmp_path, capsys):
    code, out, err = run_cli(["generate", "--model", "gpt2,llama", "--impls", "c,sdpa", *FAST,
                              "--out", str(tmp_path)], capsys)
    assert code == 0, err
    header, rows = read_rows(tmp_path / "runs.csv")
    assert tuple(header) == G.COLUMNS
    assert [(r["model"], r["pass"], r["impl"]) for r in rows] == [
        (m, p, i) for m in ("gpt2", "llama") for p in ("decode", "train") for i in ("c", "sdpa")]
    assert all(r["status"] == "ok" and r["device"] == DEVICE and r["dtype"] == "fp32" for r in rows)
    for r in rows:
        assert float(r["ms_median"]) > 0 and float(r["tokens_per_s"]) > 0
        if r["pass"] == "decode":
            assert float(r["ttft_ms"]) > 0 and r["decode_step_ms"] and r["seq_len"] == ""
            # fp32 on a tiny model: stage C and SDPA pick the same greedy tokens
            assert float(r["same_tokens_frac"]) == 1.0
        else:
            assert r["seq_len"] == str(G.TINY_SIZES.train_seq) and r["ttft_ms"] == ""
    llama = next(r for r in rows if r["model"] == "llama")
    assert (llama["heads"], llama["kv_heads"], llama["head_dim"]) == ("4", "2", "16")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["transformers"] and env["command"] and env["git_commit"]  # provenance beside the rows
    assert ("interpreter times" in out) == (DEVICE == "interpreter")


def test_cli_decodes_with_each_cache_asked_for(tmp_path, capsys):
    """``--cache dynamic,static``: a decode pass per cache, each in turns of its own, its rows saying
    which; with the static cache stage C reads the filled length as a key range and picks SDPA's tokens."""
    code, out, err = run_cli(["generate", "--model", "llama", "--pass", "decode", "--cache", "dynamic,static",
                              "--impls", "c,sdpa", *FAST, "--out", str(tmp_path)], capsys)
    assert code == 0, err
    _, rows = read_rows(tmp_path / "runs.csv")
    assert [(r["cache"], r["impl"]) for r in rows] == [("dynamic", "c"), ("dynamic", "sdpa"), ("static", "c"),
                                                      ("static", "sdpa")]
    assert all(r["status"] == "ok" and float(r["same_tokens_frac"]) == 1.0 for r in rows)
    assert "decode static" in out


def test_a_runs_csv_from_before_the_cache_column_gains_it(tmp_path):
    """Rows written before ``cache`` existed were all measured with the dynamic cache: appending to
    such a file rewrites it with the column (decode rows "dynamic", training rows empty), losing nothing."""
    old_columns = [c for c in G.COLUMNS if c != "cache"]
    folder = tmp_path / "generate"
    folder.mkdir()
    with open(folder / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_columns)
        writer.writeheader()
        for row in (decode("c", 700.0), train("c", 60.0)):
            writer.writerow({c: row.get(c, "") for c in old_columns})
    assert [r["cache"] for r in G.load_rows(folder / "runs.csv")] == ["dynamic", None]  # read as dynamic
    G.append_rows(folder, [decode("c", 900.0, cache="static", run_id="2026-12-02T00:00:00.000000Z")])
    header, rows = read_rows(folder / "runs.csv")
    assert tuple(header) == G.COLUMNS
    assert [(r["pass"], r["cache"]) for r in rows] == [("decode", "dynamic"), ("train", ""), ("decode", "static")]
    assert [float(r["tokens_per_s"]) for r in rows] == [700.0, train("c", 60.0)["tokens_per_s"], 900.0]
    block = report.render_generate_block(tmp_path, tmp_path)
    assert "decode (dynamic cache)" in block and "decode (static cache, its decode step compiled" in block


def test_an_impl_that_fails_is_recorded_and_the_run_goes_on(tmp_path, capsys, fake_stages):
    def broken(q, k, v, *, causal=False, sm_scale=None):
        raise RuntimeError("kernel fault in the fake stage")

    fake_stages(fake_stage("boom", attention=broken))
    code, _, err = run_cli(["generate", "--model", "llama", "--pass", "decode", "--impls", "boom,sdpa", *FAST,
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    _, rows = read_rows(tmp_path / "runs.csv")
    status = {r["impl"]: r["status"] for r in rows}
    assert status == {"boom": "error: RuntimeError: kernel fault in the fake stage", "sdpa": "ok"}


@pytest.mark.parametrize("argv, flag, allowed", [
    (["--model", "gpt3"], "--model", "gpt2, llama"),
    (["--impls", "c,zz"], "--impls", "unknown impl 'zz'"),
    (["--pass", "decode,prefill"], "--pass", "decode, train"),
    (["--cache", "paged"], "--cache", "dynamic, static"),
    (["--dtype", "fp8"], "--dtype", "fp16"),
    (["--head-dim", "12"], "--head-dim", "multiple of 8"),
    (["--model", "llama", "--heads", "6", "--kv-heads", "4"], "--kv-heads", "multiple"),
    (["--new-tokens", "0"], "--new-tokens", "positive integer"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, flag, allowed, capsys):
    code, _, err = run_cli(["generate", *argv], capsys)
    assert code == 2
    message = err.strip().splitlines()[-1]
    assert flag in message and allowed in message, message
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------- report

def fixture_row(**fields) -> dict:
    row = dict(run_id="2026-12-01T10:00:00.000000Z", model="llama", device="gpu", dtype="bf16", layers=6, heads=16,
               kv_heads=4, head_dim=128, hidden=2048, vocab=32000, reps=5, status="ok")
    return {**row, **fields}


def decode(impl, tokens_per_s, **fields):
    ms = 4 * 64 / tokens_per_s * 1e3
    return fixture_row(impl=impl, **{"pass": "decode"}, batch=4, prompt_len=128, new_tokens=64, ms_median=ms,
                       ms_min=ms, ms_max=ms, tokens_per_s=tokens_per_s, ttft_ms=20.0, decode_step_ms=5.0,
                       peak_mem_bytes=2_000_000_000, same_tokens_frac=0.75, **fields)


def train(impl, step_ms, **fields):
    return fixture_row(impl=impl, **{"pass": "train"}, batch=8, seq_len=2048, ms_median=step_ms, ms_min=step_ms,
                       ms_max=step_ms, tokens_per_s=8 * 2048 / step_ms * 1e3, peak_mem_bytes=30_000_000_000,
                       **fields)


@pytest.fixture
def results_dir(tmp_path):
    later = "2026-12-01T11:00:00.000000Z"
    rows = [decode("c", 500.0), train("c", 400.0),  # an older run of c: the later one replaces it
            decode("c", 2000.0, run_id=later), decode("sdpa", 1000.0, run_id=later),
            train("c", 50.0, run_id=later), train("sdpa", 100.0, run_id=later),
            fixture_row(impl="a", run_id=later, status="oom", **{"pass": "train"}, batch=8, seq_len=2048)]
    G.append_rows(tmp_path / "generate", rows)
    return tmp_path


def test_report_block_renders_the_latest_run_against_sdpa(results_dir):
    block = report.render_generate_block(results_dir, results_dir)
    assert block.startswith("<!-- generated by `python -m harness report . --readme <this file>` from "
                            "./generate/runs.csv")
    assert "Llama shape (6 layers, 16 query heads sharing 4 K/V heads, head dim 128, hidden 2048), decode (dynamic cache): " \
           "batch 4, prompt 128 tokens, 64 new tokens, bf16" in block
    assert "| C optimized | 2,000 | 2.00× | 2.00× | 20 | 5 | 75% | 2 GB | ok |" in block
    assert "| transformers SDPA | 1,000 | 1.00× | 1.00× |" in block
    assert "training step: batch 8 × 2048 tokens, bf16, AdamW" in block
    assert "| C optimized | 50 | 2.00× | 327,680 | 30 GB | ok |" in block
    assert "| A naive | — | — | — | — | oom |" in block
    assert "500" not in block.split("####", 1)[1].split("\n\n", 2)[1]  # the older run's decode row is gone
    assert "not GPU times" not in block


def test_times_against_sdpa_compare_rows_of_one_run(tmp_path):
    """An impl whose latest run is older than SDPA's is set against SDPA's row of its own run (the impls
    of a run take turns), not against a later run's; without an SDPA row in its run, no ratio."""
    first, second = "2026-12-01T10:00:00.000000Z", "2026-12-01T11:00:00.000000Z"
    G.append_rows(tmp_path / "generate", [decode("b", 300.0, run_id=first), decode("sdpa", 600.0, run_id=first),
                                          decode("a", 100.0, run_id="2026-12-01T09:00:00.000000Z"),
                                          decode("c", 900.0, run_id=second), decode("sdpa", 1000.0, run_id=second)])
    block = report.render_generate_block(tmp_path, tmp_path)
    assert "| B tiled | 300 | 0.50× | 0.50× |" in block      # 300 / its own run's 600, not / 1,000
    assert "| C optimized | 900 | 0.90× |" in block
    assert "| A naive | 100 | — | — |" in block         # its run timed no SDPA


def test_the_fastest_calls_are_compared_apart_from_the_median(tmp_path):
    """× SDPA by the fastest calls reads each impl's fastest generate() call (ms_min), not its median:
    a run whose host stalled during stage C's median calls but not its fastest shows both."""
    run = "2026-12-01T11:00:00.000000Z"
    c = decode("c", 900.0, run_id=run)
    c["ms_min"] = 200.0
    sdpa = decode("sdpa", 1000.0, run_id=run)
    sdpa["ms_min"] = 190.0
    G.append_rows(tmp_path / "generate", [c, sdpa])
    block = report.render_generate_block(tmp_path, tmp_path)
    assert "| C optimized | 900 | 0.90× | 0.95× |" in block  # 190 / 200 ms
    assert "fastest `generate()` call" in block


def test_report_fills_the_readme_block_only_when_the_generate_csv_exists(results_dir, tmp_path_factory):
    begin, end = report.markers("generate")
    readme = tmp_path_factory.mktemp("readme") / "README.md"
    placeholder = f"# x\n\n{begin}\nnothing measured yet\n{end}\n"
    readme.write_text(placeholder)
    empty = tmp_path_factory.mktemp("no_generate_rows")
    assert report.update_readme(readme, empty) is False and readme.read_text() == placeholder
    assert report.update_readme(readme, results_dir) is True
    text = readme.read_text()
    assert "| C optimized | 2,000 | 2.00× |" in text and text.startswith("# x\n\n" + begin)
    assert report.check_readme(readme, results_dir) == ""
