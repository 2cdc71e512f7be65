"""Host time per call of each impl on a tiny problem, beside an empty Triton kernel's launch.

``python -m harness latency`` answers "what does one call cost the CPU?". On a tiny problem
(default B=1, H=8, N=128, D=64, fp16) the GPU's work takes a few microseconds, less than the host
path in front of it: checking the inputs, choosing a config, building launch arguments, Triton's
launcher, PyTorch's dispatch. A program that calls attention once per layer and token runs at the
host's pace then, whatever the kernel's speed.

How: after a few warm calls (compilation, autotuning), ``calls`` calls are issued back to back
with no synchronization between them and one at the end, and the CPU wall time is divided by
``calls``; nothing is subtracted. While the host is slower than the GPU, the GPU keeps up and the
figure is the host path. Beside the impls, the *floor*: an empty ``@triton.jit`` kernel with no
arguments, launched the same way, the least any Triton kernel's call costs.

On a CPU the stages and the empty kernel run in the Triton interpreter and the peers in PyTorch's
CPU kernels: the figures are interpreter times, useful for checking the command, not for
conclusions about a GPU.

Passes (``--pass``, the ``pass`` column), as ``sweep`` names them: ``fwd`` the forward call; ``bwd``
the backward alone, ``torch.autograd.grad(o, (q, k, v), dO, retain_graph=True)`` on one saved
forward, which is what a training step's backward costs the host beside its forward; ``fwd_bwd``
both, a whole training call. A layer's backward runs an autograd node of the impl's (a Python
function for the stages, C++ for SDPA) and launches more kernels than its forward (the Δ pre-pass,
dQ), so its host path can be the longer one.

Rows go to ``latency.csv`` (``--out DIR``; by default ``results/<gpu>/`` on a GPU, nothing on a
CPU), appended, one per impl and pass (the floor once, its pass empty), with the :data:`LATENCY_COLUMNS`.
A file written before the ``pass`` column existed gets it, its rows ``fwd``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

LATENCY_CSV = "latency.csv"
LATENCY_COLUMNS = ("run_id", "impl", "kind", "B", "H", "N", "D", "dtype", "causal", "pass", "device", "calls",
                   "us_per_call", "x_floor", "status")
#: what a row of a file written before a column existed meant by it: every such run timed the forward
LATENCY_DEFAULTS = {"pass": "fwd"}
#: the passes ``--pass`` takes, in the order they are timed and shown
LATENCY_PASSES = ("fwd", "bwd", "fwd_bwd")

#: the problem ``latency`` times by default: tiny, so the host path, not the GPU, sets the pace
DEFAULT_PROBLEM = dict(B=1, H=8, N=128, D=64, dtype="fp16")
#: calls timed per impl: enough for a stable mean on a GPU; a handful in the slow interpreter
GPU_CALLS, CPU_CALLS = 1000, 3
WARM_CALLS = 3


def empty_kernel_launch() -> Callable[[], object]:
    """A launch of an empty Triton kernel with no arguments: the floor of a Triton call's host cost."""
    import triton

    @triton.jit
    def empty_kernel():
        pass

    return lambda: empty_kernel[(1,)]()


def host_us_per_call(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """CPU wall time per call, µs: ``calls`` calls back to back, one ``sync()`` at the end, nothing
    subtracted (after :data:`WARM_CALLS` warm calls, synchronized)."""
    for _ in range(WARM_CALLS):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _add_causal_argument, _dtype, _head_dim, _names, _positive_int

    d = DEFAULT_PROBLEM
    p.add_argument("--B", type=_positive_int, default=d["B"], help=f"batch (default {d['B']})")
    p.add_argument("--H", type=_positive_int, default=d["H"], help=f"heads (default {d['H']})")
    p.add_argument("--N", type=_positive_int, default=d["N"], help=f"sequence length (default {d['N']})")
    p.add_argument("--D", type=_head_dim, default=d["D"], help=f"head dim (default {d['D']})")
    p.add_argument("--dtype", type=_dtype, default=d["dtype"], help=f"fp16, bf16 or fp32 (default {d['dtype']})")
    _add_causal_argument(p, "no", choices=("no", "yes"))
    p.add_argument("--pass", dest="passes", type=_passes, default=("fwd",), metavar="fwd,bwd,fwd_bwd",
                   help="what each call does: fwd (the forward), bwd (the backward alone, on a saved forward), "
                        "fwd_bwd (both); a comma-separated list, one row each (default fwd)")
    p.add_argument("--calls", type=_positive_int, default=None,
                   help=f"calls timed per impl (default {GPU_CALLS} on a GPU, {CPU_CALLS} on a CPU)")
    p.add_argument("--stages", type=_names, default=None, metavar="a,b,c",
                   help="stages to time (default: a, b, c and every registered stage this machine can run)")
    p.add_argument("--peers", type=_names, default=None, metavar="flash,cudnn,efficient,math",
                   help="SDPA backends, or 'none' (default: all four on a GPU; flash and math on a CPU)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for {LATENCY_CSV} (default: results/<gpu>/ on a GPU; "
                        f"on a CPU no file unless given)")


def _passes(text: str) -> tuple[str, ...]:
    """``--pass``: a comma-separated list of :data:`LATENCY_PASSES`, in their order, each once."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in LATENCY_PASSES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown pass {', '.join(map(repr, bad)) or repr(text)}; "
                                         f"allowed: {', '.join(LATENCY_PASSES)} (comma-separated)")
    return tuple(p for p in LATENCY_PASSES if p in names)


def pass_call(impl, problem, q, k, v, pass_: str) -> Callable[[], object]:
    """The call ``latency`` repeats for ``pass_``: the same calls ``sweep`` times (``measure``'s), on
    inputs made once. For ``bwd`` the forward whose graph the backward walks runs here, once."""
    from .inputs import make_grad_output
    from .measure import CellData, _pass_calls

    do = make_grad_output(problem, q.device) if pass_ != "fwd" else None
    cell = CellData(problem, q, k, v, ref=None, torch_rel_err=None, pass_=pass_, do=do)
    _run, make_call = _pass_calls(impl, cell)
    return make_call()


def run(args: argparse.Namespace) -> int:
    import torch

    from . import cli
    from . import impls as impls_mod
    from .inputs import make_inputs
    from .measure import NoBackward
    from .peers import PeerUnsupported
    from .results import run_id_now, write_env
    from stages.contract import Problem

    parser = args._parser
    impl_list = impls_mod.build_impls(cli._resolve_stages(parser, args.stages), cli._resolve_peers(parser, args.peers))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    calls = args.calls or (GPU_CALLS if on_gpu else CPU_CALLS)
    # checked writable before anything is timed (a clear error otherwise)
    out = cli._out_dir(args) if args.out is not None or on_gpu else None
    problem = Problem(args.B, args.H, args.N, args.D, args.dtype, args.causal == "yes")
    q, k, v = make_inputs(problem, device)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    run_id = run_id_now()

    def row(impl: str, kind: str, pass_: str) -> dict:
        return {"run_id": run_id, "impl": impl, "kind": kind, "B": problem.B, "H": problem.H, "N": problem.N,
                "D": problem.D, "dtype": problem.dtype, "causal": int(problem.causal), "pass": pass_,
                "device": "gpu" if on_gpu else "interpreter", "calls": calls}

    floor = row("triton_empty_kernel", "floor", "")
    floor["us_per_call"] = host_us_per_call(empty_kernel_launch(), calls, sync)
    floor["status"] = "ok"
    rows = [floor]
    for impl in impl_list:
        for pass_ in args.passes:
            r = row(impl.label, impl.kind, pass_)
            try:
                r["us_per_call"] = host_us_per_call(pass_call(impl, problem, q, k, v, pass_), calls, sync)
                r["status"] = "ok"
            except NoBackward:
                r["status"] = "unsupported: no backward"
            except (PeerUnsupported, ValueError, NotImplementedError) as e:
                r["status"] = f"unsupported: {(str(e).splitlines() or [''])[0][:200]}"
            except Exception as e:
                r["status"] = f"error: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            rows.append(r)
    for r in rows:
        if r.get("us_per_call") is not None:
            r["x_floor"] = r["us_per_call"] / floor["us_per_call"]

    console = cli._console()
    where = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU (Triton interpreter)"
    console.print(latency_table(rows, f"host µs per call, B={problem.B} H={problem.H} N={problem.N} D={problem.D} "
                                      f"{problem.dtype}{' causal' if problem.causal else ''}, {calls} calls, {where}"))
    console.print("µs per call = CPU wall time of back-to-back calls (one synchronize at the end) / calls; "
                  "floor = an empty @triton.jit kernel with no arguments.")
    if not on_gpu:
        console.print("[bold yellow]Note: times are interpreter times (Triton interpreter and PyTorch's CPU "
                      "kernels), not GPU host times.[/bold yellow]")
    if out is not None:
        path = write_rows(out, rows)
        write_env(out, cli._environment(run_id))
        console.print(f"rows written to {path}")
    return 0


def write_rows(out_dir: str | Path, rows: list[dict]) -> Path:
    """Append ``rows`` to ``out_dir/latency.csv`` (header when the file is new)."""
    from .results import append_rows

    return append_rows(Path(out_dir) / LATENCY_CSV, LATENCY_COLUMNS, rows, LATENCY_DEFAULTS)


def latency_table(rows: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for col, justify in (("impl", "left"), ("pass", "left"), ("µs / call", "right"), ("× floor", "right"),
                         ("status", "left")):
        table.add_column(col, justify=justify)
    for r in rows:
        us = r.get("us_per_call")
        table.add_row(r["impl"], r.get("pass") or "", "" if us is None else f"{us:,.1f}",
                      "" if r.get("x_floor") is None else f"{r['x_floor']:.1f}×", r["status"])
    return table

