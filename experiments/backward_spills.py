"""Registers and spills of the Hopper dK/dV kernel with each of its switches, compiled without a GPU.

The dK/dV kernel's consumers hold dK and dV (two fp32 64 × D accumulators), the scores and dPᵀ, and with
fused dQ one more product's tile, in the 240 registers a thread gets; at D 128 with 64-row Q tiles
that does not fit, and ptxas spills to local memory (performance-log entries 54 and 61). This script
compiles the kernel (``stages/c_optimized/hopper_bwd.py``) for sm_90a at every tile config the tuner
races (``tune_backward.ws_candidates``), with and without fused dQ, causal or not, once with each
switch of ``--switch`` off and on (a module flag of ``hopper_bwd``, such as ``COMPACT_ROW_STATS``),
assembles it with ptxas and writes the spill bytes per thread, and, from the disassembled machine code,
what one pass of the consumers' Q-tile loop executes: its instructions and its local-memory accesses
(spilled values reloaded or saved inside the loop, the ones a spill costs on every tile; static counts,
``harness.inspect_code.first_mma_loop``). Nothing runs on a GPU: what the spills cost is measured by
``experiments/fused_dq.py`` on one.

    python experiments/backward_spills.py --csv results/compiled/<date>_backward_spills.csv
    python experiments/backward_spills.py --D 128 --switch COMPACT_ROW_STATS --problems mha
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["TRITON_INTERPRET"] = "0"  # compile for the GPU in this process

import stages  # noqa: E402,F401  (before triton)
from harness.inspect_code import first_mma_loop, run_ptxas, sass  # noqa: E402
from stages.c_optimized import backward as bwd  # noqa: E402
from stages.c_optimized import hopper_bwd  # noqa: E402
from stages.c_optimized.tune_backward import ws_candidates  # noqa: E402
from stages.contract import Problem  # noqa: E402

#: the problems compiled: the FlashAttention-paper cell at N 4096 (B·N = 16384 tokens, H·D = 2048 at
#: D 128) and a grouped-query one with a ragged N (GQA 4, N 1000). Only the layout's facts reach the
#: compiled code (the sizes are runtime values), but those do: the group, N's divisibility.
PROBLEMS = {"mha": dict(B=4, H=16, N=4096), "gqa": dict(B=2, H=8, Hkv=2, N=1000)}
COLUMNS = ("problem", "D", "config", "fused_dq", "causal", "switch", "on", "registers", "spill_stores",
           "spill_loads", "loop_instructions", "loop_local_accesses", "status")


def q_tile_loop(ptx: str) -> dict:
    """One pass of the first consumer's Q-tile loop in the kernel's SASS
    (``harness.inspect_code.first_mma_loop``): its instructions and its local-memory loads and
    stores; empty where ptxas or cuobjdump is missing."""
    loop = first_mma_loop(sass(ptx, "sm_90a"))
    if loop is None:
        return {}
    return {"loop_instructions": loop.instructions, "loop_local_accesses": loop.local_loads + loop.local_stores}


def bool_flags(ap: argparse.ArgumentParser, option: str, text: str) -> list[str]:
    """The comma-separated names in ``text``, each a bool flag of ``hopper_bwd``; otherwise ``ap`` exits
    with an error naming ``option`` and the name."""
    names = [s for s in text.split(",") if s]
    for name in names:
        if not isinstance(getattr(hopper_bwd, name, None), bool):
            ap.error(f"{option}: {name!r} is not a bool flag of stages/c_optimized/hopper_bwd.py")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", default="64,96,128", help="head dims (comma-separated)")
    ap.add_argument("--switch", default="COMPACT_ROW_STATS",
                    help="hopper_bwd module flags, each compiled off and on (comma-separated)")
    ap.add_argument("--problems", default=",".join(PROBLEMS), help=f"comma-separated from {list(PROBLEMS)}")
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    switches = bool_flags(ap, "--switch", args.switch)
    problems = args.problems.split(",")
    unknown = [p for p in problems if p not in PROBLEMS]
    if unknown:
        ap.error(f"--problems: unknown {', '.join(unknown)}; choose from {', '.join(PROBLEMS)}")
    hopper_bwd.FUSED_DQ_ATOMICS = "pair"  # (the default way fused dQ adds)
    rows = []
    for switch in switches:
        default = getattr(hopper_bwd, switch)
        for problem in problems:
            for D in (int(d) for d in args.D.split(",")):
                for ws in ws_candidates(D, 2):
                    for fused in ((False, True) if bwd.fused_dq_fits(ws) else (False,)):
                        for causal in (False, True):
                            for on in (False, True):
                                setattr(hopper_bwd, switch, on)
                                p = Problem(D=D, dtype=args.dtype, causal=causal, **PROBLEMS[problem])
                                row = dict(problem=problem, D=D, config=str(ws), fused_dq=int(fused),
                                           causal=int(causal), switch=switch, on=int(on))
                                try:
                                    kernels = bwd.compile_backward(p, 90, ws_config=ws,
                                                                   ws_dq_config="fused" if fused else None)
                                    dkdv = next(k for k in kernels if k.name == "ws_bwd_dkdv_kernel")
                                    facts = run_ptxas(dkdv.asm["ptx"], "sm_90a")
                                    row.update({k: facts.get(k, "") for k in ("registers", "spill_stores",
                                                                              "spill_loads")},
                                               status=facts.get("ptxas_error", "ok"))
                                    row.update(q_tile_loop(dkdv.asm["ptx"]))
                                except Exception as e:  # noqa: BLE001 - a config that fails is recorded
                                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                                rows.append(row)
                                print(" ".join(f"{k}={row.get(k, '')}" for k in COLUMNS), flush=True)
        setattr(hopper_bwd, switch, default)
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
