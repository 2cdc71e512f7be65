"""The harness's new dimensions: K/V heads and rows (GQA, Nq != Nk), passes (fwd, bwd, fwd_bwd),
the CUDA-graph time column, the model suite and the host-latency command.

CPU tests run tiny problems (fake stages built on the textbook formula where the stage itself is
not the point, stage A and the SDPA MATH peer where it is); the GPU test checks ``ms_gpu``.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch

import stages
from stages.contract import HbmTraffic, Problem, Stage

from harness import cli, impls, inputs, latency, measure, peers, reference, results, suites

from .helpers import run_cli

HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------- helpers

def _textbook(q, k, v, *, causal=False, sm_scale=None):
    """Same-precision textbook attention (GQA, bottom-right causal): a fake stage's forward, no backward."""
    return reference.torch_same_precision(q, k, v, causal=causal, sm_scale=sm_scale)


@pytest.fixture
def fake_stage():
    """Register a cheap fake stage ``fake`` for one test, then restore the registry."""
    saved = dict(stages.STAGES)
    stage = Stage(name="fake", title="fake", techniques=(), attention=_textbook,
                  hbm_bytes=lambda p: HbmTraffic(read=p.q_bytes + 2 * p.kv_bytes, write=p.q_bytes),
                  workspace_bytes=lambda p: 0)
    stages.register(stage)
    yield stage
    stages.STAGES.clear()
    stages.STAGES.update(saved)


_main = run_cli


def _old_header() -> list[str]:
    """The header results files had before the K/V shape, the pass, the suite name and ms_gpu."""
    return [c for c in results.COLUMNS if c not in results.LATER_COLUMNS]


def _write_old_file(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=_old_header())
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _old_row(**kw) -> dict:
    row = {"run_id": "old", "impl": "b", "kind": "stage", "variant": "", "B": 2, "H": 4, "N": 64, "D": 16,
           "dtype": "fp16", "causal": 1, "device": "gpu", "ms_median": 0.5, "status": "ok"}
    row.update(kw)
    return row


# ---------------------------------------------------------------------------------- results files

def test_old_results_file_loads_with_the_meaning_it_had(tmp_path):
    _write_old_file(tmp_path / "runs.csv", [_old_row(), _old_row(impl="c")])
    rows = results.load_rows(tmp_path)
    assert [r["impl"] for r in rows] == ["b", "c"]
    for r in rows:
        assert (r["Hkv"], r["Nk"], r["pass"]) == (r["H"], r["N"], "fwd")
        assert r["ms_gpu"] is None and r["cell"] is None
    # an old row and a new row of the same cell are the same cell (for --resume and re-measuring)
    new = dict(rows[0], Hkv=rows[0]["H"], Nk=rows[0]["N"], **{"pass": "fwd"})
    assert results.cell_key(_old_row()) == results.cell_key(new)
    assert results.cell_key(dict(new, Hkv=1)) != results.cell_key(new)
    assert results.cell_key(dict(new, **{"pass": "bwd"})) != results.cell_key(new)


def test_appending_to_an_old_file_keeps_its_header_or_says_how_to_upgrade(tmp_path):
    path = tmp_path / "runs.csv"
    _write_old_file(path, [_old_row()])
    fits = dict(_old_row(impl="a"), Hkv=4, Nk=64, **{"pass": "fwd"})
    with results.RowWriter(tmp_path) as w:
        w.write(fits)  # Hkv = H, Nk = N, forward: the old header holds it
    assert path.read_text().splitlines()[0] == ",".join(_old_header())
    assert [r["impl"] for r in results.load_rows(tmp_path)] == ["b", "a"]
    for extra in ({"Hkv": 2}, {"pass": "bwd"}, {"ms_gpu": 0.25}, {"cell": "gpt2"}):
        with results.RowWriter(tmp_path) as w, pytest.raises(results.ResultsError, match="upgrade_results_file"):
            w.write(dict(fits, **extra))
    with results.RowWriter(tmp_path) as w, pytest.raises(results.ResultsError, match="ms_gpu"):
        w.require(["ms_gpu"])  # what a GPU run checks before it measures anything
    results.upgrade_results_file(path)
    assert path.read_text().splitlines()[0] == ",".join(results.COLUMNS)
    with results.RowWriter(tmp_path) as w:
        w.write(dict(fits, impl="gqa", Hkv=2, ms_gpu=0.25))
    rows = results.load_rows(tmp_path)
    assert [(r["impl"], r["Hkv"]) for r in rows] == [("b", 4), ("a", 4), ("gqa", 2)]
    assert rows[-1]["ms_gpu"] == 0.25


def test_inputs_have_the_kv_shape_and_old_cells_keep_their_data():
    p = Problem(2, 4, 8, 16, "fp16", True, Hkv=2, Nk=12)
    q, k, v = inputs.make_inputs(p, "cpu")
    assert q.shape == (2, 4, 8, 16) and k.shape == v.shape == (2, 2, 12, 16)
    plain = Problem(2, 4, 8, 16, "fp16", True)
    explicit = Problem(2, 4, 8, 16, "fp16", True, Hkv=4, Nk=8)
    assert inputs.cell_seed(plain) == inputs.cell_seed(explicit) != inputs.cell_seed(p)
    do = inputs.make_grad_output(p, "cpu")
    assert do.shape == q.shape and not torch.equal(do, q)


# ------------------------------------------------------------------------------------------- peers

@pytest.mark.parametrize("Nq, Nk", [(8, 20), (20, 8)])
def test_peers_compute_gqa_and_bottom_right_causal(Nq, Nk):
    p = Problem(1, 4, Nq, 16, "fp32", True, Hkv=2, Nk=Nk)
    q, k, v = inputs.make_inputs(p, "cpu")
    with warnings.catch_warnings():  # torch warns that rows seeing no key may give NaN (Nq > Nk)
        warnings.simplefilter("ignore")
        kwargs = peers.sdpa_kwargs(q, k, causal=True)
    assert kwargs.get("enable_gqa") is True and "is_causal" not in kwargs  # the bottom-right mask instead
    ref = reference.reference_attention(q, k, v, causal=True)
    for name in ("sdpa_flash", "sdpa_math"):  # the backends with CPU kernels
        out = peers.peer_attention(name)(q, k, v, causal=True)
        assert reference.rel_err(out, ref) < 1e-5, name
    # SDPA's own is_causal is aligned to the top left: it differs when Nq != Nk (why the mask is needed)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert reference.rel_err(top_left, ref) > 1e-2


def test_peer_models_read_kv_per_kv_head():
    gqa, mha = Problem(1, 8, 64, 16, "fp16", Hkv=2), Problem(1, 8, 64, 16, "fp16")
    for name in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        saved = peers.peer_hbm_bytes(name, mha).read - peers.peer_hbm_bytes(name, gqa).read
        assert saved == 2 * (mha.kv_bytes - gqa.kv_bytes) > 0
    flash = peers.peer_hbm_bytes("sdpa_flash", gqa)
    assert (flash.read, flash.write) == (gqa.q_bytes + 2 * gqa.kv_bytes, gqa.q_bytes)
    bwd = peers.peer_bwd_hbm_bytes("sdpa_flash", gqa)
    assert (bwd.read, bwd.write) == (3 * gqa.q_bytes + 2 * gqa.kv_bytes, gqa.q_bytes + 2 * gqa.kv_bytes)


# ---------------------------------------------------------------------------------------- the CLI

def test_compare_writes_gqa_and_cross_length_rows(tmp_path, capsys):
    code, out, err = _main(["compare", "--B", "1", "--H", "4", "--Hkv", "2", "--N", "8", "--Nk", "24", "--D", "16",
                            "--dtype", "fp32", "--causal", "yes", "--stages", "a", "--peers", "math",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "Hkv=2 Nk=24" in out
    rows = results.load_rows(tmp_path)
    assert [r["impl"] for r in rows] == ["a", "sdpa_math"]
    p = Problem(1, 4, 8, 16, "fp32", True, Hkv=2, Nk=24)
    for r in rows:
        assert r["status"] == "ok", r
        assert (r["H"], r["Hkv"], r["N"], r["Nk"], r["pass"]) == (4, 2, 8, 24, "fwd")
        assert r["rel_err"] < 1e-5
        assert r["tflops"] == pytest.approx(p.flops / (r["ms_median"] * 1e-3) / 1e12, rel=1e-4)
        # the CUDA-graph time exists exactly where there is a GPU
        assert (r["ms_gpu"] is None) == (not torch.cuda.is_available())


def test_sweep_takes_lists_of_kv_heads_and_lengths(tmp_path, capsys, fake_stage):
    code, out, err = _main(["sweep", "--B", "1", "--H", "4", "--Hkv", "1,4", "--N", "4", "--Nk", "4,12", "--D", "8",
                            "--dtype", "fp32", "--causal", "yes", "--stages", "fake", "--peers", "none",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = results.load_rows(tmp_path)
    assert sorted((r["Hkv"], r["Nk"]) for r in rows) == [(1, 4), (1, 12), (4, 4), (4, 12)]
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 for r in rows)
    # --resume knows these cells, also when only Hkv / Nk tell them apart
    code, out, err = _main(["sweep", "--B", "1", "--H", "4", "--Hkv", "1,2", "--N", "4", "--Nk", "12", "--D", "8",
                            "--dtype", "fp32", "--causal", "yes", "--stages", "fake", "--peers", "none",
                            "--out", str(tmp_path), "--resume"], capsys)
    assert code == 0, err
    assert sorted((r["Hkv"], r["Nk"]) for r in results.load_rows(tmp_path)) == [(1, 4), (1, 12), (2, 12), (4, 4),
                                                                               (4, 12)]


@pytest.mark.parametrize("argv", [
    ["compare", "--H", "4", "--Hkv", "3"],
    ["sweep", "--H", "6", "--Hkv", "4", "--N", "16", "--D", "16"],
    ["sweep", "--Hkv", "0"],
])
def test_bad_kv_heads_is_a_parser_error_naming_hkv(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --Hkv" in err and "Traceback" not in err


def test_head_dim_argument_takes_every_multiple_of_8(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["compare", "--D", "80"]).D == 80
    assert parser.parse_args(["sweep", "--D", "8,72,200,256"]).D == [8, 72, 200, 256]
    with pytest.raises(SystemExit):
        parser.parse_args(["compare", "--D", "84"])
    assert "multiple of 8" in capsys.readouterr().err


def test_pass_argument(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["compare"]).passes == ["fwd"]
    assert parser.parse_args(["sweep", "--pass", "bwd,fwd_bwd"]).passes == ["bwd", "fwd_bwd"]
    with pytest.raises(SystemExit):
        parser.parse_args(["compare", "--pass", "backward"])
    assert "argument --pass" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- passes

def test_backward_rows_of_a_stage_and_a_peer(tmp_path, capsys):
    if stages.STAGES["a"].bwd_hbm_bytes is None:
        pytest.skip("stage A has no backward models yet")
    code, out, err = _main(["compare", "--B", "1", "--H", "2", "--Hkv", "1", "--N", "8", "--Nk", "12", "--D", "16",
                            "--dtype", "fp32", "--causal", "yes", "--stages", "a", "--peers", "math",
                            "--pass", "bwd", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    assert "backward" in out and "2.5×" in out
    p = Problem(1, 2, 8, 16, "fp32", True, Hkv=1, Nk=12)
    rows = {r["impl"]: r for r in results.load_rows(tmp_path)}
    a, math_ = rows["a"], rows["sdpa_math"]
    for r in (a, math_):
        assert r["status"] == "ok" and r["pass"] == "bwd", r
        assert r["rel_err"] < 1e-5 and r["torch_rel_err"] is not None
        assert r["tflops"] == pytest.approx(p.bwd_flops / (r["ms_median"] * 1e-3) / 1e12, rel=1e-4)
    bwd_model = stages.STAGES["a"].bwd_hbm_bytes(p)
    assert (a["dram_read_model"], a["dram_write_model"]) == (bwd_model.read, bwd_model.write)
    grads = p.q_bytes + 2 * p.kv_bytes
    assert a["peak_mem_model"] == stages.STAGES["a"].train_workspace_bytes(p) + p.q_bytes + grads


def test_backward_error_is_the_worst_gradient_and_no_backward_is_unsupported(fake_stage):
    p = Problem(1, 2, 6, 8, "fp32", True, Hkv=1, Nk=10)
    data = measure.prepare_cell(p, torch.device("cpu"), pass_="fwd_bwd")
    assert len(data.ref) == 3 and data.do is not None
    # the fake stage's textbook forward runs under no_grad: no grad_fn, so no backward
    row = measure.measure_impl(impls.stage_impl("fake"), data, run_id="t", on_gpu=False)
    assert row["status"].startswith("unsupported") and "no backward" in row["status"]
    assert row["pass"] == "fwd_bwd"
    ok = measure.measure_impl(impls.peer_impl("sdpa_math"), data, run_id="t", on_gpu=False)
    assert ok["status"] == "ok"
    q, k, v = (t.detach().requires_grad_(True) for t in (data.q, data.k, data.v))
    grads = torch.autograd.grad(peers.peer_attention("sdpa_math")(q, k, v, causal=True), (q, k, v), data.do)
    assert ok["rel_err"] == pytest.approx(max(reference.rel_err(g, r) for g, r in zip(grads, data.ref)))
    assert ok["tflops"] == pytest.approx((p.flops + p.bwd_flops) / (ok["ms_median"] * 1e-3) / 1e12, rel=1e-4)


def test_gradient_references_per_kv_head_equal_the_whole():
    """The cell's gradient references are computed one K/V head group at a time (memory); the
    pieces must put back together exactly what the whole computation gives."""
    p = Problem(2, 6, 5, 8, "fp32", True, Hkv=2, Nk=9)
    q, k, v = inputs.make_inputs(p, "cpu")
    do = inputs.make_grad_output(p, "cpu")
    whole = reference.reference_gradients(q, k, v, do, causal=True)
    pieces = measure._per_kv_head(reference.reference_gradients, q, k, v, do, True)
    for a, b in zip(pieces, whole, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


# ------------------------------------------------------------------------------------------ suites

def test_model_suite_cells_and_help(capsys):
    names = [c.name for c in suites.MODELS]
    assert len(names) == len(set(names)) == 17
    for c in suites.MODELS:
        Problem(c.B, c.Hq, c.Nq, c.D, c.dtype, c.causal, Hkv=c.Hkv, Nk=c.Nk)  # every cell is a valid problem
    by = {c.name: c for c in suites.MODELS}
    assert (by["decode-gqa"].Nq, by["decode-gqa"].Hkv, by["decode-gqa"].Nk) == (1, 8, 8192)
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--help"])
    out = capsys.readouterr().out
    assert "--suite" in out and all(name in out for name in suites.SUITES)


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU refusal")
def test_model_suite_refused_on_a_cpu_smoke_suite_runs(tmp_path, capsys, fake_stage):
    code, out, err = _main(["sweep", "--suite", "models", "--stages", "fake", "--peers", "none",
                            "--out", str(tmp_path)], capsys)
    assert code == 1 and "sized for a GPU" in err and "--suite smoke" in err
    code, out, err = _main(["sweep", "--suite", "smoke", "--stages", "fake", "--peers", "none",
                            "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = results.load_rows(tmp_path)  # --out given: the rows go there (by default: results/<gpu>/smoke/)
    assert [r["cell"] for r in rows] == [c.name for c in suites.SMOKE]
    assert [(r["H"], r["Hkv"], r["N"], r["Nk"]) for r in rows] == [(c.Hq, c.Hkv, c.Nq, c.Nk) for c in suites.SMOKE]


def test_suite_refuses_grid_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["sweep", "--suite", "smoke", "--N", "64"])
    assert exc.value.code == 2 and "--N" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- latency

def test_latency_command_on_the_interpreter(tmp_path, capsys):
    code, out, err = _main(["latency", "--H", "1", "--N", "16", "--D", "16", "--calls", "1", "--stages", "a",
                            "--peers", "math", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    if not HAS_CUDA:
        assert "interpreter times" in out
    with (tmp_path / latency.LATENCY_CSV).open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["impl"] for r in rows] == ["triton_empty_kernel", "a", "sdpa_math"]
    assert all(r["status"] == "ok" and float(r["us_per_call"]) > 0 for r in rows)
    assert float(rows[0]["x_floor"]) == pytest.approx(1.0)


def test_latency_times_the_backward_on_a_saved_forward(tmp_path, capsys):
    """``--pass fwd,bwd,fwd_bwd``: a row per impl and pass (the floor once, its pass empty), each call
    the one ``sweep`` times for that pass; a bad pass is named with the allowed ones."""
    code, out, err = _main(["latency", "--H", "1", "--N", "16", "--D", "16", "--calls", "1", "--stages", "a",
                            "--peers", "math", "--pass", "bwd,fwd", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    with (tmp_path / latency.LATENCY_CSV).open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], r["pass"]) for r in rows] == [("triton_empty_kernel", ""), ("a", "fwd"), ("a", "bwd"),
                                                      ("sdpa_math", "fwd"), ("sdpa_math", "bwd")]
    assert all(r["status"] == "ok" and float(r["us_per_call"]) > 0 for r in rows)
    code, out, err = _main(["latency", "--pass", "fwd,back"], capsys)
    assert code == 2 and "--pass: unknown pass 'back'; allowed: fwd, bwd, fwd_bwd" in err


def test_latency_backward_call_is_the_sweeps(monkeypatch):
    """The timed backward differentiates one saved forward again and again (the forward is not in
    the loop): the impl's forward runs once, its backward on every call."""
    import torch

    from stages.contract import Problem

    calls = {"forward": 0, "backward": 0}

    class Counted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            calls["forward"] += 1
            return q * 1.0

        @staticmethod
        def backward(ctx, do):
            calls["backward"] += 1
            return do, torch.zeros_like(do), torch.zeros_like(do)

    impl = impls.Impl("counted", "stage", "", lambda q, k, v, causal=False: Counted.apply(q, k, v), None, None)
    problem = Problem(1, 1, 4, 8, "fp32", False)
    q, k, v = inputs.make_inputs(problem, "cpu")
    call = latency.pass_call(impl, problem, q, k, v, "bwd")
    for _ in range(3):
        dq, dk, dv = call()
    assert calls == {"forward": 1, "backward": 3} and dq.shape == q.shape
    call = latency.pass_call(impl, problem, q, k, v, "fwd_bwd")
    call()
    assert calls == {"forward": 2, "backward": 4}


# --------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
def test_gpu_graph_time_beside_eager_time(tmp_path, capsys):
    code, out, err = _main(["compare", "--B", "1", "--H", "8", "--N", "128", "--D", "64", "--stages", "b",
                            "--peers", "flash", "--no-energy", "--pass", "fwd,bwd", "--out", str(tmp_path)], capsys)
    assert code == 0, err
    rows = results.load_rows(tmp_path)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["ms_gpu"] is not None, r.get("note")
        # replaying a graph drops the host path: never much slower than the eager call
        assert r["ms_gpu"] <= 1.1 * r["ms_median"]
