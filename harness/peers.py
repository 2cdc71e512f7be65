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

Traffic models (bytes requested from DRAM, as the stages' models count them):

* flash-family peers (flash, cudnn, efficient): the minimum, Q, K, V read once and O written once
  (K/V re-reads by different query blocks are assumed served by L2; the small logsumexp is left out);
* math: additionally S = QKᵀ written, read by softmax, P written, read by PV: 2·B·H·N²·4 bytes each
  way for fp16/bf16 inputs (PyTorch's math backend upcasts half inputs to fp32: its GEMMs are
  fp32 kernels under Nsight Compute) and 2·B·H·N²·e for fp32. The scaling, masking and
  safe-softmax passes are left out, so it is a lower bound: on an H200 at N = 4096 ncu measured
  about 4.5× these bytes.
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
            try:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)
            except RuntimeError as e:
                if not any(m in str(e) for m in _REFUSALS):
                    raise
                reasons = [str(w.message).splitlines()[0] for w in caught if "not used because" in str(w.message)]
                raise PeerUnsupported("; ".join(reasons) or str(e).splitlines()[0]) from None

    attention.__name__ = name
    return attention


def peer_hbm_bytes(name: str, problem: Problem) -> HbmTraffic:
    """Modelled DRAM bytes of one call (see the module docstring for what is and isn't counted)."""
    tile = problem.heads * problem.N * problem.D * problem.element_bytes
    read, write = 3 * tile, tile
    if name == "sdpa_math":
        sp = problem.heads * problem.N * problem.N * 4  # fp32 scores and probabilities
        read += 2 * sp
        write += 2 * sp
    return HbmTraffic(read=read, write=write)


def peer_workspace_bytes(name: str, problem: Problem) -> int:
    """Modelled extra bytes besides the output: fp32 S and P for math, the fp32 logsumexp for the others."""
    if name == "sdpa_math":
        return 2 * problem.heads * problem.N * problem.N * 4
    return problem.heads * problem.N * 4
