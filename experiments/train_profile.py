"""Where a training step of ``harness train``'s model goes, per attention: the torch profiler over a few
steps of the GPU-sized GPT (harness/train.py: 4 layers, 8 query / 2 KV heads, D 64, context 1024,
batch 16, bf16), after warm-up steps, for each stage named.

    python experiments/train_profile.py                      # stage C against SDPA
    python experiments/train_profile.py --stages c,b,sdpa --steps 30 --top 25
    python experiments/train_profile.py --compile inductor    # the forward and backward compiled

Per stage: the step time as ``harness train`` measures it (between two synchronizations), with the
stages taking their steps in turns (as ``harness train`` runs them) and each on its own; the GPU
kernels launched per step and their summed GPU time (step time minus GPU time is where the GPU
waited on the host), the kernels with the most GPU time (a kernel one stage launches and the other
does not stands out); and the Python functions with the most time of their own. GPU only.
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

from generate_profile import python_top  # noqa: E402
from harness import train as T  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="c,sdpa")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per stage, in each of the two orders")
    ap.add_argument("--profiled", type=int, default=4, help="steps per stage under each profiler")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--compile", choices=list(T.COMPILE_MODES), default="off",
                    help="as harness train's --compile: off (eager), inductor, cudagraphs")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_profile needs a GPU")
        return 2
    import cProfile

    from torch.profiler import ProfilerActivity, profile

    device = torch.device("cuda")
    names = args.stages.split(",")
    cfg = T.TrainConfig(steps=args.warmup + 2 * args.steps + 3 * args.profiled + 1, compile=args.compile)
    batches = T._Batches(T.GPU_MODEL, cfg, device)
    trainers = {n: T._StageTrainer(n, T.attention_for(n), T.GPU_MODEL, cfg, device, batches) for n in names}
    step = 0

    def take(name: str) -> float:
        nonlocal step
        trainers[name].step(step % cfg.steps)
        return trainers[name].run.step_ms[-1]

    for _ in range(args.warmup):
        for n in names:
            take(n)
        step += 1
    print(f"model {T.GPU_MODEL}, batch {cfg.batch}, compile {cfg.compile}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}")
    # 1. the step time as harness train measures it (between two synchronizations), stages in turns
    #    (harness train's order) and each stage's steps one after another
    lockstep = {n: [] for n in names}
    for i in range(args.steps):
        for n in (names[i % len(names):] + names[:i % len(names)]):
            lockstep[n].append(take(n))
        step += 1
    alone = {n: [take(n) for _ in range(args.steps)] for n in names}
    for n in names:
        print(f"{n}: step {statistics.median(lockstep[n]):.2f} ms in turns with the others, "
              f"{statistics.median(alone[n]):.2f} ms on its own (medians of {args.steps})")
    # 2. Python's time per function, stages in turns
    pyprof = {n: cProfile.Profile() for n in names}
    for i in range(args.profiled):
        for n in names:
            pyprof[n].enable()
            take(n)
            pyprof[n].disable()
        step += 1
    # 3. GPU kernels, each stage's steps one after another
    for name in names:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profiled):
                take(name)
        kernels = collections.Counter()
        kernel_us = collections.Counter()
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name] += 1
                kernel_us[e.name] += e.device_time
        n = args.profiled
        gpu_ms = sum(kernel_us.values()) / 1e3 / n
        print(f"\n{name}: GPU kernels {sum(kernels.values()) / n:.0f} per step, {gpu_ms:.2f} ms of GPU time per step")
        for kname, us in kernel_us.most_common(args.top):
            print(f"  {us / n / 1e3:8.3f} ms  {kernels[kname] / n:6.1f}x  {kname[:110]}")
        print(f"  CPU side (operators and CUDA runtime/driver calls), {args.profiled} steps, by own CPU time:")
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60)
        print("\n".join("    " + line for line in table.splitlines()))
        print(f"  Python, {args.profiled} steps in turns with the others, by own time:")
        print(python_top(pyprof[name], args.top, width=150))
        print("  Python, the same steps, the lab's and the model's functions by cumulative time:")
        print(python_top(pyprof[name], args.top, sort="cumulative", only=r"stages/|harness/train", width=150))
    return 0


if __name__ == "__main__":
    sys.exit(main())
