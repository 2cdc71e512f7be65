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


def _mask_and_softmax(s: torch.Tensor, r0: int, Nq: int, causal: bool) -> torch.Tensor:
    """softmax over the last dim of scores for query rows r0.. (bottom-right causal); rows that see
    no key (causal, Nq > Nk) get all-zero probabilities instead of softmax's NaN."""
    if causal:
        Nk = s.shape[-1]
        i = torch.arange(r0, r0 + s.shape[-2], device=s.device)[:, None]
        j = torch.arange(Nk, device=s.device)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0) if causal else p


def _attention_chunked(q, k, v, causal: bool, sm_scale: float, dtype: torch.dtype) -> torch.Tensor:
    B, H, N, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = H // Hkv
    out = torch.empty((B, H, N, D), dtype=dtype, device=q.device)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = max(1, min(N, CHUNK_BYTES // max(1, Nk * elem)))
    for b in range(B):
        for h in range(H):
            kh = k[b, h // group].to(dtype)  # grouped-query attention: query head h reads KV head h // group
            vh = v[b, h // group].to(dtype)
            for r0 in range(0, N, rows):
                r1 = min(N, r0 + rows)
                # Scale q before the product, as SDPA's math backend does: in fp16, q·kᵀ of large
                # logits overflows (65504) before a later scale could bring it back.
                s = (q[b, h, r0:r1].to(dtype) * sm_scale) @ kh.transpose(0, 1)
                out[b, h, r0:r1] = _mask_and_softmax(s, r0, N, causal) @ vh
    return out


def reference_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Attention in float64 on q's device (chunked to bound memory); returns a float64 tensor.
    q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]``; causal is aligned to the bottom right."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.no_grad():
        return _attention_chunked(q, k, v, causal, scale, torch.float64)


def torch_same_precision(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """The textbook formulation in the inputs' own dtype (what PyTorch gives without a fused kernel)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.no_grad():
        return _attention_chunked(q, k, v, causal, scale, q.dtype)


def _attention_autograd(q, k, v, causal: bool, sm_scale: float, scores_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unchunked textbook attention built from differentiable torch ops (for the gradient references).
    ``scores_dtype``: the scores rounded to that dtype before the softmax, the gradient passing
    straight through the rounding (what a kernel that stores S in the inputs' dtype computes)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = (q * sm_scale) @ k.transpose(-2, -1)
    if scores_dtype is not None:
        s = s + (s.detach().to(scores_dtype).to(s.dtype) - s.detach())
    Nq, Nk = q.shape[2], k.shape[2]
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (Nk - Nq), float("-inf"))
        # a row with no visible key: softmax would be NaN; give it zeros (and zero gradient)
        empty = (j > i + (Nk - Nq)).all(dim=-1, keepdim=True)
        s = s.masked_fill(empty, 0.0)
        p = torch.softmax(s, dim=-1).masked_fill(empty, 0.0)
    else:
        p = torch.softmax(s, dim=-1)
    return p @ v


def reference_gradients(q, k, v, do, *, causal: bool = False, sm_scale: float | None = None,
                        scores_dtype: torch.dtype | None = None):
    """(dq, dk, dv) of ``sum(o * do)`` in float64 by PyTorch autograd of the textbook formula
    (GQA: dk and dv summed over each KV head's query group). Returns float64 tensors.
    ``scores_dtype``: of attention whose scores are rounded to that dtype (``_attention_autograd``)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.enable_grad():
        q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_(True) for t in (q, k, v))
        o = _attention_autograd(q64, k64, v64, causal, scale, scores_dtype)
        return torch.autograd.grad(o, (q64, k64, v64), do.to(torch.float64))


def torch_same_precision_gradients(q, k, v, do, *, causal: bool = False, sm_scale: float | None = None):
    """The same gradients computed by autograd in the inputs' own dtype: the error a textbook
    implementation at that precision makes (the bound the stages' gradients are held to)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    with torch.enable_grad():
        qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        o = _attention_autograd(qs, ks, vs, causal, scale)
        return torch.autograd.grad(o, (qs, ks, vs), do.to(q.dtype))


def rel_err(o: torch.Tensor, ref: torch.Tensor) -> float:
    """‖o − ref‖₂ / ‖ref‖₂ in float64 (NaN anywhere in ``o`` gives NaN)."""
    if tuple(o.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(o.shape)} does not match the reference {tuple(ref.shape)}")
    with torch.no_grad():
        diff = o.to(device=ref.device, dtype=torch.float64) - ref
        return float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref))
