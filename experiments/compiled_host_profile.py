"""Where a compiled attention step's host time goes: ``torch.compile`` of the attention alone, forward and
``autograd.grad``, stage C against cuDNN, taken apart with the profilers.

    python experiments/compiled_host_profile.py                     # harness train's attention
    python experiments/compiled_host_profile.py --B 1 --H 8 --Hkv 8 --steps 100
    python experiments/compiled_host_profile.py --timing-only     # the host-time lines alone

``backward_host.py --compiled`` showed the gap (at B 16, H 8/2, N 1024, D 64 on an H100: 790 µs of host
time a step for stage C, 311 for cuDNN) and that the lab's two ops take only about 130 µs of it. This
script says where the rest is:

* the step's host time (the clock stops before the GPU is waited for) for each backend of
  ``torch.compile`` (``aot_eager``: AOTAutograd's runtime without Inductor; ``inductor``), and the
  compiled forward alone, without gradients; beside it the wall time, the GPU waited for;
* whether a step makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``: a warning per
  synchronizing call, counted);
* the torch profiler's operators and CUDA runtime calls by their own host time, and the GPU's kernels
  by their time (a compiled step may also queue work that the eager one does not);
* cProfile's Python functions by their own time, per step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def host_us(fn, steps: int) -> str:
    """Host µs per step (the clock read before the GPU is waited for: few enough steps that the launch
    queue never fills, so a step that does not synchronize never blocks) and wall µs (after the wait)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return f"host {host / steps * 1e6:7.1f}  wall {wall / steps * 1e6:7.1f}"


def warm_up(fn) -> None:
    """A few steps first: a function compiled by two backends may compile again when called after the other."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()


def synchronizations(fn) -> list[str]:
    """The synchronizing calls one step makes, as ``set_sync_debug_mode`` warns of them."""
    warm_up(fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return [str(w.message).splitlines()[0][:120] for w in caught]


def profiled(fn, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    warm_up(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return (averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=70) + "\n"
            + averages.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))


def python_profile(fn, steps: int, rows: int) -> str:
    warm_up(fn)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(rows)
    return text.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--Hkv", type=int, default=2)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200, help="steps per host-time line")
    ap.add_argument("--rows", type=int, default=30, help="rows per profile table")
    ap.add_argument("--timing-only", action="store_true",
                    help="print the host-time lines only (no synchronization count, no profiles)")
    args = ap.parse_args()
    for option in ("B", "H", "Hkv", "N", "D", "steps", "rows"):
        if getattr(args, option) < 1:
            ap.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if args.H % args.Hkv:
        ap.error(f"--Hkv must divide --H ({args.H}), got {args.Hkv}")
    if not torch.cuda.is_available():
        sys.exit("error: this experiment profiles GPU calls' host path; no CUDA GPU here")
    import stages  # noqa: F401
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    causal, gqa = bool(args.causal), args.Hkv != args.H
    q = torch.randn((args.B, args.H, args.N, args.D), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn((args.B, args.Hkv, args.N, args.D), device="cuda", dtype=torch.bfloat16,
                        requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    print(f"B={args.B} H={args.H}/{args.Hkv} N={args.N} D={args.D} bf16 causal={int(causal)}; host µs per step "
          f"over {args.steps} steps")
    attends = {"stage C": lambda a, b, c: stages.STAGES["c"].attention(a, b, c, causal=causal),
               "cuDNN": lambda a, b, c: sdpa(a, b, c, is_causal=causal, enable_gqa=gqa)}
    steps = {}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for name, attend in attends.items():
            eager_step = lambda attend=attend: torch.autograd.grad(attend(q, k, v), (q, k, v), do)  # noqa: E731
            print(f"  {name}, eager forward + autograd.grad: {host_us(eager_step, args.steps)}")
            for backend in ("aot_eager", "inductor"):
                compiled = torch.compile(attend, fullgraph=True, backend=backend)

                def step(compiled=compiled):
                    torch.autograd.grad(compiled(q, k, v), (q, k, v), do)

                def forward_only(compiled=compiled):
                    with torch.no_grad():
                        compiled(q, k, v)

                print(f"  {name}, {backend}: forward + autograd.grad {host_us(step, args.steps)};   "
                      f"forward alone, no grad {host_us(forward_only, args.steps)}")
                steps[name, backend] = step
        if args.timing_only:
            return
        for (name, backend), step in steps.items():
            syncs = synchronizations(step)
            print(f"  {name}, {backend}: {len(syncs)} synchronizing calls a step" +
                  "".join(f"\n      {s}" for s in syncs))
        for name in attends:
            step = steps[name, "inductor"]
            print(f"\n=== torch profiler, {name}, inductor, 20 steps (times are totals over the 20) ===")
            print(profiled(step, 20, args.rows))
            print(f"\n=== cProfile, {name}, inductor, {args.steps} steps (times are totals) ===")
            print(python_profile(step, args.steps, args.rows))


if __name__ == "__main__":
    main()
