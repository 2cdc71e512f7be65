"""Stage A: naive attention with S and P materialized in device memory (see README.md)."""

from .. import register
from ..contract import Stage
from .kernels import attention, bwd_hbm_bytes, compile, hbm_bytes, train_workspace_bytes, workspace_bytes

STAGE = register(Stage(
    name="a",
    title="A: naive (S and P in HBM)",
    techniques=("tiled tensor-core matmul for S = scale·QKᵀ", "row softmax kernel", "tiled matmul for O = PV"),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=("naive_scores_kernel", "naive_softmax_kernel", "naive_pv_kernel"),
    compile=compile,
    bwd_hbm_bytes=bwd_hbm_bytes,
    train_workspace_bytes=train_workspace_bytes,
))

__all__ = ["STAGE", "attention", "bwd_hbm_bytes", "compile", "hbm_bytes", "train_workspace_bytes",
           "workspace_bytes"]
