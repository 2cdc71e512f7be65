"""Host time of one backward call, piece by piece: where a small backward's time goes when the GPU
work is tiny (B 1, H 8, N 1024, D 64: tens of µs of kernels).

    python experiments/backward_host.py                      # B 1, H 8, N 1024, D 64, bf16, causal
    python experiments/backward_host.py --N 128 --calls 2000
    python experiments/backward_host.py --B 16 --H 8 --Hkv 2 --compiled   # harness train's attention
    python experiments/backward_host.py --profile 25       # and where the Python of a call goes

Each line is the mean wall time per call over ``--calls`` calls, the GPU synchronized once at the end
(so a line is host-bound when the host is slower than the kernels it queues, which is the point):

* ``autograd.grad`` through each impl's attention (what training pays), and through SDPA's backends;
  stage C's and cuDNN's again with autograd's device threads off (the backward on the caller's thread);
* stage C's ``attention_backward`` called directly (no autograd), and what a compiled graph calls
  instead: the custom ops ``torch.ops.attention_lab.c_forward``/``c_backward`` against the same
  functions called directly and cuDNN's forward op; with ``--compiled``, the forward and
  ``autograd.grad`` of the attention alone through ``torch.compile`` (Inductor), stage C and cuDNN;
  then what separates ``autograd.grad`` from the direct call:
  autograd.grad with stage C's backward stubbed out, the backward formula called from the main
  thread, a thread handoff alone and the direct call on another thread;
* its parts: the checks, ``plan_backward`` (building the launches as data), each launch run alone
  through Triton's ``kernel[grid]``, then what the direct call does instead: allocating the
  gradients and each kept launch (planned at the layout's first call, ``launch.KeptLaunch``), then
  each bound one (``launch.BoundKeptLaunch``, what the direct call runs from its second call on).
  The kept and bound launches are timed on the host alone (the clock stops before the GPU is waited
  for): one launch of the dK/dV kernel takes longer on the GPU than on the host.

The kernels' own GPU time comes from a CUDA graph of the direct call, replayed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def per_call_us(fn, calls: int, host_only: bool = False) -> float:
    """Wall µs per call over ``calls`` calls after a warm-up, the GPU waited for at the end; ``host_only``:
    the clock stops before that wait (fewer calls than the launch queue holds, so none blocks), the host's
    time alone, for a launch whose kernel takes longer on the GPU than its launch on the host."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if not host_only:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_us(fn, calls: int) -> float:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return per_call_us(graph.replay, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--Hkv", type=int, default=None, help="K/V heads (default: --H)")
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["fp16", "bf16"])
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--compiled", action="store_true", help="also time the attention through torch.compile")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="also profile the Python of a forward and autograd.grad through stage C (cProfile, autograd's "
                         "device threads off so that the backward runs where the profiler looks; "
                         "compiled_host_profile.python_profile) and print the ROWS functions that take the most "
                         "time of their own, in seconds over --calls steps")
    args = ap.parse_args()
    for option in ("B", "H", "N", "D", "calls"):
        if getattr(args, option) < 1:
            ap.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if args.Hkv is not None and args.Hkv < 1:
        ap.error(f"--Hkv must be >= 1, got {args.Hkv}")
    Hkv = args.Hkv or args.H
    if args.H % Hkv:
        ap.error(f"--Hkv must divide --H ({args.H}), got {Hkv}")
    if not torch.cuda.is_available():
        sys.exit("error: this experiment times the host path of GPU calls; no CUDA GPU here")
    import stages  # noqa: F401  (first: it chooses the interpreter on a machine without a GPU)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from stages.c_optimized import backward as bwd
    from stages.contract import validate_backward_inputs
    from stages.c_optimized.kernels import attention_with_lse

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    causal = bool(args.causal)
    shape = (args.B, args.H, args.N, args.D)
    q = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    k, v = (torch.randn((args.B, Hkv, args.N, args.D), device="cuda", dtype=dtype, requires_grad=True)
            for _ in range(2))
    do = torch.randn(shape, device="cuda", dtype=dtype)
    scale = args.D ** -0.5
    print(f"B={args.B} H={args.H}/{Hkv} N={args.N} D={args.D} {args.dtype} causal={int(causal)}; "
          f"{args.calls} calls per line; µs per call")

    def grad_of(forward):
        o = forward()
        return lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)

    for name in ("b", "c"):
        attention = stages.STAGES[name].attention
        print(f"  autograd.grad, stage {name}: {per_call_us(grad_of(lambda: attention(q, k, v, causal=causal)), args.calls):8.1f}")
    gqa = Hkv != args.H
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        with sdpa_kernel(backend):
            fn = grad_of(lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa))
            print(f"  autograd.grad, SDPA {backend.name}: {per_call_us(fn, args.calls):8.1f}")
    # Autograd runs a CUDA backward on a device thread of its own; with its threads off the backward runs on
    # the caller's thread: what the handoff and the other thread cost each implementation.
    with torch.autograd.set_multithreading_enabled(False):
        fn = grad_of(lambda: stages.STAGES["c"].attention(q, k, v, causal=causal))
        print(f"  autograd.grad, stage c, autograd's device threads off: {per_call_us(fn, args.calls):8.1f}")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            fn = grad_of(lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=gqa))
            print(f"  autograd.grad, SDPA CUDNN_ATTENTION, autograd's device threads off: "
                  f"{per_call_us(fn, args.calls):8.1f}")
    if args.profile:  # (autograd's threads off: cProfile sees only the thread it was started on)
        from compiled_host_profile import python_profile

        with torch.autograd.set_multithreading_enabled(False):
            print(python_profile(lambda: torch.autograd.grad(stages.STAGES["c"].attention(q, k, v, causal=causal),
                                                             (q, k, v), do), args.calls, args.profile))
    if args.compiled:  # the attention alone through torch.compile, as harness train --compile inductor runs it
        for name, attend in (("stage C", lambda a, b, c: stages.STAGES["c"].attention(a, b, c, causal=causal)),
                             ("SDPA CUDNN_ATTENTION", lambda a, b, c: sdpa(a, b, c, is_causal=causal, enable_gqa=gqa))):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                compiled = torch.compile(attend, fullgraph=True)

                def step():
                    torch.autograd.grad(compiled(q, k, v), (q, k, v), do)

                print(f"  compiled forward + autograd.grad, {name}: {per_call_us(step, args.calls):8.1f}   host only "
                      f"{per_call_us(step, min(args.calls, 200), host_only=True):8.1f}")
        # Whether the compiled graph's calls take the lean path: the layouts planned by the forward and
        # the backward (one each after the first step, as in eager), and whether their launches were bound.
        from stages.c_optimized import backward as c_bwd, kernels as c_kernels

        forward_plans = list(c_kernels._LAYOUT_PLANS.values())
        print(f"  forward layouts planned: {len(forward_plans)}, bound: "
              f"{[bool(p.bound) for p in forward_plans]}; backward layouts kept: {len(c_bwd._KEPT)}, bound: "
              f"{[bool(k.bound) for k in c_bwd._KEPT.values()]}")

    qd, kd, vd = (t.detach() for t in (q, k, v))
    o, lse = attention_with_lse(qd, kd, vd, causal=causal)
    direct = lambda: bwd.attention_backward(do, qd, kd, vd, o, lse, causal=causal, scale=scale)  # noqa: E731
    print(f"  stage C attention_backward, direct: {per_call_us(direct, args.calls):8.1f}")
    # What a compiled graph calls: the custom ops, through PyTorch's dispatcher, against the same functions
    # called directly (their arguments as kernels._forward_op and _backward_op take them).
    from stages.c_optimized import kernels as ck

    options = (None, None, None, True, True, True, True, True, True, False)  # config ... deterministic
    ops = torch.ops.attention_lab
    with torch.no_grad():
        rows = {"stage C forward with lse, direct": lambda: ck._forward(qd, kd, vd, causal, scale, True, *options),
                "stage C forward with lse, through its op": lambda: ops.c_forward(qd, kd, vd, causal, scale, True,
                                                                                  *options),
                "cuDNN's forward op with lse": lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qd, qd, qd, None, True, 0.0, causal, False, scale=scale),
                "stage C backward, through its op": lambda: ops.c_backward(do, qd, kd, vd, o, lse, causal, scale,
                                                                           False, True, True, True, True, True)}
        for label, fn in rows.items():  # wall (GPU waited for) and the host's own time (before the wait)
            print(f"  {label}: {per_call_us(fn, args.calls):8.1f}   host only "
                  f"{per_call_us(fn, min(args.calls, 200), host_only=True):8.1f}")
    # Where autograd.grad's extra time goes: autograd's own cost (the backward replaced by three empty
    # tensors), stage C's backward formula called from this thread with a saved context, and the
    # direct call run on another thread (autograd runs a CUDA backward on a device thread of its own).
    from concurrent.futures import ThreadPoolExecutor

    # (Both entries stubbed: the op's implementation calls kernels._backward, the eager node's formula
    # backward.run_backward, which it looks up in its module at every call.)
    real_backward, real_run = ck._backward, bwd.run_backward

    def stub(do_, q_, k_, v_, *rest):
        return torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)

    ck._backward = bwd.run_backward = stub
    try:
        fn = grad_of(lambda: stages.STAGES["c"].attention(q, k, v, causal=causal))
        print(f"  autograd.grad, stage C with the backward stubbed out: {per_call_us(fn, args.calls):8.1f}")
    finally:
        ck._backward, bwd.run_backward = real_backward, real_run

    class SavedContext:  # what kernels._setup_context saves: no key ranges
        saved_tensors = (qd, kd, vd, o, lse, None, None)
        args = (causal, scale, False, True, True, True, True, True)
        inputs = 3

    print(f"  stage C's backward formula (_grad) from this thread: "
          f"{per_call_us(lambda: ck._grad(SavedContext, do, None), args.calls):8.1f}")
    with ThreadPoolExecutor(1) as pool:
        print(f"  a no-op handed to another thread and waited for: "
              f"{per_call_us(lambda: pool.submit(lambda: None).result(), args.calls):8.1f}")
        print(f"  stage C attention_backward, direct, on another thread: "
              f"{per_call_us(lambda: pool.submit(direct).result(), args.calls):8.1f}")
    print(f"  stage C attention_backward, GPU only (graph replay): {graph_us(direct, args.calls):8.1f}")
    print(f"    checks: {per_call_us(lambda: validate_backward_inputs(do, qd, kd, vd, o, lse, scale), args.calls):8.1f}")
    B, Hq, Nq, D = qd.shape
    plan = bwd.backward_plan(D, dtype, bwd.device_arch(qd.device), causal)
    delta = torch.empty((B, Hq, Nq), dtype=torch.float32, device="cuda")
    dk, dv, dq = torch.empty_like(kd), torch.empty_like(vd), torch.empty_like(qd)
    dq_acc = None if plan.separate_dq else torch.empty(shape, dtype=torch.float32, device="cuda")

    def planned():
        return bwd.plan_backward(do, qd, kd, vd, o, lse, delta, dq, dk, dv, dq_acc, causal=causal, scale=scale,
                                 arch=90, deterministic=plan.separate_dq, config=plan.dkdv, dq_config=plan.dq)

    print(f"    plan_backward: {per_call_us(planned, args.calls):8.1f}   ({plan})")
    for launch in planned():
        print(f"    run {launch.kernel.fn.__name__} through kernel[grid]: {per_call_us(launch.run, args.calls):8.1f}")
    # What the direct call runs: the launches it planned at its first call and kept (launch.KeptLaunch).
    layout = list(bwd._KEPT.values())[-1]
    tensors = {**bwd._allocate(qd, kd, vd, layout.separate), "do": do, "q": qd, "k": kd, "v": vd, "o": o, "lse": lse}
    print(f"    allocating the gradients: {per_call_us(lambda: bwd._allocate(qd, kd, vd, layout.separate), args.calls):8.1f}")
    calls = min(args.calls, 500)  # (the launch queue holds about a thousand)
    for launch in layout.launches:
        print(f"    run {launch.kernel.fn.__name__} kept, host only: {per_call_us(lambda: launch(tensors), calls, host_only=True):8.1f}")
    for launch, bound in zip(layout.launches, layout.bound or ()):
        print(f"    run {launch.kernel.fn.__name__} bound, host only: {per_call_us(lambda: bound(tensors), calls, host_only=True):8.1f}")


if __name__ == "__main__":
    main()
