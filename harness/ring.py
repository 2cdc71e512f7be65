"""Ring attention across processes: check it against one process, and time its overlap on GPUs.

``python -m harness ring`` runs :mod:`stages.ring` (attention over a sequence sharded across ranks,
K/V blocks passed around a ring) in W processes, one per rank:

* ``--check`` (the default; any machine): the sharded forward and backward, causal and not, with
  grouped-query heads, on small sizes, against one process's float64 reference; beside the ring's
  error, the same stage's error unsharded. A comparison passes when the ring is within 3× the
  unsharded stage's error (or under the dtype's rounding floor). Exit code 1 on any mismatch.
* ``--time`` (GPUs): per ring step and per whole forward / backward pass, CUDA events, the median of
  ``--reps`` repetitions (ranks aligned by a barrier before each; a pass takes as long as its
  slowest rank). Beside the ring, the same passes with the stage calls alone (``communicate=False``)
  and with the transfers alone; then

      hidden fraction of communication = (compute + communication − ring) / communication

  and the model of when the ring hides it: per step, compute = the step's FLOPs / the achieved
  rate (the compute-only run's), communication = bytes per step / link bandwidth (``--link-gbps``,
  else the transfers-only run's); the ring step costs max(compute, communication) if the overlap is
  perfect. FLOPs per step grow as n², bytes as n (n = rows per rank), so the ring hides its transfers
  from n* = n · communication / compute rows per rank on (both measured at this n): the ``n*`` column. Rows go to ``results/<gpu>/ring.csv``
  (:data:`COLUMNS`) on a GPU; on a CPU the timing runs in the interpreter (tiny sizes, wall clock)
  and writes only with ``--out``.

The columns of ``ring.csv`` (ms: the median over repetitions of the slowest rank; per rank and step
where it says so): ``N`` the global sequence, ``n_local`` the rows per rank; ``ms_total`` the pass,
``ms_step`` one ring step, ``ms_compute`` the pass without transfers, ``ms_comm`` the transfers
without compute, ``ms_model`` the model's pass; ``bytes_per_step`` what one rank sends in the busiest
step (K/V; backward also the fp32 dK/dV), ``link_gbps`` the bandwidth the model used (``link_source``
measured or given); ``tflops`` the whole problem's FLOPs over ``ms_total``, ``tflops_compute`` one
rank's FLOPs over its compute-only time (the model's rate); ``hidden_measured`` and ``hidden_model``
the hidden fraction of the communication; ``n_crossover`` the model's n*; ``compute_imbalance`` the
slowest rank's compute time over the fastest's (1.0: balanced).

Launching: ``--world-size W`` spawns W processes on this machine (``torch.multiprocessing``, a free
localhost port; gloo on a CPU, NCCL with one GPU per rank). Under ``torchrun`` (RANK, WORLD_SIZE,
LOCAL_RANK in the environment) every rank runs this command itself:
``torchrun --nproc-per-node 8 -m harness ring --time``. World size 1 runs in this process: the
ring is one local call, no communication.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

RING_CSV = "ring.csv"
COLUMNS = ("run_id", "stage", "world_size", "backend", "B", "Hq", "Hkv", "N", "n_local", "D", "dtype", "causal",
           "pass", "device", "reps", "ms_total", "ms_p20", "ms_p80", "ms_step", "ms_compute", "ms_comm", "ms_model",
           "bytes_per_step", "link_gbps", "link_source", "tflops", "tflops_compute", "hidden_measured",
           "hidden_model", "n_crossover", "compute_imbalance", "status", "note")

#: below these relative errors a difference is rounding noise whatever the unsharded stage achieves
ABS_FLOOR = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}
#: the ring may be this many times less accurate than one call of the same stage (it rounds each
#: block's output to the input dtype before merging, and sums dK/dV over the ranks)
ERROR_FACTOR = 3.0
GPU_REPS, CPU_REPS = 10, 2
WARM_PASSES = 2


@dataclass(frozen=True)
class RingJob:
    """What every rank runs: the cases (global shapes), the modes and the stage."""

    stage: str
    B: int
    Hq: int
    Hkv: int
    Ns: tuple[int, ...]
    D: int
    dtype: str
    causals: tuple[bool, ...]
    check: bool
    time: bool
    reps: int
    link_gbps: float | None
    seed: int = 0


# ------------------------------------------------------------------------------------------ arguments

def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _add_causal_argument, _dtype, _head_dim, _int_list, _positive_int

    p.add_argument("--world-size", type=_positive_int, default=None,
                   help="ranks (processes) of the ring, >= 1 (default: WORLD_SIZE under torchrun; else one per GPU "
                        "on a GPU machine, 2 on a CPU)")
    p.add_argument("--check", action="store_true",
                   help="sharded forward and backward against one process's float64 reference (default mode)")
    p.add_argument("--time", action="store_true",
                   help="time ring steps and passes, compute alone, transfers alone: the overlap (GPU)")
    p.add_argument("--stage", default="c", help="the local kernel: a stage that returns the row log-sum-exp "
                                                "(default c; see stages.ring.LSE_STAGES)")
    p.add_argument("--B", type=_positive_int, default=None, help="batch (default 1)")
    p.add_argument("--H", type=_positive_int, default=None, help="query heads (default 4 --check, 32 --time on a GPU)")
    p.add_argument("--Hkv", type=_positive_int, default=None,
                   help="key/value heads, H a multiple of it (default H / 2 --check, 8 --time on a GPU)")
    p.add_argument("--N", type=_int_list, default=None, metavar="N1,N2",
                   help="global sequence lengths: a multiple of the world size W, and of 2W when causal "
                        "(default 16·W --check; 1024·W, 4096·W, 16384·W --time on a GPU)")
    p.add_argument("--D", type=_head_dim, default=None, help="head dim (default 16 --check, 128 --time on a GPU)")
    p.add_argument("--dtype", type=_dtype, default=None, help="fp16, bf16 or fp32 (default fp16 --check, bf16 --time)")
    _add_causal_argument(p, "both")
    p.add_argument("--reps", type=_positive_int, default=None,
                   help=f"timed repetitions, median reported (default {GPU_REPS} on a GPU, {CPU_REPS} on a CPU)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="link bandwidth for the overlap model, GB/s (default: measured by the transfers-only run)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"directory for {RING_CSV} (--time; default results/<gpu>/ on a GPU, on a CPU no file)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")


def _torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun (or any launcher that sets them)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def _job(args: argparse.Namespace, world: int, on_gpu: bool) -> RingJob:
    """The job from the flags, each bad value a ``parser.error`` naming its flag (exit 2, no traceback)."""
    import stages
    from stages import ring

    parser = args._parser
    check, timing = args.check, args.time
    if not check and not timing:
        check = True
    allowed = [n for n in ring.LSE_STAGES if n in stages.STAGES]
    if args.stage not in allowed:
        what = (f"unknown stage {args.stage!r}" if args.stage not in stages.STAGES
                else f"stage {args.stage!r} does not return the row log-sum-exp")
        parser.error(f"argument --stage: {what}; allowed: {', '.join(allowed)} (the stages that return it: the ring "
                     f"merges its blocks by it)")
    gpu_timing = timing and on_gpu and not check
    H = args.H or (32 if gpu_timing else 4)
    Hkv = args.Hkv or (8 if gpu_timing and H % 8 == 0 else H // 2 if H % 2 == 0 else H)
    if H % Hkv:
        parser.error(f"argument --Hkv: the query heads H = {H} must be a multiple of the key/value heads "
                     f"Hkv = {Hkv} (grouped-query attention)")
    causals = tuple({"no": [False], "yes": [True], "both": [False, True]}[args.causal])
    Ns = tuple(args.N or ([1024 * world, 4096 * world, 16384 * world] if gpu_timing else [16 * world]))
    multiple = 2 * world if any(causals) else world
    for N in Ns:
        if N % multiple:
            what = (f"2 x world size = {multiple} (causal: each rank holds two equal chunks)" if any(causals)
                    else f"the world size {world}")
            parser.error(f"argument --N: the sequence length must be a multiple of {what}, got {N}")
    if args.link_gbps is not None and not (math.isfinite(args.link_gbps) and args.link_gbps > 0):
        parser.error(f"argument --link-gbps: must be a positive number of GB/s, got {args.link_gbps}")
    return RingJob(stage=args.stage, B=args.B or 1, Hq=H, Hkv=Hkv, Ns=Ns, D=args.D or (128 if gpu_timing else 16),
                   dtype=args.dtype or ("bf16" if timing and not check else "fp16"), causals=causals, check=check,
                   time=timing, reps=args.reps or (GPU_REPS if on_gpu else CPU_REPS), link_gbps=args.link_gbps,
                   seed=args.seed)


def run(args: argparse.Namespace) -> int:
    import torch

    parser = args._parser
    env = _torchrun_env()
    on_gpu = torch.cuda.is_available()
    if env is not None:
        rank, world, local_rank = env
        if args.world_size is not None and args.world_size != world:
            parser.error(f"argument --world-size: {args.world_size} differs from torchrun's WORLD_SIZE={world}; "
                         f"leave it out under torchrun")
    else:
        rank, local_rank = 0, 0
        world = args.world_size or (torch.cuda.device_count() if on_gpu else 2)
        if on_gpu and world > torch.cuda.device_count():
            parser.error(f"argument --world-size: {world} ranks need {world} GPUs (one each; NCCL cannot put two "
                         f"ranks on one GPU), this machine has {torch.cuda.device_count()}")
    job = _job(args, world, on_gpu)
    out = None
    if job.time and (args.out is not None or on_gpu) and rank == 0:
        from .cli import _out_dir

        out = _out_dir(args)
    if env is not None:
        report = _rank_main(rank, world, local_rank, job, init_method="env://")
        return _finish(report, job, world, out) if rank == 0 else report["exit_code"]
    if world == 1:
        return _finish(_rank_main(0, 1, 0, job, init_method=f"tcp://127.0.0.1:{_free_port()}"), job, world, out)
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:  # rank 0 leaves its report here (a pipe could fill up and block)
        path = Path(tmp) / "report.pickle"
        mp.spawn(_spawned_rank, args=(world, job, _free_port(), str(path)), nprocs=world, join=True)
        report = pickle.loads(path.read_bytes())
    return _finish(report, job, world, out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------- one rank

def _spawned_rank(rank: int, world: int, job: RingJob, port: int, report_path: str) -> None:
    import pickle

    import stages  # noqa: F401  (first: without a GPU it must choose the Triton interpreter before triton loads)
    import torch

    if not torch.cuda.is_available():
        torch.set_num_threads(1)  # W processes share the CPU: one thread each instead of W × all cores
    report = _rank_main(rank, world, rank, job, init_method=f"tcp://127.0.0.1:{port}")
    if rank == 0:
        Path(report_path).write_bytes(pickle.dumps(report))


def _rank_main(rank: int, world: int, local_rank: int, job: RingJob, init_method: str) -> dict:
    """One rank's whole run: join the group, run the cases, leave. Rank 0's report holds the results
    (``check``: comparison rows; ``time``: ring.csv rows); every rank's holds the exit code."""
    import warnings

    import torch
    import torch.distributed as dist

    import stages  # noqa: F401  (chooses the Triton interpreter before triton loads, without a GPU)

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    report = {"check": [], "time": [], "backend": dist.get_backend(), "exit_code": 0}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="invalid value encountered", category=RuntimeWarning)
            for N in job.Ns:
                for causal in job.causals:
                    if job.check:
                        report["check"] += check_case(job, N, causal, device)
                    if job.time:
                        report["time"] += time_case(job, N, causal, device)
        ok = all(r["passed"] for r in report["check"])
        flag = [0 if ok else 1]
        dist.broadcast_object_list(flag, src=0)  # rank 0 compared: every rank exits with its verdict
        report["exit_code"] = flag[0]
    finally:
        dist.destroy_process_group()
    return report


def _gather(t):
    """Every rank's tensor ``t`` (same shape everywhere), as a list indexed by rank."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


# ------------------------------------------------------------------------------------------- check

def check_case(job: RingJob, N: int, causal: bool, device) -> list[dict]:
    """The ring's forward and backward on this rank's shards; on rank 0 the comparison rows (o, dq, dk,
    dv: the ring's error and the unsharded stage's against float64), [] elsewhere."""
    import torch
    import torch.distributed as dist

    import stages
    from stages import ring
    from stages.contract import DTYPES

    from .reference import reference_attention, reference_gradients, rel_err

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[job.dtype]
    # Every rank draws the whole problem from one seed and keeps its shard: no scatter needed.
    g = torch.Generator().manual_seed(job.seed + N + causal)
    q, k, v = ((torch.randn(job.B, h, N, job.D, generator=g)).to(dtype).to(device)
               for h in (job.Hq, job.Hkv, job.Hkv))
    do = torch.randn(job.B, job.Hq, N, job.D, generator=g).to(dtype).to(device)
    mine = [ring.shard(t, rank, world, causal).requires_grad_(True) for t in (q, k, v)]
    o = ring.ring_attention(*mine, causal=causal, stage=job.stage)
    o.backward(ring.shard(do, rank, world, causal))
    ring_results = [ring.unshard(_gather(t), causal) for t in (o.detach(), *(m.grad for m in mine))]
    if rank != 0:
        return []
    refs = [reference_attention(q, k, v, causal=causal), *reference_gradients(q, k, v, do, causal=causal)]
    single = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o_single = stages.get_stage(job.stage).attention(*single, causal=causal)
    o_single.backward(do)
    singles = [o_single.detach(), *(t.grad for t in single)]
    rows = []
    for name, got, ref, one in zip(("o", "dq", "dk", "dv"), ring_results, refs, singles):
        err, stage_err = rel_err(got, ref), rel_err(one, ref)
        bound = max(ERROR_FACTOR * stage_err, ABS_FLOOR[job.dtype])
        rows.append({"N": N, "causal": causal, "tensor": name, "ring_err": err, "stage_err": stage_err,
                     "bound": bound, "passed": bool(torch.isfinite(got).all()) and err <= bound})
    return rows


# -------------------------------------------------------------------------------------------- time

class _Clock:
    """Marks on the GPU's stream (CUDA events) or, on a CPU, the wall clock; ms between two marks."""

    def __init__(self, on_gpu: bool):
        import torch

        self.on_gpu = on_gpu
        self._torch = torch

    def mark(self):
        if not self.on_gpu:
            return time.perf_counter()
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        if not self.on_gpu:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


def _barrier() -> None:
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
    else:
        dist.barrier()


def _time_pass(run_pass, clock: _Clock, reps: int) -> tuple[list[float], list[list[float]]]:
    """This rank's times of ``run_pass(on_step)``: (ms per repetition, ms per step per repetition),
    ranks aligned by a barrier before each repetition."""
    totals, steps = [], []
    for _ in range(reps):
        _barrier()
        marks = []
        run_pass(lambda i: marks.append(clock.mark()))
        step_ms = [clock.ms(a, b) for a, b in zip(marks, marks[1:])]
        steps.append(step_ms)
        totals.append(clock.ms(marks[0], marks[-1]))
    return totals, steps


def _time_transfers(pairs, clock: _Clock, reps: int, transfers: int, last_pairs=None) -> list[float]:
    """This rank's ms per repetition of ``transfers`` ring transfers of ``pairs`` back to back (and one
    of ``last_pairs`` after them, when given: the backward's last dK/dV hop), no compute."""
    from stages import ring

    totals = []
    for _ in range(reps):
        _barrier()
        start = clock.mark()
        for batch in [pairs] * transfers + ([last_pairs] if last_pairs else []):
            for request in ring.pass_along(batch):
                request.wait()
        totals.append(clock.ms(start, clock.mark()))
    return totals


def step_flops(job: RingJob, n: int, rank: int, world: int, causal: bool, pass_: str) -> list[float]:
    """FLOPs of each of this rank's ring steps (the stage call of :func:`stages.ring.block_call`):
    4·B·Hq·rows·keys·D forward, visible pairs only on the diagonal step; backward 2.5× (the lab's
    convention)."""
    from stages import ring
    from stages.contract import Problem

    flops = []
    for step in range(world):
        call = ring.block_call(rank, (rank - step) % world, world, causal, n)
        rows = len(range(n)[call.q_rows])
        keys = len(range(n)[call.kv_rows])
        p = Problem(job.B, job.Hq, rows, job.D, job.dtype, call.causal, job.Hkv, keys)
        flops.append(p.pass_flops(pass_))
    return flops


def transfer_bytes(job: RingJob, n: int) -> tuple[int, int]:
    """(bytes of a rank's K/V block, bytes of its fp32 dK/dV accumulator): 2·B·Hkv·n·D elements each."""
    from stages.contract import DTYPES

    elements = 2 * job.B * job.Hkv * n * job.D
    return elements * DTYPES[job.dtype].itemsize, elements * 4


def step_transfers(world: int, pass_: str, kv_bytes: int, dkv_bytes: int) -> tuple[list[int], int]:
    """(bytes in flight during each ring step, bytes sent after the last step) on one rank.

    Forward: the next K/V block during steps 0 … W − 2, nothing during the last. Backward: during step
    i the next K/V block (i < W − 1) and the dK/dV accumulator the previous step sent (i ≥ 1); the
    last step's accumulator travels home after all compute (the tail: exposed whatever the overlap).
    """
    if world == 1:
        return [0], 0
    if pass_ == "fwd":
        return [kv_bytes] * (world - 1) + [0], 0
    return [kv_bytes * (i < world - 1) + dkv_bytes * (i >= 1) for i in range(world)], dkv_bytes


def overlap_model(step_compute_ms: list[float], step_comm_ms: list[float], tail_ms: float) -> tuple[float, float]:
    """(predicted ms of a pass, predicted hidden fraction of its communication) with perfect overlap:
    step i costs max(compute_i, the transfer in flight during it), and the tail comes after. NaN
    hidden fraction when nothing is sent (world size 1)."""
    total = sum(max(c, t) for c, t in zip(step_compute_ms, step_comm_ms)) + tail_ms
    comm = sum(step_comm_ms) + tail_ms
    if comm <= 0:
        return total, float("nan")
    return total, 1.0 - (total - sum(step_compute_ms)) / comm


def time_case(job: RingJob, N: int, causal: bool, device) -> list[dict]:
    """Forward and backward of one case: the ring, its compute alone, its transfers alone, the model.
    Rank 0 returns the ring.csv rows (one per pass), other ranks []."""
    import torch
    import torch.distributed as dist

    from stages import ring
    from stages.contract import DTYPES, validate_inputs

    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    clock = _Clock(on_gpu)
    n = N // world
    dtype = DTYPES[job.dtype]
    g = torch.Generator(device=device).manual_seed(job.seed + rank)
    q, do = (torch.randn(job.B, job.Hq, n, job.D, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(job.B, job.Hkv, n, job.D, generator=g, device=device, dtype=dtype) for _ in range(2))
    kernel = ring.lse_kernel(job.stage)
    scale = validate_inputs(q, k, v, causal=causal)
    ring.check_shards(q, k, v, causal)
    common = dict(causal=causal, scale=scale, kernel=kernel)
    o, lse = ring.ring_forward(q, k, v, **common)

    def forward(on_step, communicate):
        return ring.ring_forward(q, k, v, **common, on_step=on_step, communicate=communicate)

    def backward(on_step, communicate):
        return ring.ring_backward(do, q, k, v, o, lse, **common, on_step=on_step, communicate=communicate)

    kv = torch.stack((k, v))
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=device)
    rows = []
    for pass_, run_pass in (("fwd", forward), ("bwd", backward)):
        for _ in range(WARM_PASSES):  # compilation, autotuning, NCCL's connection set-up stay out
            run_pass(None, True)
            run_pass(None, False)
        ring_ms, ring_steps = _time_pass(lambda hook: run_pass(hook, True), clock, job.reps)
        compute_ms, compute_steps = _time_pass(lambda hook: run_pass(hook, False), clock, job.reps)
        comm_ms = [0.0] * job.reps
        if world > 1:  # the ring's transfers back to back: W − 1 of K/V; backward, with dK/dV, and its last hop
            pairs = [(kv, torch.empty_like(kv))] + ([(dkv, torch.empty_like(dkv))] if pass_ == "bwd" else [])
            comm_ms = _time_transfers(pairs, clock, job.reps, world - 1, last_pairs=pairs[1:] or None)
        mine = {"ring": ring_ms, "ring_steps": ring_steps, "compute": compute_ms, "compute_steps": compute_steps,
                "comm": comm_ms}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            rows.append(_timing_row(job, N, n, causal, pass_, everyone, world, on_gpu))
    return rows


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _timing_row(job: RingJob, N: int, n: int, causal: bool, pass_: str, everyone: list[dict], world: int,
                on_gpu: bool) -> dict:
    """One ring.csv row from every rank's times: a repetition lasts as long as its slowest rank."""
    from stages.contract import Problem

    reps = job.reps

    def slowest(key):  # per repetition, the largest time over the ranks
        return [max(r[key][i] for r in everyone) for i in range(reps)]

    ring_ms = sorted(slowest("ring"))
    compute_ms, comm_ms = _median(slowest("compute")), _median(slowest("comm"))
    # per step: each rank's median over repetitions, the slowest rank's
    step_ring = [max(_median([rep[s] for rep in r["ring_steps"]]) for r in everyone) for s in range(world)]
    step_compute = [max(_median([rep[s] for rep in r["compute_steps"]]) for r in everyone) for s in range(world)]
    per_rank_compute = [_median(r["compute"]) for r in everyone]
    total = _median(ring_ms)
    kv_bytes, dkv_bytes = transfer_bytes(job, n)
    in_flight, tail = step_transfers(world, pass_, kv_bytes, dkv_bytes)
    sent = sum(in_flight) + tail
    measured_gbps = sent / (comm_ms * 1e6) if sent and comm_ms > 0 else None
    link_gbps = job.link_gbps or measured_gbps
    # The model: rank 0's step FLOPs at the rate the compute-only run achieved, bytes at the link's rate.
    flops = step_flops(job, n, 0, world, causal, pass_)
    rate = sum(flops) / (sum(step_compute) * 1e9) if sum(step_compute) > 0 else None  # TFLOP/s
    model_compute = [f / (rate * 1e9) for f in flops] if rate else step_compute
    model_comm = [b / (link_gbps * 1e6) for b in in_flight] if link_gbps else [0.0] * world
    model_tail = tail / (link_gbps * 1e6) if link_gbps else 0.0
    ms_model, hidden_model = overlap_model(model_compute, model_comm, model_tail)
    hidden = float("nan")
    if sent and comm_ms > 0:
        hidden = min(1.0, max(0.0, (compute_ms + comm_ms - total) / comm_ms))
    # One block's transfer against one (off-diagonal) block's compute: FLOPs grow as n², bytes as n, so
    # the two are equal at n* = n · transfer / compute.
    crossover = None
    if world > 1 and link_gbps and model_compute[1] > 0:
        crossover = n * (max(in_flight) / (link_gbps * 1e6)) / model_compute[1]
    whole = Problem(job.B, job.Hq, N, job.D, job.dtype, causal, job.Hkv, N).pass_flops(pass_)
    row = {
        "stage": job.stage, "world_size": world, "B": job.B, "Hq": job.Hq, "Hkv": job.Hkv, "N": N, "n_local": n,
        "D": job.D, "dtype": job.dtype, "causal": int(causal), "pass": pass_,
        "device": "gpu" if on_gpu else "interpreter", "reps": reps, "ms_total": total,
        "ms_p20": ring_ms[int(0.2 * (reps - 1))], "ms_p80": ring_ms[int(0.8 * (reps - 1))],
        "ms_step": _median(step_ring), "ms_compute": compute_ms, "ms_comm": comm_ms, "ms_model": ms_model,
        "bytes_per_step": max(in_flight), "link_gbps": link_gbps if world > 1 else None,
        "link_source": ("given" if job.link_gbps else "measured") if world > 1 else "",
        "tflops": whole / (total * 1e9), "tflops_compute": rate, "hidden_measured": hidden,
        "hidden_model": hidden_model, "n_crossover": crossover,
        "compute_imbalance": max(per_rank_compute) / min(per_rank_compute) if min(per_rank_compute) > 0 else None,
        "status": "ok",
        "note": "world size 1: the ring is one local call, no communication" if world == 1 else "",
    }
    return {k: None if isinstance(x, float) and math.isnan(x) else x for k, x in row.items()}  # NaN: not measured


# ------------------------------------------------------------------------------------------ report

def _finish(report: dict, job: RingJob, world: int, out: Path | None) -> int:
    """Print rank 0's results; append the timing rows to ring.csv; the exit code."""
    from . import cli

    where = "GPU" if report["backend"] == "nccl" else "CPU: Triton interpreter"
    shape = f"B={job.B} Hq={job.Hq} Hkv={job.Hkv} D={job.D} {job.dtype}"
    if job.check:
        print(f"ring check: stage {job.stage}, {world} rank{'s' * (world > 1)} ({report['backend']}, {where}), "
              f"{shape}; the ring's relative error vs float64 beside the unsharded stage's")
        for r in report["check"]:
            causal = "yes" if r["causal"] else "no"
            print(f"  N={r['N']:<6} causal={causal:3}  {r['tensor']:2}  ring {r['ring_err']:.2e}  stage "
                  f"{r['stage_err']:.2e}  bound {r['bound']:.2e}  {'PASS' if r['passed'] else 'FAIL'}")
        failed = sum(not r["passed"] for r in report["check"])
        print(f"{len(report['check']) - failed} of {len(report['check'])} comparisons PASS"
              + (f", {failed} FAIL" if failed else ""))
    if job.time:
        from .results import run_id_now, write_env

        run_id = run_id_now()
        rows = [{**r, "run_id": run_id, "backend": report["backend"]} for r in report["time"]]
        cli._console().print(timing_table(rows, f"ring attention, stage {job.stage}, {world} rank"
                                                f"{'s' * (world > 1)} ({report['backend']}, {where}), {shape}"))
        print("ms: median over repetitions of the slowest rank. compute = the same stage calls without "
              "transfers; comm = the transfers alone; hidden = (compute + comm - ring) / comm; model = each step "
              "max(FLOPs / achieved rate, bytes / link GB/s); n* = rows per rank above which the ring hides "
              "its transfers.")
        if report["backend"] != "nccl":
            print("Note: times are CPU interpreter wall-clock times, not GPU times.")
        if out is not None:
            path = write_rows(out, rows)
            write_env(out, cli._environment(run_id))
            print(f"rows written to {path}")
    return report["exit_code"]


def write_rows(out_dir: str | Path, rows: list[dict]) -> Path:
    """Append ``rows`` to ``out_dir/ring.csv`` (header when the file is new)."""
    from .results import append_rows

    return append_rows(Path(out_dir) / RING_CSV, COLUMNS, rows)


def timing_table(rows: list[dict], title: str):
    from rich.table import Table

    def fmt(x, spec=".3f"):
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    table = Table(title=title, header_style="bold")
    for col in ("N", "n/rank", "causal", "pass", "ring ms", "step ms", "compute ms", "comm ms", "model ms",
                "MB/step", "GB/s", "TFLOP/s", "hidden", "model hidden", "n*", "imbalance"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["N"]), str(r["n_local"]), "yes" if r["causal"] else "no", r["pass"], fmt(r["ms_total"]),
                      fmt(r["ms_step"]), fmt(r["ms_compute"]), fmt(r["ms_comm"]), fmt(r["ms_model"]),
                      fmt(r["bytes_per_step"] / 1e6, ".2f"), fmt(r["link_gbps"], ".0f"), fmt(r["tflops"], ".1f"),
                      fmt(r["hidden_measured"], ".0%"), fmt(r["hidden_model"], ".0%"),
                      fmt(r["n_crossover"], ".0f"), fmt(r["compute_imbalance"], ".2f"))
    return table
