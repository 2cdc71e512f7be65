"""A register cap on stage C's tl kernel: does ``maxnreg=128`` give back the occupancy its registers cost?

Performance-log entry 4 (docs/performance-log/tuning.md) explained why stage C with every switch
off ran slower than stage B on causal problems at D = 64: 136 registers per thread against B's
118, so three 4-warp programs fit an SM's 64K registers instead of four, and a kernel without a
software pipeline hides its load latency only with other warps. Compiled, a cap of 128 registers
(Triton's ``maxnreg`` launch option) kept the kernel free of spills and would restore the fourth
program. This measures it (GPU only), FA-paper sizes (B·N = 16384, H·D = 2048), fp16:

* ``b``: stage B;
* ``c+none``: stage C with every switch off (the ablation's first row), and ``c+none maxnreg128``:
  the same launches capped at 128 registers;
* ``c-tl``: stage C's tuned tl kernel (``warp_specialization=False``: what sm_80 runs, and the
  fallback on sm_90), and ``c-tl maxnreg128``;
* ``cudnn``: SDPA's cuDNN backend, the reference the outputs are checked against.

Each variant's launches are compiled first (their registers and spills, as ptxas reports them,
go into the file), then timed in turns (``harness.timing.samples_gpu``: CUDA events, the L2 flushed
by reading 256 MB before each repetition), the order reversed every turn; the median of every
repetition of every turn.

    python experiments/maxnreg.py --out results/h200/experiments/<date>_maxnreg.csv
    python experiments/maxnreg.py --D 64 --N 4096 --causal 1   # one cell
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401  (first: it decides about the interpreter)
import torch  # noqa: E402

from experiments.ab import cudnn, fa_paper_inputs, time_in_turns  # noqa: E402
from harness.timing import samples_gpu  # noqa: E402
from stages.c_optimized import VARIANTS, kernels  # noqa: E402
from stages.contract import Problem, new_output  # noqa: E402

CAP = 128
COLUMNS = ["dtype", "D", "causal", "N", "impl", "maxnreg", "kernel", "regs", "spills", "shared_bytes", "ms",
           "tflops", "vs_b", "rel_err_vs_cudnn"]


def capped_call(q, k, v, causal: bool, switches: dict, maxnreg: int | None):
    """(call, [(kernel name, registers, spills, shared bytes)]): stage C's launches for these
    switches, as ``attention`` would plan them, with ``maxnreg`` added to their launch options."""
    arch, sms = kernels._arch_and_sms(q)
    o = new_output(q)
    launches = kernels.plan(q, k, v, o, causal=causal, scale=q.shape[-1] ** -0.5, arch=arch, sms=sms, **switches)
    facts = []
    for launch in launches:
        if maxnreg is not None:
            launch.extra = {**launch.extra, "maxnreg": maxnreg}
        compiled = launch.kernel[tuple(launch.grid)](**launch.args, num_warps=launch.num_warps,
                                                     num_stages=launch.num_stages, **launch.extra)
        facts.append((launch.kernel.fn.__name__, compiled.n_regs, compiled.n_spills, compiled.metadata.shared))

    def call():
        for launch in launches:
            launch.run()
        return o

    return call, facts


def cell(w, dtype: str, D: int, causal: bool, N: int, turns: int) -> None:
    q, k, v = fa_paper_inputs(N, D, dtype)
    ref = cudnn(q, k, v, causal).float()
    variants, facts = {"cudnn": lambda: cudnn(q, k, v, causal)}, {}
    variants["b"] = lambda: stages.get_stage("b").attention(q, k, v, causal=causal)
    for name, switches in (("c+none", VARIANTS["+none"]), ("c-tl", {"warp_specialization": False})):
        for cap in (None, CAP):
            label = name if cap is None else f"{name} maxnreg{cap}"
            variants[label], facts[label] = capped_call(q, k, v, causal, switches, cap)
    errors = {name: ((fn().float() - ref).norm() / ref.norm()).item() for name, fn in variants.items()}
    ms = time_in_turns(variants, turns, sample=samples_gpu)
    flops = Problem.of(q, causal=causal).flops
    for name in variants:
        kernel, regs, spills, shared = (facts.get(name) or [("", "", "", "")])[0]
        cap = CAP if "maxnreg" in name else ""
        w.writerow([dtype, D, int(causal), N, name, cap, kernel, regs, spills, shared, f"{ms[name]:.5f}",
                    f"{flops / ms[name] / 1e9:.1f}", f"{ms['b'] / ms[name]:.4f}", f"{errors[name]:.3e}"])
        print(f"{dtype} D={D} causal={int(causal)} N={N} {name:22s} regs={regs!s:>4} spills={spills!s:>3} "
              f"{ms[name]:.4f} ms  vs B {ms['b'] / ms[name]:.3f}  err {errors[name]:.1e}", file=sys.stderr, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="CSV to append rows to (default: print only)")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    p.add_argument("--D", default="64,128", help="head dims, comma-separated (default 64,128)")
    p.add_argument("--N", default="1024,4096,16384", help="sequence lengths (default 1024,4096,16384)")
    p.add_argument("--causal", default="1,0", help="1, 0 or both (default 1,0)")
    p.add_argument("--turns", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("experiments/maxnreg.py needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        Ds = [int(x) for x in args.D.split(",")]
        Ns = [int(x) for x in args.N.split(",")]
        causals = [bool(int(x)) for x in args.causal.split(",")]
    except ValueError:
        print(f"--D, --N and --causal take comma-separated integers, got {args.D!r}, {args.N!r}, {args.causal!r}",
              file=sys.stderr)
        return 2
    sink = open(args.out, "a", newline="") if args.out else sys.stdout
    try:
        w = csv.writer(sink)
        if not args.out or sink.tell() == 0:
            w.writerow(COLUMNS)
        for D in Ds:
            for causal in causals:
                for N in Ns:
                    cell(w, args.dtype, D, causal, N, args.turns)
                    sink.flush()
    finally:
        if args.out:
            sink.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
