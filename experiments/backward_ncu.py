"""Nsight Compute on the backward's kernels: where fused dQ's time goes, beside cuDNN's backward.

Fused dQ (``ws_dq_config="fused"``) pays off at D 64 and not at D 128, where it costs the dK/dV kernel
1.2-1.4 ms for 0.4 ms of tensor work (docs/performance-log/backward.md, entries 54-59). This profiles,
at one FlashAttention-paper cell (B·N = 16384, H·D = 2048, bf16), one launch of each of:

* ``dkdv``: the Hopper dK/dV kernel alone (the two-kernel plan's first kernel);
* ``fused``: the same kernel forming dQ too (the pair's bulk reduce); ``fused_stagger`` with each
  program's Q tiles in its own order (``hopper_bwd.FUSED_DQ_STAGGER``), ``fused_lag`` with each Q
  tile's dQ slice formed during the next tile (``hopper_bwd.FUSED_DQ_LAG``);
* ``dq``: the Hopper dQ kernel (the two-kernel plan's second kernel);
* ``default``: stage C's backward as it runs by default (``attention_backward``: its plan, every kernel);
* ``cudnn``: SDPA's cuDNN backward (``torch.autograd.grad`` of a kept forward), every kernel it launches;

each in a child process under ``ncu`` that makes the inputs, warms the launch up and brackets one
launch with ``cudaProfilerStart``/``Stop``. Per kernel: duration, the tensor, XU and FMA pipes' busy
share, issue activity, the stall reasons per issued instruction (``harness.ncu.PIPE_AND_STALL_METRICS``),
DRAM bytes, L2 throughput and the sectors L2 reduced (the bulk reduce's adds) and atomically updated.

    python experiments/backward_ncu.py --csv results/h200/experiments/<date>_backward_ncu.csv
    python experiments/backward_ncu.py --D 64 --cases dkdv,fused,cudnn --csv <file>
    python experiments/backward_ncu.py --cell llama3-8b --cases default,cudnn --csv <file>

``--cell`` takes a model-suite cell (``harness/suites.py``: its batch, heads, grouped K/V heads, lengths,
head dim, mask and dtype) instead of the FlashAttention-paper cell at ``--D``/``--N``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.ncu import PIPE_AND_STALL_METRICS, find_ncu, parse_ncu_csv  # noqa: E402
from stages.c_optimized.tune_backward import _write_csv  # noqa: E402

CASES = ("dkdv", "fused", "fused_stagger", "fused_lag", "dq", "default", "cudnn")
#: Beside the pipes and stalls: time, bytes, and what the L2 did (reads, the bulk reduce's adds, atomics).
EXTRA_METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors_op_read.sum",
    "lts__t_sectors_op_red.sum",
    "lts__t_sectors_op_atom.sum",
)


def cell_inputs(name: str):
    """(q, k, v, o, lse, do, causal) of a model-suite cell, with stage C's forward's O and lse."""
    import torch

    from harness.suites import MODELS
    from stages.c_optimized.kernels import attention_with_lse
    from stages.contract import DTYPES

    cell = next(c for c in MODELS if c.name == name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(cell.B, cell.Hq, cell.Nq, cell.D, device="cuda", generator=gen).to(DTYPES[cell.dtype])
    k, v = (torch.randn(cell.B, cell.Hkv, cell.Nk, cell.D, device="cuda", generator=gen).to(q.dtype) for _ in range(2))
    o, lse = attention_with_lse(q, k, v, causal=cell.causal)
    return q, k, v, o, lse, torch.randn_like(o), cell.causal


def child(case: str, D: int, N: int, causal: bool, ws: str, cell: str | None = None) -> int:
    """Build the case's launch, run it once unprofiled, then once inside the profiler's window."""
    import torch

    from stages.c_optimized import backward as bwd
    from stages.c_optimized import hopper_bwd
    from stages.c_optimized.tune_backward import _inputs

    if cell:
        q, k, v, o, lse, do, causal = cell_inputs(cell)
        D, N = q.shape[-1], q.shape[2]
    else:
        q, k, v, o, lse, do = _inputs("bf16", D, causal, N)
    B, H = q.shape[:2]
    if case == "default":
        run = lambda: bwd.attention_backward(do, q, k, v, o, lse, causal=causal, scale=D ** -0.5)  # noqa: E731
    elif case == "cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal,
                                                                  enable_gqa=q.shape[1] != k.shape[1])
        run = lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)  # noqa: E731
    else:
        hopper_bwd.FUSED_DQ_STAGGER = case == "fused_stagger"
        hopper_bwd.FUSED_DQ_LAG = case == "fused_lag"
        fused = case.startswith("fused")
        tiles = bwd.WsConfig.parse(ws)
        delta = torch.zeros((B, H, N), dtype=torch.float32, device="cuda")
        dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
        acc = torch.zeros((B, H, N, D), dtype=torch.float32, device="cuda") if fused else None
        launches = bwd.plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, acc, causal=causal, scale=D ** -0.5,
                                     arch=90, deterministic=not fused, ws=tiles,
                                     ws_dq=bwd.FUSED_DQ if fused else tiles if case == "dq" else None)
        launch = launches[1] if case != "dq" else launches[2]
        run = launch.run
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


def profile(ncu: str, case: str, args) -> list[dict]:
    metrics = ",".join(PIPE_AND_STALL_METRICS + EXTRA_METRICS)
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--target-processes", "all",
           "--metrics", metrics, "--csv", "--print-units", "base",
           sys.executable, __file__, "--child", case, "--D", str(args.D), "--N", str(args.N), "--ws", args.ws]
    if args.causal:
        cmd.append("--causal")
    if args.cell:
        cmd += ["--cell", args.cell]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    kernels = parse_ncu_csv(done.stdout)
    if not kernels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return [{"case": case, "kernel": "", "status": f"no kernel profiled (rc {done.returncode}): "
                 + " | ".join(tail)[:300]}]
    return [{"case": case, "kernel": k["name"].split("(")[0][:60], "status": "ok", **k["metrics"]} for k in kernels]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--N", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--ws", default="ws-M64-c2-s2", help="the Hopper kernels' tile config (dK/dV and dQ)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"some of {','.join(CASES)}")
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--cell", default=None, help="a model-suite cell by name (harness/suites.py) instead of --D/--N")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell is not None:
        from harness.suites import MODELS

        names = [c.name for c in MODELS]
        if args.cell not in names:
            ap.error(f"--cell: unknown cell {args.cell!r}; choose from {', '.join(names)}")
        cell = MODELS[names.index(args.cell)]
        args.D, args.N, args.causal = cell.D, cell.Nq, cell.causal  # (what the rows record)
    if args.child:
        return child(args.child, args.D, args.N, args.causal, args.ws, args.cell)
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}")
    ncu = find_ncu()
    if ncu is None:
        print("backward_ncu.py needs Nsight Compute (ncu) and a GPU", file=sys.stderr)
        return 2
    rows: list[dict] = []
    for case in cases:
        found = profile(ncu, case, args)
        for r in found:
            r.update(D=args.D, N=args.N, causal=int(args.causal), ws=args.ws, cell=args.cell or "",
                     head_group=os.environ.get("LAB_BWD_HEAD_GROUP", ""))
            t = r.get("gpu__time_duration.sum")
            print(f"{case:14s} {r['kernel'][:40]:40s} " + (f"{t / 1e6:.3f} ms" if t else r["status"]), flush=True)
        rows += found
        _write_csv(args.csv, rows)  # after every case: a crash keeps what was profiled
    return 0


if __name__ == "__main__":
    sys.exit(main())
