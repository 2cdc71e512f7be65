"""Graded exercises: each lab is a small template with gaps marked ``TODO(lab)``, a check that fails
until the gaps are filled, and a reference solution under ``labs/solutions/`` (read it after).

``python -m labs`` lists them; ``python -m labs check <name>`` grades your template;
``python -m labs check <name> --solution`` grades the reference solution. See labs/README.md.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


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
    Lab("pipeline_stages", "Choose num_stages and predict the cp.async counts in the sm_80 PTX",
        "stages/c_optimized (pipelining), notebook 05"),
    Lab("bank_padding", "Pad flash_b.cu's shared rows; predict the bank conflicts, count with bank_model",
        "stages/CUDA_TWINS.md, stages/bank_model.py"),
    Lab("lazy_rescale", "Rescale O only when the running max grows past 2^8 (exact result)",
        "stages/c_optimized/hopper_ws.py"),
    Lab("delta_prepass", "The backward's delta = rowsum(dO·O) as a Triton kernel",
        "the backward pass"),
    Lab("gqa_indexing", "Grouped-query attention: read K/V head h // (Hq // Hkv), never copy",
        "stages/contract.py"),
)


def find(name: str) -> Lab:
    for lab in LABS:
        if lab.name == name:
            return lab
    raise ValueError(f"no lab named {name!r}; the labs are: {', '.join(lab.name for lab in LABS)}")


def load(name: str, solution: bool = False):
    """The lab's module: the learner's template, or with ``solution=True`` the reference solution."""
    find(name)
    return importlib.import_module(f"labs.solutions.{name}" if solution else f"labs.{name}")


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


def check(name: str, solution: bool = False) -> str:
    """Grade one lab: its one-line summary when solved; raises AssertionError when the answer is
    wrong and NotImplementedError (possibly wrapped by the interpreter) while a gap is open."""
    from . import checks

    return getattr(checks, f"check_{name}")(load(name, solution))
