"""The registry of stages: name -> :class:`stages.contract.Stage`.

``a``, ``b`` and ``c`` are the Triton lesson (naive, tiled, optimized); the CUDA C++ twins
(``b_cuda``, ``c_cuda``) register themselves here too when their package imports. Add your own
kernel with :func:`register` and every harness command picks it up (notebook 07 shows how).
"""

from __future__ import annotations

import os
import sys

# The Triton interpreter must be chosen before triton is imported anywhere. Without a CUDA GPU the
# stages can only run interpreted, so choose it here, once, for every entry point (harness, tests,
# notebooks). Setting TRITON_INTERPRET yourself (0 or 1) always wins.
if "TRITON_INTERPRET" not in os.environ:
    import torch as _torch

    if not _torch.cuda.is_available():
        if "triton" in sys.modules:
            # Too late: triton built its own @triton.jit helpers (tl.sum, tl.cdiv, ...) for a GPU when
            # it was imported, and every interpreted kernel that calls one would fail with "Cannot
            # call @triton.jit'd outside of the scope of a kernel". Say so now, and what to do.
            raise ImportError(
                "triton was imported before stages on a machine without a CUDA GPU, so Triton's "
                "interpreter can no longer be chosen and every kernel call would fail. Import stages "
                "before triton (`import stages` first), or set TRITON_INTERPRET=1 in the environment "
                "before starting Python.")
        os.environ["TRITON_INTERPRET"] = "1"

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
