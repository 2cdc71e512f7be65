"""The steps of stage C's ablation walk, and what each one launches on the H200.

A step is one ``+name`` variant of ``stages.c_optimized.VARIANTS``, in the walk's order: ``+none``
(every switch off: stage B's settings), the five switches of the ``tl`` kernel one at a time, then
the rungs of the warp-specialization ladder (``hopper_ws.LADDER``), whose top is
``+warp_specialization``. Nothing here is a second list of the optimizations: the steps are read off
``VARIANTS``, and what a step launches is read off the stage's own ``plan``/``select``.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass
from unittest import mock

import torch

from .. import VARIANTS, configs, hopper_ws, kernels
from ..configs import DEFAULT_SMS
from ..kernels import LOG2E

#: Where the ablation rows were measured and what the step views show: the H200 (sm_90, 132 SMs)
#: with its tuning table, ``tuned/h200.json``.
ARCH, SMS, TUNED_SLUG = 90, DEFAULT_SMS, "h200"

#: The ``tl`` kernel's constexprs that the switches set (``kernels._recipe``): the ones a step view
#: resolves. ``tuned_tiles`` and ``pipelining`` set none (they change the launch: tile sizes,
#: ``num_stages``); ``warp_specialization`` changes the kernel.
SWITCH_CONSTEXPRS = ("CAUSAL_SKIP", "USE_TMA", "EXP2")

#: The functions of ``kernels.py`` that make up the forward ``tl`` kernel, helpers first.
TL_FUNCTIONS = ("_attend_tiles", "optimized_attention_kernel")


@dataclass(frozen=True)
class Cell:
    """One measured problem: fp16 forward, Nq = Nk = N, H = Hkv (the FlashAttention-paper grid:
    B·N = 16384 tokens, H·D = 2048)."""

    B: int
    H: int
    N: int
    D: int
    causal: bool
    dtype: str = "fp16"

    @property
    def label(self) -> str:
        return f"D {self.D}, {'causal' if self.causal else 'non-causal'}"


#: The ablation's cells at N = 4096: D 64 and 128, causal or not.
CELLS = tuple(Cell(16384 // 4096, 2048 // D, 4096, D, causal) for D in (64, 128) for causal in (False, True))
#: The cell the compiled-code facts are read at: D 128, causal, where every step and every rung of
#: the ladder changes the code (at D 64 causal the tuner chose the eager rescale, so the last rung
#: changes nothing there).
FACTS_CELL = CELLS[3]


@dataclass(frozen=True)
class Step:
    """One step of the walk. ``index``: its place (00 = ``+none``); ``variant``: the ablation
    variant (``+tma``); ``kwargs``: the stage's keyword arguments for it; ``rung``: the ladder rung
    (1..6) of a warp-specialized step, None for the ``tl`` steps."""

    index: int
    variant: str
    switches: tuple  # the keyword arguments as (name, value) pairs (hashable: steps key caches)
    rung: int | None

    @property
    def kwargs(self) -> dict:
        return dict(self.switches)

    @property
    def name(self) -> str:
        return self.variant[1:]

    @property
    def file_stem(self) -> str:
        return f"{self.index:02d}_{self.name}"

    @property
    def is_ws(self) -> bool:
        return self.rung is not None


def _steps() -> tuple[Step, ...]:
    out = []
    for variant, kwargs in VARIANTS.items():
        if not variant.startswith("+"):
            continue
        if "ws_rung" in kwargs:
            rung = kwargs["ws_rung"]
        elif kwargs.get("warp_specialization"):
            rung = len(hopper_ws.LADDER)  # the top of the ladder is the full kernel
        else:
            rung = None
        out.append(Step(len(out), variant, tuple(kwargs.items()), rung))
    return tuple(out)


STEPS = _steps()


def previous(step: Step) -> Step | None:
    return STEPS[step.index - 1] if step.index else None


@contextlib.contextmanager
def tuned_for(slug: str | None):
    """Choose configs as stage C does on the GPU whose tuning table is ``tuned/<slug>.json`` (None:
    no table, the first candidate that fits), whatever GPU this process has. The choice reads the
    table through ``configs.gpu_slug()``; its caches are cleared on the way in and out so no choice
    leaks across."""
    def clear():
        configs.choose_config.cache_clear()
        kernels._select.cache_clear()

    clear()
    try:
        with mock.patch.object(configs, "gpu_slug", lambda: slug):
            yield
    finally:
        clear()


def _tensors(cell: Cell):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[cell.dtype]
    q = torch.empty((cell.B, cell.H, cell.N, cell.D), dtype=dtype, device="meta")
    return q, torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)


@functools.lru_cache(maxsize=None)
def launch(step: Step, cell: Cell, arch: int = ARCH, slug: str | None = TUNED_SLUG):
    """The stage's launch of ``step`` at ``cell`` on an sm_``arch`` GPU with the tuning table
    ``slug`` (default: the H200's), as a ``stages.launch.Launch`` (kernel, grid, every argument by
    name, warps, stages), and the config chosen."""
    q, k, v, o = _tensors(cell)
    with tuned_for(slug):
        (one,) = kernels.plan(q, k, v, o, causal=cell.causal, scale=cell.D ** -0.5, arch=arch, sms=SMS,
                              **step.kwargs)
        choice = kernels.select(cell.B, cell.H, cell.H, cell.N, cell.N, cell.D, q.dtype, cell.causal, arch, SMS,
                                **step.kwargs)
    return one, choice.config


def kernel_name(kernel) -> str:
    return getattr(kernel, "fn", kernel).__name__


@functools.lru_cache(maxsize=None)
def _switch_values(step: Step) -> tuple:
    seen = {tuple((n, launch(step, cell)[0].args[n]) for n in SWITCH_CONSTEXPRS) for cell in CELLS}
    if len(seen) != 1:
        raise ValueError(f"{step.variant} sets the switches differently per cell: {seen}")
    return seen.pop()


def switch_values(step: Step) -> dict[str, bool]:
    """The values the step gives the ``tl`` kernel's switch constexprs, as the H200 launches it (the
    same at every cell: checked)."""
    if step.is_ws:
        raise ValueError(f"{step.variant} runs the warp-specialized kernel, not the tl kernel")
    return dict(_switch_values(step))


def _fmt_grid(grid: tuple) -> str:
    return " × ".join(str(g) for g in grid)


def settings(step: Step, cell: Cell) -> dict[str, str]:
    """What the host passes for ``step`` at ``cell``, as (label -> text): the kernel, its tiles and
    launch shape, and the constexprs the step sets. The labels are the same for every step of a
    kernel, so two steps can be compared label by label."""
    one, config = launch(step, cell)
    a = one.args
    out = {"kernel": f"`{kernel_name(one.kernel)}`", "config": f"`{config}`", "grid": _fmt_grid(one.grid)}
    if not step.is_ws:
        scale = cell.D ** -0.5
        out.update({
            "tile (BLOCK_M × BLOCK_N)": f"{a['BLOCK_M']} × {a['BLOCK_N']}",
            "num_warps": str(one.num_warps),
            "num_stages": str(one.num_stages),
            "Q/K/V/O reads and writes": ("TMA descriptors, K/V block " + "×".join(map(str, a["k_desc"].block_shape))
                                         if a["USE_TMA"] else "pointers (`tl.load`/`tl.store`)"),
            "qk_scale": "scale · log2 e" if math.isclose(a["qk_scale"], scale * LOG2E) else "scale",
            **{name: str(a[name]) for name in SWITCH_CONSTEXPRS},
        })
        return out
    regs = f"{a['CONSUMER_REGS']} / {a['PRODUCER_REGS']} of {one.extra['maxnreg']}"
    turns = ("exponentials (named barriers)" if a["EXP_TURNS"] else
             "wgmma issue (mbarriers)" if a["ISSUE_TURNS"] else "none")
    out.update({
        "CONSUMERS (× 64 rows)": str(a["CONSUMERS"]),
        "K/V ring (STAGES × BLOCK_N)": f"{a['STAGES']} × {a['BLOCK_N']}",
        "registers: consumer / producer of maxnreg": regs,
        "ping-pong turns": turns,
        "Q_BUFS (2: persistent)": str(a["Q_BUFS"]),
        "ZIGZAG": str(a["ZIGZAG"]),
        "LANE_ROW_SUMS": str(a["LANE_ROW_SUMS"]),
        "LAZY_RESCALE": str(a["LAZY_RESCALE"]),
    })
    return out


__all__ = ["ARCH", "CELLS", "FACTS_CELL", "SMS", "STEPS", "SWITCH_CONSTEXPRS", "TL_FUNCTIONS", "TUNED_SLUG", "Cell",
           "Step", "kernel_name", "launch", "previous", "settings", "switch_values", "tuned_for"]
