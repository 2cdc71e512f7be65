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
"""

from __future__ import annotations

import argparse
import csv
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--D", default="40,64,72,80,104,136,168,200,232")
    ap.add_argument("--arch", default="80,90")
    ap.add_argument("--csv", default=None)
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
    rows = []
    for arch in archs:
        for D in head_dims:
            for told in (False, True):
                for r in facts(arch, D, told):
                    rows.append(r)
                    print("  ".join(f"{k}={r[k]}" for k in FIELDS), flush=True)
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
