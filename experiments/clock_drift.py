"""Rerun ``results/h200/experiments/2026-11-30_clock_drift.csv``: stage C and SDPA cuDNN timed in eight
alternating turns at two cells, with NVML's SM clock and board power sampled every 5 ms during each
turn. It shows the power cap at work: the clock, and with it a kernel's time, moves between turns.

    python experiments/clock_drift.py --out results/h200/experiments/<date>_clock_drift.csv

GPU only; needs ``pynvml`` (``nvidia-ml-py``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CELLS = ((64, True), (128, False))  # (D, causal), fp16, N = 1024
N, TURNS, SAMPLE_S = 1024, 8, 0.005


class NvmlSampler:
    """Samples the SM clock (MHz) and board power (W) every ``SAMPLE_S`` seconds while active."""

    def __init__(self):
        import pynvml

        pynvml.nvmlInit()
        self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        self.clocks, self.watts, self._stop = [], [], threading.Event()

    def __enter__(self):
        self.clocks, self.watts = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.clocks.append(self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM))
            self.watts.append(self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000)
            time.sleep(SAMPLE_S)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import triton.testing

    import stages
    from ab import cudnn, fa_paper_inputs

    c = stages.STAGES["c"]
    sampler = NvmlSampler()
    with args.out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["dtype", "D", "causal", "N", "turn", "impl", "ms_median", "reps", "sm_clock_mhz_mean",
                    "sm_clock_mhz_min", "sm_clock_mhz_max", "power_w_mean", "clock_samples"])
        for D, causal in CELLS:
            q, k, v = fa_paper_inputs(N, D, "fp16")
            fns = {"c": lambda: c.attention(q, k, v, causal=causal), "cudnn": lambda: cudnn(q, k, v, causal)}
            for fn in fns.values():
                fn()
            for turn in range(TURNS):
                for name in (list(fns) if turn % 2 == 0 else list(fns)[::-1]):
                    with sampler:
                        times = triton.testing.do_bench(fns[name], warmup=100, rep=100, return_mode="all")
                    w.writerow(["fp16", D, int(causal), N, turn, name, f"{statistics.median(times):.5f}", len(times),
                                f"{statistics.mean(sampler.clocks):.0f}", min(sampler.clocks), max(sampler.clocks),
                                f"{statistics.mean(sampler.watts):.1f}", len(sampler.clocks)])
                    f.flush()


if __name__ == "__main__":
    main()
