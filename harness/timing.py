"""Time per call, in ms: median and the 20th/80th percentiles of a set of samples.

On a GPU: ``triton.testing.do_bench``'s recipe, after a warm call made by the caller (so compilation
and autotuning are not timed): estimate the call's time, run it for ``warmup_ms`` (100 ms, not
do_bench's 25: compiling a kernel leaves the GPU idle for seconds, and a sub-millisecond kernel timed
right after that can catch the clocks still ramping), then repeat it for ``rep_ms``, each repetition
after an L2 flush and timed with CUDA events. ``samples`` returns every repetition's time, so a caller
can pool the samples of several turns (``measure.run_cells`` times a cell's implementations in turns).

**The flush reads, it does not write.** do_bench clears the L2 by zeroing a 256 MB buffer. The L2 is a
write-back cache, so that leaves it full of dirty lines (up to its size: 60 MB on an H200), and the
timed call's first loads must wait while they are written back to DRAM. A call that only reads (a
decode step reading its KV cache) is then charged for the benchmark's own writes: on the H200 about
10 µs per call, a fifth of a 134 MB decode step. Reading a 256 MB buffer instead evicts the timed
call's data just as surely and leaves the L2 clean (:func:`flush_l2`).

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
    method: str  # "cuda_events" or "perf_counter"


#: How GPU times are taken, for the results' provenance (``env.json``'s ``timing``).
METHOD = ("CUDA events around each repetition (do_bench's counts: 100 ms of warm-up, then 100 ms of "
          "repetitions, at least 5 of them), the L2 flushed before each by reading a 256 MB buffer")

#: Repetitions a sample set takes however long the call: do_bench's count alone gives a 60 ms call one
#: repetition per 100 ms, and one repetition reads whatever clock the power cap had just then (a long
#: call right after a pause runs at boost, one after a long call at the capped clock: up to 15 %).
MIN_REPS = 5

#: Bytes read between repetitions: more than any GPU's L2 (60 MB on an H200), so nothing the timed
#: call left there survives.
FLUSH_BYTES = 256 * 2**20
_FLUSH_BUFFERS: dict = {}


def flush_l2() -> None:
    """Evict the L2 of the current CUDA device by reading :data:`FLUSH_BYTES`, leaving it full of clean
    lines, so the next call finds none of its data there and writes nothing back (the module
    docstring says why not zeroing)."""
    import torch

    device = torch.cuda.current_device()
    buf = _FLUSH_BUFFERS.get(device)
    if buf is None:
        buf = _FLUSH_BUFFERS[device] = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf.sum()


def samples_gpu(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 100,
                flush: Callable[[], object] = flush_l2) -> list[float]:
    """Every repetition's time (ms) on the current CUDA device (call ``fn`` once before: compilation is
    not timed): the module docstring's recipe with at least :data:`MIN_REPS` repetitions, ``flush()``
    before each repetition (``experiments/l2_flush.py`` passes others to compare)."""
    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        flush()
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate_ms = max(start.elapsed_time(end) / 5, 1e-3)
    warmup, reps = max(1, int(warmup_ms / estimate_ms)), max(MIN_REPS, int(rep_ms / estimate_ms))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(warmup):
        fn()
    for s, e in zip(starts, ends):
        flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def samples_cpu(fn: Callable[[], object], calls: int = 3) -> list[float]:
    """Wall time (ms) of each of ``calls`` calls with perf_counter (CPU / Triton interpreter)."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def samples_graph(make_call: Callable[[], Callable[[], object]], warmup_ms: int = 100,
                  rep_ms: int = 100, flush: Callable[[], object] = flush_l2) -> list[float]:
    """Every repetition's time (ms) of the call replayed from a CUDA graph: the GPU's time alone.

    ``make_call()`` returns the call to capture; it runs on the side stream the graph is captured
    on, so anything it sets up there (the saved forward a backward call needs: autograd runs each
    backward op on its forward op's stream) is on the capturing stream too. The call runs once
    before the capture, on that stream, as PyTorch asks (lazy initialization, such as a library
    creating its handle or workspace, must not happen inside a capture). Replays are timed by
    :func:`samples_gpu` like the eager call, so the two columns differ by the host path only. A call that
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
        return samples_gpu(graph.replay, warmup_ms, rep_ms, flush)
    finally:
        del graph
        torch.cuda.synchronize()


def samples(fn: Callable[[], object], on_gpu: bool, cpu_calls: int = 3) -> list[float]:
    return samples_gpu(fn) if on_gpu else samples_cpu(fn, cpu_calls)


def summarize(times_ms: Sequence[float], on_gpu: bool) -> Timing:
    arr = np.asarray(times_ms, dtype=float)
    return Timing(float(np.median(arr)), float(np.percentile(arr, 20)), float(np.percentile(arr, 80)),
                  "cuda_events" if on_gpu else "perf_counter")


def bench_gpu(fn: Callable[[], object], warmup_ms: int = 100, rep_ms: int = 100) -> Timing:
    """One turn of :func:`samples_gpu` on the current CUDA device, summarized (the notebooks' quick timings)."""
    return summarize(samples_gpu(fn, warmup_ms, rep_ms), True)
