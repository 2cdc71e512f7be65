"""Host time per call of stage C: Triton's ordinary launch against the lean launch (stages/launch.py).

On a GPU (the default when one is present) it prints µs of CPU wall time per call, back-to-back
calls with one synchronize at the end (``harness.latency.host_us_per_call``), on a tiny problem
where the host path sets the pace, for:

- the floor: an empty ``@triton.jit`` kernel with no arguments,
- stage C with ``launch.fast_launch_enabled = False`` (every launch through ``kernel[grid](...)``)
  and with the lean launch, on each path: the default choice, the ``tl`` kernel
  (``warp_specialization=False``) and split-KV (``split_kv=2``),
- SDPA's FLASH, CUDNN and EFFICIENT backends,

then the per-step µs of stage C's host path (validation, output allocation, the recipe lookup,
the launches). Both paths' outputs are compared (bit for bit) before timing.

Without a GPU (or with ``--cpu-steps``) it times the same steps on the CPU with the compiled
kernel replaced by a no-op: the Python side of the path alone, not GPU host times.

    python experiments/host_path.py                 # on the GPU
    python experiments/host_path.py --B 1 --H 8 --N 128 --D 64 --calls 2000
    python experiments/host_path.py --cpu-steps     # the Python side, anywhere
    python experiments/host_path.py --B 4 --H 12 --N 1 --Nk 160   # a decode step of GPT-2's shape
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402  (first: it chooses the interpreter on a machine without a GPU)
import torch  # noqa: E402

from stages import launch  # noqa: E402
from stages.c_optimized import kernels  # noqa: E402
from stages.contract import new_output, validate_inputs  # noqa: E402

#: stage C's options as ``attention`` passes them on with no keyword given
DEFAULT_OPTIONS = dict(config=None, split_kv=None, tuned_tiles=True, pipelining=True, tma=True, exp2=True,
                       causal_skip=True, warp_specialization=True, ws_rung=None)
VARIANTS = {"default": {}, "tl": {"warp_specialization": False}, "split": {"split_kv": 2}}


def plan_options(full: dict) -> dict:
    """The keywords ``kernels._plan_call`` takes, from ``attention``'s options."""
    return dict(config=full["config"], split_kv=full["split_kv"], ws_rung=full["ws_rung"],
                **{name: full[name] for name in kernels.SWITCH_NAMES})


def step_times(q, k, v, causal: bool, options: dict, number: int) -> dict:
    """µs per call of each step of stage C's forward host path (best of 5 repeats of ``number``)."""
    def us(fn):
        fn()
        return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6

    scale = validate_inputs(q, k, v, causal=causal)
    full = {**DEFAULT_OPTIONS, **options}
    o = new_output(q)
    arch, sms = kernels._arch_and_sms(q)
    plan = plan_options(full)
    choice, recipe = kernels._plan_call(q, k, v, o, None, causal, arch, sms, **plan)
    workspace, runs = recipe.runtime(q, k, v, o, choice)
    tensors = kernels._call_tensors(workspace, q, k, v, o, None)
    times = {
        "validate_inputs": us(lambda: validate_inputs(q, k, v, causal=causal)),
        "new_output": us(lambda: new_output(q)),
        "arch_and_sms": us(lambda: kernels._arch_and_sms(q)),
        "plan (choice and recipe lookup)": us(lambda: kernels._plan_call(q, k, v, o, None, causal, arch, sms, **plan)),
        "runtime arguments": us(lambda: recipe.runtime(q, k, v, o, choice)),
        "workspace": us(lambda: kernels._call_tensors(workspace, q, k, v, o, None)),
    }
    for i, (r, (grid, ints)) in enumerate(zip(recipe.launches, runs)):
        name = getattr(r.kernel, "__name__", None) or r.kernel.fn.__name__
        times[f"launch {i}: {name} ({len(r.descs)} descriptors)"] = us(
            lambda r=r, grid=grid, ints=ints: r.launch(grid, tensors, ints, scale))
    times["attention (whole call)"] = us(lambda: kernels.attention(q, k, v, causal=causal, **options))
    # What a call of a known layout runs after its checks: the layout's launches bound (kernels._BoundLayout;
    # descriptors' tensor maps found by address, launch.BoundLaunch).
    bound = next((p.bound for p in kernels._LAYOUT_PLANS.values() if p.recipe is recipe and p.bound), None)
    if bound is not None:
        qa, ka, va = q.data_ptr(), k.data_ptr(), v.data_ptr()
        times["the layout's bound launches"] = us(lambda: bound.launch(q, k, v, new_output(q), None, qa, ka, va, scale))
    return times, recipe


def _mock_launchers(recipe) -> None:
    """CPU only: every launch of ``recipe`` takes the lean path into a launcher that does nothing."""
    class AnyKey(dict):
        def get(self, key, default=None):
            return (lambda *args: None), None, (), None

    for r in recipe.launches:
        fl = r.launcher
        fl._fast, fl._get_device, fl._get_stream, fl._compiled = True, (lambda: 0), (lambda d: 0), AnyKey()


def inputs(args, device) -> tuple[torch.Tensor, ...]:
    """q [B, H, N, D], k and v [B, Hkv, Nk, D] (Hkv and Nk default to H and N), fp16."""
    q = torch.randn(args.B, args.H, args.N, args.D, dtype=torch.float16, device=device)
    kv = (args.B, args.Hkv or args.H, args.Nk or args.N, args.D)
    return q, torch.randn(kv, dtype=torch.float16, device=device), torch.randn(kv, dtype=torch.float16, device=device)


def cpu_steps(args) -> None:
    q, k, v = inputs(args, "cpu")
    kernels._DEVICE_FACTS[q.get_device()] = (90, 132)  # plan as for an H200
    print(f"CPU, compiled kernels replaced by a no-op; problem B={args.B} H={args.H} N={args.N} D={args.D} fp16, "
          f"planned for sm_90 with 132 SMs; µs per call (best of 5)")
    for variant, options in VARIANTS.items():
        full = {**DEFAULT_OPTIONS, **options}
        o = new_output(q)
        plan = plan_options(full)
        _, recipe = kernels._plan_call(q, k, v, o, None, False, 90, 132, **plan)
        _mock_launchers(recipe)
        times, recipe = step_times(q, k, v, False, options, args.number)
        print(f"--- {variant}: path {recipe.path}")
        for name, t in times.items():
            print(f"  {name:48s} {t:7.2f}")


def gpu(args) -> None:
    from harness.latency import empty_kernel_launch, host_us_per_call
    from harness.peers import peer_attention

    device = torch.device("cuda")
    q, k, v = inputs(args, device)
    sync = torch.cuda.synchronize
    print(f"GPU {torch.cuda.get_device_name()}; B={args.B} H={args.H} N={args.N} D={args.D} fp16; "
          f"µs of host time per call, {args.calls} calls back to back")
    print(f"  {'triton empty kernel (floor)':40s} {host_us_per_call(empty_kernel_launch(), args.calls, sync):7.1f}")
    for variant, options in VARIANTS.items():
        call = lambda options=options: kernels.attention(q, k, v, **options)  # noqa: E731
        try:
            launch.fast_launch_enabled = False
            slow_out = call()
            slow = host_us_per_call(call, args.calls, sync)
            launch.fast_launch_enabled = True
            fast_out = call()
            fast = host_us_per_call(call, args.calls, sync)
        except ValueError as e:  # a path this GPU or shape cannot take
            print(f"  stage C {variant:32s} unsupported: {e}")
            continue
        finally:
            launch.fast_launch_enabled = True
        same = "same output" if torch.equal(slow_out, fast_out) else "OUTPUTS DIFFER"
        print(f"  stage C {variant:8s} ordinary launch          {slow:7.1f}")
        print(f"  stage C {variant:8s} lean launch              {fast:7.1f}   ({same})")
    for peer in ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"):
        fn = peer_attention(peer)
        try:
            print(f"  {peer:40s} {host_us_per_call(lambda: fn(q, k, v), args.calls, sync):7.1f}")
        except Exception as e:  # noqa: BLE001  (a backend this build lacks)
            print(f"  {peer:40s} unsupported: {type(e).__name__}: {str(e)[:80]}")
    from triton.runtime import driver

    index = torch.cuda.current_device()
    get_stream = driver.active.get_current_stream
    for name, fn in (("stream: triton driver.get_current_stream", lambda: get_stream(index)),
                     ("stream: torch.cuda.current_stream().cuda_stream",
                      lambda: torch.cuda.current_stream().cuda_stream),
                     ("device: torch.cuda.current_device", torch.cuda.current_device)):
        print(f"  {name:48s} {min(timeit.repeat(fn, number=10000, repeat=5)) / 10000 * 1e6:7.3f}")
    print("per-step µs of stage C's lean path (no synchronize; the launches queue on the GPU):")
    for variant, options in VARIANTS.items():
        try:
            times, recipe = step_times(q, k, v, False, options, args.number)
        except ValueError as e:
            print(f"--- {variant}: unsupported: {e}")
            continue
        print(f"--- {variant}: path {recipe.path}")
        for name, t in times.items():
            print(f"  {name:48s} {t:7.2f}")
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--N", type=int, default=128)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--Nk", type=int, default=None, help="keys (default N): --N 1 --Nk 160 is a decode step")
    p.add_argument("--Hkv", type=int, default=None, help="key/value heads (default H)")
    p.add_argument("--calls", type=int, default=2000, help="calls timed per row on the GPU")
    p.add_argument("--number", type=int, default=2000, help="calls per repeat in the per-step timings")
    p.add_argument("--cpu-steps", action="store_true", help="time the Python side on the CPU (no-op kernels)")
    args = p.parse_args()
    if args.cpu_steps or not torch.cuda.is_available():
        cpu_steps(args)
    else:
        gpu(args)


if __name__ == "__main__":
    main()
