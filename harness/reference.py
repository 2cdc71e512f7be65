"""The float64 reference, the relative error, and PyTorch's own same-precision error.

The reference is plain ``softmax(q kᵀ · scale, masked) v`` in float64 on the inputs' device, computed
in chunks of heads and query rows so that the N×N score block never exceeds ~256 MiB (N = 16384
would otherwise need 2 GiB per head in float64).

"PyTorch's same-precision error" is the error of the same math formulation run in the *input*
dtype (fp16 scores, fp16 softmax, fp16 PV): what a textbook implementation in that precision
achieves. A stage should not be more than ~2× worse than it.
"""

from __future__ import annotations

import math

import torch

#: largest score block (rows × N × element size) one chunk may hold, bytes
CHUNK_BYTES = 256 * 2**20


def _attention_chunked(q, k, v, causal: bool, sm_scale: float, dtype: torch.dtype) -> torch.Tensor:
    B, H, N, D = q.shape
    out = torch.empty((B, H, N, D), dtype=dtype, device=q.device)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = max(1, min(N, CHUNK_BYTES // max(1, N * elem)))
    for b in range(B):
        for h in range(H):
            kh = k[b, h].to(dtype)
            vh = v[b, h].to(dtype)
            for r0 in range(0, N, rows):
                r1 = min(N, r0 + rows)
                # Scale q before the product, as SDPA's math backend does: in fp16, q·kᵀ of large
                # logits overflows (65504) before a later scale could bring it back.
                s = (q[b, h, r0:r1].to(dtype) * sm_scale) @ kh.transpose(0, 1)
                if causal:
                    i = torch.arange(r0, r1, device=q.device)[:, None]
                    j = torch.arange(N, device=q.device)[None, :]
                    s = s.masked_fill(j > i, float("-inf"))
                p = torch.softmax(s, dim=-1)
                out[b, h, r0:r1] = p @ vh
    return out


def reference_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Attention in float64 on q's device (chunked to bound memory); returns a float64 tensor."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.no_grad():
        return _attention_chunked(q, k, v, causal, scale, torch.float64)


def torch_same_precision(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """The textbook formulation in the inputs' own dtype (what PyTorch gives without a fused kernel)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.no_grad():
        return _attention_chunked(q, k, v, causal, scale, q.dtype)


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """‖o − ref‖₂ / ‖ref‖₂ in float64 (NaN anywhere in ``o`` gives NaN)."""
    if tuple(o.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(o.shape)} does not match the reference {tuple(ref.shape)}")
    with torch.no_grad():
        diff = o.to(device=ref.device, dtype=torch.float64) - ref
        return float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
