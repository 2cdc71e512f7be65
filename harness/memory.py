"""Peak extra device memory of one call, in bytes: measured, and the model beside it.

Measured: ``max_memory_allocated`` during one call minus ``memory_allocated`` just before it, i.e.
everything the call allocates *including its output* (inputs are already allocated before).
This is PyTorch's caching allocator's view: memory a kernel library allocates behind PyTorch's
back (cuDNN workspaces via its own allocator, for example) is not seen.

Model: the stage's ``workspace_bytes(problem)`` plus the output's bytes.

For the backward rows (``pass`` bwd and fwd_bwd) the measured call is one training step, forward
then backward, with q, k, v and dO allocated before it; its model is the stage's
``train_workspace_bytes(problem)`` plus o, dq, dk and dv.

On a CPU nothing is measured (there is no device allocator to ask).
"""

from __future__ import annotations

from typing import Callable

import torch

from stages.contract import Problem


def output_bytes(problem: Problem) -> int:
    return problem.heads * problem.N * problem.D * problem.element_bytes


def peak_mem_model(workspace_bytes: int | None, problem: Problem) -> int | None:
    """Modelled extra bytes of one call: workspace + output (None when there is no workspace model)."""
    return None if workspace_bytes is None else int(workspace_bytes) + output_bytes(problem)


def train_peak_mem_model(train_workspace_bytes: int | None, problem: Problem) -> int | None:
    """Modelled extra bytes of one training step (forward + backward) beyond q, k, v and dO: the
    stage's training workspace (A: its saved P) + the output o + the gradients dq, dk, dv
    (None when there is no model)."""
    if train_workspace_bytes is None:
        return None
    grads = problem.q_bytes + 2 * problem.kv_bytes
    return int(train_workspace_bytes) + output_bytes(problem) + grads


def measure_peak_extra_bytes(fn: Callable[[], torch.Tensor]) -> int | None:
    """Bytes allocated at the peak of one call of ``fn`` above what was allocated before it (GPU only)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return int(peak)
