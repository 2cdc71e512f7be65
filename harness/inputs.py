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
    """A stable 31-bit seed for a cell (the same in every process: no Python ``hash``).

    Hkv and Nk enter the key only when they differ from H and N, so a plain multi-head self-attention
    cell keeps the data it had before the K/V shape was a dimension of its own."""
    key = f"{base_seed}:{problem.B}:{problem.H}:{problem.N}:{problem.D}:{problem.dtype}:{int(problem.causal)}"
    if (problem.Hkv, problem.Nk) != (problem.H, problem.N):
        key += f":kv{problem.Hkv}:{problem.Nk}"
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def make_inputs(problem: Problem, device: str | torch.device, base_seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, H, N, D]`` and k, v ``[B, Hkv, Nk, D]`` in the problem's dtype on ``device``, standard normal."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(cell_seed(problem, base_seed))
    q_shape = (problem.B, problem.H, problem.N, problem.D)
    kv_shape = (problem.B, problem.Hkv, problem.Nk, problem.D)
    dtype = DTYPES[problem.dtype]
    return tuple(torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
                 for shape in (q_shape, kv_shape, kv_shape))  # type: ignore[return-value]


def make_grad_output(problem: Problem, device: str | torch.device, base_seed: int = 0) -> torch.Tensor:
    """dO ``[B, H, N, D]`` for the backward pass: standard normal, from its own seed (so q, k, v are
    the same as the forward cell's)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed((cell_seed(problem, base_seed) + 1) & 0x7FFFFFFF)
    shape = (problem.B, problem.H, problem.N, problem.D)
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(DTYPES[problem.dtype])


def default_device() -> torch.device:
    """The GPU when there is one, else the CPU (stages then run in the Triton interpreter)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
