"""Host µs per call and a cProfile of stages B and C on a decode step as a model makes it.

GPT-2's attention (q [4, 12, 1, 64]) against caches of 129 ... 192 keys, six sweeps over the 64
lengths per timed pass (so each length's plan is made once and then kept, as in a model, whose six
layers see one cache length per step), three timed passes after three warm calls, then one pass
under cProfile (its times are inflated by the profiler; the ranking
is what it is for). Stage B launches through Triton's own ``kernel[grid]``; stage C through its
kept plans and ``FastLaunch``.

    python experiments/decode_host_profile.py > results/h200/experiments/<date>_decode_host_profile.txt
"""

import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import stages  # noqa: E402

q = torch.randn(4, 12, 1, 64, dtype=torch.bfloat16, device="cuda")
caches = [torch.randn(4, 12, n, 64, dtype=torch.bfloat16, device="cuda") for n in range(129, 193)]


def one_pass(attention):
    for _sweep in range(6):
        for k in caches:
            attention(q, k, k, causal=True)


for name in ("b", "c"):
    attention = stages.get_stage(name).attention
    for k in caches[:3]:
        attention(q, k, k, causal=True)
    torch.cuda.synchronize()
    for _ in range(3):
        t0 = time.perf_counter()
        one_pass(attention)
        torch.cuda.synchronize()
        print(name, "us/call", (time.perf_counter() - t0) / (6 * len(caches)) * 1e6)
    profile = cProfile.Profile()
    profile.enable()
    one_pass(attention)
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(22)
    print(text.getvalue()[-5000:])
