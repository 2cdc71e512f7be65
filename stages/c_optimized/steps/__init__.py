"""Stage C, one optimization at a time: a readable page per step of the ablation walk.

Stage C's kernel carries every optimization behind a switch, so its source holds all of them at
once and ``diff ../b_tiled/kernels.py kernels.py`` is one big change. This package takes it apart
along the ablation walk (``VARIANTS``' ``+name`` steps): for each step, the forward kernel's source
with that step's constexpr switches resolved (``resolve.py``), the launch settings it changes
(``ladder.py``), its measured share on the H200 (``measured.py``) and what it changes in the
compiled code (``facts.py``), written to ``docs/stage-c-steps/`` by ``python -m
stages.c_optimized.steps`` (``render.py``).
"""

from .ladder import CELLS, FACTS_CELL, STEPS, Cell, Step
from .render import OUT_DIR, build, kernel_module, resolved_kernel
from .resolve import resolve_functions

__all__ = ["CELLS", "FACTS_CELL", "OUT_DIR", "STEPS", "Cell", "Step", "build", "kernel_module", "resolve_functions",
           "resolved_kernel"]
