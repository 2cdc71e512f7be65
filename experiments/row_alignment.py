"""What telling the pointer kernels their rows' 16-byte alignment changes in the compiled code (no GPU).

Stage C's ``tl`` kernels (the one-pass forward, the split-KV decode kernel, the backward's Δ, dK/dV and
dQ kernels) take a constexpr ``ALIGN`` when the host finds every stride a multiple of 16 bytes
(``stages/c_optimized/aligned.py``). Triton sees that itself only when a stride is divisible by 16
elements, which a contiguous tensor's row stride D is not at a head dim of 8 mod 16. This script
compiles the kernels stage C would launch for a contiguous problem at each head dim, for sm_80 and
sm_90, with the alignment told (``LAB_ROW_ALIGNMENT`` on, the default) and not (off), and writes per
kernel: the loads and stores of single 16-bit elements, the 16-byte ones, the ``cp.async`` copies,
and the registers and spills ptxas reports.

    python experiments/row_alignment.py --csv results/compiled/<date>_row_alignment.csv
    python experiments/row_alignment.py --D 72,200 --arch 80

On a GPU, ``--time`` times what it is worth instead: stage C told and not told, in turns, each call
replayed from a CUDA graph (the GPU's time alone), at each head dim: a grouped decode step (B 4, 32/8
heads, Nk 8192: the split-KV kernel), the ``tl`` forward (``warp_specialization=False``; on an A100 the
only one) and its backward (forward and backward together), bf16, B 4, H 16, N 2048, causal:

    python experiments/row_alignment.py --time --D 64,72,136,200 --time-csv results/<gpu>/experiments/<date>_row_alignment_time.csv
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "0"  # (compile in this process: the switch below must reach the planner)

import stages  # noqa: E402
from harness.inspect_code import count_instructions, run_ptxas  # noqa: E402
from stages.c_optimized import aligned, backward  # noqa: E402
from stages.c_optimized.tune_backward import _write_csv  # noqa: E402
from stages.contract import Problem  # noqa: E402

FIELDS = ("arch", "D", "problem", "kernel", "aligned", "element_accesses", "vector_loads", "vector_stores",
          "cp_async", "registers", "spill_bytes")


def kernels(arch: int, D: int):
    """(problem name, compiled kernel) for what stage C launches at this head dim, fp16, causal."""
    prefill = Problem(B=2, H=8, N=1000, D=D, dtype="fp16", causal=True)
    decode = Problem(B=4, H=8, N=1, Hkv=2, Nk=8192, D=D, dtype="fp16")
    for name, p in (("prefill", prefill), ("decode", decode)):
        for k in stages.STAGES["c"].compile(p, arch):
            yield name, k
    for k in backward.compile_backward(prefill, arch, deterministic=True):
        yield "backward", k


def facts(arch: int, D: int, told: bool) -> list[dict]:
    aligned.ROW_ALIGNMENT = told
    rows = []
    for name, k in kernels(arch, D):
        ptx = k.asm["ptx"]
        c = count_instructions(ptx)
        ptxas = run_ptxas(ptx)
        spills = None if ptxas.get("spill_stores") is None else ptxas["spill_stores"] + ptxas["spill_loads"]
        rows.append(dict(arch=arch, D=D, problem=name, kernel=k.name, aligned=int(told),
                         element_accesses=len(re.findall(r"\b(?:ld|st)\.global(?:\.[\w:]+)*\.b16\b", ptx)),
                         vector_loads=c["ld.global.v4"], vector_stores=c["st.global.v4"],
                         cp_async=c["cp.async.cg.shared.global"] + c["cp.async.ca.shared.global"],
                         registers=ptxas.get("registers"), spill_bytes=spills))
    return rows


def time_cells(head_dims: list[int], turns: int = 3) -> list[dict]:
    """GPU ms (median of CUDA-graph replays, in turns) of stage C with the alignment told and not."""
    import statistics

    import torch

    from harness.timing import samples_graph
    from stages.c_optimized import kernels

    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    rows = []
    for D in head_dims:
        decode = (randn(4, 32, 1, D), randn(4, 8, 8192, D), randn(4, 8, 8192, D))
        prefill = tuple(randn(4, 16, 2048, D) for _ in range(3))
        do = randn(4, 16, 2048, D)

        def decode_call():
            return lambda: stages.STAGES["c"].attention(*decode)

        def forward_call():
            return lambda: stages.STAGES["c"].attention(*prefill, causal=True, warp_specialization=False)

        def training_call():
            q, k, v = (t.detach().requires_grad_() for t in prefill)

            def step():
                o = stages.STAGES["c"].attention(q, k, v, causal=True, warp_specialization=False)
                return torch.autograd.grad(o, (q, k, v), do)
            return step

        for cell, make_call in (("decode", decode_call), ("tl forward", forward_call),
                                ("tl forward+backward", training_call)):
            samples = {False: [], True: []}
            for turn in range(turns):
                for told in ((False, True) if turn % 2 == 0 else (True, False)):
                    aligned.ROW_ALIGNMENT = told
                    kernels._LAYOUT_PLANS.clear()  # (plans are kept per layout, not per setting)
                    backward._KEPT.clear()
                    backward.backward_plan.cache_clear()
                    try:
                        samples[told] += samples_graph(make_call)
                    except Exception as e:  # noqa: BLE001  (one cell's failure is a row, not the end)
                        print(f"D={D} {cell} told={told}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            for told, times in samples.items():
                rows.append(dict(D=D, cell=cell, aligned=int(told),
                                 ms=f"{statistics.median(times):.5f}" if times else "",
                                 status="ok" if times else "error"))
                print("  ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
    aligned.ROW_ALIGNMENT = True
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", default="40,64,72,80,104,136,168,200,232")
    ap.add_argument("--arch", default="80,90")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--time", action="store_true", help="on a GPU: time stage C told and not (see above)")
    ap.add_argument("--time-csv", default=None, help="with --time: write the times here")
    args = ap.parse_args(argv)
    try:
        head_dims = [int(d) for d in args.D.split(",")]
        archs = [int(a) for a in args.arch.split(",")]
    except ValueError:
        ap.error("--D and --arch take comma-separated integers")
    if bad := [d for d in head_dims if d % 8 or not 8 <= d <= 256]:
        ap.error(f"--D: head dims are multiples of 8 from 8 to 256, got {bad}")
    if bad := [a for a in archs if a not in (80, 90)]:
        ap.error(f"--arch: 80 or 90, got {bad}")
    if args.time:
        import torch

        if not torch.cuda.is_available():
            print("--time needs a CUDA GPU; none found", file=sys.stderr)
            return 2
        _write_csv(args.time_csv, time_cells(head_dims))
        return 0
    rows = []
    for arch in archs:
        for D in head_dims:
            for told in (False, True):
                for r in facts(arch, D, told):
                    rows.append(r)
                    print("  ".join(f"{k}={r[k]}" for k in FIELDS), flush=True)
    _write_csv(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
