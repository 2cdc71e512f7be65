"""Attention in a decode loop: a KV cache that grows by one key per call, against a cache of fixed length.

``python -m harness decode`` answers "what does one decode step's attention cost inside a model?".
A model generating text calls attention once per layer and token with one query per sequence
(q ``[B, Hq, 1, D]``) against its whole cache (k, v ``[B, Hkv, Nk, D]``), and the cache is one key
longer at every call: transformers' default cache concatenates the new key onto the old ones, so
k and v are fresh tensors, at a new address, with new strides, every time. A kernel whose host path
compiles or plans per sequence length pays for that on every generated token; a benchmark that
calls it on one fixed shape never sees it. So this command times both:

* **growing**: ``calls`` calls, the i-th against a cache of ``Nk + i`` keys (each cache its own
  contiguous tensors, made before the timing starts, as a concatenating cache hands them over);
* **fixed**: the same number of calls, all against one cache of the middle length.

Per impl and cache, the figure is the wall time of the calls issued back to back (one synchronize
at the end) divided by the calls, µs, the median of ``--reps`` repetitions timed in turns (every
impl's first, then every impl's second, ...: the host these calls run on is shared and its speed
drifts): what the user's loop sees, host path included, whichever of
host and GPU is slower (on a GPU, after a few warm-up calls at the first length, which keep the first
compilation out of the numbers, as every benchmark here does; a kernel compiled again for a later
length is in them, because that is the cost being measured). Beside it, ``us_gpu``: the same calls captured
into one CUDA graph and replayed, the GPU's work alone (empty where a backend cannot be captured).
The ratio growing / fixed is the price of a changing shape; 1.0 is the goal.

Shapes: ``--shape gpt2`` (q [4, 12, 1, 64], 12 KV heads) and ``--shape llama`` (q [4, 16, 1, 128],
4 KV heads: grouped-query attention), from ``--Nk 310`` keys, 400 calls (the cache grows to 709), or
any of them set by flags. Rows go to ``decode.csv`` (:data:`COLUMNS`) in ``results/<gpu>/`` on a GPU;
on a CPU the stages run in the Triton interpreter (tiny shapes, a few calls; interpreter times, no
file unless ``--out`` is given).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

DECODE_CSV = "decode.csv"
COLUMNS = ("run_id", "shape", "impl", "kind", "cache", "B", "Hq", "Hkv", "Nk_first", "Nk_last", "D", "dtype",
           "device", "calls", "reps", "us_per_call", "us_p20", "us_p80", "us_gpu", "x_fixed", "status", "note")


@dataclass(frozen=True)
class DecodeShape:
    """One decode step's attention: q [B, Hq, 1, D] against a cache of Hkv heads, Nk keys at first."""

    B: int
    Hq: int
    Hkv: int
    D: int
    Nk: int


#: GPT-2 small's attention (12 heads of 64) and a Llama-3-like grouped-query one (16 query heads of 128
#: sharing 4 KV heads), batch 4, a 310-token context at the first call
SHAPES = {"gpt2": DecodeShape(4, 12, 12, 64, 310), "llama": DecodeShape(4, 16, 4, 128, 310)}
GPU_CALLS, CPU_CALLS = 400, 3
#: repetitions of every loop, in turns (the figure is their median)
GPU_REPS = 5
CPU_SHAPE = DecodeShape(1, 4, 2, 16, 20)
WARM_CALLS = 3


def make_caches(shape: DecodeShape, calls: int, dtype, device, *, growing: bool, seed: int = 0):
    """(q, [(k, v) per call]): a growing cache holds ``calls`` pairs of fresh contiguous tensors of
    ``Nk, Nk + 1, ...`` keys; a fixed one the same pair, of the middle length, ``calls`` times."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*size):
        return torch.randn(size, generator=g).to(dtype=dtype, device=device)

    q = rand(shape.B, shape.Hq, 1, shape.D)
    if not growing:
        nk = shape.Nk + calls // 2
        kv = (rand(shape.B, shape.Hkv, nk, shape.D), rand(shape.B, shape.Hkv, nk, shape.D))
        return q, [kv] * calls
    return q, [(rand(shape.B, shape.Hkv, shape.Nk + i, shape.D), rand(shape.B, shape.Hkv, shape.Nk + i, shape.D))
               for i in range(calls)]


def loop_us_per_call(attention, q, caches, sync) -> float:
    """Wall time per call of ``attention(q, k, v)`` over ``caches`` back to back, µs (after
    :data:`WARM_CALLS` warm-up calls on the first cache, synchronized)."""
    k0, v0 = caches[0]
    for _ in range(WARM_CALLS):
        attention(q, k0, v0, causal=True)
    sync()
    t0 = time.perf_counter()
    for k, v in caches:
        attention(q, k, v, causal=True)
    sync()
    return (time.perf_counter() - t0) / len(caches) * 1e6


def graph_us_per_call(attention, q, caches) -> float:
    """The same calls captured into one CUDA graph and replayed: GPU µs per call (median of 5 replays)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for k, v in caches[:2]:
            attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k, v in caches:
            attention(q, k, v, causal=True)
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(caches))
    return statistics.median(times)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _dtype, _names, _positive_int

    p.add_argument("--shape", type=_names, default=["gpt2", "llama"], metavar="gpt2,llama",
                   help="decode shapes to time (default both; --B --Hq --Hkv --D --Nk override their sizes)")
    for flag, what in (("--B", "sequences"), ("--Hq", "query heads"), ("--Hkv", "key/value heads"),
                       ("--D", "head dim"), ("--Nk", "keys in the cache at the first call")):
        p.add_argument(flag, type=_positive_int, default=None, help=f"{what} (default: the shape's)")
    p.add_argument("--dtype", type=_dtype, default="bf16", help="fp16, bf16 or fp32 (default bf16)")
    p.add_argument("--calls", type=_positive_int, default=None,
                   help=f"calls per loop (default {GPU_CALLS} on a GPU, {CPU_CALLS} on a CPU)")
    p.add_argument("--reps", type=_positive_int, default=None,
                   help=f"repetitions of every loop, timed in turns; the row holds their median (default {GPU_REPS} "
                        f"on a GPU, 1 on a CPU)")
    p.add_argument("--stages", type=_names, default=None, metavar="a,b,c",
                   help="stages to time (default: a, b, c and every other registered stage this machine can run)")
    p.add_argument("--peers", type=_names, default=None, metavar="flash,cudnn,efficient,math",
                   help="SDPA backends, or 'none' (default: all four on a GPU; flash and math on a CPU)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for {DECODE_CSV} (default: results/<gpu>/ on a GPU; on a CPU no file unless given)")


def _shape(parser, name: str, args) -> DecodeShape:
    import torch

    if name not in SHAPES:
        parser.error(f"argument --shape: unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    base = SHAPES[name] if torch.cuda.is_available() else CPU_SHAPE
    sizes = {f: getattr(args, f) or getattr(base, f) for f in ("B", "Hq", "Hkv", "D", "Nk")}
    if sizes["Hq"] % sizes["Hkv"]:
        parser.error(f"argument --Hkv: the query heads ({sizes['Hq']}) must be a multiple of the key/value heads "
                     f"({sizes['Hkv']})")
    if sizes["D"] % 8 or sizes["D"] > 256:
        parser.error(f"argument --D: the head dim must be a multiple of 8 up to 256, got {sizes['D']}")
    return DecodeShape(**sizes)


def _short_error(e: Exception) -> str:
    return (str(e).splitlines() or [""])[0][:200]


def run(args: argparse.Namespace) -> int:
    import torch

    from . import cli
    from . import impls as impls_mod
    from .peers import PeerUnsupported
    from .results import run_id_now, write_env
    from stages.contract import DTYPES

    parser = args._parser
    shapes = {name: _shape(parser, name, args) for name in args.shape}
    impl_list = impls_mod.build_impls(cli._resolve_stages(parser, args.stages), cli._resolve_peers(parser, args.peers))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    calls = args.calls or (GPU_CALLS if on_gpu else CPU_CALLS)
    out = cli._out_dir(args) if args.out is not None or on_gpu else None
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    dtype = DTYPES[args.dtype]
    run_id = run_id_now()
    rows = []
    reps = args.reps or (GPU_REPS if on_gpu else 1)
    for shape_name, shape in shapes.items():
        caches = {cache: make_caches(shape, calls, dtype, device, growing=cache == "growing")
                  for cache in ("fixed", "growing")}
        shape_rows = {}
        for impl in impl_list:
            for cache in ("fixed", "growing"):
                q, kvs = caches[cache]
                shape_rows[impl.label, cache] = {
                    "run_id": run_id, "shape": shape_name, "impl": impl.label, "kind": impl.kind, "cache": cache,
                    "B": shape.B, "Hq": shape.Hq, "Hkv": shape.Hkv, "D": shape.D, "dtype": args.dtype,
                    "Nk_first": kvs[0][0].shape[2], "Nk_last": kvs[-1][0].shape[2],
                    "device": "gpu" if on_gpu else "interpreter", "calls": calls, "times": []}
        # In turns: repetition 1 of every impl and cache, then repetition 2, ..., so a drifting clock or
        # a noisy host hits them all alike. A loop that takes seconds (SDPA's cuDNN backend building a
        # graph per cache length) is measured once.
        for rep in range(reps):
            for impl in impl_list:
                for cache in ("fixed", "growing"):
                    r = shape_rows[impl.label, cache]
                    if r.get("status", "ok") != "ok" or (rep and r["times"][0] * calls > 2e6):
                        continue
                    q, kvs = caches[cache]
                    try:
                        r["times"].append(loop_us_per_call(impl.attention, q, kvs, sync))
                        r["status"] = "ok"
                    except (PeerUnsupported, ValueError, NotImplementedError) as e:
                        r["status"] = f"unsupported: {_short_error(e)}"
                    except torch.cuda.OutOfMemoryError:
                        r["status"] = "oom"
                    except Exception as e:  # a kernel failure is a result; the loop goes on
                        r["status"] = f"error: {type(e).__name__}: {_short_error(e)}"
        for impl in impl_list:
            fixed_us = None
            for cache in ("fixed", "growing"):
                r = shape_rows[impl.label, cache]
                times = sorted(r.pop("times"))
                if times:
                    r["us_per_call"] = statistics.median(times)
                    r["us_p20"], r["us_p80"] = times[int(0.2 * (len(times) - 1))], times[int(0.8 * (len(times) - 1))]
                    r["reps"] = len(times)
                q, kvs = caches[cache]
                # (a loop that took seconds eagerly is not captured: the capture would build it all again)
                if on_gpu and r.get("status") == "ok" and r["us_per_call"] * calls < 2e6:
                    try:
                        r["us_gpu"] = graph_us_per_call(impl.attention, q, kvs)
                    except Exception as e:
                        r["note"] = f"no CUDA graph: {type(e).__name__}: {_short_error(e)}"
                        torch.cuda.synchronize()
                if cache == "fixed":
                    fixed_us = r.get("us_per_call")
                elif fixed_us and r.get("us_per_call"):
                    r["x_fixed"] = r["us_per_call"] / fixed_us
                rows.append(r)
        del caches
        if on_gpu:
            torch.cuda.empty_cache()

    console = cli._console()
    where = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU (Triton interpreter)"
    console.print(decode_table(rows, f"decode attention, µs per call, {calls} calls per loop, {args.dtype}, {where}"))
    console.print("growing: the cache one key longer at every call (fresh tensors, as a concatenating cache gives "
                  "them); fixed: one cache of the middle length. µs per call = wall time of the loop / calls; "
                  "GPU µs = the loop captured into one CUDA graph and replayed.")
    if not on_gpu:
        console.print("[bold yellow]Note: times are interpreter times, not GPU times.[/bold yellow]")
    if out is not None:
        path = write_rows(out, rows)
        write_env(out, cli._environment(run_id))
        console.print(f"rows written to {path}")
    return 0


def write_rows(out_dir: str | Path, rows: list[dict]) -> Path:
    """Append ``rows`` to ``out_dir/decode.csv`` (header when the file is new)."""
    from .results import append_rows

    return append_rows(Path(out_dir) / DECODE_CSV, COLUMNS, rows)


def decode_table(rows: list[dict], title: str):
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for col, justify in (("shape", "left"), ("impl", "left"), ("cache", "left"), ("Nk", "right"),
                         ("µs / call", "right"), ("GPU µs", "right"), ("× fixed", "right"), ("status", "left")):
        table.add_column(col, justify=justify)
    for r in rows:
        us, gpu = r.get("us_per_call"), r.get("us_gpu")
        table.add_row(r["shape"], r["impl"], r["cache"], f"{r['Nk_first']}–{r['Nk_last']}",
                      "" if us is None else f"{us:,.1f}", "" if gpu is None else f"{gpu:,.1f}",
                      "" if r.get("x_fixed") is None else f"{r['x_fixed']:.2f}×", r["status"])
    return table


def load_rows(path: str | Path) -> list[dict]:
    """The rows of a ``decode.csv``, numbers parsed (empty cells: None); ``ResultsError`` naming the file
    (and line) when columns are missing, as in a damaged file, or a number does not parse."""
    from .results import ResultsError

    numeric = {"B", "Hq", "Hkv", "Nk_first", "Nk_last", "D", "calls", "reps", "us_per_call", "us_p20", "us_p80",
               "us_gpu", "x_fixed"}
    rows = []
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ResultsError(f"{path}: missing columns {missing}")
        for raw in reader:
            row = {k: (v or None) for k, v in raw.items()}
            for k in numeric:
                if row[k] is not None:
                    try:
                        row[k] = float(row[k])
                    except ValueError:
                        raise ResultsError(f"{path}:{reader.line_num}: column {k!r} should be a number, "
                                           f"got {row[k]!r}") from None
            rows.append(row)
    return rows


def render_block(path: str | Path, readme_dir: str | Path = ".") -> str:
    """The README table of the latest run in ``decode.csv``: per shape and impl, µs per call with a
    growing and a fixed cache, growing / fixed, and the growing loop against SDPA's fastest backend;
    its do-not-edit line names the results folder as a README in ``readme_dir`` sees it."""
    from .report import _generated_note, _posix_rel

    rows = load_rows(path)
    if not rows:
        return "_no decode rows yet: run `python -m harness decode` on a GPU_"
    latest = rows[-1]["run_id"]
    rows = [r for r in rows if r["run_id"] == latest]
    growing = next(r for r in rows if r["cache"] == "growing")
    reps = max(int(r["reps"] or 1) for r in rows if r.get("reps"))
    lines = [_generated_note(_posix_rel(Path(path).parent, Path(readme_dir)), Path(path).name), "",
             f"Run `{latest}`, {rows[0]['dtype']}: µs per call over a loop of {int(rows[0]['calls'])} calls, the wall "
             f"time of the loop (host path included) divided by the calls, median of {reps} loops timed in turns. "
             f"Growing: one key more at every call (Nk {int(growing['Nk_first'])} → {int(growing['Nk_last'])}, "
             f"fresh tensors each time, as a concatenating cache hands them over); fixed: the middle length at every "
             f"call. GPU µs: the growing loop captured into one CUDA graph and replayed (the GPU's work alone).", "",
             "| shape | impl | growing µs | fixed µs | growing / fixed | growing GPU µs | growing × fastest SDPA |",
             "|---|---|--:|--:|--:|--:|--:|"]
    by = {(r["shape"], r["impl"], r["cache"]): r for r in rows}
    refused = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sdpa = [r["us_per_call"] for r in rows if r["shape"] == shape and r["cache"] == "growing"
                and r["impl"].startswith("sdpa") and r["us_per_call"]]
        fastest = min(sdpa) if sdpa else None
        for impl in dict.fromkeys(r["impl"] for r in rows if r["shape"] == shape):
            g, f = by.get((shape, impl, "growing"), {}), by.get((shape, impl, "fixed"), {})
            if g.get("status") != "ok":
                refused.append(f"{impl} ({shape})")
                continue

            def fmt(x, spec=",.1f"):
                return "" if x is None else format(x, spec)
            g_us, f_us = g.get("us_per_call"), f.get("us_per_call")
            lines.append(f"| {shape} | {impl} | {fmt(g_us)} | {fmt(f_us)} | "
                         f"{fmt(g_us / f_us if g_us and f_us else None, '.2f')} | {fmt(g.get('us_gpu'))} | "
                         f"{fmt(g_us / fastest if g_us and fastest else None, '.2f')} |")
    if refused:
        lines += ["", "Not run (the impl refuses the shape: the CUDA twins take Nq = Nk and no GQA, SDPA's "
                      "EFFICIENT backend no GQA here): " + ", ".join(refused) + "."]
    return "\n".join(lines)
