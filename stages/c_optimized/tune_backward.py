"""Tune stage C's backward tiles on this GPU and cache the winners.

    python -m stages.c_optimized.tune_backward                       # D 64/128/256, causal both, bf16
    python -m stages.c_optimized.tune_backward --D 128 --causal no --csv bwd_tuning.csv

The backward has two ways to form dQ (``backward.py``'s docstring): *atomic* (the dK/dV kernel adds
each tile pair's dS·K into an fp32 buffer) and *separate* (a second kernel owns a Q tile and loops
over K/V, in a fixed order). Which is faster is a property of the GPU, the head dim and the mask, so
it is measured, not assumed. For every (dtype, D, causal) at one problem of the FlashAttention-paper
setting (B·N = 16384 tokens, H·D = 2048, N = ``--N``), this times, kernel by kernel:

* the dK/dV kernel with atomic dQ, for every candidate tile config;
* the dK/dV kernel without it, for every candidate;
* the separate dQ kernel, for every candidate (its resident tile is ``block_n`` Q rows);

then the best atomic plan and the best separate plan are timed whole (the Δ pre-pass, the casts)
in interleaved rounds, and the faster one is written to ``tuned/<gpu-slug>-backward.json`` with
its tiles. ``backward.backward_config`` reads it. Tuning keys are dtype, padded head dim and causal
(the Hopper kernels' tiles at a head dim with a tail, ``--hopper --D 80``: under its own width,
``backward.tuned_width``, starting from the padded width's tl plan): never the sequence length, so
every N runs the tiles tuned at one (the backward's loops are long at every N that matters for
training, and a test shows the choice does not move with N).

Compiling is the slow part (a backward kernel takes seconds, and a cell has ~100 of them), so
``--workers`` child processes compile every candidate first on a tiny problem with the same
compile-time facts (Triton's on-disk cache then serves the timing process); the timing itself
runs in this process alone, one kernel at a time. ``--budget-s`` stops tuning new cells once spent
and keeps what was measured. Every timing goes to ``--csv``.

``--hopper`` races the Hopper kernels (``hopper_bwd.py``: the dK/dV and the dQ kernel, each with its
own tile candidates, and the dK/dV kernel adding dQ itself, fused) against the tl plans already
tuned, and keeps each where the whole backward measures faster with it (``ws`` and ``ws_dq`` in the
JSON's entries; ``"ws_dq": "fused"`` for the fused one). Fused dQ adds with atomics, so where it wins
the entry also keeps the fastest of the other plans, raced in the same rounds, for
``deterministic=True`` (``"deterministic": {"ws": ..., "ws_dq": ...}``, ``{}`` for the tl kernels), fused
dQ's own tiles adding in a fixed order among them (``"ws_dq": "ordered"``, ``backward.ORDERED_DQ``):

    python -m stages.c_optimized.tune_backward --hopper --D 64,128 --dtype bf16
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

#: Candidate tile shapes before the shared-memory filter: Q rows streamed per step (``block_m``)
#: and K/V rows resident (``block_n``), warps, pipeline depth.
BLOCK_MS = (16, 32, 64)
BLOCK_NS = {64: (64, 128), 128: (64, 128), 256: (32, 64)}  # by padded head dim (smaller: as 64)
WARPS = (4, 8)
STAGES = (1, 2, 3)
#: Rounds of whole-call timing that decide between the best atomic and the best separate plan.
ROUNDS = 5


@dataclass(frozen=True)
class Job:
    dtype: str
    D: int
    causal: bool
    kind: str  # "dkdv_atomic", "dkdv", "dq"
    config: str


def candidates(D: int, dtype: torch.dtype, arch: int) -> list:
    """Every tile config that fits this GPU's shared memory at this head dim (an estimate: a config
    that still fails to compile or launch is recorded and dropped)."""
    from ..contract import padded_head_dim
    from .backward import BwdConfig, fits

    D_pad = padded_head_dim(D)
    e = torch.empty((), dtype=dtype).element_size()
    out = []
    for bm in BLOCK_MS:
        for bn in BLOCK_NS[max(D_pad, 64)]:
            for w in WARPS:
                for s in STAGES:
                    c = BwdConfig(bm, bn, w, s)
                    # Register budget, roughly: the resident tile's two fp32 accumulators per thread.
                    accumulator_regs = 2 * bn * D_pad // (32 * w)
                    if fits(c, D_pad, e, arch) and accumulator_regs <= 160:
                        out.append(c)
    return out


def _inputs(dtype_name: str, D: int, causal: bool, N: int, device="cuda", B: int | None = None, H: int | None = None):
    """Inputs of the FlashAttention-paper setting at N (or B, H as given), with the forward's O and lse."""
    from ..contract import DTYPES
    from .kernels import attention_with_lse

    dtype = DTYPES[dtype_name]
    B, H = B or max(1, 16384 // N), H or max(1, 2048 // D)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=dtype, generator=gen) for _ in range(3))
    o, lse = attention_with_lse(q, k, v, causal=causal)
    do = torch.randn_like(o)
    return q, k, v, o, lse, do


def _plan(kind: str, config, tensors, causal: bool):
    """The launches of one backward plan: ``dkdv_atomic`` (Δ + zero, dK/dV with atomic dQ) or
    ``dkdv``/``dq`` (Δ, dK/dV, separate dQ), all with ``config`` for the kernel being tuned."""
    from .backward import plan_backward
    from .configs import device_arch

    q, k, v, o, lse, do = tensors
    B, Hq, Nq, D = q.shape
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    atomic = kind == "dkdv_atomic"
    dq_acc = torch.empty((B, Hq, Nq, D), dtype=torch.float32, device=q.device) if atomic else None
    return plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, dq_acc, causal=causal, scale=D ** -0.5,
                         arch=device_arch(q.device), deterministic=not atomic, config=config, dq_config=config)


def _compile_jobs(jobs: list[Job]) -> list[tuple[Job, str]]:
    """Child process: run each job's kernel once on a tiny problem (same dtype, head dim, mask and
    divisibility facts as the tuned one), so the kernel lands in Triton's cache. Returns statuses."""
    import stages  # noqa: F401
    from .backward import BwdConfig

    out, cache = [], {}
    for job in jobs:
        key = (job.dtype, job.D, job.causal)
        if key not in cache:
            cache[key] = _inputs(job.dtype, job.D, job.causal, 256, B=1, H=2)
        try:
            launches = _plan(job.kind, BwdConfig.parse(job.config), cache[key], job.causal)
            launch = launches[2] if job.kind == "dq" else launches[1]
            launch.run()
            torch.cuda.synchronize()
            out.append((job, "ok"))
        except Exception as e:  # noqa: BLE001 - out of resources, a compiler failure: recorded
            out.append((job, f"error: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"))
    return out


def precompile(jobs: list[Job], workers: int) -> dict[Job, str]:
    if workers <= 1:
        return dict(_compile_jobs(jobs))
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_compile_jobs, [c for c in chunks if c])
    return {job: status for chunk in results for job, status in chunk}


def _bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=60)


def tune_cell(dtype_name: str, D: int, causal: bool, N: int, statuses: dict, rows: list) -> dict | None:
    from ..contract import DTYPES
    from .backward import BwdConfig, attention_backward

    tensors = _inputs(dtype_name, D, causal, N)
    q, k, v, o, lse, do = tensors
    B, H = q.shape[0], q.shape[1]
    flops = 2.5 * 4.0 * B * H * N * N * D / (2 if causal else 1)
    best: dict[str, tuple[float, str]] = {}
    pieces = {}
    for kind in ("dkdv_atomic", "dkdv", "dq"):
        for config in candidates(D, DTYPES[dtype_name], 90):
            job = Job(dtype_name, D, causal, kind, str(config))
            status = statuses.get(job, "ok")
            ms = None
            if status == "ok":
                try:
                    launches = _plan(kind, config, tensors, causal)
                    ms = _bench(launches[2].run if kind == "dq" else launches[1].run)
                    pieces.setdefault(kind + "_delta", _bench(launches[0].run))
                except Exception as e:  # noqa: BLE001
                    status = f"error: {type(e).__name__}"
            rows.append({"dtype": dtype_name, "D": D, "causal": int(causal), "N": N, "kind": kind,
                         "config": str(config), "ms": f"{ms:.4f}" if ms else "", "status": status})
            if ms is not None and (kind not in best or ms < best[kind][0]):
                best[kind] = (ms, str(config))
    if "dkdv_atomic" not in best and not ("dkdv" in best and "dq" in best):
        return None
    plans = {}
    if "dkdv_atomic" in best:
        plans["atomic"] = dict(config=BwdConfig.parse(best["dkdv_atomic"][1]), deterministic=False)
    if "dkdv" in best and "dq" in best:
        plans["separate"] = dict(config=BwdConfig.parse(best["dkdv"][1]), dq_config=BwdConfig.parse(best["dq"][1]),
                                 deterministic=True)
    plans["default"] = dict(deterministic=False)  # what ran before this tuning, for the record
    scale = D ** -0.5
    samples = {name: [] for name in plans}
    for _ in range(ROUNDS):
        for name, kw in plans.items():
            samples[name].append(_bench(lambda: attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, **kw)))
    medians = {name: statistics.median(t) for name, t in samples.items()}
    for name, ms in medians.items():
        rows.append({"dtype": dtype_name, "D": D, "causal": int(causal), "N": N, "kind": f"whole_{name}",
                     "config": _describe(plans[name]), "ms": f"{ms:.4f}", "status": "ok"})
    winner = min((n for n in medians if n != "default"), key=medians.get)
    print(f"{dtype_name} D={D} causal={int(causal)} N={N}: "
          + ", ".join(f"{n} {_describe(plans[n])} {medians[n]:.3f} ms ({flops / medians[n] * 1e-9:.0f} TFLOPS)"
                      for n in medians) + f" -> {winner}", flush=True)
    entry = {"dq_method": winner, "dkdv": str(plans[winner]["config"])}
    if winner == "separate":
        entry["dq"] = str(plans[winner]["dq_config"])
    return entry


def ws_candidates(D: int, element_bytes: int, kernel: str = "dkdv") -> list:
    """Tile configs of a Hopper backward kernel (``hopper_bwd.py``; ``kernel`` "dkdv" or "dq") that it
    takes at head dim ``D`` and that fit shared memory: two consumer warpgroups with 32- or 64-row
    streamed tiles, or one with 64 or 128, and 2 or 3 stages; where two consumers split the head dim
    (``hopper_ws.split_head_dim``), each of theirs also with the scores shared ("-x")."""
    from .backward import WsConfig
    from .configs import SHARED_MEMORY_LIMIT

    limit = SHARED_MEMORY_LIMIT.get(90, 227 * 1024) - 2048
    tried = [WsConfig(m, 2, s, x) for x in (False, True) for m in (32, 64) for s in (2, 3)] \
        + [WsConfig(m, 1, 2) for m in (64, 128)]
    return [c for c in tried if c.fits_head_dim(D, kernel) and c.shared_bytes(D, element_bytes, kernel) <= limit]


def tune_hopper_cell(dtype_name: str, D: int, causal: bool, N: int, entry: dict, rows: list) -> dict:
    """The Hopper kernels against the tuned tl plan ``entry`` at one cell: every candidate of the dK/dV
    and the dQ kernel timed alone (each checked against the tl kernels' gradients first), then whole
    backwards in interleaved rounds: the tl plan, and the tl plan with the fastest Hopper dK/dV kernel,
    the fastest Hopper dQ kernel, both. Returns ``entry`` with ``ws``/``ws_dq`` set where the whole
    backward measured faster with them (and removed where not)."""
    from ..contract import padded_head_dim
    from . import hopper_ws
    from .backward import FUSED_DQ, ORDERED_DQ, BwdConfig, attention_backward, fused_dq_fits, ordered_dq_fits

    tensors = _inputs(dtype_name, D, causal, N)
    q, k, v, o, lse, do = tensors
    scale = D ** -0.5
    cell = {"dtype": dtype_name, "D": D, "causal": int(causal), "N": N}
    tl_kw = dict(deterministic=True, config=BwdConfig.parse(entry["dkdv"]),
                 dq_config=BwdConfig.parse(entry.get("dq", entry["dkdv"])))
    tl_grads = attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, **tl_kw)
    tl_launches = _plan("dkdv", tl_kw["config"], tensors, causal)
    best = {}

    def race(kind: str, ws, kw: dict, time_it) -> None:
        """Check one candidate's gradients against the tl kernels', then time it (``time_it``)."""
        status, ms = "ok", None
        try:
            grads = attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale, **kw)
            torch.cuda.synchronize()
            diff = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                       for a, b in zip(grads, tl_grads))
            if not diff < 0.02:
                status = f"wrong: max relative difference {diff:.2e} from the tl kernels"
            else:
                ms = time_it()
        except Exception as e:  # noqa: BLE001 - recorded, the rest go on
            status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
        rows.append({**cell, "kind": kind, "config": str(ws), "ms": f"{ms:.4f}" if ms else "", "status": status})
        if ms is not None and (kind not in best or ms < best[kind][0]):
            best[kind] = (ms, ws)

    for kind, index in (("ws", 1), ("ws_dq", 2)):
        for ws in ws_candidates(padded_head_dim(D), q.element_size(), "dkdv" if kind == "ws" else "dq"):
            kw = {"ws_config" if kind == "ws" else "ws_dq_config": ws}
            race(kind, ws, kw, lambda: _bench(_ws_launches(tensors, causal, tl_kw, kw)[index].run))
    # Fused dQ (the dK/dV kernel adding dQ itself): only whole backwards compare, since it does the
    # work of two kernels; the Q tiles it takes (backward.fused_dq_fits), each in the plain order and
    # reordered ("-r": staggered Q tiles, dQ a tile late; measured 7 % faster alone at D 128 non-causal
    # and level causal, performance-log entry 70).
    fused = [c for c in ws_candidates(padded_head_dim(D), q.element_size()) if fused_dq_fits(c)
             and hopper_ws.split_head_dim(padded_head_dim(D)) == 1]
    for ws in fused + [replace(c, reorder=True) for c in fused]:
        kw = {"ws_config": ws, "ws_dq_config": FUSED_DQ}
        race("fused", ws, kw, lambda: _bench(lambda: attention_backward(do, q, k, v, o, lse, causal=causal,
                                                                        scale=scale, **kw)))
    tl_ms = {"ws": _bench(tl_launches[1].run), "ws_dq": _bench(_plan("dq", tl_kw["dq_config"], tensors, causal)[2].run)}
    for kind in ("ws", "ws_dq"):
        rows.append({**cell, "kind": kind, "config": "tl", "ms": f"{tl_ms[kind]:.4f}", "status": "ok"})
    plans = {"tl": {}}
    if "ws" in best:
        plans["ws"] = {"ws_config": best["ws"][1]}
    if "ws_dq" in best:
        plans["ws_dq"] = {"ws_dq_config": best["ws_dq"][1]}
    if "ws" in best and "ws_dq" in best:
        plans["ws+ws_dq"] = {**plans["ws"], **plans["ws_dq"]}
    if "fused" in best:
        plans["ws+fused"] = {"ws_config": best["fused"][1], "ws_dq_config": FUSED_DQ, "deterministic": False}
        # its deterministic twin: the same tiles adding in a fixed order (a '-r' config in its plain order)
        ordered = replace(best["fused"][1], reorder=False)
        if ordered_dq_fits(ordered):
            plans["ws+ordered"] = {"ws_config": ordered, "ws_dq_config": ORDERED_DQ}
    samples = {name: [] for name in plans}
    for _ in range(ROUNDS):
        for name, kw in plans.items():
            samples[name].append(_bench(lambda: attention_backward(do, q, k, v, o, lse, causal=causal, scale=scale,
                                                                   **{**tl_kw, **kw})))
    medians = {name: statistics.median(t) for name, t in samples.items()}
    for name, ms in medians.items():
        rows.append({**cell, "kind": f"whole_{name}",
                     "config": ",".join(str(c) for key, c in plans[name].items() if key != "deterministic") or "tl",
                     "ms": f"{ms:.4f}", "status": "ok"})
    winner = min(medians, key=medians.get)
    print(f"{dtype_name} D={D} causal={int(causal)} N={N} Hopper kernels: "
          + ", ".join(f"{n} {medians[n]:.3f} ms" for n in medians) + f" -> {winner}", flush=True)
    def entry_keys(plan: dict) -> dict:  # (a plan's Hopper kernels as the JSON names them)
        return {"ws" if key == "ws_config" else "ws_dq": str(config) for key, config in plan.items()
                if key != "deterministic"}

    out = {key: value for key, value in entry.items() if key not in ("ws", "ws_dq", "deterministic")}
    out.update(entry_keys(plans[winner]))
    if winner not in ("tl", "ws+fused"):
        out["dq_method"] = "separate"  # the Hopper kernels form dQ in a kernel of its own
    if winner == "ws+fused":
        # Fused dQ adds with atomics; a deterministic backward needs a plan without them: the fastest
        # of the others, raced in the same rounds ({} = the tl kernels alone).
        fixed = min((name for name in medians if name != "ws+fused"), key=medians.get)
        out["deterministic"] = entry_keys(plans[fixed])
        print(f"  deterministic: {fixed} {medians[fixed]:.3f} ms", flush=True)
    return out


def _ws_launches(tensors, causal: bool, tl_kw: dict, kw: dict):
    """The launches of a backward with the tl plan ``tl_kw`` and the Hopper kernels ``kw``."""
    from .backward import WsConfig, plan_backward
    from .configs import device_arch

    q, k, v, o, lse, do = tensors
    B, Hq, Nq, D = q.shape
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device=q.device)
    dk, dv, dq = torch.empty_like(k), torch.empty_like(v), torch.empty_like(q)
    ws, ws_dq = (WsConfig.parse(c) if isinstance(c, str) else c for c in (kw.get("ws_config"), kw.get("ws_dq_config")))
    return plan_backward(do, q, k, v, o, lse, delta, dq, dk, dv, None, causal=causal, scale=D ** -0.5,
                         arch=device_arch(q.device), deterministic=True, config=tl_kw["config"],
                         dq_config=tl_kw["dq_config"], ws=ws, ws_dq=ws_dq)


def _describe(kw: dict) -> str:
    if "config" not in kw:
        return "untuned"
    return str(kw["config"]) + (f"+dq:{kw['dq_config']}" if "dq_config" in kw else "")


def tuned_key(dtype_name: str, D_pad: int, causal: bool) -> str:
    return f"{dtype_name}/D{D_pad}/causal{int(causal)}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stages.c_optimized.tune_backward",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--N", type=int, default=4096, help="the sequence length tuned at (default 4096)")
    ap.add_argument("--D", default="64,128,256")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    ap.add_argument("--workers", type=int, default=max(1, (mp.cpu_count() or 2) - 1),
                    help="child processes compiling candidates ahead of the timing (default: CPUs − 1)")
    ap.add_argument("--budget-s", type=float, default=None, help="stop starting new cells after this many seconds")
    ap.add_argument("--csv", default=None, help="also write every timing to this CSV")
    ap.add_argument("--out", default=None, help="the JSON to write (default: tuned/<gpu-slug>-backward.json)")
    ap.add_argument("--hopper", action="store_true",
                    help="tune only the Hopper kernels (hopper_bwd.py, sm_90, D 64-256) against the tl plans "
                         "already in the JSON, keeping them where they measure faster")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tuning needs a CUDA GPU; none found", file=sys.stderr)
        return 2
    from pathlib import Path

    from ..contract import DTYPES, padded_head_dim
    from . import configs

    start = time.monotonic()
    path = Path(args.out) if args.out else configs.TUNED_DIR / f"{configs.gpu_slug()}-backward.json"
    data = json.loads(path.read_text()) if path.exists() else configs.seed_tuning(path, "-backward")
    data.update(gpu=torch.cuda.get_device_name(), arch=configs.device_arch(torch.device("cuda")), N=args.N)
    data.setdefault("best", {})
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    cells = [(dt, int(D), c) for dt in args.dtype.split(",") for D in args.D.split(",") for c in causals]
    if args.hopper:
        return _tune_hopper(args, cells, data, path, start)
    jobs = [Job(dt, D, c, kind, str(cfg)) for dt, D, c in cells for kind in ("dkdv_atomic", "dkdv", "dq")
            for cfg in candidates(D, DTYPES[dt], 90)]
    print(f"compiling {len(jobs)} kernels in {args.workers} processes", flush=True)
    statuses = precompile(jobs, args.workers)
    failed = sum(s != "ok" for s in statuses.values())
    print(f"compiled in {time.monotonic() - start:.0f} s ({failed} failed)", flush=True)
    rows: list[dict] = []
    try:
        for dt, D, c in cells:
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                print(f"budget spent: {dt} D={D} causal={int(c)} not tuned", flush=True)
                continue
            entry = tune_cell(dt, D, c, args.N, statuses, rows)
            if entry:
                data["best"][tuned_key(dt, padded_head_dim(D), c)] = entry
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    finally:
        _write_csv(args.csv, rows)
    print(f"wrote {path}")
    return 0


def _write_csv(path, rows: list[dict]) -> None:
    """Every row of the run, one line each (nothing when no ``--csv`` was asked or nothing was timed); the
    columns are every key the rows have, in the order first seen (a failed row may lack some)."""
    if path and rows:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for r in rows for key in r)))
            w.writeheader()
            w.writerows(rows)


def _tune_hopper(args, cells, data: dict, path, start: float) -> int:
    from ..contract import DTYPES, padded_head_dim
    from . import hopper_ws
    from .backward import tuned_width

    if data.get("arch") != 90:
        print("the Hopper kernels need an sm_90 GPU", file=sys.stderr)
        return 2
    rows: list[dict] = []
    try:
        for dt, D, c in cells:
            key = tuned_key(dt, tuned_width(D), c)
            tl_key = tuned_key(dt, padded_head_dim(D), c)  # (a tail's width starts from its padded width's tl plan)
            if not hopper_ws.supported(DTYPES[dt], D, 90, "backward") or tl_key not in data["best"]:
                print(f"{key}: no Hopper kernel or no tuned tl plan to race; skipped", flush=True)
                continue
            if key not in data["best"]:
                data["best"][key] = {k: v for k, v in data["best"][tl_key].items() if k not in ("ws", "ws_dq")}
            if args.budget_s is not None and time.monotonic() - start > args.budget_s:
                print(f"budget spent: {key} not tuned", flush=True)
                continue
            data["best"][key] = tune_hopper_cell(dt, D, c, args.N, data["best"][key], rows)
            path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    finally:
        _write_csv(args.csv, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
