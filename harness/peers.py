"""The production peers: PyTorch's ``scaled_dot_product_attention`` forced to one backend each.

========================  ==========================================================
peer                      backend (``torch.nn.attention.SDPBackend``)
========================  ==========================================================
``sdpa_flash``            FLASH_ATTENTION (FlashAttention-2)
``sdpa_cudnn``            CUDNN_ATTENTION (cuDNN's fused attention)
``sdpa_efficient``        EFFICIENT_ATTENTION (xFormers' memory-efficient kernel)
``sdpa_math``             MATH (the unfused composite: S and P materialized)
========================  ==========================================================

A backend that refuses a problem (fp32 on FLASH, any CUDA-only backend on a CPU, ...) makes
PyTorch raise "No available kernel" (CPU: "No viable backend") after warning why; :class:`PeerUnsupported` carries that reason
and the harness records the row as ``unsupported: <reason>``.

The lab's shapes, and how SDPA is asked for them:

* **GQA / MQA** (fewer K/V heads than query heads): ``enable_gqa=True``, the same grouping as the
  stages (query head h reads K/V head ``h // (Hq // Hkv)``). FLASH reads the shared head; MATH
  copies K/V out to Hq heads first (``repeat_interleave``); a backend without GQA refuses.
* **Causal with Nq ≠ Nk**: SDPA's plain ``is_causal=True`` is aligned to the *top left* (query i
  sees keys j <= i), while the lab's contract, FlashAttention >= 2.1 and a KV cache need the
  *bottom right* (j <= i + Nk − Nq); the two agree only when Nq = Nk. So those cells pass
  ``attn_mask=torch.nn.attention.bias.causal_lower_right(Nq, Nk)``. PyTorch dispatches that mask
  itself: FLASH and EFFICIENT have native bottom-right kernels, the others get the mask
  materialized as a dense boolean matrix. It only picks a backend the ``sdpa_kernel`` context
  enables (its checks start with "is this backend switched off"), so each row still runs the
  backend it is named after, or refuses.

Traffic models (bytes requested from DRAM, as the stages' models count them; K and V are read per
K/V head, so GQA reads Hq/Hkv times less of them than multi-head attention):

* flash-family peers (flash, cudnn, efficient): the minimum, Q, K, V read once and O written once
  (K/V re-reads by different query blocks are assumed served by L2; the small logsumexp is left out);
* math: additionally S = QKᵀ written, read by softmax, P written, read by PV: 2·B·Hq·Nq·Nk·4 bytes each
  way for fp16/bf16 inputs (PyTorch's math backend upcasts half inputs to fp32: its GEMMs are
  fp32 kernels under Nsight Compute) and 2·B·Hq·Nq·Nk·e for fp32; with GQA also the copy of K and V
  out to Hq heads (written once, read by the GEMMs). The scaling, masking and
  safe-softmax passes are left out, so it is a lower bound: on an H200 at N = 4096 ncu measured
  about 4.5× these bytes.
* backward, given the saved forward: the flash family reads Q, K, V, O, dO and writes dQ, dK, dV
  (a lower bound: FlashAttention-2 accumulates dQ in fp32 through atomics); math additionally
  reads the saved P twice, writes dP and reads it, writes dS and reads it twice (5 reads and 2
  writes of an fp32 Nq×Nk matrix per query head).

Workspace models (extra bytes besides the output; for a training step besides q, k, v, o, dO and
the three gradients): the flash family keeps an fp32 log-sum-exp per query row (and, in the
backward, an fp32 row sum δ; FLASH with GQA computes dK, dV per query head before summing them);
math keeps fp32 S and P in the forward, and P, dP and dS at the backward's peak. Lower bounds: the
libraries' private scratch is not modelled.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from stages.contract import HbmTraffic, Problem

PEERS: dict[str, str] = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}
#: the short names the CLI accepts (``--peers flash,cudnn``)
SHORT_NAMES = {name.removeprefix("sdpa_"): name for name in PEERS}


#: how PyTorch says "the forced backend cannot run this" (CUDA builds / CPU builds)
_REFUSALS = ("No available kernel", "No viable backend")


class PeerUnsupported(Exception):
    """The forced SDPA backend does not handle this problem (the message says why)."""


def peer_attention(name: str) -> Callable[..., torch.Tensor]:
    """``attention(q, k, v, *, causal=False, sm_scale=None)`` for the peer ``name``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, PEERS[name])

    def attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # (inside: causal_lower_right warns that rows seeing no key may give NaN when Nq > Nk;
            # the error column shows it if a backend does, and the warning would repeat every call)
            kwargs = sdpa_kwargs(q, k, causal)
            try:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, scale=sm_scale, **kwargs)
            except RuntimeError as e:
                if not any(m in str(e) for m in _REFUSALS):
                    raise
                reasons = [str(w.message).splitlines()[0] for w in caught if "not used because" in str(w.message)]
                raise PeerUnsupported("; ".join(reasons) or str(e).splitlines()[0]) from None

    attention.__name__ = name
    return attention


def sdpa_kwargs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> dict:
    """The keyword arguments that make SDPA compute the lab's contract for these shapes: GQA when
    the head counts differ, and the bottom-right causal mask when the lengths differ (SDPA's
    ``is_causal=True`` is top-left aligned; see the module docstring)."""
    from torch.nn.attention.bias import causal_lower_right

    kwargs: dict = {}
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if causal and q.shape[2] != k.shape[2]:
        kwargs["attn_mask"] = causal_lower_right(q.shape[2], k.shape[2])
    else:
        kwargs["is_causal"] = causal
    return kwargs


def _sp_bytes(problem: Problem) -> int:
    """One fp32 Nq×Nk matrix per query head (the math backend's S, P, dP or dS), bytes."""
    return problem.heads * problem.N * problem.Nk * 4


def _expanded_kv_bytes(problem: Problem) -> int:
    """K and V copied out to Hq heads (the math backend's GQA; FLASH's per-query-head dK, dV), bytes;
    0 without GQA."""
    if problem.Hkv == problem.H:
        return 0
    return 2 * problem.heads * problem.Nk * problem.D * problem.element_bytes


def peer_hbm_bytes(name: str, problem: Problem) -> HbmTraffic:
    """Modelled DRAM bytes of one forward call (see the module docstring for what is and isn't counted)."""
    read, write = problem.q_bytes + 2 * problem.kv_bytes, problem.q_bytes
    if name == "sdpa_math":
        sp = _sp_bytes(problem)  # fp32 scores and probabilities
        read += 2 * sp + _expanded_kv_bytes(problem)
        write += 2 * sp + _expanded_kv_bytes(problem)
    return HbmTraffic(read=read, write=write)


def peer_bwd_hbm_bytes(name: str, problem: Problem) -> HbmTraffic:
    """Modelled DRAM bytes of one backward call given the saved forward, bytes (a lower bound)."""
    read = 3 * problem.q_bytes + 2 * problem.kv_bytes   # q, o, dO; k, v
    write = problem.q_bytes + 2 * problem.kv_bytes      # dq; dk, dv
    if name == "sdpa_math":
        sp = _sp_bytes(problem)
        read += 5 * sp + _expanded_kv_bytes(problem)
        write += 2 * sp + _expanded_kv_bytes(problem)
    return HbmTraffic(read=read, write=write)


def peer_workspace_bytes(name: str, problem: Problem) -> int:
    """Modelled extra bytes besides the output: fp32 S and P for math, the fp32 logsumexp for the others."""
    if name == "sdpa_math":
        return 2 * _sp_bytes(problem) + _expanded_kv_bytes(problem)
    return problem.heads * problem.N * 4


def peer_train_workspace_bytes(name: str, problem: Problem) -> int:
    """Modelled extra bytes at the peak of a training step besides q, k, v, o, dO, dq, dk, dv (a lower
    bound): math's saved P with dP and dS; the flash family's fp32 log-sum-exp and δ per query row."""
    if name == "sdpa_math":
        return 3 * _sp_bytes(problem) + _expanded_kv_bytes(problem)
    rows = 2 * problem.heads * problem.N * 4
    return rows + (_expanded_kv_bytes(problem) if name == "sdpa_flash" else 0)
