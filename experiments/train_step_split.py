"""Where a training step's time goes, stage C against SDPA: ``harness train``'s model (4 layers, 8 query / 2 KV
heads of 64, context 1024, batch 16, bf16), each step split on the host's clock.

``harness train`` times each step between two synchronizations, the stages taking their steps in turns. Its
eager step reads stage C 0.89-0.94x of SDPA's speed (results pages), a gap of 0.7-1.4 ms a step that the
attention's own host time (about 30 µs a layer more than cuDNN's, performance-log entry 90) cannot explain,
and ``experiments/train_profile.py`` once read the order reversed when each stage took its steps alone. So
each step here is cut where the host reaches each point (nothing waits for the GPU between them):

* ``forward``: the loss's forward issued; ``backward``: ``loss.backward()`` returned (autograd ran every
  node); ``optimizer``: clipping and AdamW issued; ``tail``: from there until the GPU is done (the loss read);
* eager only, per layer, the attention's own share: its forward call on the host, and its backward node
  (from the moment the output's gradient is ready to the moment q's is, both read in gradient hooks);
* the caching allocator's device allocations and frees during the step and its retries (a ``cudaMalloc``
  or ``cudaFree`` inside a step can stall it: a free synchronizes the device).

Three phases: the stages in turns, step by step (as ``harness train`` ran them); in turns by blocks of
``--block`` steps, the first step of each block (right after the other model's) apart from the rest; then each
stage's steps one after another ("alone", where the host's pace may drift between the stages' stretches: the
optimizer's share, the same work for every stage, shows by how much). Medians over the steps. GPU only.

    python experiments/train_step_split.py
    python experiments/train_step_split.py --steps 60 --compile inductor
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from harness import train as T  # noqa: E402

#: the columns of one step's record, in ms (``allocs``/``frees``/``retries``: counts)
FIELDS = ("step", "forward", "backward", "optimizer", "tail", "attn_fwd", "attn_bwd", "allocs", "frees", "retries")


class AttentionClock:
    """The attention function of a stage, timed on the host: its forward calls, and (with gradients) its
    backward node, from the output's gradient hook to q's."""

    def __init__(self, attention):
        self.attention = attention
        self.fwd_s = 0.0
        self.bwd_s = 0.0
        self._grad_ready = []

    def reset(self) -> None:
        self.fwd_s = self.bwd_s = 0.0
        self._grad_ready.clear()

    def __call__(self, q, k, v, *, causal=False, sm_scale=None):
        start = time.perf_counter()
        o = self.attention(q, k, v, causal=causal, sm_scale=sm_scale)
        self.fwd_s += time.perf_counter() - start
        if o.requires_grad and q.requires_grad:
            o.register_hook(self._output_grad)
            q.register_hook(self._query_grad)
        return o

    def _output_grad(self, grad):
        self._grad_ready.append(time.perf_counter())

    def _query_grad(self, grad):
        if self._grad_ready:  # (layers' backward nodes run one after another: last in, first out)
            self.bwd_s += time.perf_counter() - self._grad_ready.pop()


def _alloc_counts() -> tuple[int, int, int]:
    s = torch.cuda.memory_stats()
    return s.get("num_device_alloc", 0), s.get("num_device_free", 0), s.get("num_alloc_retries", 0)


def split_step(trainer, clock: AttentionClock | None, step: int) -> dict:
    """One optimizer step of ``trainer`` (``harness.train._StageTrainer.step``, as ``harness train`` takes it),
    cut where its marks fall."""
    if clock is not None:
        clock.reset()
    a0, f0, r0 = _alloc_counts()
    marks: list[float] = []
    trainer.step(step, marks)
    t0, t1, t2, t3, t4 = marks
    a1, f1, r1 = _alloc_counts()
    ms = lambda s: s * 1e3  # noqa: E731
    return dict(step=ms(t4 - t0), forward=ms(t1 - t0), backward=ms(t2 - t1), optimizer=ms(t3 - t2), tail=ms(t4 - t3),
                attn_fwd=ms(clock.fwd_s) if clock else float("nan"), attn_bwd=ms(clock.bwd_s) if clock else float("nan"),
                allocs=a1 - a0, frees=f1 - f0, retries=r1 - r0)


def summary(records: list[dict]) -> dict:
    return {f: statistics.median(r[f] for r in records) for f in FIELDS}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="c,sdpa")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40, help="steps per stage in each phase")
    ap.add_argument("--block", type=int, default=5, help="steps a stage takes in a row in the blocks phase")
    ap.add_argument("--compile", choices=list(T.COMPILE_MODES), default="off",
                    help="as harness train's --compile (compiled: no per-layer attention split)")
    args = ap.parse_args(argv)
    for option in ("warmup", "steps", "block"):
        if getattr(args, option) < 1:
            ap.error(f"--{option} must be >= 1, got {getattr(args, option)}")
    names = args.stages.split(",")
    choices = T.trainable_stage_names()
    unknown = [n for n in names if n not in choices]
    if unknown:
        ap.error(f"--stages: unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
    if not torch.cuda.is_available():
        print("error: train_step_split.py splits GPU training steps; no CUDA GPU here", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    blocks = -(-args.steps // args.block)
    cfg = T.TrainConfig(steps=args.warmup + (1 + len(names)) * args.steps + blocks * args.block + 1,
                        compile=args.compile)
    batches = T._Batches(T.GPU_MODEL, cfg, device)
    clocks = {n: AttentionClock(T.attention_for(n)) if args.compile == "off" else None for n in names}
    trainers = {n: T._StageTrainer(n, clocks[n] or T.attention_for(n), T.GPU_MODEL, cfg, device, batches)
                for n in names}
    print(f"model {T.GPU_MODEL}, batch {cfg.batch}, compile {cfg.compile}, {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    step = 0
    for _ in range(args.warmup):
        for n in names:
            split_step(trainers[n], clocks[n], step)
        step += 1
    phases = {phase: {n: [] for n in names} for phase in ("in turns", "block, 1st", "block, rest", "alone")}
    for i in range(args.steps):
        for n in names[i % len(names):] + names[:i % len(names)]:
            phases["in turns"][n].append(split_step(trainers[n], clocks[n], step))
        step += 1
    for b in range(blocks):
        for n in names[b % len(names):] + names[:b % len(names)]:
            for j in range(args.block):
                phases["block, 1st" if j == 0 else "block, rest"][n].append(
                    split_step(trainers[n], clocks[n], step + j))
        step += args.block
    for n in names:
        for _ in range(args.steps):
            phases["alone"][n].append(split_step(trainers[n], clocks[n], step))
            step += 1
    layers = T.GPU_MODEL.n_layer
    print(f"medians over each phase's steps ({args.steps} a stage; blocks of {args.block}), ms (attention: the {layers} "
          f"layers' sum; counts: per step)")
    print(f"{'phase':>11} {'stage':>6} " + " ".join(f"{f:>9}" for f in FIELDS))
    for phase, runs in phases.items():
        for n in names:
            s = summary(runs[n])
            print(f"{phase:>11} {n:>6} " + " ".join(f"{s[f]:9.3f}" if f not in ("allocs", "frees", "retries")
                                                  else f"{s[f]:9.1f}" for f in FIELDS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
