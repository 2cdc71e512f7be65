"""The tuner's choice among close candidates (no GPU needed: the timings are given)."""

from __future__ import annotations

import itertools

import pytest

from stages.c_optimized import tune


def test_a_clear_winner_is_not_timed_again():
    calls = []
    winner, ms = tune.pick({"a": 1.00, "b": 1.10, "c": 1.50}, lambda c: calls.append(c) or 0.0)
    assert (winner, ms) == ("a", 1.00)
    assert calls == []


def test_close_candidates_are_timed_again_in_turns_and_the_lowest_median_wins():
    # First pass: "a" 1 % ahead of "b"; timed again, "b" is faster every round.
    again = {"a": itertools.repeat(1.05), "b": itertools.repeat(0.98)}
    calls = []

    def retime(c):
        calls.append(c)
        return next(again[c])

    winner, ms = tune.pick({"a": 1.00, "b": 1.01, "c": 2.0}, retime)
    assert winner == "b" and ms == 0.98
    assert calls == ["a", "b"] * tune.TIE_ROUNDS  # interleaved, the slow "c" left out


def test_close_candidates_are_those_within_the_margin():
    times = {"a": 1.00, "b": 1.00 * (1 + tune.TIE_MARGIN) - 1e-9, "c": 1.00 * (1 + tune.TIE_MARGIN) + 1e-6}
    assert tune.close_candidates(times) == ["a", "b"]


def test_a_candidate_that_fails_when_timed_again_drops_out_and_the_others_go_on(capsys):
    def retime(c):
        if c == "a":
            raise RuntimeError("out of memory\nmore detail")
        return 1.02

    winner, ms = tune.pick({"a": 1.00, "b": 1.01}, retime)
    assert (winner, ms) == ("b", 1.02)
    assert "a: timed again, RuntimeError: out of memory; left out" in capsys.readouterr().out


def test_the_error_is_raised_when_every_close_candidate_fails_again():
    def retime(c):
        raise RuntimeError("device lost")

    with pytest.raises(RuntimeError, match="device lost"):
        tune.pick({"a": 1.00, "b": 1.01}, retime)


# ------------------------------------------------------------------ a GPU that was never tuned


def test_an_untuned_gpu_reads_the_tuning_of_a_gpu_of_its_architecture():
    from stages.c_optimized import configs

    h200 = configs.TUNED_DIR / "h200.json"
    h100_bwd = configs.TUNED_DIR / "h100-80gb-hbm3-backward.json"
    assert configs.tuning_file("h200", "", 90) == h200  # its own, whatever the arch asked
    assert configs.tuning_file("h100-80gb-hbm3", "-backward", 90) == h100_bwd
    # An H100 has no forward file: it reads the H200's. An H800 (sm_90) has neither: it reads the first
    # Hopper file by name of each, forward and backward apart.
    assert configs.tuning_file("h100-80gb-hbm3", "", 90) == h200
    assert configs.tuning_file("h800-pcie", "", 90) == h200
    assert configs.tuning_file("h800-pcie", "-backward", 90) == h100_bwd
    # An A100 (sm_80) has nothing of its architecture; no GPU (arch None) borrows nothing.
    assert configs.tuning_file("a100-sxm4-80gb", "", 80) is None
    assert configs.tuning_file("h800-pcie", "-backward", None) is None
    assert configs.tuning_file(None, "", 90) is None


def test_an_untuned_sm90_gpu_runs_the_hopper_backward(monkeypatch):
    """The Hopper backward runs only where a tuned plan names it: a GPU without a file of its own
    must still get it (it once fell back to the hand-picked tl tiles: half of cuDNN on an H100)."""
    import torch

    from stages.c_optimized import backward as bwd, configs

    monkeypatch.setattr(configs, "this_arch", lambda: 90)
    monkeypatch.setattr(bwd, "this_arch", lambda: 90)
    monkeypatch.setattr(bwd, "gpu_slug", lambda: "h800-pcie")
    bwd.tuned_backward_table.cache_clear()
    bwd.backward_plan.cache_clear()
    try:
        plan = bwd.backward_plan(128, torch.bfloat16, 90, False)
        assert plan.ws is not None
        assert bwd.tuned_backward_table("h800-pcie") == bwd.tuned_backward_table("h100-80gb-hbm3")
    finally:
        bwd.tuned_backward_table.cache_clear()
        bwd.backward_plan.cache_clear()


def test_a_gpus_first_tuning_starts_from_the_borrowed_winners(monkeypatch, tmp_path):
    import json

    from stages.c_optimized import configs

    monkeypatch.setattr(configs, "this_arch", lambda: 90)
    seed = configs.seed_tuning(tmp_path / "h800-pcie-backward.json", "-backward")
    h100 = json.loads((configs.TUNED_DIR / "h100-80gb-hbm3-backward.json").read_text())
    assert seed["best"] == h100["best"] and seed["seeded_from"] == "h100-80gb-hbm3-backward" and "gpu" not in seed
    monkeypatch.setattr(configs, "this_arch", lambda: 80)
    assert configs.seed_tuning(tmp_path / "a100-backward.json", "-backward") == {}
