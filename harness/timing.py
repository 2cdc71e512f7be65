"""Time per call, in ms: median and the 20th/80th percentiles.

On a GPU: ``triton.testing.do_bench(fn, warmup=100, rep=100, quantiles=[0.5, 0.2, 0.8])`` after a
warm call made by the caller (so compilation and autotuning are not timed). The warmup is 100 ms,
not do_bench's 25: compiling a kernel leaves the GPU idle for seconds, and a sub-millisecond
kernel timed right after that can catch the clocks still ramping. do_bench runs ``fn``
for ~100 ms of repetitions, clears the L2 cache before each one (it writes a 256 MB buffer), and
times each with CUDA events; warmup/rep are in ms.

On a CPU the stages run in the Triton interpreter: each call is timed with ``time.perf_counter``
and the result is labelled ``interpreter``: it says how slow the interpreter is, nothing about a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Timing:
    ms_median: float
    ms_p20: float
    ms_p80: float
    method: str  # "do_bench" or "perf_counter"


def bench_gpu(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 100) -> Timing:
    """do_bench on the current CUDA device (call ``fn`` once before: compilation is not timed)."""
    import triton.testing

    med, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
    return Timing(float(med), float(p20), float(p80), "do_bench")


def bench_cpu(fn: Callable[[], object], calls: int = 3) -> Timing:
    """Wall time of ``calls`` calls with perf_counter (CPU / Triton interpreter)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    arr = np.asarray(times)
    return Timing(float(np.median(arr)), float(np.percentile(arr, 20)), float(np.percentile(arr, 80)),
                  "perf_counter")


def bench(fn: Callable[[], object], on_gpu: bool, cpu_calls: int = 3) -> Timing:
    return bench_gpu(fn) if on_gpu else bench_cpu(fn, cpu_calls)
