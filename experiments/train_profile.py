"""Where a training step of ``harness train``'s model goes, per attention: the torch profiler over a few
steps of the GPU-sized GPT (harness/train.py: 4 layers, 8 query / 2 KV heads, D 64, context 1024,
batch 16, bf16), after warm-up steps, for each stage named.

    python experiments/train_profile.py                      # stage C against SDPA
    python experiments/train_profile.py --stages c,b,sdpa --steps 8 --top 25

Per stage, per step: wall ms (between two synchronizations, as ``harness train`` times it); the GPU
kernels launched and their summed GPU time (wall minus GPU time is where the GPU waited on the
host); then the kernels with the most GPU time, and the attention's own kernels beside SDPA's, so a
kernel one stage launches and the other does not stands out. GPU only.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401
import torch  # noqa: E402

from harness import train as T  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="c,sdpa")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="profiled steps per stage")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_profile needs a GPU")
        return 2
    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    names = args.stages.split(",")
    cfg = T.TrainConfig(steps=args.warmup + 2 * args.steps + 1)
    batches = T._Batches(T.GPU_MODEL, cfg, device)
    trainers = {n: T._StageTrainer(n, T.attention_for(n), T.GPU_MODEL, cfg, device, batches) for n in names}
    step = 0
    for _ in range(args.warmup):
        for t in trainers.values():
            t.step(step)
        step += 1
    print(f"model {T.GPU_MODEL}, batch {cfg.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, t in trainers.items():
        # wall times of unprofiled steps first (the profiler itself slows the host)
        walls = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t.step(step)
            walls.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                t.step(step)
        kernels = collections.Counter()
        kernel_us = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] += 1
                kernel_us[e.name] += e.device_time
        n = args.steps
        gpu_ms = sum(kernel_us.values()) / 1e3 / n
        print(f"\n{name}: wall {statistics.median(walls):.2f} ms per step (median of {n}), GPU kernels "
              f"{sum(kernels.values()) / n:.0f} per step, {gpu_ms:.2f} ms of GPU time per step")
        for kname, us in kernel_us.most_common(args.top):
            print(f"  {us / n / 1e3:8.3f} ms  {kernels[kname] / n:6.1f}x  {kname[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
