"""Host µs of one attention call as a transformers model makes it in a decode loop, per attention
implementation, on a GPU.

A small model's ``generate()`` is host-bound: the GPU finishes each step's kernels long before the
host has issued the next step's. What attention adds to a step is then its host time, not its GPU
time. This replays what the 6 layers of ``harness generate``'s GPT-2- and Llama-shaped models do in a
decode loop (batch 4, a cache growing from 129 keys by one per step, concatenated per layer as
transformers' dynamic cache does, the query a transposed view of the projection) and times only the
attention function transformers would call (``ALL_ATTENTION_FUNCTIONS[impl]``: the lab's through
``stages.hf``, transformers' own ``sdpa_attention_forward``), the impls in turns, the turn order
reversed every round; then the stage's own call alone (no transformers wrapper).

    python experiments/hf_attention_host.py > results/h200/experiments/<date>_hf_attention_host.txt
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import torch  # noqa: E402

from harness import generate as G  # noqa: E402

STEPS, ROUNDS, BATCH, PROMPT = 64, 7, 4, 128


def decode_loop(fn, shape, device, dtype) -> float:
    """µs per attention call over STEPS steps of shape.layers layers (host time of the calls alone)."""
    B, Hq, Hkv, D = BATCH, shape.heads, shape.kv_heads, shape.head_dim
    caches = [(torch.randn(B, Hkv, PROMPT, D, device=device, dtype=dtype),) * 2 for _ in range(shape.layers)]
    spent = 0.0
    for _ in range(STEPS):
        for layer in range(shape.layers):
            k_old, v_old = caches[layer]
            new = torch.randn(B, 1, Hkv, D, device=device, dtype=dtype).transpose(1, 2)
            k, v = torch.cat([k_old, new], dim=-2), torch.cat([v_old, new], dim=-2)
            caches[layer] = (k, v)
            q = torch.randn(B, 1, Hq, D, device=device, dtype=dtype).transpose(1, 2)
            t0 = time.perf_counter()
            fn(q, k, v)
            spent += time.perf_counter() - t0
    torch.cuda.synchronize()
    return spent / (STEPS * shape.layers) * 1e6


def main() -> int:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from stages import hf

    hf.register(["c", "b"])
    device, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}; batch {BATCH}, cache {PROMPT + 1}..{PROMPT + STEPS} keys, {dtype}; "
          f"median of {ROUNDS} rounds, µs of host time per attention call")
    for name, shape in G.GPU_SHAPES.items():
        config = G.model_config(shape, PROMPT + STEPS)
        module = SimpleNamespace(is_causal=True, num_key_value_groups=shape.heads // shape.kv_heads, config=config,
                                 training=False)
        scaling = shape.head_dim ** -0.5
        impls = {}
        for impl in ("lab_c", "lab_b", "sdpa"):
            f = ALL_ATTENTION_FUNCTIONS[impl]
            impls[impl] = (lambda f: lambda q, k, v: f(module, q, k, v, None, dropout=0.0, scaling=scaling))(f)
        impls["stage c alone"] = lambda q, k, v: stages.get_stage("c").attention(q, k, v, causal=True,
                                                                                 sm_scale=scaling)
        order = list(impls)
        times = {impl: [] for impl in order}
        with torch.no_grad():
            for r in range(ROUNDS + 1):
                for impl in (order if r % 2 == 0 else order[::-1]):
                    us = decode_loop(impls[impl], shape, device, dtype)
                    if r:  # round 0 warms every impl up (compiles, plans)
                        times[impl].append(us)
        print(f"\n{name}: {shape.describe()}")
        for impl, t in times.items():
            print(f"  {impl:14} {statistics.median(t):6.1f} µs per call (min {min(t):.1f}, max {max(t):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
