"""Time per call, in ms: median and the 20th/80th percentiles of a set of samples.

On a GPU: ``triton.testing.do_bench(fn, warmup=100, rep=100, return_mode="all")`` after a warm call
made by the caller (so compilation and autotuning are not timed). The warmup is 100 ms, not
do_bench's 25: compiling a kernel leaves the GPU idle for seconds, and a sub-millisecond kernel
timed right after that can catch the clocks still ramping. do_bench runs ``fn`` for ~100 ms of
repetitions, clears the L2 cache before each one (it writes a 256 MB buffer), and times each with
CUDA events; warmup/rep are in ms. ``samples`` returns every repetition's time, so a caller can
pool the samples of several turns (``measure.run_cells`` times a cell's implementations in turns).

On a CPU the stages run in the Triton interpreter: each call is timed with ``time.perf_counter``
and the result is labelled ``interpreter``: it says how slow the interpreter is, nothing about a GPU.

Beside the eager call (what a user's program sees: the host path of validation, launches and
PyTorch's dispatch, plus the GPU's work), ``samples_graph`` times the same call replayed from a
CUDA graph: the GPU's work alone. When the GPU work is shorter than the host path, the eager time
is the host's; the gap between the two is the launch overhead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class Timing:
    ms_median: float
    ms_p20: float
    ms_p80: float
    method: str  # "do_bench" or "perf_counter"


def samples_gpu(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 100) -> list[float]:
    """Every repetition's time (ms) of do_bench on the current CUDA device (call ``fn`` once before:
    compilation is not timed)."""
    import triton.testing

    return [float(t) for t in triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="all")]


def samples_cpu(fn: Callable[[], object], calls: int = 3) -> list[float]:
    """Wall time (ms) of each of ``calls`` calls with perf_counter (CPU / Triton interpreter)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def samples_graph(make_call: Callable[[], Callable[[], object]], warmup_ms: int = 100,
                  rep_ms: int = 100) -> list[float]:
    """Every repetition's time (ms) of the call replayed from a CUDA graph: the GPU's time alone.

    ``make_call()`` returns the call to capture; it runs on the side stream the graph is captured
    on, so anything it sets up there (the saved forward a backward call needs: autograd runs each
    backward op on its forward op's stream) is on the capturing stream too. The call runs once
    before the capture, on that stream, as PyTorch asks (lazy initialization, such as a library
    creating its handle or workspace, must not happen inside a capture). Replays are timed with
    do_bench like the eager call, so the two columns differ by the host path only. A call that
    cannot be captured (it synchronizes, or reads a result on the host) raises; the caller leaves
    the column empty and says why.
    """
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call = make_call()
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream):
            out = call()  # noqa: F841  (held until the replays end: the graph writes into it)
        return samples_gpu(graph.replay, warmup_ms, rep_ms)
    finally:
        del graph
        torch.cuda.synchronize()


def samples(fn: Callable[[], object], on_gpu: bool, cpu_calls: int = 3) -> list[float]:
    return samples_gpu(fn) if on_gpu else samples_cpu(fn, cpu_calls)


def summarize(times_ms: Sequence[float], on_gpu: bool) -> Timing:
    arr = np.asarray(times_ms, dtype=float)
    return Timing(float(np.median(arr)), float(np.percentile(arr, 20)), float(np.percentile(arr, 80)),
                  "do_bench" if on_gpu else "perf_counter")


def bench_gpu(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 100) -> Timing:
    """One turn of do_bench on the current CUDA device, summarized (the notebooks' quick timings)."""
    return summarize(samples_gpu(fn, warmup_ms, rep_ms), True)
