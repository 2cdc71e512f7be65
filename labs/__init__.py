"""Graded exercises: each lab is a small template with gaps marked ``TODO(lab)``, a check that fails
until the gaps are filled, and a reference solution under ``labs/solutions/`` (read it after).

``python -m labs`` lists them; ``python -m labs check <name>`` grades your template;
``python -m labs check <name> --solution`` grades the reference solution. See labs/README.md.

This module stays light (no torch, no triton at import): the CLI imports it to list the labs and
to start the grading child process.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Lab:
    name: str      # module name under labs/ and labs/solutions/
    title: str
    teaches: str   # which stage or notebook it builds on


LABS: tuple[Lab, ...] = (
    Lab("online_softmax", "Write stage B's inner loop (the online softmax) from notebook 03's NumPy",
        "notebook 03, stages/b_tiled"),
    Lab("causal_skip", "Stop a causal kernel's loop at the diagonal; count the tiles it visits",
        "stages/c_optimized (causal_skip)"),
    Lab("pipeline_stages", "Choose num_stages and predict the cp.async counts in the sm_80 PTX for any tile",
        "stages/c_optimized (pipelining), notebook 05"),
    Lab("bank_padding", "Pad flash_b.cu's shared rows; predict the bank conflicts as a formula",
        "stages/CUDA_TWINS.md, stages/bank_model.py"),
    Lab("lazy_rescale", "Rescale O only when the running max grows past 2^8 (exact result)",
        "stages/c_optimized/hopper_ws.py"),
    Lab("delta_prepass", "The backward's delta = rowsum(dO·O) as a Triton kernel",
        "the backward pass"),
    Lab("gqa_indexing", "Grouped-query attention: read K/V head h // (Hq // Hkv), never copy",
        "stages/contract.py"),
    Lab("fused_forward", "Write the whole fused forward kernel body: tiles, online softmax, causal, masks, LSE",
        "stages/b_tiled"),
    Lab("backward_dkdv", "The backward's dK/dV kernel: recompute P from Q, K and the LSE, loop over query tiles",
        "stages/b_tiled (backward)"),
    Lab("splitkv_merge", "Merge split-KV partial outputs and log-sum-exps exactly (empty splits, extreme logits)",
        "stages/c_optimized/decode.py"),
    Lab("traffic_prediction", "Predict stage A's and stage B's HBM bytes from their traffic models",
        "stages/a_naive/README.md, stages/b_tiled/README.md"),
    Lab("gpu_timed", "Tune a slow Triton kernel until it runs within 2x of PyTorch's SDPA (needs a GPU)",
        "stages/c_optimized (tuned tiles), the harness"),
    Lab("backward_dq", "The backward's dQ as a second pass: a query tile's program walks the keys in a fixed order",
        "stages/c_optimized/backward.py (separate dQ)"),
    Lab("program_order", "Launch a causal backward's programs so that no heavy one is left running alone at the end",
        "stages/c_optimized/hopper_bwd.py (program order)"),
)


def find(name: str) -> Lab:
    for lab in LABS:
        if lab.name == name:
            return lab
    raise ValueError(f"no lab named {name!r}; the labs are: {', '.join(lab.name for lab in LABS)}")


def load(name: str, solution: bool = False, path: str | os.PathLike | None = None):
    """The lab's module: the learner's template, with ``solution=True`` the reference solution, or
    with ``path`` any copy of the lab (a file elsewhere, loaded under its own module name)."""
    find(name)
    if path is None:
        return importlib.import_module(f"labs.solutions.{name}" if solution else f"labs.{name}")
    path = Path(path).resolve()
    if not path.is_file():
        raise ValueError(f"no file {path} to grade as lab {name}")
    module_name = f"labs._graded_{name}_{abs(hash(str(path))):x}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # Triton and the compile helper look kernels up by module
    spec.loader.exec_module(module)
    return module


def gap_still_open(exc: BaseException) -> bool:
    """Whether ``exc`` comes from a ``TODO(lab)`` gap. The Triton interpreter wraps an exception raised
    inside a kernel in its own ``InterpreterError``, so the chain and the message are both searched."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, NotImplementedError) or "NotImplementedError" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


class NeedsGPU(Exception):
    """A check that can only grade on a CUDA GPU, run without one: not a pass, not a failure."""


def check(name: str, solution: bool = False, path: str | os.PathLike | None = None) -> str:
    """Grade one lab: its one-line summary when solved; raises AssertionError when the answer is
    wrong, NotImplementedError (possibly wrapped by the interpreter) while a gap is open,
    :class:`NeedsGPU` for a GPU-only check on a machine without one, and whatever the learner's code
    raised otherwise. Kernels run bounds-checked (:func:`labs.guard.bounds_checked`), so a load or
    store outside a tensor raises ``IndexError`` instead of corrupting memory."""
    import warnings

    import numpy as np

    from . import checks, guard

    module = load(name, solution, path)
    # The interpreter runs kernels in NumPy, which warns about log(0) or inf - inf; the check judges
    # the numbers themselves, and a warning with a NumPy file and line would only mislead.
    with guard.bounds_checked(), np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return getattr(checks, f"check_{name}")(module)


@dataclass(frozen=True)
class Grade:
    status: str    # "pass", "gap", "not_yet", "error", "skipped"
    message: str   # the line the CLI prints after the lab's name
    error: BaseException | None = None  # what was raised, for --traceback

    @property
    def exit_code(self) -> int:
        """0 pass, 1 not passed (gap, wrong answer, an exception), 3 skipped (needs a GPU)."""
        return {"pass": 0, "skipped": 3}.get(self.status, 1)


def grade(name: str, solution: bool = False, path: str | os.PathLike | None = None) -> Grade:
    """:func:`check`, with every outcome turned into one line (never a traceback)."""
    from . import guard

    try:
        summary = check(name, solution, path)
    except NeedsGPU as e:
        return Grade("skipped", f"SKIPPED: {e}", e)
    except AssertionError as e:
        if guard.raised_by_grader(e):
            return Grade("not_yet", f"NOT YET: {e}", e)
        return Grade("error", f"NOT YET: {guard.explain(e)}", e)  # an assert of the learner's own
    except Exception as e:  # noqa: BLE001 - a learner's code can fail in any way; say which and why
        if gap_still_open(e):
            inner, _ = guard.root_cause(e)
            return Grade("gap", f"a TODO(lab) gap is still open ({type(inner).__name__}: "
                                f"{(str(inner).splitlines() or [''])[0]})", e)
        return Grade("error", f"NOT YET: {guard.explain(e)}", e)
    return Grade("pass", f"PASS: {summary}")
