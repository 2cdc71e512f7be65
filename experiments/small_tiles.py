"""Small work items, two programs to an SM: the warp-specialized forward with one consumer warpgroup (64
query rows per item) and a persistent grid of two programs per SM (``-P2`` configs,
``hopper_ws.register_budget``), against the kernel stage C chooses and cuDNN.

Why. On a call whose every item is one K/V tile (the model suite's ``short``: 2,048 heads of 128 tokens),
a program loads Q, K and V, runs two products and a softmax on one tile and stores O, then does it again.
The persistent kernel overlaps an item's loads with the one before it through its Q double buffer and K/V
ring, but one program's consumers still wait on every item's first tile. cuDNN's kernel for such calls
(its name says so) runs 64-row tiles of one warpgroup, several programs to an SM: while one waits on its
loads, another computes. Ours can do the same without a new kernel: one consumer (``WS-M64-...``) takes
a 64-row tile, and halving the register pool (``maxnreg`` 128: the producer warp 24 registers a thread,
the consumer the other 232) and fitting the shared memory twice lets two programs share an SM.

Per cell (the model suite's, by name), in rounds of turns, each timed eagerly and on the GPU alone
(CUDA-graph replay), the harness's reading flush before every repetition; each config's output checked
against a float64 reference first:

* ``chosen``: the config stage C picks for the cell;
* ``WS-M64-N128-s3-P``: one consumer, one program per SM (the ``-P2`` configs' one-program twin);
* ``WS-M64-N128-s3-P2``, ``WS-M64-N128-s2-P2``, ``WS-M64-N64-s3-P2``: two programs per SM, and
  ``WS-M64-N128-s2-P2-Q3`` with each Q fetched two items ahead (``hopper_ws.q_buffers``), as stage C
  runs ``short`` with two consumers;
* ``cudnn``: SDPA's cuDNN backend.

A config that does not fit the cell's head dim (shared memory) is recorded as skipped.

    python experiments/small_tiles.py --cells short,tiny,vit-l,bert-base,gpt2,odd-n --csv <file>
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import stages  # noqa: E402,F401  (before triton)
import turns  # noqa: E402  (experiments/turns.py)
from harness.peers import peer_attention  # noqa: E402
from harness.reference import reference_attention, rel_err  # noqa: E402
from stages.c_optimized import configs  # noqa: E402
from stages.c_optimized import kernels as ck  # noqa: E402

CONFIGS = ("WS-M64-N128-s3-P", "WS-M64-N128-s3-P2", "WS-M64-N128-s2-P2", "WS-M64-N128-s2-P2-Q3", "WS-M64-N64-s3-P2")
HOW = ("eager", "graph")


def main(argv=None) -> int:
    parsed = turns.parse(__doc__.splitlines()[0], rounds=3, argv=argv)
    if parsed is None:
        return 2
    args, cells = parsed
    sms = configs.num_sms(torch.device("cuda"))
    cudnn = peer_attention("sdpa_cudnn")
    rows = []
    turns.header(sms)
    for c in cells:
        name = c.name
        q, k, v, choice = turns.cell_inputs(c, sms)
        variants = {"chosen": lambda: ck.attention(q, k, v, causal=c.causal),
                    "cudnn": lambda: cudnn(q, k, v, causal=c.causal)}
        status = {}
        for text in CONFIGS:
            config = configs.Config.parse(text)
            if c.Nq != c.Nk:
                status[text] = "skipped: the warp-specialized kernel needs Nq == Nk"
            elif not configs.fits(config, c.D, q.element_size(), 90):
                status[text] = "skipped: does not fit shared memory at this head dim"
            else:
                variants[text] = (lambda cfg: lambda: ck.attention(q, k, v, causal=c.causal, config=cfg))(config)
        print(f"\n{name} (B {c.B}, H {c.Hq}/{c.Hkv}, N {c.Nq}/{c.Nk}, D {c.D}, causal {int(c.causal)}): chosen "
              f"{choice.path}:{choice.config}", flush=True)
        for text, why in status.items():
            print(f"  {text}: {why}")
            rows.append(dict(cell=name, variant=text, timing="", round="", us="", status=why))
        ref = reference_attention(q, k, v, causal=c.causal)
        for kind, fn in list(variants.items()):
            try:
                print(f"  {kind}: error against float64 {rel_err(fn(), ref):.2e}", flush=True)
            except Exception as e:  # a config that does not run here: recorded, the rest go on
                del variants[kind]
                print(f"  {kind}: {turns.failure(e, 160)}", flush=True)
                rows.append(dict(cell=name, variant=kind, timing="", round="", us="", status=turns.failure(e, 160)))
        del ref
        times = {(kind, how): [] for kind in variants for how in HOW}
        for r in range(args.rounds):
            for kind, fn in variants.items():
                for how in HOW:
                    us, state = turns.median_us(turns.eager_or_graph(fn, how))
                    times[kind, how].append(us)
                    rows.append(dict(cell=name, variant=kind, timing=how, round=r, us=f"{us:.3f}", status=state))
        turns.print_medians(times, variants, HOW, width=19)
        del q, k, v
        torch.cuda.empty_cache()
    turns.write_rows(args.csv, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
