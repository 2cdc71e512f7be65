"""What each step is worth, read from the committed ablation rows (``results/<gpu>/runs.csv``).

A step's share at a cell compares two rows of ``python -m harness sweep --stages c --ablation``:
the step's own ``+name`` row and the row of the step before it (for ``+none``, stage B's plain row),
the newest ``ok`` row of each (``harness.views.load`` keeps the last measurement of a cell). The
share is the report's (``harness.report.ablation_table``): the step's part of the logarithm of the
whole B → C speedup (C = the ``all`` row), so the shares of the walk add up to about 100 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from harness import views

from .ladder import Cell, Step, previous

RESULTS_DIR = Path(__file__).resolve().parents[3] / "results" / "h200"


@dataclass(frozen=True)
class Share:
    """One step at one cell: TFLOPS and median ms of the row before and of the step's row (None
    where a row is missing or not ``ok``); ``before``: what the row before is (``+tma``, "stage B")."""

    before: str
    tflops_before: float | None
    tflops_after: float | None
    ms_before: float | None
    ms_after: float | None
    share: float | None  # of log(B ms / C ms); None without the B or C row

    @property
    def speedup(self) -> float | None:
        if self.ms_before and self.ms_after:
            return self.ms_before / self.ms_after
        return None


def load_rows(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """The newest row of every forward grid cell of ``results_dir`` (``harness.views.load``)."""
    return views.load(results_dir)[0]


def _row(rows: list[dict], cell: Cell, impl: str, kind: str, variant: str) -> dict | None:
    found = [r for r in rows if r["impl"] == impl and r["kind"] == kind and (r.get("variant") or "") == variant
             and (r["B"], r["H"], r["N"], r["D"], r["dtype"], bool(r["causal"]))
             == (cell.B, cell.H, cell.N, cell.D, cell.dtype, cell.causal) and views.is_ok(r)]
    return found[-1] if found else None


def _step_row(rows, cell: Cell, step: Step | None) -> dict | None:
    if step is None:
        return _row(rows, cell, "b", "stage", "")
    return _row(rows, cell, "c", "ablation", step.variant)


def share(rows: list[dict], step: Step, cell: Cell) -> Share:
    """The step's measured effect at ``cell``."""
    before_step = previous(step)
    before, after = _step_row(rows, cell, before_step), _step_row(rows, cell, step)
    b, c = _row(rows, cell, "b", "stage", ""), _row(rows, cell, "c", "ablation", "all")
    total = math.log(b["ms_median"] / c["ms_median"]) if b and c and b["ms_median"] > c["ms_median"] else None
    part = None
    if total and before and after:
        part = math.log(before["ms_median"] / after["ms_median"]) / total
    return Share(before="stage B" if before_step is None else before_step.variant,
                 tflops_before=before and before["tflops"], tflops_after=after and after["tflops"],
                 ms_before=before and before["ms_median"], ms_after=after and after["ms_median"], share=part)


def stage_totals(rows: list[dict], cell: Cell) -> tuple[dict | None, dict | None]:
    """(stage B's row, stage C's ``all`` row) at ``cell``: the two ends of the walk."""
    return _row(rows, cell, "b", "stage", ""), _row(rows, cell, "c", "ablation", "all")


__all__ = ["RESULTS_DIR", "Share", "load_rows", "share", "stage_totals"]
