"""Stage B: fused tiled attention with online softmax, no pipelining (see README.md)."""

from .. import register
from ..contract import Stage
from .kernels import (DQ_METHODS, attention, attention_backward, attention_with_lse, bwd_hbm_bytes, compile, hbm_bytes,
                      train_workspace_bytes, workspace_bytes)

STAGE = register(Stage(
    name="b",
    title="B: tiled, online softmax",
    techniques=("one fused kernel: S and P stay on chip", "Q tile resident, loop over K/V tiles",
                "online softmax (running max m, running sum l, rescaled accumulator)",
                "backward recomputes P from the saved row log-sum-exp (no N² storage)"),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=("tiled_attention_kernel", "tiled_attention_bwd_delta_kernel",
                  "tiled_attention_bwd_dkdv_kernel", "tiled_attention_bwd_dq_kernel"),
    compile=compile,
    # dQ by fp32 atomics from the dK/dV kernel instead of a kernel of its own (the forward is the same)
    variants={"dq-atomic": {"dq_method": "atomic"}},
    bwd_hbm_bytes=bwd_hbm_bytes,
    train_workspace_bytes=train_workspace_bytes,
))

__all__ = ["STAGE", "DQ_METHODS", "attention", "attention_backward", "attention_with_lse", "bwd_hbm_bytes", "compile", "hbm_bytes", "train_workspace_bytes",
           "workspace_bytes"]

from . import cuda_twin  # noqa: E402,F401  (registers the CUDA C++ twin; compiles on first use)
