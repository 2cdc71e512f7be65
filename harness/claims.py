"""The numbers the lessons state, checked against the committed results.

A stage README or a notebook that says "B moves 261 MB in 1.97 ms" makes a claim about
``results/h200/``; when the results are re-measured the sentence must follow. A :class:`Claim`
ties a quote of the prose to the computation that produces its numbers, so a test
(``tests/test_claims.py``) fails when the two drift apart::

    Claim("stages/b_tiled/README.md",
          "moves {} MB of DRAM traffic in {} ms",
          lambda d: (d.measured_bytes("b", **HEADLINE) / 1e6, d.ms("b", **HEADLINE)))

``{}`` stands for one number in the quote (digits, an optional decimal point, thousands commas).
The quote is matched against the file's text with every run of whitespace folded into one space
(a sentence may wrap anywhere), and, for a notebook, against its markdown cells only: what a code
cell prints is computed from the results when it runs, and needs no claim. ``expect`` returns the
numbers in the quote's order, or, for a quote without ``{}``, a bool: a trend ("rise with N") whose
truth the data decide.

A stated number passes when it is within ``rel`` of the computed one, or within half a unit of its
own last printed digit (so "3.9×" states 3.947 truthfully). :class:`Data` is the results folder
read once, with the few look-ups the claims need; units as in the CSVs (ms, bytes, µs, GB/s).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from . import views

ROOT = Path(__file__).resolve().parents[1]
#: a number as prose writes it: 1,879 · 0.72 · 58 · 4.3
NUMBER = r"([0-9][0-9,]*(?:\.[0-9]+)?)"


@dataclass(frozen=True)
class Claim:
    """One quote of ``path`` (relative to the repo root) and what its numbers must be."""

    path: str
    quote: str
    expect: Callable[["Data"], tuple | bool]
    rel: float = 0.03
    why: str = ""

    @property
    def pattern(self) -> re.Pattern:
        parts = [re.escape(re.sub(r"\s+", " ", p)) for p in self.quote.split("{}")]
        return re.compile(NUMBER.join(parts))


@dataclass
class Verdict:
    claim: Claim
    ok: bool
    message: str
    stated: tuple = field(default_factory=tuple)
    computed: tuple = field(default_factory=tuple)


def fold(text: str) -> str:
    """Every run of whitespace as one space: prose wraps its sentences anywhere."""
    return re.sub(r"\s+", " ", text).strip()


def prose_of(path: Path) -> str:
    """The text a claim is read from: a notebook's markdown cells, any other file whole; folded."""
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"]
        return fold("\n\n".join("".join(c.get("source", "")) for c in cells))
    return fold(path.read_text())


def _decimals(text: str) -> int:
    return len(text.split(".")[1]) if "." in text else 0


def agrees(stated_text: str, computed: float, rel: float) -> bool:
    """``stated_text`` (as printed) tells the truth about ``computed``: within ``rel``, or within
    half a unit of the stated number's last digit."""
    stated = float(stated_text.replace(",", ""))
    slack = max(abs(computed) * rel, 0.5 * 10 ** -_decimals(stated_text) + 1e-9)
    return abs(stated - computed) <= slack


def check(claim: Claim, data: "Data", root: Path = ROOT) -> Verdict:
    """Find the claim's quote in its file and compare its numbers with ``claim.expect(data)``."""
    path = root / claim.path
    if not path.exists():
        return Verdict(claim, False, f"{claim.path}: no such file")
    text = prose_of(path)
    matches = list(claim.pattern.finditer(text))
    if not matches:
        return Verdict(claim, False, f"{claim.path}: the quote {claim.quote!r} is not in the text "
                                     "(reworded? update the claim with the sentence)")
    expected = claim.expect(data)
    if isinstance(expected, bool):
        if claim.quote.count("{}"):
            raise ValueError(f"{claim.quote!r}: a quote with numbers needs numbers, not a bool")
        return Verdict(claim, expected, "" if expected else
                       f"{claim.path}: {claim.quote!r} is not what the results say ({claim.why})")
    expected = tuple(expected)
    if len(expected) != claim.quote.count("{}"):
        raise ValueError(f"{claim.quote!r}: {claim.quote.count('{}')} numbers quoted, {len(expected)} computed")
    for m in matches:  # every occurrence of the sentence must be true
        stated = m.groups()
        bad = [(s, c) for s, c in zip(stated, expected) if not agrees(s, c, claim.rel)]
        if bad:
            return Verdict(claim, False,
                           f"{claim.path}: {m.group(0)!r} states {', '.join(s for s, _ in bad)}; the results give "
                           f"{', '.join(f'{c:.4g}' for _, c in bad)} ({claim.why or 'see the claim'})",
                           stated, expected)
    return Verdict(claim, True, "", matches[0].groups(), expected)


class Data:
    """One results folder (``results/h200`` by default), read once, with the look-ups claims use."""

    def __init__(self, results_dir=ROOT / "results" / "h200"):
        self.dir = Path(results_dir)

    # ------------------------------------------------------------------ the sweep (forward grid)
    @cached_property
    def _loaded(self) -> tuple[list[dict], dict]:
        return views.load(self.dir)

    @property
    def rows(self) -> list[dict]:
        return self._loaded[0]

    @property
    def env(self) -> dict:
        return self._loaded[1]

    @cached_property
    def all_rows(self) -> list[dict]:
        return views.load(self.dir, forward_only=False)[0]

    def row(self, impl: str, *, N: int, D: int, causal: bool = False, dtype: str = "fp16",
            variant: str | None = None, pass_: str = "fwd") -> dict:
        """The latest ``ok`` row of one grid cell (a stage or peer; ``variant`` for an ablation row)."""
        rows = self.rows if pass_ == "fwd" else views.grid_rows(self.all_rows, pass_)
        at = views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal)
        found = [r for r in at if r["impl"] == impl and (r.get("variant") or "") == (variant or "")
                 and views.is_ok(r)]
        if not found:
            raise LookupError(f"no ok row for {impl} {variant or ''} at N={N} D={D} causal={causal} {dtype}")
        return found[-1]

    def ms(self, impl: str, **cell) -> float:
        return self.row(impl, **cell)["ms_median"]

    def tflops(self, impl: str, **cell) -> float:
        return self.row(impl, **cell)["tflops"]

    def model_bytes(self, impl: str, **cell) -> int:
        return views.dram_bytes(self.row(impl, **cell), "model")

    def measured_bytes(self, impl: str, **cell) -> int:
        nbytes = views.dram_bytes(self.row(impl, **cell), "measured")
        if nbytes is None:
            raise LookupError(f"no Nsight Compute bytes for {impl} at {cell}")
        return nbytes

    def measured_gbps(self, impl: str, **cell) -> float:
        """Measured DRAM bytes over the median time, GB/s."""
        return self.measured_bytes(impl, **cell) / (self.ms(impl, **cell) * 1e-3) / 1e9

    def model_gbps(self, impl: str, **cell) -> float:
        return self.model_bytes(impl, **cell) / (self.ms(impl, **cell) * 1e-3) / 1e9

    def ns(self, impl: str, *, D: int, causal: bool = False, dtype: str = "fp16") -> list[int]:
        """The sequence lengths the grid measured for ``impl`` at (D, causal, dtype), sorted."""
        return sorted({r["N"] for r in views.select(views.plain(self.rows), impl=impl, D=D, dtype=dtype,
                                                      causal=causal) if views.is_ok(r)})

    @property
    def copy_gbps(self) -> float:
        return views.ceilings(self.env)[0]

    def matmul_tflops(self, dtype: str = "fp16") -> float:
        return views.ceilings(self.env)[1][dtype]

    # ------------------------------------------------------------------ the ablation
    def ablation_steps(self, *, N: int, D: int, causal: bool, dtype: str = "fp16") -> list[tuple[str, float]]:
        """[(step, ms)]: stage B, then stage C's cumulative '+x' variants in the walk's order (the order of
        ``stages.c_optimized.VARIANTS``, whatever order the rows were measured in)."""
        from stages.c_optimized import VARIANTS

        order = [v for v in VARIANTS if v.startswith("+")]
        at = views.cell_rows(self.rows, N=N, D=D, dtype=dtype, causal=causal)
        b = [r for r in at if r["impl"] == "b" and r["kind"] == "stage" and views.is_ok(r)]
        latest = {r["variant"]: r["ms_median"] for r in at if r["impl"] == "c" and r["kind"] == "ablation"
                  and r["variant"] in order and views.is_ok(r)}
        if not b:
            raise LookupError(f"no stage B row at N={N} D={D} causal={causal} {dtype}")
        return [("b", b[-1]["ms_median"])] + [(v, latest[v]) for v in order if v in latest]

    def step_speedups(self, **cell) -> dict[str, float]:
        """{'+x': speedup of that step over the row before it} along the cumulative walk."""
        steps = self.ablation_steps(**cell)
        return {name: prev / ms for (_, prev), (name, ms) in zip(steps, steps[1:])}

    def step_shares(self, **cell) -> dict[str, float]:
        """{'+x': its share of the log of the whole B → C speedup} (the README's share column)."""
        steps = self.ablation_steps(**cell)
        full = self.row("c", variant="all", **cell)["ms_median"]
        total = math.log(steps[0][1] / full)
        return {name: math.log(sp) / total for name, sp in self.step_speedups(**cell).items()}

    def leave_one_out(self, switch: str, **cell) -> float:
        """Slowdown of the all-on kernel when ``switch`` is left out ('-x' over 'all')."""
        full = self.row("c", variant="all", **cell)["ms_median"]
        return self.row("c", variant=f"-{switch}", **cell)["ms_median"] / full

    # ------------------------------------------------------------------ other files
    @cached_property
    def latency_runs(self) -> dict[str, dict[str, float]]:
        """{run_id: {impl: host µs per call}} from ``latency.csv``, every run (oldest first): the forward
        calls and the floor (a file from before the ``pass`` column timed only those)."""
        path = self.dir / "latency.csv"
        runs: dict[str, dict[str, float]] = {}
        if path.exists():
            with path.open(newline="") as f:
                for r in csv.DictReader(f):
                    if r["status"] == "ok" and r["us_per_call"] and r.get("pass", "fwd") in ("fwd", ""):
                        runs.setdefault(r["run_id"], {})[r["impl"]] = float(r["us_per_call"])
        return dict(sorted(runs.items()))

    def latency_range(self, impl: str) -> tuple[float, float]:
        """(lowest, highest) host µs per call of ``impl`` over the runs of ``latency.csv``."""
        values = [run[impl] for run in self.latency_runs.values() if impl in run]
        if not values:
            raise LookupError(f"no latency rows for {impl}")
        return min(values), max(values)

    @cached_property
    def generate_rows(self) -> list[dict]:
        """The rows of ``generate/runs.csv`` (``python -m harness generate``), as strings."""
        path = self.dir / "generate" / "runs.csv"
        if not path.exists():
            return []
        with path.open(newline="") as f:
            return list(csv.DictReader(f))

    @cached_property
    def suite_rows(self) -> list[dict]:
        return views.load_suite(self.dir)

    def suite_row(self, cell: str, impl: str) -> dict:
        """The latest ``ok`` forward row of one model-suite cell for ``impl``."""
        found = [r for r in self.suite_rows if r.get("cell") == cell and r["impl"] == impl
                 and (r.get("pass") or "fwd") == "fwd" and views.is_ok(r)]
        if not found:
            raise LookupError(f"no suite row {cell} / {impl}")
        return max(found, key=lambda r: r["run_id"])


def check_all(claims, data: Data | None = None, root: Path = ROOT) -> list[Verdict]:
    data = data or Data()
    return [check(c, data, root) for c in claims]
