"""The end-to-end check of the backward passes: a tiny GPT trains with each stage and with SDPA from
the same weights and batches, and the loss curves agree (harness/train.py).

CPU: the stages run in the Triton interpreter, so the model is as small as still learns something
(one block, two query heads sharing one K/V head, head dim 16, 16 tokens, 2 sequences, 6 steps).
"""

from __future__ import annotations

import csv
import math

import pytest
import torch

from harness import train as T

from .helpers import run_cli

# the stages run compiled on a GPU (CPU tensors are for the interpreter only)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

MODEL = T.ModelConfig(n_layer=1, n_head=2, n_kv_head=1, head_dim=16, context=16)
CONFIG = T.TrainConfig(steps=6, batch=2, lr=1e-2, dtype="fp32", warmup=1)
TOLERANCE = T.LOSS_TOLERANCE["fp32"]


@pytest.fixture(scope="module")
def sdpa_run() -> T.TrainRun:
    return T.train(T.sdpa_attention, MODEL, CONFIG, stage="sdpa", device=DEVICE)


def _learned(run: T.TrainRun) -> bool:
    """At init the logits are ~0, so the first loss is ~ln(vocab); learning the character frequencies
    alone takes it well below that within a few steps. Batches of 32 tokens make single steps noisy,
    so the second half's mean is compared (a model that does not learn stays within ~1 % of ln(vocab))."""
    uniform = math.log(MODEL.vocab_size)
    second_half = run.losses[len(run.losses) // 2:]
    return abs(run.losses[0] - uniform) < 0.05 * uniform and sum(second_half) / len(second_half) < 0.93 * run.losses[0]


def test_sdpa_reference_learns(sdpa_run):
    assert sdpa_run.status == "ok" and len(sdpa_run.losses) == CONFIG.steps
    assert _learned(sdpa_run), sdpa_run.losses


def test_the_learning_check_can_fail():
    frozen = T.train(T.sdpa_attention, MODEL, T.TrainConfig(**{**CONFIG.__dict__, "lr": 1e-7}), device=DEVICE)
    assert not _learned(frozen), frozen.losses


def test_same_seed_same_run(sdpa_run):
    again = T.train(T.sdpa_attention, MODEL, CONFIG, device=DEVICE)
    assert again.losses == sdpa_run.losses


@pytest.mark.parametrize("stage", ["b", "c", "a"])
def test_stage_trains_like_sdpa(stage, sdpa_run):
    run = T.train(T.attention_for(stage), MODEL, CONFIG, stage=stage, device=DEVICE)
    assert run.status == "ok", run.status
    assert _learned(run), run.losses
    gap = T.max_loss_gap(run.losses, sdpa_run.losses)
    assert gap <= TOLERANCE, f"stage {stage}: loss differs from sdpa's by up to {gap:.2e} (tolerance {TOLERANCE})"


def _textbook_attention(q, k, v, *, causal=False, sm_scale=None):
    """softmax(QKᵀ/√D)·V from torch ops (autograd differentiates it): a correct second implementation."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[2]
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s.softmax(-1) @ v


class _ZeroValueGradient(torch.autograd.Function):
    """Correct forward, wrong backward: dV comes back as zeros (a forgotten accumulation)."""

    @staticmethod
    def forward(ctx, q, k, v):
        with torch.enable_grad():
            q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
            o = _textbook_attention(q_, k_, v_, causal=True)
        ctx.save_for_backward(q_, k_, v_, o)
        return o.detach()

    @staticmethod
    def backward(ctx, do):
        q_, k_, v_, o = ctx.saved_tensors
        with torch.enable_grad():
            dq, dk, dv = torch.autograd.grad(o, (q_, k_, v_), do)
        return dq, dk, torch.zeros_like(dv)


def test_a_second_correct_implementation_agrees(sdpa_run):
    run = T.train(_textbook_attention, MODEL, CONFIG, device=DEVICE)
    assert T.max_loss_gap(run.losses, sdpa_run.losses) <= TOLERANCE


@pytest.mark.parametrize("broken", [
    pytest.param(lambda q, k, v, causal: T.sdpa_attention(q, k, v, causal=False), id="future-leak"),
    pytest.param(lambda q, k, v, causal: _ZeroValueGradient.apply(q, k, v), id="wrong-dV"),
])
def test_the_check_catches_a_broken_attention(broken, sdpa_run):
    run = T.train(broken, MODEL, CONFIG, device=DEVICE)
    assert T.max_loss_gap(run.losses, sdpa_run.losses) > TOLERANCE


def _recording(name: str, calls: list[str], attention=T.sdpa_attention):
    def attend(q, k, v, *, causal=False):
        calls.append(name)
        return attention(q, k, v, causal=causal)
    return attend


def test_lockstep_interleaves_and_rotates_the_stages(sdpa_run):
    """Every step, each stage takes its step in turn, and the first of the turn rotates (step i starts
    with stage i mod n); each model still starts from the same weights and sees the same batches."""
    names, calls = ["x", "y", "z"], []
    runs = T.train_lockstep({n: _recording(n, calls) for n in names}, MODEL, CONFIG, device=DEVICE)
    assert list(runs) == names
    # MODEL has one block: one attention call per forward, so the calls are the steps' order
    assert calls == [names[(step + turn) % 3] for step in range(CONFIG.steps) for turn in range(3)]
    for run in runs.values():
        assert run.status == "ok" and len(run.step_ms) == CONFIG.steps
        assert run.losses == sdpa_run.losses  # as if trained alone


def test_lockstep_a_failing_stage_lets_the_others_go_on(sdpa_run):
    calls = []

    def fails_at_step_3(q, k, v, *, causal=False):
        if calls.count("boom") == 3:  # this is its third call (recorded before it runs)
            raise RuntimeError("boom\nsecond line")
        return T.sdpa_attention(q, k, v, causal=causal)

    def diverges(q, k, v, *, causal=False):
        return T.sdpa_attention(q, k, v, causal=causal) * float("nan")

    runs = T.train_lockstep({"sdpa": _recording("sdpa", calls), "boom": _recording("boom", calls, fails_at_step_3),
                             "nan": diverges}, MODEL, CONFIG, device=DEVICE)
    assert runs["sdpa"].status == "ok" and runs["sdpa"].losses == sdpa_run.losses
    assert runs["boom"].status == "error: RuntimeError: boom" and runs["boom"].losses == []
    assert runs["nan"].status == "error: loss is nan at step 0" and len(runs["nan"].losses) == 1
    assert calls.count("boom") == 3 and calls.count("sdpa") == CONFIG.steps  # boom stopped after failing


def test_device_bytes_counts_each_storage_once_in_allocator_blocks():
    a, b = torch.zeros(10), torch.zeros(200)  # 40 and 800 bytes: one and two 512-byte blocks
    assert T._device_bytes([a, a[2:], b, None], torch.device("cpu")) == 3 * 512
    assert T._device_bytes([a], torch.device("cuda", 0)) == 0


def test_attention_without_backward_is_an_error():
    def detached(q, k, v, *, causal=False):
        return T.sdpa_attention(q, k, v, causal=causal).detach()

    with pytest.raises(T.NoBackwardError, match="no backward"):
        T.train(detached, MODEL, CONFIG, device=DEVICE)


def test_corpus_is_deterministic_and_in_the_alphabet():
    text = T.make_corpus(5000, seed=3)
    assert text == T.make_corpus(5000, seed=3) and text != T.make_corpus(5000, seed=4)
    assert len(text) == 5000 and set(text) <= set(T.ALPHABET)
    assert T.decode(T.encode(text)) == text
    with pytest.raises(ValueError, match="n_chars"):
        T.make_corpus(0)


@pytest.mark.parametrize("kwargs, name", [(dict(n_head=3, n_kv_head=2), "n_head"), (dict(context=0), "context")])
def test_model_config_rejects_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=name):
        T.ModelConfig(**kwargs)


# ------------------------------------------------------------------------------------------------ CLI

_run = run_cli


def test_cli_rejects_an_unknown_stage(capsys):
    code, _, err = _run(["train", "--stage", "zz"], capsys)
    assert code == 2 and "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert "--stage" in message and "'zz'" in message
    assert all(name in message for name in ("a", "b", "c", "sdpa"))


def test_cli_rejects_heads_not_divisible_by_kv_heads(capsys):
    code, _, err = _run(["train", "--stage", "sdpa", "--heads", "3", "--kv-heads", "2"], capsys)
    assert code == 2 and "--kv-heads" in err and "Traceback" not in err


def test_cli_writes_losses_summary_and_figure(tmp_path, capsys):
    steps = 3
    code, out, err = _run(["train", "--stages", "sdpa", "--steps", str(steps), "--context", "16", "--batch", "2",
                           "--out", str(tmp_path)], capsys)
    assert code == 0, out + err
    with (tmp_path / "train" / T.LOSSES_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1)) and {r["stage"] for r in rows} == {"sdpa"}
    with (tmp_path / "train" / T.SUMMARY_CSV).open() as f:
        (summary,) = list(csv.DictReader(f))
    assert summary["status"] == "ok" and float(summary["final_loss"]) == float(rows[-1]["loss"])
    assert (tmp_path / "train" / "env.json").exists()
    figure = tmp_path / "figures" / "train_loss.png"
    assert figure.exists()
    figure.unlink()
    code, out, err = _run(["train", "--plot", str(tmp_path)], capsys)
    assert code == 0 and figure.exists(), out + err


def test_the_loss_figure_draws_one_run_the_latest(tmp_path):
    """The figure's curves come from the run appended last, all its stages and no other run's: a stage
    missing from it is not drawn from an older run of other length or mode."""
    run = lambda stage, losses: T.TrainRun(stage=stage, losses=losses, step_ms=[1.0] * len(losses),
                                           tokens_per_step=10)
    old_cfg = T.TrainConfig(**{**CONFIG.__dict__, "steps": 3})
    for stage in ("a", "sdpa"):
        T.write_run(tmp_path, "2026-01-01", run(stage, [3.0, 2.0, 1.0]), MODEL, old_cfg, device="cpu",
                    reference_losses=None)
    new_cfg = T.TrainConfig(**{**CONFIG.__dict__, "steps": 2, "compile": "inductor"})
    for stage in ("c", "sdpa"):
        T.write_run(tmp_path, "2026-02-01", run(stage, [3.0, 2.5]), MODEL, new_cfg, device="cpu",
                    reference_losses=None)
    curves = T.load_losses(tmp_path)
    assert set(curves) == {"c", "sdpa"} and {c["run_id"] for c in curves.values()} == {"2026-02-01"}
    assert curves["sdpa"]["losses"] == [3.0, 2.5]
    assert T._compile_label(tmp_path, "2026-02-01") == ", compiled (inductor)"
    assert T._compile_label(tmp_path, "2026-01-01") == ""
    assert T.plot_train_losses(tmp_path).exists()


@pytest.mark.slow
def test_cli_default_tiny_run_all_stages_agree(tmp_path, capsys):
    code, out, err = _run(["train", "--out", str(tmp_path)], capsys)
    assert code == 0, out + err
    with (tmp_path / "train" / T.SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert {r["stage"] for r in rows} == {"a", "b", "c", "sdpa"}
    for r in rows:
        assert r["status"] == "ok" and (r["stage"] == "sdpa" or float(r["max_loss_gap"]) <= float(r["tolerance"]))


# ------------------------------------------------------------------------------------- compiled steps

def _custom_ops_run(fn) -> set[str]:
    """The lab's custom ops (``attention_lab::...``) that ran during ``fn()``, by the profiler's names.
    Eager calls skip the dispatcher (stages/ops.py), so only a traced call shows up here."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("attention_lab::")}


def test_compiled_steps_train_like_eager_through_the_custom_ops(sdpa_run):
    """``compile="inductor"``: forward and loss through torch.compile(fullgraph=True), the backward
    AOTAutograd's. The stage's kernels must run as its custom ops, forward and backward (a graph break
    or a fallback to the eager path would not), and train as eager SDPA does."""
    cfg = T.TrainConfig(**{**CONFIG.__dict__, "compile": "inductor"})
    runs = {}
    ran = _custom_ops_run(lambda: runs.update(c=T.train(T.attention_for("c"), MODEL, cfg, stage="c", device=DEVICE)))
    run = runs["c"]
    assert run.status == "ok" and len(run.losses) == CONFIG.steps, run.status
    assert {"attention_lab::c_forward", "attention_lab::c_backward"} <= ran, ran
    gap = T.max_loss_gap(run.losses, sdpa_run.losses)
    assert gap <= TOLERANCE, f"compiled stage c: loss differs from eager sdpa's by up to {gap:.2e}"


def test_eager_steps_skip_the_dispatcher():
    """The other side of the check above: eager, the same training runs no custom op."""
    cfg = T.TrainConfig(**{**CONFIG.__dict__, "steps": 2})
    ran = _custom_ops_run(lambda: T.train(T.attention_for("c"), MODEL, cfg, stage="c", device=DEVICE))
    assert not ran, ran


def test_compile_mode_is_checked():
    with pytest.raises(ValueError, match="compile must be one of off, inductor, cudagraphs"):
        T.TrainConfig(compile="max-autotune")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cli_refuses_cuda_graphs_without_a_gpu(capsys, tmp_path):
    code, _, err = _run(["train", "--stage", "sdpa", "--compile", "cudagraphs", "--out", str(tmp_path)], capsys)
    assert code == 2 and "Traceback" not in err
    assert "--compile" in err and "CUDA" in err


def test_summary_written_before_the_compile_column_is_upgraded_in_place(tmp_path):
    """A summary.csv from before ``compile`` existed: its rows are kept, marked eager, and the new row
    appended; a file with a column this version does not know is refused, untouched."""
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    old_fields = [f for f in T.SUMMARY_FIELDS if f != "compile"]
    old_row = {f: "x" for f in old_fields}
    with (train_dir / T.SUMMARY_CSV).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_fields)
        writer.writeheader()
        writer.writerow(old_row)
    run = T.TrainRun(stage="c", losses=[3.0, 2.0], step_ms=[1.0, 1.0], tokens_per_step=4)
    cfg = T.TrainConfig(**{**CONFIG.__dict__, "compile": "inductor"})
    T.write_run(tmp_path, "r2", run, MODEL, cfg, device="cpu", reference_losses=None)
    with (train_dir / T.SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(T.SUMMARY_FIELDS)
    assert rows[0] == {**old_row, "compile": "off"}
    assert rows[1]["run_id"] == "r2" and rows[1]["compile"] == "inductor"

    other = tmp_path / "other"
    (other / "train").mkdir(parents=True)
    text = "run_id,stage,unknown_column\nr1,c,1\n"
    (other / "train" / T.SUMMARY_CSV).write_text(text)
    from harness.results import ResultsError
    with pytest.raises(ResultsError, match="write to another --out"):
        T.write_run(other, "r2", run, MODEL, cfg, device="cpu", reference_losses=None)
    assert (other / "train" / T.SUMMARY_CSV).read_text() == text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("mode", ["inductor", "cudagraphs"])
def test_gpu_compiled_training_matches_eager(mode):
    """On a GPU, stage C's compiled steps (Inductor; Inductor with CUDA graphs) train as its eager steps
    do, through its custom ops, in bf16 at a size where the kernels are the compiled ones; taking turns
    with SDPA's compiled steps, as ``harness train`` runs them (under CUDA graphs the two stages' graphs
    share one memory pool, so neither may touch what the other's replays overwrite)."""
    model = T.ModelConfig(n_layer=2, n_head=4, n_kv_head=2, head_dim=64, context=256)
    base = dict(steps=8, batch=4, lr=1e-3, dtype="bf16", warmup=2)
    eager = T.train(T.attention_for("c"), model, T.TrainConfig(**base), stage="c", device="cuda")
    runs = {}
    compiled = T.TrainConfig(**base, compile=mode)
    attentions = {"sdpa": T.sdpa_attention, "c": T.attention_for("c")}
    ran = _custom_ops_run(lambda: runs.update(T.train_lockstep(attentions, model, compiled, device="cuda")))
    assert runs["sdpa"].status == "ok", runs["sdpa"].status
    run = runs["c"]
    assert run.status == "ok", run.status
    assert {"attention_lab::c_forward", "attention_lab::c_backward"} <= ran, ran
    gap = T.max_loss_gap(run.losses, eager.losses)
    assert gap <= T.LOSS_TOLERANCE["bf16"], f"{mode}: loss differs from eager's by up to {gap:.2e}"


def test_results_tables_show_each_compile_modes_latest_run_against_sdpa(tmp_path):
    """The results page's train block: one table per compile mode, from that mode's latest run; a row
    written before the compile column counts as eager; × SDPA is SDPA's step time over the stage's."""
    run = lambda stage, ms: T.TrainRun(stage=stage, losses=[3.0, 2.5], step_ms=[ms, ms], tokens_per_step=1000)
    old_fields = [f for f in T.SUMMARY_FIELDS if f != "compile"]
    (tmp_path / "train").mkdir()
    with (tmp_path / "train" / T.SUMMARY_CSV).open("w", newline="") as f:  # an eager run from before the column
        writer = csv.DictWriter(f, fieldnames=old_fields)
        writer.writeheader()
        for stage, ms in (("sdpa", 10.0), ("c", 20.0)):
            writer.writerow({**{k: "" for k in old_fields}, "run_id": "2026-01-01", "stage": stage, "steps": "2",
                             "step_ms_median": str(ms), "status": "ok"})
    rows = T.load_summary(tmp_path)
    assert [r["compile"] for r in rows] == ["off", "off"]
    for run_id, ms_c in (("2026-02-01", 8.0), ("2026-03-01", 5.0)):  # two compiled runs: the later one shows
        cfg = T.TrainConfig(**{**CONFIG.__dict__, "compile": "inductor"})
        for stage, ms in (("sdpa", 10.0), ("c", ms_c)):
            T.write_run(tmp_path, run_id, run(stage, ms), MODEL, cfg, device="cpu", reference_losses=None)
    block = T.render_block(tmp_path, tmp_path)
    eager, compiled = block.split("#### ")[1:]
    assert eager.startswith("Eager steps: run 2026-01-01") and "| C optimized | 20.00 |" in eager
    assert "| 0.50× |" in eager  # 10 ms / 20 ms
    assert compiled.startswith("Compiled steps (Inductor): run 2026-03-01") and "| 2.00× |" in compiled
    assert "2026-02-01" not in block  # (no cudagraphs run: no table for it)
    assert T.render_block(tmp_path / "nothing", tmp_path).count("No training runs yet") == 1


def test_lockstep_by_blocks_leaves_each_blocks_first_step_out_of_the_median(sdpa_run):
    """With ``block`` > 1 the stages take turns a block of steps at a time (block b starts with stage
    b mod n); each block's first step is recorded as right after a switch and left out of the median
    step time; the models still see the same batches as alone."""
    names, calls = ["x", "y", "z"], []
    cfg = T.TrainConfig(**{**CONFIG.__dict__, "block": 4})  # 6 steps: blocks of 4 and 2
    runs = T.train_lockstep({n: _recording(n, calls) for n in names}, MODEL, cfg, device=DEVICE)
    assert calls == [names[(b + turn) % 3] for b, size in enumerate((4, 2)) for turn in range(3) for _ in range(size)]
    for run in runs.values():
        assert run.status == "ok" and run.losses == sdpa_run.losses and run.after_switch == [0, 4]
    run = T.TrainRun(stage="x", step_ms=[100.0, 1.0, 2.0, 3.0, 50.0, 4.0], after_switch=[0, 4])
    assert run.step_ms_median == 2.5  # (the first tenth, at least the first step, and step 4 left out)
    run.after_switch = []
    assert run.step_ms_median == 3.0
    with pytest.raises(ValueError, match="block must be a positive integer"):
        T.TrainConfig(block=0)


def test_a_step_hands_out_its_marks_on_the_hosts_clock():
    """``_StageTrainer.step(step, marks)``: the host's clock where the timed step starts, after its forward,
    backward and optimizer step are issued, and where it ends, in order; its recorded time is end - start."""
    batches = T._Batches(MODEL, CONFIG, torch.device(DEVICE))
    trainer = T._StageTrainer("sdpa", T.sdpa_attention, MODEL, CONFIG, torch.device(DEVICE), batches)
    marks: list[float] = []
    trainer.step(0, marks)
    assert len(marks) == 5 and marks == sorted(marks)
    assert trainer.run.step_ms[-1] == pytest.approx((marks[-1] - marks[0]) * 1e3)
    trainer.step(1)  # (no marks: the step as harness train takes it)
    assert len(trainer.run.step_ms) == 2
