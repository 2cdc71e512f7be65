"""What a call through the lab's custom ops costs the host, measured robustly enough to compare two
registrations of the same ops (``torch.library.custom_op`` against ``stages/ops.py``'s ``define``).

Host timings on a shared GPU machine jump by 2-3× from one 300-step mean to the next (another
process, a clock change), so every line here is the median and the minimum over ``--blocks`` blocks of
``--calls`` calls each, the GPU waited for between blocks but not inside one (the clock stops before
the wait: host time alone). At B 16, H 8/2, N 1024, D 64, bf16, causal (``harness train``'s attention):

* stage C's forward (with the log-sum-exp, no autograd) and its backward, called directly and
  through ``torch.ops.attention_lab``: the difference is the dispatcher's share;
* the attention's forward and ``autograd.grad``, eager and through ``torch.compile`` (Inductor),
  stage C and cuDNN.

    python experiments/op_dispatch_cost.py
    python experiments/op_dispatch_cost.py --blocks 60 --calls 20

To compare two trees, run it from each in turn (``cd other-tree && python experiments/op_dispatch_cost.py``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def host_us(fn, blocks: int, calls: int) -> tuple[float, float]:
    """(median, minimum) over ``blocks`` of the host µs per call in a block of ``calls`` calls."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(blocks):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call), min(per_call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    for option in ("blocks", "calls"):
        if getattr(args, option) < 1:
            ap.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    if not torch.cuda.is_available():
        sys.exit("error: this experiment times GPU calls' host path; no CUDA GPU here")
    import stages
    from stages.c_optimized import backward as bwd, kernels as ck
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    B, H, Hkv, N, D = 16, 8, 2, 1024, 64
    q = torch.randn((B, H, N, D), device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn((B, Hkv, N, D), device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    do = torch.randn_like(q)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    scale = D ** -0.5
    options = (None, None, None, True, True, True, True, True, True, False)  # config ... deterministic
    with torch.no_grad():
        o, lse = ck._forward(qd, kd, vd, True, scale, True, *options)
    ops = torch.ops.attention_lab
    rows = {
        "forward, direct": lambda: ck._forward(qd, kd, vd, True, scale, True, *options),
        "forward, through its op": lambda: ops.c_forward.default(qd, kd, vd, True, scale, True, *options),
        "backward, direct": lambda: bwd.attention_backward(do, qd, kd, vd, o, lse, causal=True, scale=scale),
        "backward, through its op": lambda: ops.c_backward.default(do, qd, kd, vd, o, lse, True, scale, False,
                                                                   True, True, True, True, True),
    }
    print(f"B={B} H={H}/{Hkv} N={N} D={D} bf16 causal; host µs per call: median and minimum of {args.blocks} "
          f"blocks of {args.calls} calls")
    with torch.no_grad():
        for label, fn in rows.items():
            med, low = host_us(fn, args.blocks, args.calls)
            print(f"  stage C {label:28s} median {med:7.1f}  min {low:7.1f}")
    attends = {"stage C": lambda a, b, c: stages.STAGES["c"].attention(a, b, c, causal=True),
               "cuDNN": lambda a, b, c: sdpa(a, b, c, is_causal=True, enable_gqa=True)}
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for name, attend in attends.items():
            compiled = torch.compile(attend, fullgraph=True)
            for mode, fn in (("eager", attend), ("inductor", compiled)):
                med, low = host_us(lambda fn=fn: torch.autograd.grad(fn(q, k, v), (q, k, v), do),
                                   args.blocks, args.calls)
                print(f"  {name:8s} {mode:9s} forward + autograd.grad    median {med:7.1f}  min {low:7.1f}")


if __name__ == "__main__":
    main()
