"""The command line: ``python -m harness <command>`` (console script ``harness``).

Commands: ``compare`` (one problem, one table), ``sweep`` (grids -> results CSV), ``profile``
(DRAM bytes by Nsight Compute), ``inspect`` (compiled-code facts, no GPU), ``device`` (roofline
ceilings of this GPU), ``repair`` (moves a damaged runs.csv's bad lines aside), and from their own
modules ``plot``, ``report`` and ``pc-sampling`` (Nsight Compute's per-instruction warp sampling,
summarized). ``python -m harness <command> --help`` lists
each one's flags.

Adding a command: the subcommands are built from the :data:`SUBCOMMANDS` registry. Call
:func:`register_subcommand` (name, help, ``add_arguments(parser)``, ``run(args) -> exit code``), or,
for the plotting/report modules, just define module-level ``add_arguments(parser)`` and
``run(args) -> int`` in ``harness/plots.py`` (command ``plot``) or ``harness/report.py`` (command
``report``), or ``add_parser(subparsers) -> parser`` (which adds the subparser itself) and ``run``:
:data:`OPTIONAL_SUBCOMMANDS` imports them when the files exist (the first line of the module
docstring is the help text for the ``add_arguments`` form).

User mistakes (unknown stage, N = 0, unsupported dtype or head dim, malformed lists) end with
``parser.error``: a usage line, a message naming the argument, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# ---------------------------------------------------------------------------------- registry of commands


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    hidden: bool = False
    #: alternative to add_arguments: ``add_parser(subparsers) -> parser`` adds the subparser itself
    add_parser: Callable | None = None


SUBCOMMANDS: dict[str, Subcommand] = {}

#: commands provided by optional modules (written separately); loaded when the module exists.
OPTIONAL_SUBCOMMANDS: dict[str, str] = {"plot": "harness.plots", "report": "harness.report",
                                         "pc-sampling": "harness.pc_sampling", "train": "harness.train",
                                         "latency": "harness.latency", "generate": "harness.generate",
                                         "decode": "harness.decode_loop", "ring": "harness.ring"}


def register_subcommand(name: str, help: str, add_arguments, run, hidden: bool = False, add_parser=None) -> None:
    """Add (or replace) a ``python -m harness <name>`` command."""
    SUBCOMMANDS[name] = Subcommand(name, help, add_arguments, run, hidden, add_parser)


def _load_optional_subcommands() -> None:
    for name, module_name in OPTIONAL_SUBCOMMANDS.items():
        if name in SUBCOMMANDS or importlib.util.find_spec(module_name) is None:
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception as e:  # a broken optional module must not take the whole CLI down
            err = f"{module_name} failed to import: {type(e).__name__}: {e}"

            def run_broken(args, err=err):
                print(f"harness {args.command}: {err}", file=sys.stderr)
                return 1

            register_subcommand(name, f"(unavailable: {err})", lambda p: None, run_broken)
            continue
        doc = (module.__doc__ or name).strip().splitlines()[0]
        if hasattr(module, "add_parser") and hasattr(module, "run"):
            register_subcommand(name, doc, None, module.run, add_parser=module.add_parser)
        elif hasattr(module, "add_arguments") and hasattr(module, "run"):
            register_subcommand(name, doc, module.add_arguments, module.run)


# ------------------------------------------------------------------------------------ argument types

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def _list_of(item_type: Callable[[str], object], what: str):
    def parse(text: str) -> list:
        parts = [p.strip() for p in text.split(",")]
        if not text.strip() or any(not p for p in parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}")
        out = []
        for p in parts:
            try:
                out.append(item_type(p))
            except argparse.ArgumentTypeError as e:
                raise argparse.ArgumentTypeError(f"in {text!r}: {e}") from None
        return out

    parse.__name__ = f"list of {what}"
    return parse


def _head_dim(text: str) -> int:
    from stages.contract import HEAD_DIMS

    value = _positive_int(text)
    if value not in HEAD_DIMS:
        raise argparse.ArgumentTypeError(f"head dim must be a multiple of 8 from {HEAD_DIMS[0]} to "
                                         f"{HEAD_DIMS[-1]}, got {value}")
    return value


def _pass_list(text: str) -> list[str]:
    """``--pass fwd,bwd,fwd_bwd``: the passes to time, each once, in the order given."""
    from .results import PASSES

    names = _list_of(str, "passes")(text)
    for n in names:
        if n not in PASSES:
            raise argparse.ArgumentTypeError(f"pass must be one of {', '.join(PASSES)}, got {n!r}")
    return list(dict.fromkeys(names))


def _add_pass_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pass", dest="passes", type=_pass_list, default=["fwd"], metavar="fwd,bwd,fwd_bwd",
                   help="what to time: fwd (forward), bwd (backward alone, given a saved forward), fwd_bwd "
                        "(a training step); a comma-separated list, one row each (default fwd)")


def _check_kv_heads(parser: argparse.ArgumentParser, Hs: list[int], Hkvs: list[int] | None) -> None:
    """Grouped-query attention needs every query head count to be a multiple of every K/V head count."""
    for H in Hs:
        for Hkv in Hkvs or []:
            if H % Hkv:
                parser.error(f"argument --Hkv: the query heads H = {H} must be a multiple of the key/value "
                             f"heads Hkv = {Hkv} (grouped-query attention shares each K/V head among H / Hkv "
                             f"query heads)")


def _dtype(text: str) -> str:
    from stages.contract import DTYPES

    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"dtype must be one of {', '.join(DTYPES)}, got {text!r}")
    return text


def _names(text: str) -> list[str]:
    return _list_of(str, "names")(text)


_int_list = _list_of(_positive_int, "positive integers")
_head_dim_list = _list_of(_head_dim, "head dims")
_dtype_list = _list_of(_dtype, "dtypes")

CAUSAL_CHOICES = {"no": [False], "yes": [True], "both": [False, True]}


def _add_causal_argument(p: argparse.ArgumentParser, default: str, choices=tuple(CAUSAL_CHOICES)) -> None:
    """``--causal {no,yes,both}``, spelled the same in every command; a bare ``--causal`` means yes
    (it was an on/off flag in ``compare`` and ``inspect`` before)."""
    p.add_argument("--causal", choices=list(choices), nargs="?", const="yes", default=default,
                   help=f"masking: {', '.join(choices)} (default {default}; a bare --causal means yes)")


# ------------------------------------------------------------------------------------------- helpers

def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 200, highlight=False)


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def default_out_dir(sub: str = "") -> Path:
    """``results/<gpu-slug>/[sub]`` on a GPU. On a CPU ``<system temp dir>/harness-cpu-interpreter/[sub]``:
    interpreter times must not land in results/, which holds measured GPU runs only, and the folder
    is the same on every call, so ``sweep --resume`` finds the cells of the last CPU sweep and
    repeated ``compare`` runs append to one file instead of leaving a folder each behind."""
    from .device_info import device_slug

    if _on_gpu():
        path = _repo_root() / "results" / device_slug()
    else:
        path = Path(tempfile.gettempdir()) / "harness-cpu-interpreter"
    return path / sub if sub else path


def _out_dir(args: argparse.Namespace, sub: str = "") -> Path:
    """``--out`` or the default folder, created and checked writable before anything is measured
    (a ResultsError naming the folder otherwise: one line, exit 1)."""
    from .results import ensure_writable_dir

    return ensure_writable_dir(args.out or default_out_dir(sub))


def _resolve_stages(parser: argparse.ArgumentParser, names: list[str] | None, flag: str = "--stages") -> list[str]:
    import stages

    from .impls import cuda_ok, default_stage_names

    if names is None:
        return default_stage_names()
    for n in names:
        if n not in stages.STAGES:
            parser.error(f"argument {flag}: unknown stage {n!r}; registered stages: {', '.join(stages.STAGES)}")
        if not cuda_ok(stages.STAGES[n]):
            parser.error(f"argument {flag}: stage {n!r} needs a CUDA GPU and this machine has none")
    return names


def _resolve_ablation(parser: argparse.ArgumentParser, ablation: bool | list[str], stage_names: list[str]):
    """``--ablation`` as given (True: every variant; False: none), a list of names checked against the
    variants of the stages asked for."""
    import stages

    if not isinstance(ablation, list):
        return ablation
    known = ["all"] + list(dict.fromkeys(v for n in stage_names for v in stages.STAGES[n].variants))
    for v in ablation:
        if v not in known:
            parser.error(f"argument --ablation: unknown variant {v!r} of stages {','.join(stage_names)}; "
                         f"choose from {', '.join(known)}")
    return ablation


def _resolve_peers(parser: argparse.ArgumentParser, names: list[str] | None) -> list[str]:
    from .impls import default_peer_names
    from .peers import PEERS, SHORT_NAMES

    if names is None:
        return default_peer_names()
    if names == ["none"]:
        return []
    out = []
    for n in names:
        full = SHORT_NAMES.get(n, n)
        if full not in PEERS:
            parser.error(f"argument --peers: unknown peer {n!r}; choose from "
                         f"{', '.join(SHORT_NAMES)} (or sdpa_<name>), or 'none'")
        out.append(full)
    return out


def _environment(run_id: str) -> dict:
    from .device_info import cpu_env, gpu_env
    from .results import base_env

    env = base_env(run_id)
    if Path(sys.argv[0]).name == "__main__.py":  # `python -m harness ...` reads better than `__main__.py ...`
        env["command"] = " ".join(["python -m harness"] + sys.argv[1:])
    env.update(gpu_env() if _on_gpu() else cpu_env())
    return env


def _ncu_hook(seed: int):
    """The ``ncu`` callback for measure_impl: measured columns, or a note when ncu fails."""
    from . import ncu

    path = ncu.find_ncu()

    def hook(impl, problem) -> dict:
        try:
            return ncu.profile_impl(impl, problem, seed=seed, ncu=path).as_row()
        except ncu.NcuError as e:
            return {"note": f"ncu failed: {e}"}

    return hook


def _require_ncu() -> str | None:
    from . import ncu

    path = ncu.find_ncu()
    if not path:
        print(f"error: {ncu.NO_NCU_MESSAGE}", file=sys.stderr)
    elif not _on_gpu():
        print("error: ncu found, but there is no CUDA GPU to profile on this machine", file=sys.stderr)
        return None
    return path


def _add_impl_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_names, default=None, metavar="a,b,c",
                   help="stages to run (default: a, b, c and every registered stage this machine can run)")
    p.add_argument("--peers", type=_names, default=None, metavar="flash,cudnn,efficient,math",
                   help="SDPA backends to run beside the stages, or 'none' "
                        "(default: all four on a GPU; flash and math on a CPU)")
    p.add_argument("--ablation", type=_names, nargs="?", const=True, default=False, metavar="VARIANT,...",
                   help="also run stage.variants entries as rows (kind=ablation): bare, every one and 'all' (the "
                        "stage itself); or only those named (e.g. --ablation deterministic)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory (default: results/<gpu>/ on a GPU; on a CPU "
                        "<system temp dir>/harness-cpu-interpreter/, the same every time)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the inputs (default 0)")


# ------------------------------------------------------------------------------------------- compare

def _add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--B", type=_positive_int, help="batch (GPU default 4, CPU default 1)")
    p.add_argument("--H", type=_positive_int, help="query heads (GPU default 32, CPU default 2)")
    p.add_argument("--N", type=_positive_int, help="query sequence length (GPU default 4096, CPU default 128)")
    p.add_argument("--Hkv", type=_positive_int, help="key/value heads, H a multiple of it: GQA, MQA with 1 "
                                                     "(default: H)")
    p.add_argument("--Nk", type=_positive_int, help="key/value sequence length: cross-attention, a KV cache "
                                                    "(default: N; causal is aligned to the bottom right)")
    p.add_argument("--D", type=_head_dim, help="head dim, a multiple of 8 up to 256 (default 64)")
    p.add_argument("--dtype", type=_dtype, help="fp16, bf16 or fp32 (default fp16)")
    _add_causal_argument(p, "no")
    _add_pass_argument(p)
    _add_impl_arguments(p)
    p.add_argument("--ncu", action="store_true", help="also measure DRAM bytes with Nsight Compute (slow)")
    p.add_argument("--energy", action=argparse.BooleanOptionalAction, default=True,
                   help="measure J/call and W with NVML (GPU only; default on)")


#: one problem sized for the device: a realistic GPU shape; a CPU shape the interpreter runs quickly
GPU_COMPARE = dict(B=4, H=32, N=4096, D=64, dtype="fp16")
CPU_COMPARE = dict(B=1, H=2, N=128, D=64, dtype="fp16")


def run_compare(args: argparse.Namespace) -> int:
    from . import impls as impls_mod
    from .measure import run_cells
    from .results import Cell, RowWriter, run_id_now, write_env
    from .table import print_compare

    if args.causal == "both":  # one compare (and one table) per masking
        codes = [run_compare(argparse.Namespace(**{**vars(args), "causal": c})) for c in ("no", "yes")]
        return max(codes)
    parser = args._parser
    stage_names = _resolve_stages(parser, args.stages)
    peer_names = _resolve_peers(parser, args.peers)
    on_gpu = _on_gpu()
    defaults = GPU_COMPARE if on_gpu else CPU_COMPARE
    shape = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    _check_kv_heads(parser, [shape["H"]], [args.Hkv] if args.Hkv else None)
    ncu_hook = None
    if args.ncu:
        if not _require_ncu():
            return 1
        ncu_hook = _ncu_hook(args.seed)
    out = _out_dir(args)
    run_id = run_id_now()
    write_env(out, _environment(run_id))
    cells = [Cell(shape["B"], shape["H"], shape["N"], shape["D"], shape["dtype"], args.causal == "yes", args.Hkv,
                  args.Nk, pass_) for pass_ in args.passes]
    cell = cells[0]
    impl_list = impls_mod.build_impls(stage_names, peer_names,
                                       ablation=_resolve_ablation(parser, args.ablation, stage_names))
    import torch

    device = torch.device("cuda" if on_gpu else "cpu")
    console = _console()
    console.print(f"[bold]compare[/bold] {_shape_text(cell)} "
                  f"causal={int(cell.causal)} on {'GPU ' + torch.cuda.get_device_name() if on_gpu else 'CPU (Triton interpreter)'}"
                  f": {', '.join(i.label for i in impl_list)}")
    from .results import RUNS_CSV

    with RowWriter(out) as writer:
        rows = run_cells(cells, impl_list, writer, run_id=run_id, device=device,
                         energy=bool(args.energy and on_gpu), ncu=ncu_hook, seed=args.seed,
                         on_row=lambda r: console.print(f"  measured {r['impl']} {r.get('variant') or ''}: {r['status']}"))
    footer = []
    if args.energy and on_gpu:
        from .energy import energy_unavailable_reason

        why = energy_unavailable_reason()
        if why:
            footer.append(f"energy: {why}")
    notes = [f"  {r['impl']}{' ' + r['variant'] if r.get('variant') else ''}: {r['note']}"
             for r in rows if r.get("note") and "CPU time" not in r["note"]]
    if notes:
        footer.append("notes:\n" + "\n".join(notes))
    footer.append(f"rows written to {Path(out) / RUNS_CSV} (provenance in env.json)")
    for c in cells:  # one table per pass: ×prev and ×A compare rows of one pass only
        print_compare([r for r in rows if r["pass"] == c.pass_], console,
                      title=f"attention {PASS_TITLES[c.pass_]}, {_shape_text(c)}{' causal' if c.causal else ''}",
                      interpreted=not on_gpu, footer=footer if c is cells[-1] else [])
    if any(c.pass_ != "fwd" for c in cells):
        console.print("Backward FLOPs count 2.5× the forward's (the FlashAttention papers' convention), a "
                      "training step 3.5×; the error of a backward row is the largest of dq's, dk's and dv's.")
    return 0


PASS_TITLES = {"fwd": "forward", "bwd": "backward (given the saved forward)", "fwd_bwd": "forward + backward"}


def _shape_text(cell) -> str:
    """``B=4 H=32 N=4096 D=64 fp16``, with ``Hkv=``/``Nk=`` when they differ from H/N."""
    kv = (f" Hkv={cell.Hkv}" if cell.Hkv != cell.H else "") + (f" Nk={cell.Nk}" if cell.Nk != cell.N else "")
    return f"B={cell.B} H={cell.H} N={cell.N}{kv} D={cell.D} {cell.dtype}"


# --------------------------------------------------------------------------------------------- sweep

#: (tokens = B·N, hidden = H·D) of a grid cell: the FlashAttention paper's on a GPU; on a CPU sizes
#: the Triton interpreter runs in seconds
GPU_TOKENS_HIDDEN = (16384, 2048)
CPU_TOKENS_HIDDEN = (256, 128)

def _add_grid_arguments(p: argparse.ArgumentParser, default_N: str, default_causal: str) -> None:
    p.add_argument("--N", type=_int_list, default=None, metavar="512,1024,...",
                   help=f"sequence lengths (GPU default {default_N}; CPU default 64,128)")
    p.add_argument("--D", type=_head_dim_list, default=None, metavar="64,128", help="head dims (default 64,128)")
    _add_causal_argument(p, default_causal)
    p.add_argument("--dtype", type=_dtype_list, default=None, metavar="fp16,bf16",
                   help="dtypes (GPU default fp16; CPU default fp32)")
    p.add_argument("--tokens", type=_positive_int, default=None,
                   help="B·N kept constant, FlashAttention-paper setting: B = tokens/N, at least 1 "
                        f"(GPU default {GPU_TOKENS_HIDDEN[0]}; CPU default {CPU_TOKENS_HIDDEN[0]})")
    p.add_argument("--hidden", type=_positive_int, default=None,
                   help="H·D kept constant: H = hidden/D, at least 1 "
                        f"(GPU default {GPU_TOKENS_HIDDEN[1]}; CPU default {CPU_TOKENS_HIDDEN[1]})")
    p.add_argument("--B", type=_int_list, default=None, help="explicit batch sizes (overrides --tokens)")
    p.add_argument("--H", type=_int_list, default=None, help="explicit head counts (overrides --hidden)")


def _grid_cells(args: argparse.Namespace, default_N: list[int]) -> list:
    from .results import Cell

    on_gpu = _on_gpu()
    Ns = args.N or (default_N if on_gpu else [64, 128])
    Ds = args.D or [64, 128]
    dtypes = args.dtype or (["fp16"] if on_gpu else ["fp32"])
    # The paper's sizes on a GPU; on a CPU small ones, also when --N is given (B = 256, H = 32 at
    # N = 64 takes the interpreter about a minute per cell). --tokens/--hidden given explicitly win.
    default_tokens, default_hidden = GPU_TOKENS_HIDDEN if on_gpu else CPU_TOKENS_HIDDEN
    tokens, hidden = args.tokens or default_tokens, args.hidden or default_hidden
    cells = []
    for dtype in dtypes:
        for D in Ds:
            for causal in CAUSAL_CHOICES[args.causal]:
                for N in Ns:
                    for B in (args.B or [max(1, tokens // N)]):
                        for H in (args.H or [max(1, hidden // D)]):
                            # K/V heads and rows, and the passes: only sweep has these flags
                            Hkvs = getattr(args, "Hkv", None)
                            _check_kv_heads(args._parser, [H], Hkvs)
                            for Hkv in (Hkvs or [H]):
                                for Nk in (getattr(args, "Nk", None) or [N]):
                                    for pass_ in getattr(args, "passes", None) or ["fwd"]:
                                        cells.append(Cell(B, H, N, D, dtype, causal, Hkv, Nk, pass_))
    return cells


SWEEP_N = [512, 1024, 2048, 4096, 8192, 16384]


def _add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    from .suites import SUITE_HELP

    _add_grid_arguments(p, ",".join(map(str, SWEEP_N)), "both")
    p.add_argument("--Hkv", type=_int_list, default=None, metavar="8,32",
                   help="key/value heads (GQA; every H must be a multiple of each; default: equal to H)")
    p.add_argument("--Nk", type=_int_list, default=None, metavar="4096,32768",
                   help="key/value sequence lengths (default: equal to N; causal is aligned to the bottom right)")
    _add_pass_argument(p)
    p.add_argument("--suite", choices=list(SUITE_HELP), default=None,
                   help="measure a named suite of cells instead of the grid; rows go to results/<gpu>/<suite>/ "
                        "with the cell's name in the 'cell' column. "
                        + "; ".join(f"{name}: {text}" for name, text in SUITE_HELP.items()))
    _add_impl_arguments(p)
    p.add_argument("--resume", action="store_true", help="skip cells already in --out's runs.csv (any status)")
    p.add_argument("--energy", action=argparse.BooleanOptionalAction, default=False,
                   help="measure J/call and W with NVML (>= 2 s per row; default off in sweeps)")
    p.add_argument("--ncu", action="store_true", help="also measure DRAM bytes with Nsight Compute (slow)")


def run_sweep(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import impls as impls_mod
    from .measure import run_cells
    from .results import RUNS_CSV, RowWriter, done_cells, run_id_now, write_env

    parser = args._parser
    stage_names = _resolve_stages(parser, args.stages)
    peer_names = _resolve_peers(parser, args.peers)
    on_gpu = _on_gpu()
    ncu_hook = None
    if args.ncu:
        if not _require_ncu():
            return 1
        ncu_hook = _ncu_hook(args.seed)
    if args.suite:
        cells = _suite_cells(args, on_gpu)
        if cells is None:
            return 1
        out = _out_dir(args, args.suite)
    else:
        cells = _grid_cells(args, SWEEP_N)
        out = _out_dir(args)
    impl_list = impls_mod.build_impls(stage_names, peer_names,
                                       ablation=_resolve_ablation(parser, args.ablation, stage_names))
    skip = done_cells(out) if args.resume else set()
    run_id = run_id_now()
    write_env(out, _environment(run_id))
    console = _console()
    console.print(f"[bold]sweep[/bold]: {len(cells)} cells × {len(impl_list)} impls -> {Path(out) / RUNS_CSV}"
                  + ("" if on_gpu else "  [yellow](CPU: Triton interpreter; times are not GPU times)[/yellow]"))
    statuses: Counter = Counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        task = progress.add_task("measuring", total=len(cells) * len(impl_list))

        def on_row(r: dict) -> None:
            statuses[r["status"].split(":")[0]] += 1
            ms = f"{r['ms_median']:.3f} ms {r['tflops']:.1f} TFLOPS" if r.get("ms_median") is not None else ""
            kv = (f" Hkv={r['Hkv']}" if r["Hkv"] != r["H"] else "") + (f" Nk={r['Nk']}" if r["Nk"] != r["N"] else "")
            what = (f"{r['cell']} " if r.get("cell") else "") + (f"{r['pass']} " if r["pass"] != "fwd" else "")
            progress.console.print(f"  {what}N={r['N']:>6} D={r['D']:>3} B={r['B']} H={r['H']}{kv} {r['dtype']} "
                                   f"causal={r['causal']}  {r['impl']} {r.get('variant') or ''}  {ms}  {r['status']}")
            progress.advance(task)

        with RowWriter(out) as writer:
            run_cells(cells, impl_list, writer, run_id=run_id, device=torch.device("cuda" if on_gpu else "cpu"),
                      energy=bool(args.energy and on_gpu), ncu=ncu_hook, skip=skip, seed=args.seed,
                      on_row=on_row, on_skip=lambda n: progress.advance(task, n))
    skipped = sum(1 for c in cells for i in impl_list if _key(i, c) in skip)
    console.print(f"done: {dict(statuses)}" + (f", {skipped} skipped (--resume)" if skipped else "")
                  + f"; rows in {Path(out) / RUNS_CSV}")
    return 0


#: grid flags that a suite replaces with its own shapes
_GRID_FLAGS = ("N", "D", "dtype", "tokens", "hidden", "B", "H", "Hkv", "Nk")


def _suite_cells(args: argparse.Namespace, on_gpu: bool) -> list | None:
    """The cells of ``--suite`` (each pass of each named cell), or None after saying why not: a
    GPU-sized suite on a CPU is refused rather than scaled down, since a scaled-down "llama3-8b"
    would not be the shape its name promises (the ``smoke`` suite has the same kinds of shape at
    interpreter sizes)."""
    from .suites import GPU_SIZED, suite_cells

    given = [f"--{f}" for f in _GRID_FLAGS if getattr(args, f, None) is not None]
    if given:
        args._parser.error(f"argument --suite: the suite gives every cell's shape; drop {', '.join(given)}")
    if args.suite in GPU_SIZED and not on_gpu:
        print(f"error: the {args.suite!r} suite is sized for a GPU (up to 65,536 keys per head) and this machine has "
              f"no CUDA GPU; the Triton interpreter would take days. Try `--suite smoke`, the same kinds of shape "
              f"at interpreter sizes.", file=sys.stderr)
        return None
    return suite_cells(args.suite, args.passes)


def _key(impl, cell) -> tuple:
    from .results import cell_key

    return cell_key({"impl": impl.name, "variant": impl.variant, **cell.row_fields()})


# ------------------------------------------------------------------------------------------- profile

PROFILE_N = [1024, 4096, 16384]


def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    _add_grid_arguments(p, ",".join(map(str, PROFILE_N)), "no")
    _add_impl_arguments(p)
    p.add_argument("--sections", action="store_true",
                   help="also collect Nsight Compute's analysis sections (speed of light, warp states, "
                        "occupancy, ...) into <out>/ncu/: one CSV per impl and cell, and sections_summary.csv")


def run_profile(args: argparse.Namespace) -> int:
    from rich.table import Table

    from . import impls as impls_mod
    from . import ncu
    from .measure import base_row, problem_of
    from .results import RUNS_CSV, RowWriter, run_id_now, write_env

    parser = args._parser
    stage_names = _resolve_stages(parser, args.stages)
    peer_names = _resolve_peers(parser, args.peers)
    path = _require_ncu()
    if not path:
        return 1
    out = _out_dir(args, "profile")
    cells = _grid_cells(args, PROFILE_N)
    impl_list = impls_mod.build_impls(stage_names, peer_names,
                                       ablation=_resolve_ablation(parser, args.ablation, stage_names))
    run_id = run_id_now()
    write_env(out, _environment(run_id))
    console = _console()
    table = Table(title="DRAM bytes per call: model vs Nsight Compute (MB = 1e6 bytes)", header_style="bold")
    for col in ("impl", "B", "H", "N", "D", "causal", "read model", "read ncu", "write model", "write ncu",
                "ncu/model", "L2 hit %", "bank ld/st predicted", "bank ld/st ncu", "status"):
        table.add_column(col, justify="left" if col in ("impl", "status") else "right")
    mb = lambda v: "" if v is None else f"{v / 1e6:,.1f}"  # noqa: E731
    section_rows: list[dict] = []
    with RowWriter(out) as writer:
        for cell in cells:
            problem = problem_of(cell)
            for impl in impl_list:
                row = base_row(impl, problem, run_id, on_gpu=True)
                console.print(f"  profiling {impl.label} N={cell.N} D={cell.D} causal={int(cell.causal)} ...")
                result = None
                try:
                    result = ncu.profile_impl(impl, problem, seed=args.seed, ncu=path)
                    row.update(result.as_row())
                    row["status"] = "ok"
                except ncu.NcuError as e:
                    row["status"] = f"error: {e}"[:400]
                except Exception as e:  # the child timed out, ...
                    row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
                writer.write(row)
                if args.sections:
                    section_rows += _profile_sections(impl, problem, args.seed, path, Path(out) / "ncu", console)
                model = (row.get("dram_read_model") or 0) + (row.get("dram_write_model") or 0)
                meas = None if row.get("dram_read_measured") is None else \
                    row["dram_read_measured"] + (row.get("dram_write_measured") or 0)
                pred = result.predicted if result else None
                table.add_row(impl.label, str(cell.B), str(cell.H), str(cell.N), str(cell.D), str(int(cell.causal)),
                              mb(row.get("dram_read_model")), mb(row.get("dram_read_measured")),
                              mb(row.get("dram_write_model")), mb(row.get("dram_write_measured")),
                              f"{meas / model:.2f}" if meas is not None and model else "",
                              "" if row.get("l2_hit_rate_pct") is None else f"{row['l2_hit_rate_pct']:.1f}",
                              f"{pred.get('ld')}/{pred.get('st')}" if pred else "",
                              f"{result.conflicts_ld}/{result.conflicts_st}" if result else "",
                              row["status"][:60])
    console.print(table)
    console.print("Model = bytes the kernels request (no cache). ncu: dram__bytes_{read,write}.sum over the kernels "
                  "of one call, caches flushed before each kernel (--cache-control all); K/V re-reads served by "
                  "L2 and outputs still in L2 at kernel end make ncu read below the model.")
    console.print(f"rows written to {Path(out) / RUNS_CSV}")
    if section_rows:
        summary = _merge_section_summary(Path(out) / "ncu" / "sections_summary.csv", section_rows)
        console.print(f"Nsight Compute sections in {Path(out) / 'ncu'}; summary of every kernel: {summary}")
    return 0


SECTION_KEY = ("impl", "dtype", "D", "N", "causal")


def _profile_sections(impl, problem, seed: int, path: str, ncu_dir: Path, console) -> list[dict]:
    """One impl on one cell under ncu with the analysis sections: the raw CSV goes to ``ncu_dir``,
    the summary rows come back (an ncu failure is printed and gives none: the sweep goes on)."""
    from . import ncu

    console.print(f"  sections of {impl.label} N={problem.N} D={problem.D} causal={int(problem.causal)} ...")
    try:
        text, kernels = ncu.profile_sections(impl, problem, seed=seed, ncu=path)
    except Exception as e:
        console.print(f"  [red]sections failed: {type(e).__name__}: {str(e)[:200]}[/red]")
        return []
    ncu_dir.mkdir(parents=True, exist_ok=True)
    name = f"{impl.label.replace(' ', '')}_{problem.dtype}_D{problem.D}_N{problem.N}_c{int(problem.causal)}.csv"
    (ncu_dir / name).write_text(text)
    cell = {"impl": impl.label, "dtype": problem.dtype, "D": problem.D, "N": problem.N, "causal": int(problem.causal),
            "B": problem.B, "H": problem.H, "file": name}
    return [{**cell, **k} for k in kernels]


def _merge_section_summary(path: Path, new_rows: list[dict]) -> Path:
    """Write ``new_rows`` into the summary CSV, replacing older rows of the same impl and cell."""
    import csv

    def key(r):
        return tuple(str(r[k]) for k in SECTION_KEY)

    fresh = {key(r) for r in new_rows}
    old = []
    if path.exists():
        with path.open(newline="") as f:
            old = [r for r in csv.DictReader(f) if key(r) not in fresh]
    rows = old + new_rows
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path


def _add_child_arguments(p: argparse.ArgumentParser) -> None:
    from .ncu import add_child_arguments

    add_child_arguments(p)


def run_child(args: argparse.Namespace) -> int:
    from .ncu import child_main

    return child_main(args)


# ------------------------------------------------------------------------------------------- inspect

def _add_inspect_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", type=_names, default=None, help="stages to inspect (default: all with a compile hook)")
    p.add_argument("--arch", type=_list_of(_arch, "archs"), default=[80, 90], metavar="80,90",
                   help="compute capabilities to compile for (default 80,90)")
    p.add_argument("--N", type=_positive_int, default=4096, help="sequence length the kernels are compiled for")
    p.add_argument("--D", type=_head_dim, default=64, help="head dim (default 64)")
    p.add_argument("--dtype", type=_dtype, default="fp16", help="dtype (default fp16)")
    _add_causal_argument(p, "no", choices=("no", "yes"))
    p.add_argument("--ablation", action="store_true",
                   help="also compile every stage.variants entry (when the stage's compile hook takes its kwargs)")
    p.add_argument("--no-ptxas", dest="ptxas", action="store_false", help="skip registers/spills (ptxas)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _arch(text: str) -> int:
    value = _positive_int(text.removeprefix("sm_").rstrip("a"))
    if value not in (80, 86, 89, 90):
        raise argparse.ArgumentTypeError(f"arch must be one of 80, 86, 89, 90, got {text!r}")
    return value


def run_inspect(args: argparse.Namespace) -> int:
    import json

    import stages
    from stages.contract import Problem

    from .inspect_code import inspect_stage

    parser = args._parser
    if args.stages is None:
        names = [n for n, s in stages.STAGES.items() if s.compile is not None]
    else:
        names = args.stages
        for n in names:
            if n not in stages.STAGES:
                parser.error(f"argument --stages: unknown stage {n!r}; registered stages: {', '.join(stages.STAGES)}")
    # The headline cell's B and H (B·N = 16k tokens, H·D = 2048), so the kernels shown are the ones
    # a GPU-filling problem runs (a lone head would take the split-KV decode path); compiling needs no
    # memory, the tensors are shapes only.
    problem = Problem(max(1, 16384 // args.N), max(1, 2048 // args.D), args.N, args.D, args.dtype,
                      args.causal == "yes")
    results, skipped, failed = [], [], []  # failed: kernels asked for that did not compile
    for n in names:
        stage = stages.STAGES[n]
        if stage.compile is None:
            skipped.append(f"{n}: no compile hook (compiled by nvcc or not at all)")
            continue
        variants = [("", {})] + (list(stage.variants.items()) if args.ablation else [])
        for arch in args.arch:
            for variant, kwargs in variants:
                try:
                    results.extend(inspect_stage(stage, problem, arch, variant, kwargs, ptxas=args.ptxas))
                except TypeError as e:
                    if kwargs:
                        skipped.append(f"{n} {variant}: compile hook does not take {sorted(kwargs)} ({e})")
                    else:
                        skipped.append(f"{n} sm_{arch}: {type(e).__name__}: {e}")
                except Exception as e:
                    # the first lines say what failed and why (launch.compile_error_summary puts the cause first)
                    why = " | ".join(line for line in str(e).splitlines()[:3] if line.strip())
                    failed.append(f"{n}{' ' + variant if variant else ''} sm_{arch}: {type(e).__name__}: {why[:400]}")
    # a kernel that compiles to PTX but that ptxas rejects would not run on the GPU either: a failure too
    failed += [f"{r['stage']}{' ' + r['variant'] if r['variant'] else ''} {r['kernel']} sm_{r['arch']}: "
               f"ptxas: {r['ptxas_error']}" for r in results if r.get("ptxas_error")]
    exit_code = 1 if failed or (names and not results) else 0
    if args.json:
        print(json.dumps({"problem": problem.__dict__, "kernels": results, "skipped": skipped, "failed": failed},
                         indent=2))
        return exit_code
    console = _console()
    if not results:
        console.print("no stage produced compiled kernels" + (": " + "; ".join(failed + skipped)
                                                              if failed or skipped else ""))
        return 1
    for arch in args.arch:
        rows = [r for r in results if r["arch"] == arch]
        if rows:
            console.print(inspect_table(rows, f"sm_{arch}: N={args.N} D={args.D} {args.dtype}"
                                              f"{' causal' if problem.causal else ''} (one column per kernel)"))
        for r in rows:
            if r.get("ptxas_error"):
                console.print(f"  ptxas {r['stage']} {r['kernel']}: {r['ptxas_error']}")
    console.print("Counts are static (instructions in the code after unrolling), not executed counts. "
                  "ld.global.v4 = 16 B per thread per load; cp.async.* = Ampere async copies (pipelining); "
                  "cp.async.bulk.tensor = Hopper TMA; mma.sync/ldmatrix = sm_80 tensor cores; "
                  "wgmma.mma_async = sm_90 tensor cores. Registers/spills: triton's bundled ptxas -v.")
    for s in skipped:
        console.print(f"  skipped {s}")
    for f in failed:
        console.print(f"  [red]failed[/red] {f}")
    return exit_code


def inspect_table(rows: list[dict], title: str):
    """Facts down, kernels across (kernels are few, facts many): only instructions some kernel has."""
    from rich.table import Table

    from .inspect_code import INSTRUCTION_KEYS

    table = Table(title=title, header_style="bold")
    table.add_column("fact", no_wrap=True)
    for r in rows:
        name = r["kernel"].removesuffix("_kernel")
        table.add_column(f"{r['stage']}{' ' + r['variant'] if r['variant'] else ''}\n{name}", justify="right")

    def line(label, fn):
        table.add_row(label, *[fn(r) for r in rows])

    line("num_warps", lambda r: str(r["num_warps"]))
    line("num_stages", lambda r: str(r["num_stages"]))
    line("shared memory, bytes", lambda r: f"{r['shared_bytes']:,}")
    line("registers / thread", lambda r: "" if r.get("registers") is None else str(r["registers"]))
    line("spill stores/loads, B", lambda r: "" if r.get("spill_stores") is None
         else f"{r['spill_stores']}/{r['spill_loads']}")
    for key in INSTRUCTION_KEYS:
        if any(r["instructions"][key] for r in rows):
            line(key, lambda r, key=key: str(r["instructions"][key]) if r["instructions"][key] else "·")
    line("smem layouts", lambda r: "\n".join(dict.fromkeys(r["smem_layouts_described"])) or "-")
    return table


# -------------------------------------------------------------------------------------------- device

def _add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, default=None, help="results directory whose env.json gets the ceilings "
                                                          "(default results/<gpu>/)")


def run_device(args: argparse.Namespace) -> int:
    if not _on_gpu():
        print("error: `harness device` measures this GPU's roofline ceilings and needs a CUDA GPU; "
              "none was found (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    from rich.table import Table

    from .ceilings import measure_ceilings
    from .results import run_id_now, write_env

    console = _console()
    console.print("measuring: 2 GiB device-to-device copy, 8192³ fp16 and bf16 matmul ...")
    env = _environment(run_id_now())
    env["ceilings"] = measure_ceilings()
    out = _out_dir(args)
    path = write_env(out, env)
    table = Table(title=f"{env.get('gpu_name')}: measured ceilings and device facts", header_style="bold")
    table.add_column("fact")
    table.add_column("value", justify="right")
    c = env["ceilings"]
    table.add_row("copy bandwidth (read+write)", f"{c['copy_gbps']:,.0f} GB/s")
    table.add_row("fp16 matmul 8192³", f"{c['matmul_fp16_tflops']:,.0f} TFLOP/s")
    table.add_row("bf16 matmul 8192³", f"{c['matmul_bf16_tflops']:,.0f} TFLOP/s")
    for key in ("compute_capability", "sm_count", "l2_bytes", "memory_bytes", "driver", "cuda_runtime", "cuda_driver",
                "sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "max_mem_clock_mhz", "power_limit_w",
                "nvml_note"):
        if env.get(key) is not None:
            table.add_row(key, f"{env[key]:,}" if isinstance(env[key], int) else str(env[key]))
    console.print(table)
    console.print(f"written to {path}")
    return 0


# -------------------------------------------------------------------------------------------- repair

def _add_repair_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", type=Path, help="a results folder or its runs.csv")


def run_repair(args: argparse.Namespace) -> int:
    """A damaged runs.csv (its last row cut off by a crash or a full disk) stops report, plot and
    --resume at the bad line; this moves such lines aside so the good rows can be read again."""
    from .results import repair_results_file

    done = repair_results_file(args.results)
    if not done.moved:
        print(f"repair: every row of {args.results} parses ({done.kept} rows); nothing to do")
        return 0
    print(f"repair: kept {done.kept} rows; moved {done.moved} unparseable record(s) to {done.bad_path} "
          f"(the file as it was: {done.backup_path})")
    return 0


# ----------------------------------------------------------------------------------------------- main

register_subcommand("compare", "run the stages and SDPA peers on one problem and print one table",
                    _add_compare_arguments, run_compare)
register_subcommand("sweep", "run them over grids of N, D, dtype and masking into results/<gpu>/runs.csv",
                    _add_sweep_arguments, run_sweep)
register_subcommand("profile", "measure DRAM bytes per call with Nsight Compute (ncu) beside the traffic models",
                    _add_profile_arguments, run_profile)
register_subcommand("inspect", "compiled-code facts per stage (PTX instruction mix, registers, smem layouts); no GPU needed",
                    _add_inspect_arguments, run_inspect)
register_subcommand("device", "measure this GPU's roofline ceilings (copy GB/s, matmul TFLOP/s) into env.json",
                    _add_device_arguments, run_device)
register_subcommand("repair", "move the unparseable lines of a runs.csv (a row cut off by a crash) to runs.csv.bad",
                    _add_repair_arguments, run_repair)
register_subcommand("_ncu_child", "internal: one warm + one profiled call, run under ncu by `profile`",
                    _add_child_arguments, run_child, hidden=True)


def build_parser() -> argparse.ArgumentParser:
    _load_optional_subcommands()
    parser = argparse.ArgumentParser(
        prog="harness", description="Measure the attention stages and PyTorch's SDPA backends on the same inputs.",
        epilog="Without a CUDA GPU the stages run in the Triton interpreter: results are correct, times are not GPU times.")
    visible = [c.name for c in SUBCOMMANDS.values() if not c.hidden]
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(visible) + "}", required=True)
    for cmd in SUBCOMMANDS.values():
        if cmd.add_parser is not None:
            p = cmd.add_parser(sub)
        else:
            kwargs = {} if cmd.hidden else {"help": cmd.help, "description": cmd.help}
            p = sub.add_parser(cmd.name, **kwargs)
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    import stages  # noqa: F401  (chooses the Triton interpreter before triton is imported, when there is no GPU)

    from .results import ResultsError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            # Triton's interpreter runs kernels in numpy, which warns about every NaN it makes, also in
            # lanes that are masked off and never stored (exp(-inf - (-inf)) in a fully masked row):
            # noise in a sweep's progress. Only that warning, and only from Triton's own modules.
            warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning,
                                    module=r"triton\.")
            return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted: every row measured so far is already in the results file", file=sys.stderr)
        return 130
    except ResultsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a file the command writes or reads: one line naming it, no traceback
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
