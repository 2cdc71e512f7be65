"""The labs grade what they should: every reference solution passes its check, every template, as
shipped, fails it with the open-gap message, the known shortcuts fail, and a learner's kernel that
crashes gets a failing grade with a one-line reason, not a traceback.

CPU only: the Triton interpreter at tiny sizes; ``pipeline_stages`` compiles for sm_80 without a GPU;
``gpu_timed`` reports SKIPPED without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import labs
from labs import checks
from labs.__main__ import main as labs_main

LABS_DIR = Path(labs.__file__).parent
NAMES = [lab.name for lab in labs.LABS]


def _variant(tmp_path: Path, name: str, *edits: tuple[str, str], template: bool = False) -> Path:
    """A copy of a lab (the solution, or the template) with text replaced: a learner's attempt."""
    src = (LABS_DIR / f"{name}.py" if template else LABS_DIR / "solutions" / f"{name}.py").read_text()
    for old, new in edits:
        assert old in src, f"{old!r} is not in {name}.py"
        src = src.replace(old, new)
    path = tmp_path / f"{name}_attempt.py"
    path.write_text(src)
    return path


def _fill(tmp_path: Path, name: str, gap: str, body: str) -> Path:
    """The template with one gap's ``raise NotImplementedError("TODO(lab): <gap>")`` replaced by ``body``."""
    return _variant(tmp_path, name, (f'    raise NotImplementedError("TODO(lab): {gap}")', body), template=True)


# -------------------------------------------------------------------------------------------------
# every lab: the solution passes, the template fails with the open gap

@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(name):
    if name == "gpu_timed" and not torch.cuda.is_available():
        with pytest.raises(labs.NeedsGPU, match="needs a CUDA GPU"):
            labs.check(name, solution=True)
        return
    summary = labs.check(name, solution=True)
    assert isinstance(summary, str) and summary


@pytest.mark.parametrize("name", NAMES)
def test_template_fails_with_the_open_gap(name):
    result = labs.grade(name)
    assert result.status == "gap" and result.exit_code == 1, result.message
    assert result.message.startswith("a TODO(lab) gap is still open"), result.message


@pytest.mark.parametrize("name", NAMES)
def test_template_marks_its_gaps(name):
    template = (LABS_DIR / f"{name}.py").read_text()
    solution = (LABS_DIR / "solutions" / f"{name}.py").read_text()
    assert "# TODO(lab)" in template and "raise NotImplementedError" in template
    assert "raise NotImplementedError" not in solution, "the solution should fill every gap"


def test_at_least_ten_labs_and_a_readme_row_each():
    readme = (LABS_DIR / "README.md").read_text()
    assert len(labs.LABS) >= 10
    for lab in labs.LABS:
        assert f"[`{lab.name}`]({lab.name}.py)" in readme, f"labs/README.md has no row for {lab.name}"


# -------------------------------------------------------------------------------------------------
# lab 3: the prediction may not ask the compiler

def test_pipeline_prediction_cannot_ask_the_compiler(monkeypatch):
    lab = labs.load("pipeline_stages", solution=True)
    monkeypatch.setattr(lab, "predict_ptx_counts", lambda s, bm, bn, d: lab.ptx_counts(s, bm, bn, d))
    with pytest.raises(AssertionError, match="must not call labs/compile_helper.py"):
        checks.check_pipeline_stages(lab)


def test_pipeline_prediction_cannot_alias_the_compiler(monkeypatch):
    from labs.compile_helper import compile_ptx as cc, count_instructions

    lab = labs.load("pipeline_stages", solution=True)

    def predict(s, bm, bn, d):  # an alias made at import time: patching names would miss it
        return count_instructions(cc(lab.__name__, "attention_kernel", num_stages=s,
                                     constexprs={"D": d, "BLOCK_M": bm, "BLOCK_N": bn}))

    monkeypatch.setattr(lab, "predict_ptx_counts", predict)
    with pytest.raises(AssertionError, match="must not call"):
        checks.check_pipeline_stages(lab)


def test_pipeline_prediction_cannot_run_a_compiler_process(monkeypatch):
    lab = labs.load("pipeline_stages", solution=True)

    def predict(s, bm, bn, d):
        import os
        os.system("true")
        return {}

    monkeypatch.setattr(lab, "predict_ptx_counts", predict)
    with pytest.raises(AssertionError, match="must not start a process"):
        checks.check_pipeline_stages(lab)


def test_pipeline_prediction_for_the_default_tile_only_fails(monkeypatch):
    """The old lab's answer (a formula in num_stages alone, right for 64x64 tiles at d=64) is wrong
    on the other tiles the check asks about, including the ones it compiles."""
    lab = labs.load("pipeline_stages", solution=True)
    right = lab.predict_ptx_counts
    monkeypatch.setattr(lab, "predict_ptx_counts", lambda s, bm, bn, d: right(s, 64, 64, 64))
    with pytest.raises(AssertionError, match="predicted"):
        checks.check_pipeline_stages(lab)


# -------------------------------------------------------------------------------------------------
# lab 4: the prediction may not ask the bank model

def test_bank_prediction_cannot_ask_the_bank_model(monkeypatch):
    from stages.bank_model import wavefronts

    lab = labs.load("bank_padding", solution=True)
    monkeypatch.setattr(lab, "predict_column_wavefronts", lambda row: wavefronts(lab.column_read_addresses(row), 4))
    with pytest.raises(AssertionError, match="must not call stages/bank_model.py"):
        checks.check_bank_padding(lab)


def test_bank_padding_cannot_search_with_the_bank_model(monkeypatch):
    import stages.bank_model as bm

    lab = labs.load("bank_padding", solution=True)

    def search(D):
        row = D + D % 2
        while bm.wavefronts(lab.column_read_addresses(row), 4) > 1:
            row += 2
        return row

    monkeypatch.setattr(lab, "padded_row_halves", search)
    with pytest.raises(AssertionError, match="must not call stages/bank_model.py"):
        checks.check_bank_padding(lab)


def test_bank_check_builds_its_own_addresses(monkeypatch):
    """Editing the helper so every lane reads one word (no conflict ever) and predicting 1 fails."""
    lab = labs.load("bank_padding", solution=True)
    monkeypatch.setattr(lab, "column_read_addresses", lambda row: [0] * 32)
    monkeypatch.setattr(lab, "predict_column_wavefronts", lambda row: 1)
    with pytest.raises(AssertionError, match="predicted 1 wavefronts, bank model"):
        checks.check_bank_padding(lab)


def test_wrong_answer_is_caught(monkeypatch):
    """A filled-in but wrong gap fails the check with AssertionError, not silently."""
    wrong = labs.load("bank_padding", solution=True)
    monkeypatch.setattr(wrong, "padded_row_halves", lambda D: D + 4)  # conflict-free for some D, never minimal
    with pytest.raises(AssertionError):
        checks.check_bank_padding(wrong)


# -------------------------------------------------------------------------------------------------
# lab 8: the fused forward

def test_fused_forward_top_left_causal_fails(tmp_path):
    path = _variant(tmp_path, "fused_forward", ("(cols[None, :] <= rows[:, None] + offset)",
                                                "(cols[None, :] <= rows[:, None])"))
    result = labs.grade("fused_forward", path=path)
    assert result.status == "not_yet" and "causal=True" in result.message, result.message


def test_fused_forward_without_the_ragged_key_mask_fails(tmp_path):
    path = _variant(tmp_path, "fused_forward", ("visible = col_ok[None, :]", "visible = cols[None, :] >= 0"))
    result = labs.grade("fused_forward", path=path)
    assert result.status == "not_yet" and "O (B=2, H=3, Nq=37, Nk=45" in result.message, result.message


def test_fused_forward_nan_on_rows_without_keys_fails(tmp_path):
    """Exponentiating against m = -inf (no guard) gives NaN on the causal rows that see no key."""
    path = _variant(tmp_path, "fused_forward",
                    ('m_use = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_use = m_new"))
    result = labs.grade("fused_forward", path=path)
    assert result.status == "not_yet" and "NaN" in result.message, result.message


def test_fused_forward_wrapper_in_torch_does_not_pass(monkeypatch):
    """The check launches the kernel itself: a host wrapper rewritten to call PyTorch changes nothing."""
    lab = labs.load("fused_forward")
    monkeypatch.setattr(lab, "attention", lambda q, k, v, **kw: (torch.softmax(q @ k.transpose(-1, -2), -1) @ v, None))
    with pytest.raises(Exception) as info:
        checks.check_fused_forward(lab)
    assert labs.gap_still_open(info.value), info.value


def test_unmasked_store_is_a_grade_not_a_crash(tmp_path):
    path = _variant(tmp_path, "fused_forward", ("out,\n             mask=row_ok[:, None])", "out)"))
    result = labs.grade("fused_forward", path=path)
    if torch.cuda.is_available():
        # Compiled on a GPU there is no bounds guard: the stray rows land in the output's padding
        # or beyond, and the check fails on what the kernel got wrong (or on the CUDA error).
        assert result.exit_code == 1 and result.message.startswith("NOT YET"), result.message
        return
    assert result.status == "error" and result.exit_code == 1, result.message
    assert result.message.startswith("NOT YET: your kernel raised IndexError: out-of-bounds store"), result.message
    assert "a likely cause: a tl.store without a mask" in result.message


# -------------------------------------------------------------------------------------------------
# lab 9: dK and dV

@pytest.mark.parametrize("edit", [("dk * scale, mask", "dk, mask"),            # dK without the scale of S
                                  ("p * (dp - delta[:, None])", "p * dp")],    # dS without delta
                         ids=["no-scale", "no-delta"])
def test_backward_usual_mistakes_fail(tmp_path, edit):
    result = labs.grade("backward_dkdv", path=_variant(tmp_path, "backward_dkdv", edit))
    assert result.status == "not_yet" and "dK" in result.message, result.message


# -------------------------------------------------------------------------------------------------
# lab 13: dQ in a second pass

@pytest.mark.parametrize("edit,what", [
    (("dq * scale, mask", "dq, mask"), "dQ"),                                  # dQ without the scale of S
    (("p * (dp - delta[:, None])", "p * dp"), "dQ"),                           # dS without delta
    (("hi = tl.minimum(tl.maximum(tl.minimum(pid_m * BLOCK_M + BLOCK_M, Nq) + offset, 0), Nk)", "hi = Nk"),
     "key tiles"),                                                             # every key tile, masked
], ids=["no-scale", "no-delta", "no-causal-stop"])
def test_backward_dq_usual_mistakes_fail(tmp_path, edit, what):
    result = labs.grade("backward_dq", path=_variant(tmp_path, "backward_dq", edit))
    assert result.status == "not_yet" and what in result.message, result.message


# -------------------------------------------------------------------------------------------------
# lab 10: the split-KV merge

_MERGE_AVERAGE = '''    cnt = tl.zeros((BLOCK_R,), tl.float32)
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        lse_s = tl.load(LSE_PART + s * ROWS + rows, mask=row_ok, other=float("-inf"))
        o_s = tl.load(O_PART + (s * ROWS + rows)[:, None] * D + ds[None, :], mask=mask, other=0.0)
        some = lse_s > float("-inf")
        acc += tl.where(some[:, None], o_s, 0.0)
        cnt += some.to(tl.float32)
        m = tl.maximum(m, lse_s)
    tl.store(O + rows[:, None] * D + ds[None, :], acc / tl.maximum(cnt, 1.0)[:, None], mask=mask)
    tl.store(LSE + rows, tl.where(cnt > 0, m, float("inf")), mask=row_ok)'''

_MERGE_MAX_PICK = '''    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    best = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        lse_s = tl.load(LSE_PART + s * ROWS + rows, mask=row_ok, other=float("-inf"))
        o_s = tl.load(O_PART + (s * ROWS + rows)[:, None] * D + ds[None, :], mask=mask, other=0.0)
        best = tl.where((lse_s > m)[:, None], o_s, best)
        m = tl.maximum(m, lse_s)
    tl.store(O + rows[:, None] * D + ds[None, :], best, mask=mask)
    tl.store(LSE + rows, tl.where(m > float("-inf"), m, float("inf")), mask=row_ok)'''

_MERGE_NAIVE_EXP = '''    den = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s in range(SPLITS):
        lse_s = tl.load(LSE_PART + s * ROWS + rows, mask=row_ok, other=float("-inf"))
        o_s = tl.load(O_PART + (s * ROWS + rows)[:, None] * D + ds[None, :], mask=mask, other=0.0)
        w = tl.exp(lse_s)
        den += w
        acc += w[:, None] * o_s
    tl.store(O + rows[:, None] * D + ds[None, :], acc / den[:, None], mask=mask)
    tl.store(LSE + rows, tl.log(den), mask=row_ok)'''


@pytest.mark.parametrize("body", [_MERGE_AVERAGE, _MERGE_MAX_PICK, _MERGE_NAIVE_EXP],
                         ids=["average", "max-pick", "exp-without-max"])
def test_merge_shortcuts_fail(tmp_path, body):
    result = labs.grade("splitkv_merge", path=_fill(tmp_path, "splitkv_merge", "merge_kernel", body))
    assert result.status == "not_yet" and "merged" in result.message, result.message


# -------------------------------------------------------------------------------------------------
# lab 11: traffic, predicted without the stages' models

def test_traffic_prediction_cannot_ask_the_stage(monkeypatch):
    from stages import STAGES, Problem

    lab = labs.load("traffic_prediction", solution=True)

    def ask(B, Hq, Hkv, Nq, Nk, D, dtype, causal):
        t = STAGES["a"].hbm_bytes(Problem(B, Hq, Nq, D, dtype, causal, Hkv, Nk))
        return t.read, t.write

    monkeypatch.setattr(lab, "stage_a_bytes", ask)
    with pytest.raises(AssertionError, match="must not call stages/"):
        checks.check_traffic_prediction(lab)


def test_traffic_prediction_cannot_borrow_the_pair_count(monkeypatch):
    from stages.contract import visible_pairs

    lab = labs.load("traffic_prediction", solution=True)
    monkeypatch.setattr(lab, "visible_pairs", visible_pairs)  # stage A's solution calls it by this name
    with pytest.raises(AssertionError, match="must not call stages/contract.py"):
        checks.check_traffic_prediction(lab)


def test_traffic_prediction_fp32_tile_matters(tmp_path):
    path = _variant(tmp_path, "traffic_prediction", ('block_m = 32 if dtype == "fp32" else 64', "block_m = 64"))
    result = labs.grade("traffic_prediction", path=path)
    assert result.status == "not_yet" and "stage B" in result.message and "fp32" in result.message, result.message


# -------------------------------------------------------------------------------------------------
# lab 14: the launch order of a causal backward

_SOLUTION_ORDER = "    return sorted(programs, key=lambda p: (-work[p[1]][p[0]], p[0], p[1]))"


@pytest.mark.parametrize("order, what", [
    ("    return programs", "the kernels' default, one head after another"),
    ("    return sorted(programs, key=lambda p: work[p[1]][p[0]])", "shortest first"),
], ids=["head-by-head", "shortest-first"])
def test_program_order_that_leaves_heavy_programs_last_fails(tmp_path, order, what):
    result = labs.grade("program_order", path=_variant(tmp_path, "program_order", (_SOLUTION_ORDER, order)))
    assert result.status == "not_yet" and "the check's order" in result.message, (what, result.message)


@pytest.mark.parametrize("edit, match", [
    (("    return max(free)", "    return sum(work) / sms"), "makespan of"),
    ((_SOLUTION_ORDER, _SOLUTION_ORDER + "[:-1] + [(0, 0)]"), "every \\(tile, batch·head\\) once"),
], ids=["average-load", "a-program-twice"])
def test_program_order_shortcuts_fail(tmp_path, edit, match):
    import re

    result = labs.grade("program_order", path=_variant(tmp_path, "program_order", edit))
    assert result.status == "not_yet" and re.search(match, result.message), result.message


def test_program_order_durations_are_the_checks_own(tmp_path):
    """A helper rewritten to make every program free does not make any order pass."""
    path = _variant(tmp_path, "program_order", ("    return [[group * cdiv(N - t * kv_rows, q_rows)",
                                                  "    return [[0 * cdiv(N - t * kv_rows, q_rows)"),
                    (_SOLUTION_ORDER, "    return programs"))
    result = labs.grade("program_order", path=path)
    assert result.status == "not_yet" and "the check's order" in result.message, result.message


def test_program_order_cannot_ask_the_kernels_model(monkeypatch):
    from stages.c_optimized import hopper_bwd

    lab = labs.load("program_order", solution=True)
    monkeypatch.setattr(lab, "makespan", lambda work, sms: hopper_bwd.makespan(work, sms))
    with pytest.raises(AssertionError, match="must not call stages/"):
        checks.check_program_order(lab)


# -------------------------------------------------------------------------------------------------
# the CLI

def test_cli_lists_and_checks(capsys):
    assert labs_main([]) == 0
    listed = capsys.readouterr().out
    assert all(lab.name in listed for lab in labs.LABS)
    assert labs_main(["check", "bank_padding", "--solution", "--in-process"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert labs_main(["check", "bank_padding", "--in-process"]) == 1
    assert "gap is still open" in capsys.readouterr().out
    assert labs_main(["check", "no_such_lab"]) == 2


def test_cli_unmasked_store_in_a_child_process(tmp_path, capfd):
    """The real path: the grade runs in a child; an unmasked store is one NOT YET line, exit 1."""
    path = _variant(tmp_path, "delta_prepass", (", mask=rows < n_rows)", ")"))
    assert labs_main(["check", "delta_prepass", "--file", str(path)]) == 1
    out, err = capfd.readouterr()
    assert "NOT YET: your kernel raised IndexError: out-of-bounds store" in out, out + err
    assert "a likely cause:" in out
    assert "Traceback" not in out + err


def test_cli_traceback_on_request(tmp_path, capsys):
    path = _variant(tmp_path, "delta_prepass", (", mask=rows < n_rows)", ")"))
    assert labs_main(["check", "delta_prepass", "--file", str(path), "--in-process", "--traceback"]) == 1
    captured = capsys.readouterr()
    assert "Traceback" in captured.err and "NOT YET" in captured.out


def test_cli_reports_a_process_crash(tmp_path, capfd):
    """Native code that kills the interpreter (here a read of address 0) is a failing grade too."""
    path = _variant(tmp_path, "bank_padding", ("    return gcd(row_halves // 2, BANKS)",
                                               "    import ctypes\n    ctypes.string_at(0)\n    return 1"))
    assert labs_main(["check", "bank_padding", "--file", str(path)]) == 1
    out, _ = capfd.readouterr()
    assert "NOT YET: your code crashed the Python process (SIGSEGV)" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the skip path is for machines without a GPU")
def test_gpu_lab_skips_cleanly_without_a_gpu(capsys):
    assert labs_main(["check", "gpu_timed", "--solution", "--in-process"]) == 3
    out = capsys.readouterr().out
    assert "SKIPPED:" in out and "needs a CUDA GPU" in out


def test_gpu_lab_times_the_kernel_not_the_wrapper(monkeypatch):
    """The check launches ``flash_kernel`` itself, and it must be a Triton kernel: swapping in SDPA
    (in the host function or as the "kernel") is not a faster kernel."""
    lab = labs.load("gpu_timed", solution=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(lab, "attention", lambda q, k, v, **kw: sdpa(q, k, v))
    monkeypatch.setattr(lab, "flash_kernel", lab.attention)
    with pytest.raises(AssertionError, match="must stay a @triton.jit kernel"):
        checks.check_gpu_timed(lab)


def test_unknown_lab_is_a_value_error():
    with pytest.raises(ValueError, match="no lab named"):
        labs.load("nope")


def test_the_package_imports_light():
    """``python -m labs`` lists without importing torch or triton (the grading child does)."""
    code = "import sys, labs; print('torch' in sys.modules, 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=LABS_DIR.parent).stdout.split()
    assert out == ["False", "False"]


def test_the_bounds_guard_leaves_other_kernels_alone():
    """The guard wraps the interpreter's memory operations for the whole process: kernels outside any
    lab must still run, and exactly. Stage C's TMA path (arch 90) loads through tensor descriptors,
    which the interpreter turns into masked loads with options passed by keyword."""
    from labs import guard
    from stages import contract
    from stages.c_optimized import kernels as c_kernels

    guard._install()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 70, 16, generator=g).half()
    k, v = torch.randn(1, 2, 30, 16, generator=g).half(), torch.randn(1, 2, 30, 16, generator=g).half()
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), scale=0.25, attn_mask=torch.ones(70, 30, dtype=torch.bool).tril(-40))
    for arch in (80, 90):
        o = contract.new_output(q)
        for launch in c_kernels.plan(q, k, v, o, causal=True, scale=0.25, arch=arch, split_kv=1):
            launch.run()
        assert torch.allclose(o.double().nan_to_num(), want.nan_to_num(), atol=2e-3), arch
