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
