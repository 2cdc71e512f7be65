"""How the warp-specialized forward is launched: how many persistent programs (one per SM, or the
fewest that keep the same number of work items per program), and whether as a programmatic dependent
launch.

A persistent program of ``hopper_ws`` deals the work items round-robin, so with ``total`` items on
``sms`` programs the longest program walks ceil(total / sms) of them. The model suite's ``short`` cell
(2,048 heads of 128 tokens: 2,048 one-tile items) gives 69 of an H100's 132 programs 16 items and 63 of
them 15; the last round runs on half the SMs. ceil(total / ceil(total / sms)) programs (128 there) walk
16 items each: the same longest program, every SM busy to the end, four SMs idle throughout. Which is
faster depends on whether the last round's half of the SMs can still draw the memory bandwidth a
read-bound call needs, which this measures rather than assumes.

A kernel launched the ordinary way starts once the kernel before it in the stream has finished and the
GPU has set the next grid up. Launched with programmatic stream serialization (``hopper_ws.PDL``, the
default since this experiment; ``LAB_WS_PDL=0`` turns it off) its programs may be placed on the SMs,
allocate shared memory and set up their barriers while that kernel drains, and wait
(``griddepcontrol.wait``) only before touching memory. In the harness's timing an event stands between
the flush and the timed call and keeps them apart (measured: no change there); in a model the kernel
ahead is the projection that made Q, K and V, with nothing between. So a third timing, ``chain``, mimics
that: a copy kernel writes Q, then the attention runs, 50 times between two events (the copy's own time
is in every variant's number alike).

Per cell (the model suite's, by name, where the warp-specialized kernel runs), in rounds of turns, each
timed eagerly and on the GPU alone (CUDA-graph replay: a graph of one kernel starts after the flush has
ended, so there a programmatic launch has nothing to overlap), the harness's reading flush before every
repetition:

* ``sms``: stage C's kernel and config, one program per SM, launched the ordinary way;
* ``balanced``: the same kernel and config, the grid cut to the fewest programs with the same longest walk;
* ``pdl``, ``balanced+pdl``: the same two, launched as programmatic dependent launches;
* ``one-per-item``: the chosen config without the persistent grid (one program per item, the hardware's
  scheduler dealing them), where that config exists;
* cuDNN (SDPA's backend) beside them.

    python experiments/ws_launch.py --cells short,bert-base,vit-l,gpt2 --csv <file>
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
from harness import timing  # noqa: E402
from harness.inputs import make_inputs  # noqa: E402
from harness.peers import peer_attention  # noqa: E402
from harness.suites import SUITES  # noqa: E402
from stages.c_optimized import hopper_ws  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import num_sms  # noqa: E402
from stages.contract import Problem  # noqa: E402

VARIANTS = ("sms", "balanced", "pdl", "balanced+pdl", "one-per-item", "cudnn")
HOW = ("eager", "graph", "chain")


def chain_ms(fn, q, fresh_q, calls: int = 50, repeats: int = 5) -> list[float]:
    """ms per (copy into q, call) pair, ``calls`` pairs back to back between two events, ``repeats``
    times: the attention right behind the kernel that wrote its input, as in a model."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(repeats):
        timing.flush_l2()
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            q.copy_(fresh_q)
            fn()
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return out


def balanced_programs(units: int, sms: int) -> int:
    """The fewest programs whose round-robin deal gives no program more than ceil(units / sms) units."""
    per_program = -(-units // sms)
    return -(-units // per_program)


class _GridRule:
    """``hopper_ws.runtime_args`` with the persistent grid cut to :func:`balanced_programs` while on."""

    def __init__(self) -> None:
        self.original = hopper_ws.runtime_args
        self.balanced = False

    def __call__(self, *args, **kwargs):
        grid, ints = self.original(*args, **kwargs)
        if self.balanced and kwargs.get("persistent"):
            total = ints[-1]
            grid = (balanced_programs(hopper_ws.work_units(total, kwargs["causal"], True), kwargs["num_sms"]),)
        return grid, ints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="short", help="model-suite cells by name, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of turns (default 5)")
    ap.add_argument("--csv", help="also write one row per (cell, variant, round) here")
    args = ap.parse_args(argv)
    suite = {c.name: c for c in SUITES["models"]}
    names = [n for n in args.cells.split(",") if n]
    unknown = [n for n in names if n not in suite]
    if unknown:
        ap.error(f"--cells: unknown cell(s) {', '.join(unknown)}; choose from {', '.join(suite)}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("error: this experiment times kernels on a CUDA GPU; none here", file=sys.stderr)
        return 2
    rule = _GridRule()
    hopper_ws.runtime_args = rule
    pdl_default = hopper_ws.PDL
    sms = num_sms(torch.device("cuda"))
    cudnn = peer_attention("sdpa_cudnn")
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; µs per call, eager (events around each call) and on the GPU "
          f"alone (graph replay), the harness's reading flush before each; medians over rounds")
    for name in names:
        c = suite[name]
        p = Problem(c.B, c.Hq, c.Nq, c.D, c.dtype, c.causal, c.Hkv, c.Nk)
        q, k, v = make_inputs(p, "cuda")
        choice = ck.select(c.B, c.Hq, c.Hkv, c.Nq, c.Nk, c.D, q.dtype, c.causal, 90, sms)
        if choice.path != "ws" or not choice.config.persistent:
            print(f"{name}: runs {choice.path}:{choice.config}, not the persistent warp-specialized kernel; skipped")
            continue
        one_per_item = replace(choice.config, persistent=False, deep_q=False)

        def variant(kind: str):
            if kind == "cudnn":
                return lambda: cudnn(q, k, v, causal=c.causal)
            if kind == "one-per-item":
                return lambda: ck.attention(q, k, v, causal=c.causal, config=one_per_item)
            return lambda: ck.attention(q, k, v, causal=c.causal)

        grid, ints = rule.original(c.B, c.Hq, c.Nq, q.stride(), causal=c.causal, consumers=choice.config.consumers,
                                   persistent=True, num_sms=sms)
        units = hopper_ws.work_units(ints[-1], c.causal, True)
        print(f"\n{name}: {choice.config}, {units} units of work, grid {grid[0]} -> "
              f"{balanced_programs(units, sms)} balanced", flush=True)
        fresh_q = q.clone()  # (the chain's copy rewrites Q with the same values: every variant sees the same input)
        times = {(kind, how): [] for kind in VARIANTS for how in HOW}
        for r in range(args.rounds):
            for kind in VARIANTS:
                rule.balanced = kind.startswith("balanced")
                hopper_ws.PDL = kind.endswith("pdl")
                ck._recipe.cache_clear()  # (PDL is part of the kernel's recipe: its constants and launch options)
                ck._LAYOUT_PLANS.clear()  # (the grid is part of a layout's kept plan)
                if r == 0 and kind != "cudnn":  # (the same kernel's arithmetic: every variant's O the same bits)
                    out = variant(kind)()
                    if kind == "sms":
                        reference = out
                    same = bool(torch.equal(out, reference))
                    print(f"  {kind}: O {'the same bits as' if same else 'DIFFERS from'} the default launch's",
                          flush=True)
                for how in HOW:
                    try:
                        if how == "chain":
                            samples = chain_ms(variant(kind), q, fresh_q)
                        elif how == "eager":
                            fn = variant(kind)
                            fn()
                            samples = timing.samples_gpu(fn, 50, 60)
                        else:
                            samples = timing.samples_graph(lambda: variant(kind), 50, 60)
                        us, status = timing.summarize(samples, True).ms_median * 1e3, "ok"
                    except Exception as e:  # a config that does not run here: recorded, the rest go on
                        us, status = float("nan"), f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    times[kind, how].append(us)
                    rows.append(dict(cell=name, variant=kind, timing=how, round=r, us=f"{us:.3f}", status=status))
        rule.balanced = False
        hopper_ws.PDL = pdl_default
        ck._recipe.cache_clear()
        ck._LAYOUT_PLANS.clear()
        for kind in VARIANTS:
            line = "  ".join(f"{how} {statistics.median(times[kind, how]):8.2f} µs" for how in HOW)
            rounds = " ".join(f"{t:.2f}" for t in times[kind, "eager"])
            print(f"  {kind:13} {line}   eager rounds: {rounds}", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    hopper_ws.runtime_args = rule.original
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["cell", "variant", "timing", "round", "us", "status"])
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
