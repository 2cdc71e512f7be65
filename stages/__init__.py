"""The registry of stages: name -> :class:`stages.contract.Stage`.

``a``, ``b`` and ``c`` are the Triton lesson (naive, tiled, optimized); the CUDA C++ twins
(``b_cuda``, ``c_cuda``) register themselves here too when their package imports. Add your own
kernel with :func:`register` and every harness command picks it up (notebook 07 shows how).
"""

from __future__ import annotations

import os

# The Triton interpreter must be chosen before triton is imported anywhere. Without a CUDA GPU the
# stages can only run interpreted, so choose it here, once, for every entry point (harness, tests,
# notebooks). Setting TRITON_INTERPRET yourself (0 or 1) always wins.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch as _torch

        if not _torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass

from .contract import DTYPES, HEAD_DIMS, HbmTraffic, Problem, Stage, validate_inputs  # noqa: E402

STAGES: dict[str, Stage] = {}


def register(stage: Stage) -> Stage:
    """Add (or replace) a stage in the registry; returns it so it can be used as a one-liner."""
    STAGES[stage.name] = stage
    return stage


def get_stage(name: str) -> Stage:
    """The stage called ``name``; a ``KeyError`` with the registered names otherwise."""
    try:
        return STAGES[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; registered stages: {', '.join(STAGES)}") from None


def interpreted() -> bool:
    """True when Triton kernels run in the CPU interpreter (times are then not GPU times)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if interpreted():
    from . import interpreter_fixes

    interpreter_fixes.apply()


from . import a_naive, b_tiled, c_optimized  # noqa: E402  (each registers itself)

__all__ = ["STAGES", "DTYPES", "HEAD_DIMS", "HbmTraffic", "Problem", "Stage", "get_stage", "interpreted",
           "register", "validate_inputs", "a_naive", "b_tiled", "c_optimized"]
