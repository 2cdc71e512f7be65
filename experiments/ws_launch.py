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

import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import turns  # noqa: E402  (experiments/turns.py)
from harness import timing  # noqa: E402
from harness.peers import peer_attention  # noqa: E402
from stages.c_optimized import hopper_ws  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402
from stages.c_optimized.configs import num_sms  # noqa: E402

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
    parsed = turns.parse(__doc__.splitlines()[0], rounds=5, argv=argv)
    if parsed is None:
        return 2
    args, cells = parsed
    rule = _GridRule()
    hopper_ws.runtime_args = rule
    pdl_default = hopper_ws.PDL
    sms = num_sms(torch.device("cuda"))
    cudnn = peer_attention("sdpa_cudnn")
    rows = []
    turns.header(sms)
    for c in cells:
        name = c.name
        q, k, v, choice = turns.cell_inputs(c, sms)
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
                    fn = variant(kind)
                    samples = (lambda: chain_ms(fn, q, fresh_q)) if how == "chain" else turns.eager_or_graph(fn, how)
                    us, status = turns.median_us(samples)
                    times[kind, how].append(us)
                    rows.append(dict(cell=name, variant=kind, timing=how, round=r, us=f"{us:.3f}", status=status))
        rule.balanced = False
        hopper_ws.PDL = pdl_default
        ck._recipe.cache_clear()
        ck._LAYOUT_PLANS.clear()
        turns.print_medians(times, VARIANTS, HOW)
        del q, k, v
        torch.cuda.empty_cache()
    hopper_ws.runtime_args = rule.original
    turns.write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
