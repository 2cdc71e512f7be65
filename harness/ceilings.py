"""The roofline ceilings of this GPU, measured (``harness device``).

* bandwidth: a device-to-device copy of a 2 GiB buffer, counting bytes read + bytes written
  (2 × 2 GiB per copy) over the median time (``timing.samples_gpu``); GB/s = 1e9 bytes/s;
* tensor-core rate: an 8192³ matmul (2·8192³ FLOPs) on random fp16 and bf16 data (random, not
  zeros: the tensor cores' power, and with it the sustained clock, depends on the data).

The timing flushes the L2 between repetitions, and 2 GiB is far beyond any L2, so the copy sees DRAM.
"""

from __future__ import annotations

import torch


def _median_ms(fn) -> float:
    from .timing import samples_gpu, summarize

    return summarize(samples_gpu(fn, warmup_ms=25, rep_ms=200), True).ms_median


def copy_bandwidth_gbps(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = _median_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(dtype: torch.dtype, n: int = 8192) -> float:
    """Dense n×n×n matmul rate in TFLOP/s (2·n³ FLOPs per call) on standard-normal data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, device="cuda", dtype=torch.float32).to(dtype)
    a @ b
    ms = _median_ms(lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (ms * 1e-3) / 1e12


def measure_ceilings() -> dict:
    """{"copy_gbps": ..., "matmul_fp16_tflops": ..., "matmul_bf16_tflops": ...} (needs CUDA)."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU: the roofline ceilings can only be measured on a GPU")
    return {
        "copy_gbps": copy_bandwidth_gbps(),
        "matmul_fp16_tflops": matmul_tflops(torch.float16),
        "matmul_bf16_tflops": matmul_tflops(torch.bfloat16),
        "method": "medians (harness.timing): 2 GiB D2D copy (read+write bytes); 8192^3 matmul, random data",
    }
