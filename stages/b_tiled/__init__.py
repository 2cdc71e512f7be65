"""Stage B: fused tiled attention with online softmax, no pipelining (see README.md)."""

from .. import register
from ..contract import Stage
from .kernels import attention, compile, hbm_bytes, workspace_bytes

STAGE = register(Stage(
    name="b",
    title="B: tiled, online softmax",
    techniques=("one fused kernel: S and P stay on chip", "Q tile resident, loop over K/V tiles",
                "online softmax (running max m, running sum l, rescaled accumulator)"),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=("tiled_attention_kernel",),
    compile=compile,
))

__all__ = ["STAGE", "attention", "compile", "hbm_bytes", "workspace_bytes"]

from . import cuda_twin  # noqa: E402,F401  (registers the CUDA C++ twin; compiles on first use)
