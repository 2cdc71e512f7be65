"""What one decode step's attention mask costs in operations, per implementation: the aten operations
transformers' ``create_masks_for_generate`` dispatches in a greedy ``generate()`` with a static cache
(which builds the step's mask eagerly, outside the compiled step: each operation is a launch on a
GPU), views left out, and how many of them write a key's worth of elements or more. Stage C's key
ranges are counted both ways: the one-kernel path (``stages/key_ranges.py``; the kernel itself does
not go through aten and is counted apart) and the tensor operations a traced call takes.

    python experiments/mask_operations.py                      # GPT-2 shape, batch 4, 128 + 64 tokens
    python experiments/mask_operations.py --model llama --batch 8

Runs on a CPU in a few minutes (counts, not times: the interpreter runs the kernels there); the model is
random and small, since only the mask's shapes matter.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stages  # noqa: E402,F401  # (first: it chooses the interpreter on a machine without a GPU)
import torch  # noqa: E402

from harness.op_count import DeviceOperations, key_ranges_launches  # noqa: E402
from stages import key_ranges  # noqa: E402


def model_for(kind: str):
    import transformers

    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                                                    n_positions=1024))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024))


def count_step(model, impl: str, prompt, new_tokens: int, kernel: bool) -> tuple[list, int]:
    """(operations of the second decode step's mask, Triton launches of the key-ranges kernel)."""
    import transformers.generation.utils as generation
    from transformers import masking_utils

    real_builder, real_can_run = masking_utils.create_masks_for_generate, key_ranges.kernel_can_run
    steps, launches = [], []

    def builder(*args, **kwargs):
        before = len(launched)
        with DeviceOperations() as ops:
            out = real_builder(*args, **kwargs)
        steps.append(ops.ops)
        launches.append(len(launched) - before)
        return out

    generation.create_masks_for_generate = builder
    if not kernel:
        key_ranges.kernel_can_run = lambda *args: False
    try:
        model.set_attn_implementation(impl)
        with torch.no_grad(), key_ranges_launches() as launched:
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, cache_implementation="static",
                           disable_compile=True)
    finally:
        generation.create_masks_for_generate = real_builder
        key_ranges.kernel_can_run = real_can_run
    return steps[2], launches[2]  # (0: the prefill; 1: the first decode step)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2", choices=("gpt2", "llama"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64, help="the static cache holds prompt + new tokens")
    args = ap.parse_args()
    if min(args.batch, args.prompt) < 1 or args.new_tokens < 3:
        ap.error("--batch and --prompt must be at least 1 and --new-tokens at least 3")
    from stages import hf

    hf.register(["c"])
    model = model_for(args.model).eval()
    prompt = torch.randint(1, 128, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    slots = args.prompt + args.new_tokens
    print(f"{args.model}, batch {args.batch}, static cache of {slots} slots: one decode step's mask")
    print("| the step's mask | aten operations | of them writing >= the keys' count of elements | kernels |")
    print("|---|--:|--:|--:|")
    for label, impl, kernel in (("SDPA's (sdpa_mask)", "sdpa", True),
                                ("stage C's key ranges, tensor operations", "lab_c", False),
                                ("stage C's key ranges, one kernel", "lab_c", True)):
        ops, launches = count_step(model, impl, prompt, args.new_tokens, kernel)
        big = sum(n >= slots for _, n in ops)
        names = ", ".join(f"{k} {v}" for k, v in collections.Counter(name for name, _ in ops).most_common())
        print(f"| {label} | {len(ops)} | {big} | {launches} |    ({names})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
