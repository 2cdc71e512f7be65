"""What the L2 flush between timed calls costs a read-bound kernel, on a GPU.

``triton.testing.do_bench`` clears the L2 before every timed call by zeroing a 256 MB buffer. Zeroing
*writes*: the L2 (write-back) is left holding up to its size (60 MB on an H200) of dirty lines of
that buffer, and the timed kernel's first reads must evict them, writing them to DRAM, before its own
bytes arrive. A kernel that reads 134 MB (a B 1 decode step over a 32k cache) then moves up to a
third more bytes than it asked for, inside its timed window. Flushing by *reading* the buffer leaves
the L2 just as cold for the kernel's data, but clean.

For decode cells (Nq = 1, bf16, non-causal) this times, in CUDA-graph replay the way the harness does
(``timing.samples_graph``: CUDA events around each replay, the flush passed in), stage C, cuDNN and a device-to-device copy of the same byte count (half read, half
written: the copy bandwidth the results page divides by), each after a zeroing flush (do_bench's),
after a reading flush, and with no flush (K and V may then be served from the L2 where they fit), and
prints µs and GB/s per (cell, impl, flush). ``--cells`` takes other cells by name: the decode tile sweep's
(``experiments/decode_tiles.py``) or the model suite's (``harness/suites.py``), prefill cells included (the
model suite's ``short``: a read-bound forward of 2,048 heads of 128 tokens).

    python experiments/l2_flush.py > results/h200/experiments/<date>_l2_flush.txt
    python experiments/l2_flush.py --cells short,bert-base,decode-long
    python experiments/l2_flush.py --cells short --kernels   # + each kernel's own duration, eager calls

``--kernels``: also runs each impl eagerly after the reading flush under the torch profiler and prints
the median duration CUPTI records for each of its kernels, beside the graph replay's event time: where a
kernel's own duration equals a peer's and the event times differ, the difference is between kernels (the
launch, the flush's tail), not inside them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import torch  # noqa: E402

from experiments.decode_tiles import CELLS as DECODE_CELLS  # noqa: E402
from harness import timing  # noqa: E402
from harness.peers import peer_attention  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402

#: six of the decode tile sweep's cells (name, B, Hq, Hkv, Nk, D): batch 1 at three cache lengths,
#: multi-head, and two larger batches
CELLS = [c for c in DECODE_CELLS if c[0] in ("b1-gqa-4k", "b1-gqa-32k", "b1-gqa-128k", "b1-mha-32k", "decode-gqa",
                                               "decode-long")]


def cells_named(names: list[str]) -> list:
    """(name, B, Hq, Hkv, Nq, Nk, D, causal, dtype) of each named cell: the decode sweep's (Nq 1, bf16,
    non-causal) or the model suite's."""
    from harness.suites import MODELS

    decode = {c[0]: (c[0], c[1], c[2], c[3], 1, c[4], c[5], False, "bf16") for c in DECODE_CELLS}
    suite = {c.name: (c.name, c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, c.causal, c.dtype) for c in MODELS}
    unknown = [n for n in names if n not in decode and n not in suite]
    if unknown:
        raise ValueError(f"--cells: unknown cell(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(sorted(set(decode) | set(suite)))}")
    return [decode.get(n) or suite[n] for n in names]


def kernel_durations_us(fn, flush, calls: int = 50) -> dict[str, float]:
    """{kernel name: median duration in µs} of the kernels ``fn`` launches, each call after ``flush``
    (whose own kernels are left out: they are the ones a flush alone launches)."""
    import statistics

    from torch.profiler import ProfilerActivity, profile

    def durations(call) -> dict[str, list[float]]:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        out: dict[str, list[float]] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                out.setdefault(e.name, []).append(e.device_time)
        return out

    flush_only = durations(flush)
    both = durations(lambda: (flush(), fn()))
    return {k: statistics.median(v) for k, v in both.items() if k not in flush_only}


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cells", default=",".join(c[0] for c in CELLS),
                    help="cells by name, the decode sweep's or the model suite's (default: six decode cells)")
    ap.add_argument("--kernels", action="store_true",
                    help="also print the median CUPTI duration of each impl's kernels (reading flush, eager calls)")
    args = ap.parse_args()
    try:
        cells = cells_named([n for n in args.cells.split(",") if n])
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        print("error: this experiment times kernels on a CUDA GPU; none here", file=sys.stderr)
        return 2
    buf = torch.empty(timing.FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    flushes = {
        "zero": buf.zero_,                                # do_bench's: leaves the L2 full of dirty lines
        "read": timing.flush_l2,                          # the harness's: leaves it full of clean ones
        "none": lambda: None,
    }
    cudnn = peer_attention("sdpa_cudnn")
    print(f"{torch.cuda.get_device_name()}; median of ~100 ms of graph replays per row")
    for name, B, Hq, Hkv, Nq, Nk, D, causal, dtype in cells:
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Hq, Nq, D, device="cuda", generator=g).to(dt)
        k = torch.randn(B, Hkv, Nk, D, device="cuda", generator=g).to(dt)
        v = torch.randn(B, Hkv, Nk, D, device="cuda", generator=g).to(dt)
        nbytes = 2 * (k.numel() + v.numel() + 2 * q.numel())
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        impls = {"c": lambda: ck.attention(q, k, v, causal=causal), "cudnn": lambda: cudnn(q, k, v, causal=causal),
                 "copy": lambda: dst.copy_(src)}
        print(f"\n{name}: B {B}, H {Hq}/{Hkv}, Nq {Nq}, Nk {Nk}, D {D}, {dtype}, causal {causal}; "
              f"{nbytes / 1e6:.1f} MB read and written (the copy: half read, half written)")
        for impl, fn in impls.items():
            row = []
            for flush_name, flush in flushes.items():
                us = timing.summarize(timing.samples_graph(lambda: fn, flush=flush), True).ms_median * 1e3
                row.append(f"{flush_name} {us:7.1f} us {nbytes / us / 1e3:6.0f} GB/s")
            print(f"  {impl:6} " + " | ".join(row), flush=True)
            if args.kernels:
                for kernel, us in kernel_durations_us(fn, timing.flush_l2).items():
                    print(f"         kernel {us:7.1f} us  {kernel[:100]}", flush=True)
        del q, k, v, src, dst
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
