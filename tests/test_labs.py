"""The labs grade what they should: every reference solution passes its check, and every template, as
shipped, fails it (a gap still open, or a wrong answer), so a lab cannot be solved by doing nothing.

CPU only: the Triton interpreter at tiny sizes; ``pipeline_stages`` compiles for sm_80 without a GPU.
"""

from __future__ import annotations

import pytest

import labs
from labs.__main__ import main as labs_main


@pytest.mark.parametrize("name", [lab.name for lab in labs.LABS])
def test_solution_passes(name):
    summary = labs.check(name, solution=True)
    assert isinstance(summary, str) and summary


@pytest.mark.parametrize("name", [lab.name for lab in labs.LABS])
def test_template_fails(name):
    with pytest.raises(Exception) as info:
        labs.check(name, solution=False)
    assert isinstance(info.value, AssertionError) or labs.gap_still_open(info.value), info.value


@pytest.mark.parametrize("name", [lab.name for lab in labs.LABS])
def test_template_marks_its_gaps(name):
    from pathlib import Path

    template = Path(labs.__file__).parent / f"{name}.py"
    solution = Path(labs.__file__).parent / "solutions" / f"{name}.py"
    assert "# TODO(lab)" in template.read_text() and "raise NotImplementedError" in template.read_text()
    assert "raise NotImplementedError" not in solution.read_text(), "the solution should fill every gap"


def test_wrong_answer_is_caught(monkeypatch):
    """A filled-in but wrong gap fails the check with AssertionError, not silently."""
    wrong = labs.load("bank_padding", solution=True)
    monkeypatch.setattr(wrong, "padded_row_halves", lambda D: D + 4)  # conflict-free for some D, never minimal
    with pytest.raises(AssertionError):
        from labs import checks

        checks.check_bank_padding(wrong)


def test_cli_lists_and_checks(capsys):
    assert labs_main([]) == 0
    listed = capsys.readouterr().out
    assert all(lab.name in listed for lab in labs.LABS)
    assert labs_main(["check", "bank_padding", "--solution"]) == 0
    assert "PASS" in capsys.readouterr().out
    assert labs_main(["check", "bank_padding"]) == 1
    assert "gap is still open" in capsys.readouterr().out
    assert labs_main(["check", "no_such_lab"]) == 2


def test_unknown_lab_is_a_value_error():
    with pytest.raises(ValueError, match="no lab named"):
        labs.load("nope")
