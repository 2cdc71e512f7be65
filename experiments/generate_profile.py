"""Where a generate() step goes, per attention implementation: the torch profiler over one greedy
``generate()`` of a small transformers model (harness/generate.py's GPT-2- and Llama-shaped models,
random weights), summarized per new token.

    python experiments/generate_profile.py                       # both models, lab_c against sdpa
    python experiments/generate_profile.py --model gpt2 --impls c,b,sdpa --new-tokens 32
    python experiments/generate_profile.py --rounds 20 --python 25   # + wall times in turns, cProfile
    python experiments/generate_profile.py --impls c,sdpa,c+sdpa_mask,sdpa+lab_mask,no_attention --rounds 12
    python experiments/generate_profile.py --rounds 20 --gc frozen   # the rounds without walks of the model
    python experiments/generate_profile.py --cache static --rounds 12  # the compiled, CUDA-graphed step

Per impl, per generated token: wall ms; GPU kernels launched and their summed GPU time (so the
host-bound share shows as wall minus GPU); the attention calls' CPU time (the profiler's
``*_attention_forward`` ranges) and the mask builder's (transformers calls it once per step, and with
a static cache outside the compiled step, eagerly); then the kernels by launches per token, so a
kernel one impl launches and the other does not (a layout copy, a split-KV merge, the mask's small
operations) stands out. ``--cache static``: transformers' static cache, whose decode step ``generate``
compiles and replays as a CUDA graph on a GPU. Runs a warm-up
generate per impl first, so no compilation is profiled. On a CPU it runs the tiny shapes under the
interpreter (times are not GPU times).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401  # (first: it chooses the interpreter on a machine without a GPU)
import torch  # noqa: E402

from harness import generate as G  # noqa: E402


def timed_attention(impl_name: str):
    """Wrap transformers' attention function of ``impl_name`` in a profiler range named
    ``attention_forward``, and its mask builder in one named ``attention_mask``, so their CPU time
    can be summed (returns the undo)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    undo = []
    for table, label in ((ALL_ATTENTION_FUNCTIONS, "attention_forward"),
                         (ALL_MASK_ATTENTION_FUNCTIONS, "attention_mask")):
        inner = table[impl_name]

        def wrapped(*args, inner=inner, label=label, **kwargs):
            with torch.profiler.record_function(label):
                return inner(*args, **kwargs)

        table[impl_name] = wrapped
        undo.append(lambda table=table, inner=inner: table.__setitem__(impl_name, inner))
    return lambda: [u() for u in undo]


#: ``--impls`` names that take one part of a step from one implementation and the rest from
#: another, registered by :func:`register_hybrids`: what a generate() step costs with stage C's
#: attention behind SDPA's mask function, with SDPA's attention behind the lab's mask function,
#: and with no attention at all (the query handed back as the output: every other cost of the step)
HYBRIDS = ("c+sdpa_mask", "sdpa+lab_mask", "no_attention")


def register_hybrids() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    from stages import hf

    def no_attention(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    for name, attention, mask in (("c+sdpa_mask", hf.attention_forward("c"), sdpa_mask),
                                  ("sdpa+lab_mask", sdpa_attention_forward, hf.lab_mask),
                                  ("no_attention", no_attention, sdpa_mask)):
        AttentionInterface.register(name, attention)
        AttentionMaskInterface.register(name, mask)


def implementation(impl: str) -> str:
    return impl if impl in HYBRIDS else G.attn_implementation(impl)


#: ``--cache``: transformers' growing cache, or a static one (its step compiled and CUDA-graphed on a GPU)
CACHE = {"cache": "dynamic"}


def greedy(model, prompt, new_tokens: int):
    """One greedy ``generate()`` of ``new_tokens`` tokens with :data:`CACHE`'s cache, as ``harness
    generate`` times it."""
    options = {"cache_implementation": "static"} if CACHE["cache"] == "static" else {}
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, num_beams=1,
                              pad_token_id=model.config.eos_token_id, **options)


def profile_generate(model, prompt, new_tokens: int, on_gpu: bool):
    from torch.profiler import ProfilerActivity, profile

    def run():
        return greedy(model, prompt, new_tokens)

    run()  # warm: compiles, plans, caches
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    G._sync(on_gpu)
    with profile(activities=activities) as prof:
        _, ms, _ = G.timed_call(run, on_gpu)
    return prof, ms


def summarize(prof, ms: float, new_tokens: int, on_gpu: bool) -> tuple[str, dict]:
    kernels = collections.Counter()
    kernel_us = collections.Counter()
    attention_cpu_us = mask_cpu_us = 0.0
    for e in prof.events():
        if on_gpu and e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += 1
            kernel_us[e.name] += e.device_time
        elif e.name == "attention_forward":
            attention_cpu_us += e.cpu_time_total
        elif e.name == "attention_mask":
            mask_cpu_us += e.cpu_time_total
    gpu_ms = sum(kernel_us.values()) / 1e3
    lines = [f"  wall {ms / new_tokens:.3f} ms per token; GPU kernels {sum(kernels.values()) / new_tokens:.1f} per "
             f"token, {gpu_ms / new_tokens:.3f} ms of GPU time per token; attention calls' CPU time "
             f"{attention_cpu_us / 1e3 / new_tokens:.3f} ms per token; the mask builder's "
             f"{mask_cpu_us / 1e3 / new_tokens:.3f} ms per token"]
    return "\n".join(lines), {name: (kernels[name] / new_tokens, kernel_us[name] / new_tokens) for name in kernels}


def python_profile(model, prompt, new_tokens: int, top: int) -> str:
    """cProfile of one generate(): the Python functions with the most time of their own (the host
    path's share of a host-bound decode step, function by function)."""
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    greedy(model, prompt, new_tokens)
    prof.disable()
    return python_top(prof, top)


def python_top(prof, top: int, sort: str = "tottime", only: str | None = None, width: int | None = None) -> str:
    """A cProfile's table, indented: the ``top`` Python functions with the most time of their own
    (``sort="cumulative"``: with their callees); ``only``: a regular expression the file names must
    match; ``width``: lines cut to that many characters."""
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats(sort)
    if only:
        stats.print_stats(only, top)
    else:
        stats.print_stats(top)
    body = out.getvalue().strip().splitlines()
    start = next((i for i, line in enumerate(body) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join("    " + line[:width] for line in body[start:])


class GcClock:
    """Python's garbage collections while it is installed: per generation, how many ran and the ms
    they took (``gc.callbacks``). A decode step is host-bound, and a collection of the oldest
    generation walks every live Python object (the model's modules, transformers' and torch's own):
    an impl that allocates more container objects per call triggers such walks more often."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.ms = [0.0, 0.0, 0.0]
        self._t0 = None

    def __call__(self, phase, info):
        import time

        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            g = info["generation"]
            self.count[g] += 1
            self.ms[g] += (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def __enter__(self):
        import gc

        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc

        gc.callbacks.remove(self)


def rounds(model, prompt, new_tokens: int, impls: list[str], n: int, on_gpu: bool, gc_mode: str = "on") -> str:
    """Wall ms of ``n`` generate() calls per impl, in turns, the turn order reversed every round (so
    neither impl always follows the other): median and min per impl, and Python's garbage
    collections during the calls (:class:`GcClock`). ``gc_mode``: "on" (Python's default), "frozen"
    (``gc.freeze()`` after a full collection first: the model and everything alive then is never
    walked again) or "off" (``gc.disable()`` during the rounds)."""
    import gc
    import statistics

    times = {impl: [] for impl in impls}
    clocks = {impl: GcClock() for impl in impls}
    gc.collect()
    if gc_mode == "frozen":
        gc.freeze()
    if gc_mode == "off":
        gc.disable()
    try:
        for r in range(n):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
                model.set_attn_implementation(implementation(impl))
                with clocks[impl]:
                    _, ms, _ = G.timed_call(lambda: greedy(model, prompt, new_tokens), on_gpu)
                times[impl].append(ms)
    finally:
        gc.enable()
        if gc_mode == "frozen":
            gc.unfreeze()
    lines = []
    for impl, t in times.items():
        c = clocks[impl]
        lines.append(f"    {impl}: median {statistics.median(t):.1f} ms, min {min(t):.1f}, max {max(t):.1f} "
                     f"({n} calls; {statistics.median(t) / new_tokens:.3f} ms per token); garbage collections "
                     f"per call by generation {c.count[0] / n:.1f}/{c.count[1] / n:.2f}/{c.count[2] / n:.2f}, "
                     f"{sum(c.ms) / n:.2f} ms per call (oldest generation {c.ms[2] / n:.2f})")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2,llama")
    ap.add_argument("--impls", default="c,sdpa", help="stages by name, transformers' own (sdpa, eager) and "
                    f"the hybrids {', '.join(HYBRIDS)}")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--cache", default="dynamic", choices=G.CACHES,
                    help="transformers' growing cache (default) or a static one, its step compiled and CUDA-graphed")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per model (by launches per token)")
    ap.add_argument("--rounds", type=int, default=0, help="then time this many generate() calls per impl in turns")
    ap.add_argument("--gc", default="on", choices=("on", "frozen", "off"),
                    help="Python's garbage collector during --rounds: on (default), frozen (gc.freeze() first) or off")
    ap.add_argument("--python", type=int, default=0, metavar="TOP",
                    help="then a cProfile of one generate() per impl: the TOP functions by own time")
    args = ap.parse_args()
    CACHE["cache"] = args.cache
    from stages import hf

    hf.register()
    register_hybrids()
    on_gpu = torch.cuda.is_available()
    shapes, sizes = (G.GPU_SHAPES, G.GPU_SIZES) if on_gpu else (G.TINY_SHAPES, G.TINY_SIZES)
    new_tokens = args.new_tokens or sizes.new_tokens
    device = "cuda" if on_gpu else "cpu"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    print(f"{torch.cuda.get_device_name() if on_gpu else 'CPU (Triton interpreter: not GPU times)'}; "
          f"batch {sizes.batch}, prompt {sizes.prompt_len}, {new_tokens} new tokens, {dtype}, {args.cache} cache")
    for name in args.model.split(","):
        shape = shapes[name]
        model = G.build_model(shape, sizes, dtype, device, seed=0)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, model.config.vocab_size, (sizes.batch, sizes.prompt_len), generator=g).to(device)
        print(f"\n{name}: {shape.describe()}")
        per_impl = {}
        for impl in args.impls.split(","):
            model.set_attn_implementation(implementation(impl))
            undo = timed_attention(implementation(impl))
            try:
                prof, ms = profile_generate(model, prompt, new_tokens, on_gpu)
            finally:
                undo()
            text, per_impl[impl] = summarize(prof, ms, new_tokens, on_gpu)
            print(f" {impl}:\n{text}")
        if on_gpu:
            names = sorted({k for v in per_impl.values() for k in v},
                           key=lambda k: -max(v.get(k, (0, 0))[0] for v in per_impl.values()))[:args.top]
            print("  kernels, launches per token (µs of GPU time per token): " + " | ".join(args.impls.split(",")))
            for k in names:
                cells = [f"{per_impl[i].get(k, (0, 0))[0]:5.1f} ({per_impl[i].get(k, (0, 0))[1]:7.1f})"
                         for i in args.impls.split(",")]
                print(f"    {k[:70]:70} " + " | ".join(cells))
        impls = args.impls.split(",")
        if args.rounds:
            print(f"  generate() wall time, {args.rounds} rounds in turns, garbage collector {args.gc}:")
            print(rounds(model, prompt, new_tokens, impls, args.rounds, on_gpu, args.gc))
        for impl in impls if args.python else ():
            model.set_attn_implementation(implementation(impl))
            print(f"  cProfile of one generate(), {impl}:")
            print(python_profile(model, prompt, new_tokens, args.python))
        del model
        G.free_memory()
    return 0


if __name__ == "__main__":
    sys.exit(main())
