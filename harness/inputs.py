"""Seeded inputs for one measurement cell.

Every impl in a cell (stages, ablation variants, peers) gets the *same* q, k, v, so their errors and
times are comparable; a different cell gets fresh random data (the seed is derived from the cell),
so no result depends on one lucky draw. Values are standard normal, generated in float32 and then
cast, so fp16, bf16 and fp32 cells of one shape hold the same numbers up to rounding.
"""

from __future__ import annotations

import zlib

import torch

from stages.contract import DTYPES, Problem


def cell_seed(problem: Problem, base_seed: int = 0) -> int:
    """A stable 31-bit seed for a cell (the same in every process: no Python ``hash``)."""
    key = f"{base_seed}:{problem.B}:{problem.H}:{problem.N}:{problem.D}:{problem.dtype}:{int(problem.causal)}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def make_inputs(problem: Problem, device: str | torch.device, base_seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of shape ``[B, H, N, D]`` in the problem's dtype on ``device``, standard normal."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(cell_seed(problem, base_seed))
    shape = (problem.B, problem.H, problem.N, problem.D)
    dtype = DTYPES[problem.dtype]
    return tuple(torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
                 for _ in range(3))  # type: ignore[return-value]


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU (stages then run in the Triton interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
