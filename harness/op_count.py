"""Aten operations dispatched by a piece of host code: on a GPU, one kernel launch each (views aside).

What an eager step outside a CUDA graph pays in launches (``generate``'s mask with a static cache,
``experiments/mask_operations.py``, notebook 09, ``tests/test_mask_ranges.py``). A Triton kernel does
not go through aten, so :func:`key_ranges_launches` counts the lab's key-ranges kernel apart.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

#: aten operations that compute nothing (views, metadata): no launch on a GPU
VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "reshape", "select", "slice", "expand",
                   "unsqueeze", "squeeze", "alias", "as_strided", "detach", "lift_fresh"})


class DeviceOperations(TorchDispatchMode):
    """While active, every aten operation dispatched that is not a view, as (name, elements of its
    output): ``with DeviceOperations() as ops: ...``, then ``ops.names``."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.ops.append((name, out.numel() if isinstance(out, torch.Tensor) else 0))
        return out

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.ops]


@contextmanager
def key_ranges_launches():
    """Count the launches of ``stages.key_ranges``' kernel while active (yields the list each launch
    appends to). The kernel runs outside any :class:`DeviceOperations`: the interpreter, which runs it
    on a CPU, copies tensors as it goes, and those copies are not the host code's operations."""
    from stages import key_ranges

    launched: list[int] = []
    real_launch = key_ranges._launch

    def counting_launch(*key):
        launch = real_launch(*key)

        def call(*values):
            launched.append(1)
            with _disable_current_modes():
                launch(*values)
        return call

    key_ranges._launch = counting_launch
    try:
        yield launched
    finally:
        key_ranges._launch = real_launch
