"""The harness: formulas, the results schema, fault handling, the CLI, and small end-to-end runs.

CPU tests run the real stages in the Triton interpreter on tiny problems; GPU tests (``-m gpu``)
run ``compare``, ``profile`` and ``device`` for real.
"""

from __future__ import annotations

import argparse
import csv

import json
from pathlib import Path

import pytest
import torch

import stages
from stages.contract import HbmTraffic, Problem, Stage

from harness import cli, impls, inputs, measure, ncu, peers, reference, results, table
from harness.inspect_code import (count_instructions, describe_layout, first_mma_loop, parse_ptxas, sass_loops,
                                  smem_layouts)

from .helpers import fake_attention, fake_stage, run_cli

HAS_CUDA = torch.cuda.is_available()
REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------- helpers

_fake_attention = fake_attention
_fake_stage = fake_stage
_run_cli = run_cli


def _rows(out_dir) -> list[dict]:
    return results.load_rows(Path(out_dir))


# ------------------------------------------------------------------------------------------ formulas

def test_flops_formula():
    p = Problem(2, 3, 128, 64, "fp16", False)
    assert p.flops == 4 * 2 * 3 * 128 * 128 * 64
    # causal: the visible pairs only, N(N+1)/2 per head when Nq = Nk
    assert Problem(2, 3, 128, 64, "fp16", True).flops == 4 * 2 * 3 * (128 * 129 // 2) * 64
    # bottom-right causal with Nq < Nk: query i sees Nk - Nq + i + 1 keys
    assert Problem(1, 1, 2, 8, "fp16", True, Nk=5).flops == 4 * (4 + 5) * 8
    # GQA: FLOPs count query heads; K/V heads only change the bytes
    assert Problem(1, 8, 16, 64, "fp16", False, Hkv=2).flops == 4 * 8 * 16 * 16 * 64


def test_peer_byte_models():
    p = Problem(1, 2, 256, 64, "fp16")
    tile = 1 * 2 * 256 * 64 * 2
    flash = peers.peer_hbm_bytes("sdpa_flash", p)
    assert (flash.read, flash.write) == (3 * tile, tile)
    math_ = peers.peer_hbm_bytes("sdpa_math", p)
    sp = 1 * 2 * 256 * 256 * 4  # fp32 S and P (the math backend upcasts half inputs)
    assert (math_.read, math_.write) == (3 * tile + 2 * sp, tile + 2 * sp)
    assert peers.peer_workspace_bytes("sdpa_math", p) == 2 * sp


def test_row_derived_numbers(fake_stages):
    fake_stages(_fake_stage("fake"))
    p = Problem(1, 2, 32, 16, "fp32")
    data = measure.prepare_cell(p, torch.device("cpu"))
    row = measure.measure_impl(impls.stage_impl("fake"), data, run_id="t", on_gpu=False)
    assert row["status"] == "ok"
    assert row["tflops"] == pytest.approx(p.flops / (row["ms_median"] * 1e-3) / 1e12)
    model = row["dram_read_model"] + row["dram_write_model"]
    assert model == p.qkvo_bytes
    assert row["gbps_model"] == pytest.approx(model / (row["ms_median"] * 1e-3) / 1e9)
    assert row["peak_mem_model"] == p.heads * p.N * p.D * 4  # workspace 0 + output
    assert row["ms_p20"] <= row["ms_median"] <= row["ms_p80"]
    assert row["device"] == "interpreter"
    assert row["rel_err"] == pytest.approx(row["torch_rel_err"])


def test_inputs_same_within_cell_fresh_across_cells():
    p = Problem(1, 2, 16, 16, "fp16")
    a = inputs.make_inputs(p, "cpu")
    b = inputs.make_inputs(p, "cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[0].dtype == torch.float16 and a[0].shape == (1, 2, 16, 16)
    c = inputs.make_inputs(Problem(1, 2, 16, 16, "fp16", causal=True), "cpu")
    assert not torch.equal(a[0], c[0])


def test_reference_matches_sdpa_and_chunking(monkeypatch):
    q, k, v = inputs.make_inputs(Problem(1, 2, 40, 16, "fp32", True), "cpu")
    expect = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    monkeypatch.setattr(reference, "CHUNK_BYTES", 40 * 8 * 7)  # 7 rows per chunk: ragged last chunk
    ref = reference.reference_attention(q, k, v, causal=True)
    assert ref.dtype == torch.float64
    assert reference.rel_err(ref, expect) < 1e-12
    assert reference.rel_err(torch.zeros_like(ref), ref) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------- results schema

def _sample_row(**kw) -> dict:
    row = {"run_id": "r", "impl": "a", "kind": "stage", "variant": "", "B": 1, "H": 2, "N": 64, "D": 16,
           "dtype": "fp16", "causal": 0, "device": "interpreter", "ms_median": 1.5, "ms_p20": 1.0,
           "ms_p80": 2.0, "dram_read_model": 1000, "status": "ok"}
    row.update(kw)
    return row


def test_results_round_trip(tmp_path):
    with results.RowWriter(tmp_path) as w:
        w.write(_sample_row())
        w.write(_sample_row(impl="b", variant="", status="oom", ms_median=None))
    rows = results.load_rows(tmp_path)
    assert [r["impl"] for r in rows] == ["a", "b"]
    assert rows[0]["ms_median"] == 1.5 and rows[0]["dram_read_model"] == 1000 and rows[0]["N"] == 64
    assert rows[1]["ms_median"] is None and rows[1]["status"] == "oom"
    # appending keeps the header once
    with results.RowWriter(tmp_path) as w:
        w.write(_sample_row(impl="c"))
    text = (tmp_path / "runs.csv").read_text().splitlines()
    assert text[0].startswith("run_id,") and sum(line.startswith("run_id,") for line in text) == 1
    assert len(results.load_rows(tmp_path)) == 3


def test_results_schema_errors(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text("impl,kind\na,stage\n")
    with pytest.raises(results.ResultsError, match="missing columns"):
        results.load_rows(path)
    with pytest.raises(results.ResultsError, match="header"):
        results.RowWriter(tmp_path)

    path.unlink()
    with results.RowWriter(tmp_path) as w:
        w.write(_sample_row())
        w.write(_sample_row(impl=""))  # missing required value, line 3
    with pytest.raises(results.ResultsError, match=r"runs\.csv:3: column 'impl' is empty"):
        results.load_rows(tmp_path)

    path.unlink()
    with results.RowWriter(tmp_path) as w:
        w.write(_sample_row(ms_median="fast"))
    with pytest.raises(results.ResultsError, match=r"runs\.csv:2: column 'ms_median' should be a number"):
        results.load_rows(tmp_path)
    with pytest.raises(results.ResultsError, match="unknown result columns"):
        with results.RowWriter(tmp_path / "other") as w:
            w.write(_sample_row(bogus=1))


def test_resume_skips_done_cells(tmp_path, fake_stages):
    calls = []

    def counting(q, k, v, *, causal=False, sm_scale=None):
        calls.append(q.shape[2])
        return _fake_attention(q, k, v, causal=causal)

    fake_stages(_fake_stage("fake", counting))
    cells = [results.Cell(1, 1, n, 16, "fp32", False) for n in (16, 32)]
    impl_list = [impls.stage_impl("fake")]
    with results.RowWriter(tmp_path) as w:
        measure.run_cells(cells[:1], impl_list, w, run_id="1", device=torch.device("cpu"))
    n_first = len(calls)
    done = results.done_cells(tmp_path)
    assert results.cell_key({"impl": "fake", "variant": "", **cells[0].row_fields()}) in done
    skipped = []
    with results.RowWriter(tmp_path) as w:
        rows = measure.run_cells(cells, impl_list, w, run_id="2", device=torch.device("cpu"), skip=done,
                                 on_skip=skipped.append)
    assert [r["N"] for r in rows] == [32] and skipped == [1]
    assert set(calls[n_first:]) == {32}
    assert [r["N"] for r in results.load_rows(tmp_path)] == [16, 32]


# ---------------------------------------------------------------------------------------- faults

def test_oom_and_error_rows_and_run_continues(tmp_path, fake_stages):
    def oom(q, k, v, *, causal=False, sm_scale=None):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")

    def broken(q, k, v, *, causal=False, sm_scale=None):
        raise RuntimeError("kernel exploded\nsecond line")

    def refuses(q, k, v, *, causal=False, sm_scale=None):
        raise ValueError("head dim D must be one of [64, 128], got 16")

    fake_stages(_fake_stage("oomy", oom))
    fake_stages(_fake_stage("broken", broken))
    fake_stages(_fake_stage("picky", refuses))
    fake_stages(_fake_stage("fine"))
    cell = results.Cell(1, 2, 16, 16, "fp32", False)
    impl_list = impls.build_impls(["oomy", "broken", "picky", "fine"], [])
    with results.RowWriter(tmp_path) as w:
        measure.run_cells([cell], impl_list, w, run_id="r", device=torch.device("cpu"))
    rows = {r["impl"]: r for r in results.load_rows(tmp_path)}
    assert rows["oomy"]["status"] == "oom"
    assert rows["broken"]["status"] == "error: RuntimeError: kernel exploded"
    assert rows["picky"]["status"].startswith("unsupported: ValueError: head dim")
    assert rows["fine"]["status"] == "ok" and rows["fine"]["ms_median"] is not None
    assert rows["oomy"]["dram_read_model"] is not None  # models are kept on failed rows


def test_cells_measured_before_an_interrupt_are_kept(tmp_path, fake_stages):
    def interrupt_at_32(q, k, v, *, causal=False, sm_scale=None):
        if q.shape[2] == 32:
            raise KeyboardInterrupt
        return _fake_attention(q, k, v, causal=causal)

    fake_stages(_fake_stage("fine"))
    fake_stages(_fake_stage("ctrlc", interrupt_at_32))
    with pytest.raises(KeyboardInterrupt):
        with results.RowWriter(tmp_path) as w:
            measure.run_cells([results.Cell(1, 1, n, 16, "fp32", False) for n in (16, 32)],
                              impls.build_impls(["fine", "ctrlc"], []), w, run_id="r", device=torch.device("cpu"))
    assert [(r["impl"], r["N"]) for r in results.load_rows(tmp_path)] == [("fine", 16), ("ctrlc", 16)]


def test_impls_of_a_cell_are_timed_in_turns_and_pooled(tmp_path, fake_stages, monkeypatch):
    """Each turn adds one set of samples; turns go A B, B A, A B; an impl's median is over all of its
    samples; an impl that fails in a later turn gets an error row and the others go on."""
    order, turn = [], {"a": 0, "b": 0, "c": 0}
    samples = {"a": [[1.0, 1.0], [5.0, 5.0], [3.0, 3.0]], "b": [[2.0], [2.0], [8.0]]}

    def fake_samples(fn, on_gpu, cpu_calls=3):
        out = fn()  # the fake stages' output: which impl this is, from the output's marker
        name = {1.0: "a", 2.0: "b", 3.0: "c"}[float(out.flatten()[0])]
        order.append(name)
        turn[name] += 1
        if name == "c" and turn[name] == 2:
            raise RuntimeError("failed in its second turn")
        return samples.get(name, [[1.0]] * 3)[turn[name] - 1]

    def marked(value):
        return lambda q, k, v, *, causal=False, sm_scale=None: torch.full_like(q, value)

    fake_stages(_fake_stage("a", marked(1.0)))
    fake_stages(_fake_stage("b", marked(2.0)))
    fake_stages(_fake_stage("c", marked(3.0)))
    monkeypatch.setattr(measure.timing, "samples", fake_samples)
    with results.RowWriter(tmp_path) as w:
        measure.run_cells([results.Cell(1, 1, 16, 16, "fp32", False)], impls.build_impls(["a", "b", "c"], []), w,
                          run_id="r", device=torch.device("cpu"), timing_rounds=3)
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b"]
    rows = {r["impl"]: r for r in results.load_rows(tmp_path)}
    assert rows["a"]["ms_median"] == 3.0 and rows["a"]["ms_p20"] == 1.0 and rows["a"]["ms_p80"] == 5.0
    assert rows["b"]["ms_median"] == 2.0 and rows["b"]["status"] == "ok"
    assert rows["c"]["status"] == "error: RuntimeError: failed in its second turn"
    assert rows["c"]["ms_median"] is None


def test_unsupported_peer_row():
    p = Problem(1, 1, 16, 16, "fp32")
    data = measure.prepare_cell(p, torch.device("cpu"))
    # EFFICIENT has no CPU kernel, so on a CPU it refuses (on a GPU this cell runs: skip the check there)
    row = measure.measure_impl(impls.peer_impl("sdpa_efficient"), data, run_id="r", on_gpu=False)
    if not HAS_CUDA:
        assert row["status"].startswith("unsupported:"), row["status"]
    ok = measure.measure_impl(impls.peer_impl("sdpa_math"), data, run_id="r", on_gpu=False)
    assert ok["status"] == "ok" and ok["rel_err"] < 1e-5


def test_speedups():
    rows = [{"impl": "a", "kind": "stage", "status": "ok", "ms_median": 8.0},
            {"impl": "b", "kind": "stage", "status": "ok", "ms_median": 4.0},
            {"impl": "c", "kind": "stage", "status": "ok", "ms_median": 1.0},
            {"impl": "c", "kind": "ablation", "variant": "all", "status": "ok", "ms_median": 1.0},
            {"impl": "c", "kind": "ablation", "variant": "+none", "status": "ok", "ms_median": 4.0},
            {"impl": "c", "kind": "ablation", "variant": "+pipe", "status": "ok", "ms_median": 2.0},
            {"impl": "c", "kind": "ablation", "variant": "-pipe", "status": "ok", "ms_median": 2.0},
            {"impl": "sdpa_flash", "kind": "peer", "status": "oom", "ms_median": None}]
    got = table.speedups(rows)
    assert got[0] == (None, 1.0) and got[1] == (2.0, 2.0) and got[2] == (4.0, 8.0)
    assert got[4][0] == 1.0 and got[5][0] == 2.0 and got[6][0] == 0.5
    assert got[7] == (None, None)


def test_reading_names_the_weakest_small_n_cell_and_only_a_real_loss():
    """The README's generated reading says where stage C loses at the smallest N: the weakest
    (D, causal) cell there, and nothing when C is at or above cuDNN in every cell."""
    from harness.report import render_reading

    def rows(small_ratios):
        out = []
        for impl, tflops in (("a", 100.0), ("b", 300.0), ("c", 500.0), ("sdpa_cudnn", 450.0)):
            out.append(_sample_row(impl=impl, kind="peer" if impl.startswith("sdpa") else "stage", N=4096, D=64,
                                   tflops=tflops))
        for (D, causal), ratio in small_ratios.items():
            out.append(_sample_row(impl="c", N=512, D=D, causal=causal, tflops=400.0 * ratio))
            out.append(_sample_row(impl="sdpa_cudnn", kind="peer", N=512, D=D, causal=causal, tflops=400.0))
        return out

    text = render_reading(rows({(64, 0): 1.04, (64, 1): 0.89, (128, 1): 0.91}))
    assert "at N = 512 stage C drops to 0.89× of cuDNN (D = 64 causal;" in text
    assert "drops to" not in render_reading(rows({(64, 0): 1.04, (64, 1): 1.01}))


# ------------------------------------------------------------------------------------------- CLI

@pytest.mark.parametrize("argv, names", [
    (["compare", "--stages", "a,zz"], "--stages"),
    (["compare", "--N", "0"], "--N"),
    (["compare", "--dtype", "fp8"], "--dtype"),
    (["compare", "--D", "44"], "--D"),
    (["sweep", "--N", "12,x"], "--N"),
    (["sweep", "--D", "64,"], "--D"),
    (["sweep", "--dtype", "fp16,int8"], "--dtype"),
    (["compare", "--peers", "flashy"], "--peers"),
    (["inspect", "--stages", "nope"], "--stages"),
])
def test_cli_argument_errors(argv, names, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {names}" in err and "Traceback" not in err


def test_cli_lists_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("compare", "sweep", "profile", "inspect", "device"):
        assert name in out
    assert "_ncu_child" not in out


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU messages")
def test_cli_no_gpu_messages(capsys, tmp_path):
    code, out, err = _run_cli(["device", "--out", str(tmp_path)], capsys)
    assert code != 0 and "needs a CUDA GPU" in err
    code, out, err = _run_cli(["profile", "--out", str(tmp_path)], capsys)
    assert code != 0 and ("ncu" in err)


def test_grid_shapes_fa_paper_setting(monkeypatch):
    # On a GPU a sweep keeps the FA paper's token and hidden budget (a CPU keeps small sizes).
    monkeypatch.setattr(cli, "_on_gpu", lambda: True)
    parser = cli.build_parser()
    args = parser.parse_args(["sweep", "--N", "512,32768", "--D", "64,128", "--causal", "both", "--dtype", "fp16"])
    cells = cli._grid_cells(args, cli.SWEEP_N)
    assert len(cells) == 2 * 2 * 2
    by = {(c.N, c.D): (c.B, c.H) for c in cells}
    assert by[(512, 64)] == (32, 32) and by[(512, 128)] == (32, 16) and by[(32768, 64)] == (1, 32)
    args = parser.parse_args(["sweep", "--N", "64", "--D", "16", "--B", "3", "--H", "5", "--causal", "no"])
    assert [(c.B, c.H) for c in cli._grid_cells(args, cli.SWEEP_N)] == [(3, 5)]


# --------------------------------------------------------------------------------------- end to end

def test_compare_end_to_end_real_stages(tmp_path, capsys):
    for name in ("a", "b", "c"):
        if name not in stages.STAGES:
            pytest.skip(f"stage {name} not registered yet")
    code, out, err = _run_cli(["compare", "--B", "1", "--H", "2", "--N", "16", "--D", "16", "--dtype", "fp32",
                               "--stages", "a,b,c", "--peers", "math", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "rel err" in out and "sdpa_math" in out
    if not HAS_CUDA:
        assert "times are CPU-interpreter times, not GPU times" in out
    rows = _rows(tmp_path)
    assert [r["impl"] for r in rows] == ["a", "b", "c", "sdpa_math"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["rel_err"] < 1e-5 and r["torch_rel_err"] is not None
        assert (r["N"], r["D"], r["dtype"]) == (16, 16, "fp32")
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["runs"]


def test_compare_ablation_rows(tmp_path, capsys, fake_stages):
    fake_stages(_fake_stage("fake", variants={"+x": {}, "-x": {}}))
    code, out, err = _run_cli(["compare", "--N", "16", "--D", "16", "--H", "1", "--dtype", "fp32",
                               "--stages", "fake", "--peers", "none", "--ablation", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = _rows(tmp_path)
    assert [(r["kind"], r["variant"]) for r in rows] == [("stage", ""), ("ablation", "all"), ("ablation", "+x"),
                                                       ("ablation", "-x")]
    assert rows[1]["ms_median"] == rows[0]["ms_median"]  # 'all' reuses the stage's measurement


def test_ablation_runs_only_the_variants_named(tmp_path, capsys, fake_stages):
    fake_stages(_fake_stage("fake", variants={"+x": {}, "-x": {}, "deterministic": {}}))
    code, out, err = _run_cli(["compare", "--N", "16", "--D", "16", "--H", "1", "--dtype", "fp32", "--stages", "fake",
                               "--peers", "none", "--ablation", "deterministic", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert [(r["kind"], r["variant"]) for r in _rows(tmp_path)] == [("stage", ""), ("ablation", "deterministic")]


def test_an_unknown_ablation_variant_is_refused_naming_the_known_ones(tmp_path, capsys, fake_stages):
    fake_stages(_fake_stage("fake", variants={"+x": {}}))
    code, out, err = _run_cli(["sweep", "--N", "16", "--D", "16", "--stages", "fake", "--peers", "none",
                               "--ablation", "+y", "--out", str(tmp_path)], capsys)
    assert code == 2
    assert "--ablation: unknown variant '+y'" in err and "all, +x" in err and "Traceback" not in err
    assert not (tmp_path / "runs.csv").exists()


def test_sweep_resume_cli(tmp_path, capsys, fake_stages):
    fake_stages(_fake_stage("fake"))
    argv = ["sweep", "--N", "16,32", "--D", "16", "--causal", "both", "--dtype", "fp32", "--B", "1", "--H", "1",
            "--stages", "fake", "--peers", "none", "--out", str(tmp_path)]
    code, out, err = _run_cli(argv[:2] + ["16"] + argv[3:], capsys)  # only N=16 first
    assert code == 0, err
    assert len(_rows(tmp_path)) == 2
    code, out, err = _run_cli(argv + ["--resume"], capsys)
    assert code == 0, err
    rows = _rows(tmp_path)
    assert sorted((r["N"], r["causal"]) for r in rows) == [(16, 0), (16, 1), (32, 0), (32, 1)]
    assert "2 skipped" in out


def test_tests_never_write_into_repo_results():
    # every CLI call above passes --out tmp_path; on a CPU the default is a temporary directory anyway
    if not HAS_CUDA:
        assert not str(cli.default_out_dir()).startswith(str(REPO / "results"))


# ------------------------------------------------------------------------------------------ inspect

PTX = """
//
.version 8.7
.target sm_80
.address_size 64
.visible .entry k(
\t.param .u64 .ptr .global .align 1 k_param_0
)
{
\t.reg .b32 \t%r<10>;
$L__BB0_1:
\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\tld.global.L1::evict_last.v2.b32 { %r1, %r2 }, [ %rd1 + 0 ];
\t@!%p2 ld.global.b32 %r5, [ %rd2 + 0 ];
\tcp.async.cg.shared.global [ %r6 + 0 ], [ %rd3 + 0 ], 0x10, %r7;   // async copy
\tcp.async.cg.shared.global [ %r6 + 16 ], [ %rd3 + 16 ], 0x10, %r7;
\tcp.async.ca.shared.global [ %r6 + 32 ], [ %rd3 + 32 ], 0x4, %r7;
\tcp.async.commit_group;
\tcp.async.wait_group 0x1;
\tcp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
\tmbarrier.try_wait.parity.shared::cta.b64 %p3, [%r1], %r2;
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 { %r1, %r2, %r3, %r4 }, [ %r5 + 0 ];
\tmma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 { %f1, %f2, %f3, %f4 }, { %r1, %r2, %r3, %r4 }, { %r5, %r6 }, { %f1, %f2, %f3, %f4 };
\twgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 1;
\twgmma.wait_group.sync.aligned 0;
\tex2.approx.ftz.f32 %f5, %f6;
\tex2.approx.f32 %f7, %f8;
\tbar.sync \t0;
\tst.global.v4.b32 [ %rd4 + 0 ], { %r1, %r2, %r3, %r4 };
\tst.shared.v4.b32 [ %r1 + 0 ], { %r1, %r2, %r3, %r4 };
\t// ld.global.v4.b32 in a comment does not count
\tret;
}
"""


def test_count_instructions_hand_made_ptx():
    c = count_instructions(PTX)
    assert c["ld.global.v4"] == 1 and c["ld.global.v2"] == 1 and c["ld.global.scalar"] == 1
    assert c["cp.async.cg.shared.global"] == 2 and c["cp.async.ca.shared.global"] == 1
    assert c["cp.async.commit_group"] == 1 and c["cp.async.wait_group"] == 1  # wgmma.wait_group is not cp.async
    assert c["cp.async.bulk.tensor"] == 1 and c["mbarrier"] == 1
    assert c["ldmatrix"] == 1 and c["mma.sync"] == 1 and c["wgmma.mma_async"] == 1
    assert c["ex2.approx"] == 2 and c["bar.sync"] == 1
    assert c["st.global.v4"] == 1 and c["st.shared"] == 1


def test_parse_ptxas_and_layouts():
    text = ("ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
            "    0 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n"
            "ptxas info    : Used 142 registers, used 1 barriers\n")
    assert parse_ptxas(text) == {"registers": 142, "spill_stores": 8, "spill_loads": 12, "stack_bytes": 0}
    ttgir = ("#shared = #ttg.swizzled_shared<{vec = 8, perPhase = 1, maxPhase = 8, order = [1, 0]}>\n"
             "#shared1 = #ttg.nvmma_shared<{swizzlingByteWidth = 128, transposed = true, elementBitWidth = 16}>\n"
             "#smem = #ttg.shared_memory\n")
    layouts = smem_layouts(ttgir)
    assert len(layouts) == 2
    assert describe_layout(layouts[0]) == "XOR swizzle vec=8 perPhase=1 maxPhase=8"
    assert describe_layout(layouts[1]).startswith("128B swizzle")


def _sass_listing(body: list[str]) -> str:
    """cuobjdump's layout: one instruction per line, its address in a comment, 16 bytes apart."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {text} ;   /* 0x0 */" for i, text in enumerate(body))


def test_sass_loops_finds_innermost_loops_and_counts_a_pass():
    # An outer loop (0x10 .. 0x60) around an inner one (0x20 .. 0x50) that holds a polling loop
    # (0x30 .. 0x40, shorter than min_instructions), then a second partition's copy of the inner loop.
    listing = _sass_listing([
        "MOV R1, c[0x0][0x28]",                    # 0x00
        "LDL R2, [R1]",                           # 0x10  outer loop's start
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ",  # 0x20  inner loop's start
        "SYNCS.PHASECHK.TRANS64 P0, [UR8], R3",   # 0x30  polling loop
        "@!P0 BRA 0x30",                          # 0x40
        "@P1 STL [R1+0x4], R5",                   # 0x50
        "@P2 BRA 0x20",                           # 0x60  inner loop's branch back
        "BRA 0x10",                               # 0x70  outer loop's branch back
        "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ",  # 0x80
        "@!P0 LDL.LU R4, [R1+0x10]",              # 0x90
        "FADD R5, R5, R6",                        # 0xa0
        "@P2 BRA 0x80",                           # 0xb0
        "EXIT",                                   # 0xc0
    ])
    loops = sass_loops(listing, min_instructions=4)
    assert [(hex(loop.start), hex(loop.end)) for loop in loops] == [("0x20", "0x60"), ("0x80", "0xb0")]
    inner, copy = loops
    assert (inner.instructions, inner.local_loads, inner.local_stores, inner.wgmma) == (5, 0, 1, 1)
    assert (copy.instructions, copy.local_loads, copy.local_stores, copy.wgmma) == (4, 1, 0, 1)
    # With the polling loop counted as a loop, it is the innermost one.
    assert (sass_loops(listing, min_instructions=2)[0].start, sass_loops(listing, min_instructions=2)[0].end) == (
        0x30, 0x40)
    assert sass_loops("") == []
    assert first_mma_loop(listing, 4) == inner and first_mma_loop(listing) is None  # (64 instructions at least)


@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_inspect_real_stage_json(name, capsys):
    stage = stages.STAGES.get(name)
    if stage is None or stage.compile is None:
        pytest.skip(f"stage {name} has no compile hook (yet)")
    code, out, err = _run_cli(["inspect", "--stages", name, "--arch", "80", "--D", "64", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["kernels"], data["skipped"]
    for k in data["kernels"]:
        assert k["stage"] == name and k["arch"] == 80 and k["target"] == "sm_80"
        counts = k["instructions"]
        assert counts["mma.sync"] > 0 or name == "a"  # a's softmax kernel has no matmul
        if k.get("registers") is not None:
            assert k["registers"] > 0 and k["spill_stores"] is not None
    if name == "c":
        c = data["kernels"][0]["instructions"]
        assert c["cp.async.cg.shared.global"] > 0 and c["cp.async.wait_group"] > 0  # pipelining shows in PTX


def test_inspect_table_output(capsys):
    if not any(s.compile for s in stages.STAGES.values()):
        pytest.skip("no stage has a compile hook yet")
    code, out, err = _run_cli(["inspect", "--arch", "90", "--no-ptxas"], capsys)
    assert code == 0, err
    assert "sm_90" in out and "shared memory, bytes" in out


# --------------------------------------------------------------------------------------------- ncu

NCU_CSV = '''==PROF== Connected to process 1234 (/usr/bin/python3.12)
==PROF== Profiling "tiled_attention_kernel" - 0: 0%....50%....100% - 3 passes
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1234","python3.12","127.0.0.1","tiled_attention_kernel","1","7","(128, 1, 1)","(64, 128, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
"0","1234","python3.12","127.0.0.1","tiled_attention_kernel","1","7","(128, 1, 1)","(64, 128, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","524288"
"0","1234","python3.12","127.0.0.1","tiled_attention_kernel","1","7","(128, 1, 1)","(64, 128, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","80.5"
"0","1234","python3.12","127.0.0.1","tiled_attention_kernel","1","7","(128, 1, 1)","(64, 128, 1)","0","9.0","Command line profiler metrics","l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum","","10"
"1","1234","python3.12","127.0.0.1","other_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1000"
"1","1234","python3.12","127.0.0.1","other_kernel","1","7","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","lts__t_sector_hit_rate.pct","%","n/a"
==PROF== Disconnected from process 1234
'''


def test_parse_ncu_csv_and_summarize():
    kernels = ncu.parse_ncu_csv(NCU_CSV)
    assert [k["name"] for k in kernels] == ["tiled_attention_kernel", "other_kernel"]
    s = ncu.summarize(kernels)
    assert s["dram_read_measured"] == 1_048_576 + 1000 and s["dram_write_measured"] == 524288
    assert s["l2_hit_rate_pct"] == pytest.approx(80.5)
    assert s["smem_bank_conflicts"] == 10 and s["bank_conflicts_ld"] == 10 and s["bank_conflicts_st"] is None
    assert ncu.parse_ncu_csv("==ERROR== something\n") == []


def test_ncu_command_shape():
    cmd = ncu.ncu_command("/x/ncu", "c", "-tma", Problem(1, 2, 64, 16, "bf16", True), seed=3)
    assert cmd[0] == "/x/ncu" and "--clock-control" in cmd and cmd[cmd.index("--clock-control") + 1] == "none"
    assert "--profile-from-start" in cmd and ",".join(ncu.METRICS) in cmd
    child = cmd[cmd.index("_ncu_child") + 1:]
    # The child must parse what the parent wrote, including a variant name that starts with "-".
    parser = argparse.ArgumentParser()
    ncu.add_child_arguments(parser)
    args = parser.parse_args(child)
    assert (args.impl, args.variant, args.causal, args.dtype, args.N, args.seed) == ("c", "-tma", True, "bf16", 64, 3)


def test_ncu_sections_command_and_summary(tmp_path):
    """``profile --sections`` asks ncu for the analysis sections and the pipe/stall counters instead of
    the DRAM metrics, keeps a few metrics per kernel, and a later profile of the same impl and cell
    replaces its summary rows."""
    cmd = ncu.ncu_command("/x/ncu", "c", "", Problem(1, 2, 64, 16, "fp16", False), sections=ncu.SECTIONS)
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--section"] == list(ncu.SECTIONS)
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--metrics"] == [",".join(ncu.SECTION_RAW_METRICS)]
    assert not set(ncu.METRICS) & set(ncu.PIPE_AND_STALL_METRICS)
    assert set(ncu.PIPE_AND_STALL_METRICS) <= set(ncu.SECTION_SUMMARY)
    text = NCU_CSV.replace("dram__bytes_read.sum", "Duration")
    (row, other) = ncu.section_summary(ncu.parse_ncu_csv(text))
    assert row["kernel"] == "tiled_attention_kernel" and row["Duration"] == 1_048_576
    assert row["Achieved Occupancy"] is None and other["Duration"] == 1000
    path = tmp_path / "sections_summary.csv"
    cell = {"dtype": "fp16", "D": 64, "N": 1024, "causal": 1}
    cli._merge_section_summary(path, [{"impl": "c", **cell, "kernel": "old", "Duration": 2.0},
                                      {"impl": "sdpa_cudnn", **cell, "kernel": "k", "Duration": 1.0}])
    cli._merge_section_summary(path, [{"impl": "c", **cell, "kernel": "new", "Duration": 3.0}])
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["impl"], r["kernel"]) for r in rows) == [("c", "new"), ("sdpa_cudnn", "k")]


# ------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_compare(tmp_path, capsys):
    code, out, err = _run_cli(["compare", "--B", "2", "--H", "8", "--N", "1024", "--D", "64", "--no-energy",
                               "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = _rows(tmp_path)
    by = {r["impl"]: r for r in rows}
    for name in ("a", "b", "c"):
        assert by[name]["status"] == "ok" and by[name]["device"] == "gpu"
        assert by[name]["peak_mem_measured"] is not None and by[name]["ms_median"] > 0
        assert by[name]["rel_err"] <= max(2 * by[name]["torch_rel_err"], 2e-3)
    assert by["sdpa_flash"]["status"] == "ok"
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["gpu_name"] and env["sm_count"] > 0


@pytest.mark.gpu
def test_gpu_profile(tmp_path, capsys):
    if not ncu.find_ncu():
        pytest.skip("ncu not found")
    code, out, err = _run_cli(["profile", "--N", "1024", "--D", "64", "--B", "1", "--H", "8", "--dtype", "fp16",
                               "--stages", "b", "--peers", "flash", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = {r["impl"]: r for r in _rows(tmp_path)}
    assert rows["b"]["status"] == "ok", rows["b"]
    assert rows["b"]["dram_read_measured"] > 0 and rows["sdpa_flash"]["dram_read_measured"] > 0


@pytest.mark.gpu
def test_gpu_device(tmp_path, capsys):
    code, out, err = _run_cli(["device", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    ceilings = json.loads((tmp_path / "env.json").read_text())["ceilings"]
    assert ceilings["copy_gbps"] > 100 and ceilings["matmul_fp16_tflops"] > 10


@pytest.mark.skipif(__import__("shutil").which("git") is None, reason="needs git")
def test_git_commit_marks_a_dirty_checkout_but_not_new_results(tmp_path):
    """Provenance says when the measured code was not the commit's: a changed kernel marks the
    checkout dirty; results the sweep itself appends to do not."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@example.com", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "kernel.py").write_text("x = 1\n")
    (tmp_path / "results" / "runs.csv").write_text("a\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    clean = results.git_commit(tmp_path)
    assert clean != "unknown" and not clean.endswith("-dirty")
    (tmp_path / "results" / "runs.csv").write_text("a\nb\n")
    assert results.git_commit(tmp_path) == clean
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert results.git_commit(tmp_path) == clean + "-dirty"
    assert results.git_commit(tmp_path / "results") == clean + "-dirty"  # from a subfolder too


def test_a_run_records_the_stage_switches_its_environment_set(tmp_path, monkeypatch):
    """A run under ``LAB_DECODE_MERGE=wide`` says so in its env.json entry (its command line does not);
    a run without switches records none."""
    from harness import results

    monkeypatch.setenv("LAB_DECODE_MERGE", "wide")
    results.write_env(tmp_path, results.base_env("2026-12-03T00:00:00Z"))
    monkeypatch.delenv("LAB_DECODE_MERGE")
    monkeypatch.delenv("LAB_WS_PADDED_HEAD_DIMS", raising=False)
    results.write_env(tmp_path, results.base_env("2026-12-03T00:01:00Z"))
    runs = results.load_env(tmp_path)["runs"]
    assert runs["2026-12-03T00:00:00Z"]["switches"] == {"LAB_DECODE_MERGE": "wide"}
    assert "switches" not in runs["2026-12-03T00:01:00Z"]
    assert "switches" not in results.load_env(tmp_path)  # per run, not the directory's latest facts


@pytest.mark.gpu
def test_gpu_timing_counts_its_repetitions_and_flushes_by_reading():
    """``timing.samples_gpu``: do_bench's counts (one repetition per ~estimate within rep_ms, at least
    MIN_REPS), every
    sample positive; the flush buffer is made once per device and is larger than the L2, and the
    flush only reads it (its contents are unchanged)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from harness import timing

    x = torch.randn(1 << 20, device="cuda")
    samples = timing.samples_gpu(lambda: x.mul_(1.0), warmup_ms=5, rep_ms=20)
    assert len(samples) >= 2 and all(t > 0 for t in samples)
    # a call longer than rep_ms still gets MIN_REPS repetitions, not one
    assert len(timing.samples_gpu(lambda: x.mul_(1.0), warmup_ms=0, rep_ms=0)) == timing.MIN_REPS
    buf = timing._FLUSH_BUFFERS[torch.cuda.current_device()]
    assert buf.numel() * buf.element_size() == timing.FLUSH_BYTES > torch.cuda.get_device_properties(0).L2_cache_size
    before = buf[:1024].clone()
    timing.flush_l2()
    assert torch.equal(buf[:1024], before)
    assert timing.summarize(samples, True).method == "cuda_events"
