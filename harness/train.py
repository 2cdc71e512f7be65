"""Train a small GPT with each stage's attention and check that the loss curves agree.

``python -m harness train --stages a,b,c,sdpa`` (or ``--stage c``) is the end-to-end check of the
backward passes. A decoder-only transformer (nanoGPT's shape: token and position embeddings,
pre-LayerNorm blocks of causal self-attention and an MLP, an LM head tied to the token embedding)
learns a small generated language, one model per attention implementation, all from the same initial
weights and on the same batches. If a stage's forward or backward is wrong the model notices:
a leak of future tokens drives the loss far below the others, a wrong gradient makes it learn slower.
So the loss curves of A, B, C and SDPA must agree, within a tolerance that only rounding explains
(:data:`LOSS_TOLERANCE`), and the run records what each costs per step: time, tokens/s, peak memory.

The implementations train in lockstep (:func:`train_lockstep`): every model, optimizer and the
batches are set up first, then at each step every implementation takes its step in turn, the first
of the turn rotating from step to step, and each step is timed on its own (``--block k``: turns of k
steps each, a block's first step, right after another model's, left out of the median). Trained one after the
other, the stages' step times measured *when* each ran (on the H200 they drifted by half during a
run); timed in turns, a drift of the clocks, the temperature or the host's load hits every stage
alike. Peak memory is still each stage's own (how, with every model resident: :func:`train_lockstep`).
A stage that fails (an out-of-memory, a kernel error) is marked so and the others go on.

Every attention call goes through ``attention(q, k, v, causal=True)`` of the chosen stage with q
``[B, Hq, N, D]`` and k, v ``[B, Hkv, N, D]`` as strided views of the projections (no copies), and
with fewer key/value heads than query heads by default (grouped-query attention, as Llama and Mistral
use), so the GQA backward (dK, dV summed over each head group) does real work.

Output, per run: ``<out>/train/losses.csv`` (run_id, stage, dtype, step, loss, step_ms),
``<out>/train/summary.csv`` (one row per stage: the config, median step time in ms, tokens/s, peak
memory of a training step in bytes, final loss, largest loss gap to the reference stage),
``<out>/train/env.json`` (provenance) and ``<out>/figures/train_loss.png``. ``<out>`` defaults to
``results/<gpu>/`` on a GPU and to a fresh temporary directory on a CPU, where the stages run in the
Triton interpreter with a tiny model (seconds per stage for B and C, a minute or two for A, whose
kernels the interpreter runs slowest) and the times are interpreter times, not GPU times.

Compiled steps (``--compile inductor`` or ``--compile cudagraphs``): each stage's forward and loss go
through ``torch.compile(fullgraph=True)``, so AOTAutograd builds the backward and the attention is one
custom-op node in each graph (``stages/ops.py``); ``cudagraphs`` (Inductor's ``reduce-overhead`` mode)
also replays forward and backward as CUDA graphs. Eager, a small model's step is paid on the host, and a
stage whose autograd node is Python pays more per layer than SDPA's C++ node (docs/performance-log/backward.md,
entry 57); compiled, one node runs the whole backward and, with CUDA graphs, no Python runs per layer at
all, so the step times say what the kernels cost. The optimizer step stays eager in every mode.

``python -m harness train --plot results/h200`` redraws the figure from the CSV without training.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

#: the reference implementation every stage's loss curve is compared with
REFERENCE = "sdpa"

#: How far (in nats) a stage's loss may stray from the reference's at any step, by the attention's dtype.
#: Same weights, same batches: only rounding separates two correct implementations, and training
#: amplifies it step by step. Measured on a CPU with the tiny model at lr 1e-2, SDPA against a textbook
#: softmax(QKᵀ)V written in torch ops: fp32, the largest gap over 100 steps was 2e-6 nats; bf16 (every
#: attention output rounded to 8 significant bits), 0.13 nats over 200 steps (median gap 0.01). The
#: tolerances leave room above those: 1e-3 in fp32, 0.25 in bf16. Bugs move the loss by more: a causal
#: leak or a zeroed dV separates the curves by tenths of a nat within a few steps (tests/test_train.py
#: checks that both are caught in fp32). bf16 is therefore the realistic run and fp32 the sharp check.
LOSS_TOLERANCE: dict[str, float] = {"fp32": 1e-3, "bf16": 0.25}

#: How a step's forward and backward run: ``off`` eager; ``inductor`` ``torch.compile(fullgraph=True)``;
#: ``cudagraphs`` the same in Inductor's ``reduce-overhead`` mode (CUDA graphs; a GPU only). The value
#: is what ``torch.compile`` is given as ``mode``, None for eager.
COMPILE_MODES: dict[str, str | None] = {"off": None, "inductor": "default", "cudagraphs": "reduce-overhead"}
#: Columns added to summary.csv after files were written without them, and what an older row meant.
SUMMARY_DEFAULTS = {"compile": "off", "block": "1"}

LOSSES_CSV = "losses.csv"
SUMMARY_CSV = "summary.csv"
LOSS_FIELDS = ("run_id", "stage", "dtype", "step", "loss", "step_ms")
SUMMARY_FIELDS = ("run_id", "stage", "device", "dtype", "steps", "seed", "n_layer", "n_head", "n_kv_head",
                  "head_dim", "context", "batch", "lr", "compile", "block", "step_ms_median", "tokens_per_s",
                  "peak_memory_bytes", "first_loss", "final_loss", "reference", "max_loss_gap", "tolerance", "status")


# ------------------------------------------------------------------------------------------- the data

#: The alphabet of the generated language: a fixed vocabulary, whatever sample is drawn.
ALPHABET = "\n .+=0123456789abcdefghijklmnopqrstuvwxyz"

_ADJECTIVES = ("red", "small", "old", "quick", "quiet", "green", "tall", "lazy")
_NOUNS = ("cat", "dog", "fox", "bird", "girl", "boy", "king", "frog", "tree", "ship")
_VERBS = ("sees", "likes", "finds", "chases", "helps", "paints", "hears", "follows")


def make_corpus(n_chars: int, seed: int = 0) -> str:
    """A deterministic character-level text of about ``n_chars`` characters from a tiny language.

    Two kinds of lines: sentences from a small grammar ("the quick fox sees a red ship.") that a
    model learns from local statistics, and sums ("27+58=85.") whose answer digits can only be
    predicted by attending back to the operands, so attention has real work to do. Generated rather
    than downloaded: the lab has no network dependency and the text is the same on every machine.
    """
    if not isinstance(n_chars, int) or n_chars < 1:
        raise ValueError(f"n_chars must be a positive integer, got {n_chars!r}")
    rng = random.Random(seed)
    lines, length = [], 0
    while length < n_chars:
        if rng.random() < 0.3:
            a, b = rng.randrange(100), rng.randrange(100)
            line = f"{a}+{b}={a + b}."
        else:
            words = []
            for role in ("subject", "object"):
                words.append(rng.choice(("the", "a")))
                if rng.random() < 0.5:
                    words.append(rng.choice(_ADJECTIVES))
                words.append(rng.choice(_NOUNS))
                if role == "subject":
                    words.append(rng.choice(_VERBS))
            line = " ".join(words) + "."
        lines.append(line)
        length += len(line) + 1
    return "\n".join(lines)[:n_chars]


def encode(text: str) -> torch.Tensor:
    """Characters -> int64 token ids (indices into :data:`ALPHABET`)."""
    index = {c: i for i, c in enumerate(ALPHABET)}
    try:
        return torch.tensor([index[c] for c in text], dtype=torch.long)
    except KeyError as e:
        raise ValueError(f"text has a character outside the alphabet {ALPHABET!r}: {e.args[0]!r}") from None


def decode(ids) -> str:
    return "".join(ALPHABET[int(i)] for i in ids)


# ------------------------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class ModelConfig:
    """A small GPT. The model width is ``n_head * head_dim`` (nanoGPT's convention)."""

    n_layer: int = 4
    n_head: int = 8
    n_kv_head: int = 2      # < n_head: grouped-query attention (n_head // n_kv_head query heads per K/V head)
    head_dim: int = 64
    context: int = 1024     # tokens per sequence = the attention's N
    vocab_size: int = len(ALPHABET)

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_kv_head", "head_dim", "context", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head must be a multiple of n_kv_head, got n_head={self.n_head}, "
                             f"n_kv_head={self.n_kv_head}")

    @property
    def width(self) -> int:
        return self.n_head * self.head_dim


#: ``attention(q, k, v, causal=True) -> o``: a stage's ``attention`` or SDPA
AttentionFn = Callable[..., torch.Tensor]


class NoBackwardError(RuntimeError):
    """The attention function returned an output autograd cannot differentiate through."""


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn, attn_dtype: torch.dtype):
        super().__init__()
        self.cfg, self.attention, self.attn_dtype = cfg, attention, attn_dtype
        self.q_proj = nn.Linear(cfg.width, cfg.n_head * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.width, 2 * cfg.n_kv_head * cfg.head_dim, bias=False)
        self.out_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        H, Hkv, D = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        # [B, N, H, D] -> [B, H, N, D] as views: the kernels read the projections' memory in place
        # (strided inputs are part of the contract), as a real model would hand them over.
        q = self.q_proj(x).view(B, N, H, D).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.kv_proj(x).view(B, N, 2, Hkv, D).unbind(2))
        # The kernel gets exactly the dtype asked for, outside autocast: what is compared between
        # stages is the attention alone, not autocast's choices around it.
        with _no_autocast(x.device):
            q, k, v = (t.to(self.attn_dtype) for t in (q, k, v))
            o = self.attention(q, k, v, causal=True)
        # (Eager only: a traced output carries no grad_fn; AOTAutograd refuses an op without a backward itself.)
        if not torch.compiler.is_compiling() and torch.is_grad_enabled() and q.requires_grad and o.grad_fn is None:
            raise NoBackwardError("the attention output has no grad_fn: this attention has no backward pass "
                                  "(autograd cannot reach q, k, v through it)")
        return self.out_proj(o.transpose(1, 2).reshape(B, N, H * D).to(x.dtype))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn, attn_dtype: torch.dtype):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg, attention, attn_dtype)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` pre-LN blocks, a final LayerNorm, a tied LM head."""

    def __init__(self, cfg: ModelConfig, attention: AttentionFn, attn_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg, attention, attn_dtype) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the layers that write into the residual stream: its variance then
        # does not grow with depth.
        for block in self.blocks:
            for layer in (block.attn.out_proj, block.mlp[2]):
                nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, N]`` -> logits ``[B, N, vocab_size]``."""
        N = idx.shape[1]
        if N > self.cfg.context:
            raise ValueError(f"idx has {N} tokens per sequence, more than the context of {self.cfg.context}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(N, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok_emb.weight.T  # the LM head shares the embedding matrix


def _no_autocast(device: torch.device):
    if device.type in ("cuda", "cpu"):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------ attention choices

def sdpa_attention(q, k, v, *, causal=False, sm_scale=None):
    """PyTorch's fused attention (it picks its backend) with GQA; the reference of the loss curves.
    For Nq = Nk, as here, its top-left causal mask is the contract's bottom-right one."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def trainable_stage_names() -> list[str]:
    """The names ``--stage`` accepts: a, b, c, any other registered stage with a backward model
    that this machine can run, and ``sdpa``."""
    import stages

    names = [n for n in ("a", "b", "c") if n in stages.STAGES]
    for name, stage in stages.STAGES.items():
        has_backward = stage.bwd_hbm_bytes is not None or stage.train_workspace_bytes is not None
        if name not in names and has_backward and (torch.cuda.is_available() or not stage.requires_cuda):
            names.append(name)
    return names + [REFERENCE]


def attention_for(name: str) -> AttentionFn:
    """The attention function of stage ``name`` (or SDPA for ``'sdpa'``)."""
    if name == REFERENCE:
        return sdpa_attention
    import stages

    choices = trainable_stage_names()
    if name not in choices:
        raise ValueError(f"stage must be one of {', '.join(choices)}, got {name!r}")
    return stages.STAGES[name].attention


# --------------------------------------------------------------------------------------------- training

@dataclass(frozen=True)
class TrainConfig:
    """How to train: steps, batch (sequences per step), AdamW's learning rate, seed, attention dtype."""

    steps: int = 200
    batch: int = 16
    lr: float = 1e-3
    seed: int = 0
    dtype: str = "bf16"     # the attention's inputs; the rest of the model runs under autocast in it
    warmup: int = 10        # steps of linear learning-rate warm-up
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    compile: str = "off"    # COMPILE_MODES: eager, or the forward and backward compiled
    block: int = 1          # steps each stage takes in a row in lockstep (train_lockstep; 1: step by step)

    def __post_init__(self) -> None:
        if self.dtype not in LOSS_TOLERANCE:
            raise ValueError(f"dtype must be one of {', '.join(LOSS_TOLERANCE)}, got {self.dtype!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        for name in ("steps", "batch", "block"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite positive float, got {self.lr!r}")


#: sizes for a GPU (attention at N = 1024 is a real share of the step) and for the CPU interpreter
GPU_MODEL = ModelConfig()
GPU_TRAIN = TrainConfig()
TINY_MODEL = ModelConfig(n_layer=2, n_head=2, n_kv_head=1, head_dim=16, context=32)
TINY_TRAIN = TrainConfig(steps=15, batch=4, lr=1e-2, dtype="fp32", warmup=2)
#: ``harness train``'s steps per stage in a row (``--block``): 1, step by step. By blocks of 5, on an H100, the
#: step right after another model's cost both stages 4-9 % more than their later ones, and stage C's later
#: steps still trailed SDPA's (0.92-0.95x, performance-log entry 97): taking turns was not the gap.
DEFAULT_BLOCK = 1


@dataclass
class TrainRun:
    """One stage's training run: per-step losses and times (ms), peak memory (bytes, GPU only)."""

    stage: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    tokens_per_step: int = 0
    peak_memory_bytes: int | None = None
    status: str = "ok"
    after_switch: list[int] = field(default_factory=list)  # steps right after another stage's block

    @property
    def step_ms_median(self) -> float | None:
        """Median step time, leaving out the first steps (kernel compilation and autotuning) and, with
        blocks of steps, each block's first step, right after another model's (:func:`train_lockstep`)."""
        switches = set(self.after_switch)
        first = max(1, len(self.step_ms) // 10)
        times = [t for i, t in enumerate(self.step_ms) if i >= first and i not in switches] \
            or self.step_ms[first:] or self.step_ms
        return statistics.median(times) if times else None

    @property
    def tokens_per_s(self) -> float | None:
        ms = self.step_ms_median
        return self.tokens_per_step / (ms / 1e3) if ms else None


def batch_starts(n_tokens: int, context: int, batch: int, steps: int, seed: int) -> torch.Tensor:
    """``[steps, batch]`` start offsets of the training sequences: drawn once, the same for every stage."""
    if n_tokens < context + 2:
        raise ValueError(f"the text has {n_tokens} tokens, too few for a context of {context}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_tokens - context - 1, (steps, batch), generator=gen)


#: The CUDA caching allocator hands out blocks in multiples of this many bytes; ``memory_allocated``
#: counts the rounded sizes, so a stage's resident tensors are counted the same way.
_ALLOCATOR_BLOCK = 512


def _device_bytes(tensors, device: torch.device) -> int:
    """Bytes the caching allocator holds for ``tensors`` on ``device``: each storage once (a tied or
    viewed tensor shares its storage), rounded up to the allocator's block size."""
    storages: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device == device:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(-(-n // _ALLOCATOR_BLOCK) * _ALLOCATOR_BLOCK for n in storages.values())


class _Batches:
    """The text and the batch order, built once and shared by every stage: the same batches for all."""

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, device: torch.device):
        self.tokens = encode(make_corpus(max(20_000, 40 * model_cfg.context * cfg.batch), seed=cfg.seed)).to(device)
        self.starts = batch_starts(len(self.tokens), model_cfg.context, cfg.batch, cfg.steps, cfg.seed + 1)
        self.offsets = torch.arange(model_cfg.context + 1)

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of step ``step``, ``[batch, context]`` each."""
        seq = self.tokens[(self.starts[step][:, None] + self.offsets).to(self.tokens.device)]
        return seq[:, :-1], seq[:, 1:]


class _StageTrainer:
    """One attention implementation's model, optimizer and record, advanced one step at a time."""

    def __init__(self, stage: str, attention: AttentionFn, model_cfg: ModelConfig, cfg: TrainConfig,
                 device: torch.device, batches: _Batches):
        self.cfg, self.device, self.batches = cfg, device, batches
        self.on_gpu = device.type == "cuda"
        attn_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
        torch.manual_seed(cfg.seed)  # the same initial weights for every stage
        self.model = GPT(model_cfg, attention, attn_dtype).to(device)
        decay = [p for p in self.model.parameters() if p.dim() >= 2]  # matrices decay; gains and biases do not
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
        # bf16 needs no loss scaling (it has fp32's exponent range), so plain autocast is the whole recipe.
        self.amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16) if cfg.dtype == "bf16" \
            else contextlib.nullcontext()
        self.run = TrainRun(stage=stage, tokens_per_step=cfg.batch * model_cfg.context)
        mode = COMPILE_MODES[cfg.compile]
        if mode == "reduce-overhead" and not self.on_gpu:
            raise ValueError("compile='cudagraphs' replays CUDA graphs: it needs a CUDA device")
        # fullgraph: a graph break would leave the attention (or what surrounds it) eager, and the
        # step would not be what it says; better an error in the stage's status.
        self.forward_loss = self._forward_loss if mode is None else torch.compile(self._forward_loss, mode=mode,
                                                                                  fullgraph=True)
        self.cuda_graphs = mode == "reduce-overhead"

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.amp:
            logits = self.model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def resident_bytes(self) -> int:
        """What this stage keeps on the device between its steps: weights, gradients, AdamW's moments."""
        params = list(self.model.parameters())
        state = [t for s in self.opt.state.values() for t in s.values()]
        return _device_bytes(params + [p.grad for p in params] + state, self.device)

    def step(self, step: int, marks: list[float] | None = None) -> float:
        """Take optimizer step ``step`` (0-based), timed on its own; record its loss, time and memory.
        ``marks``: a list that gets the host's clock (``time.perf_counter``) where the timed step starts,
        where its forward, its backward and its optimizer step have been issued, and where it ends
        (``experiments/train_step_split.py`` cuts the step there)."""
        cfg, run = self.cfg, self.run
        for group in self.opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, (step + 1) / max(1, cfg.warmup))
        if self.on_gpu:
            resident = self.resident_bytes() + _device_bytes([self.batches.tokens], self.device)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        x, y = self.batches.get(step)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)  # the clock starts on an idle device
        t0 = time.perf_counter()
        # Last step's gradients go first: under CUDA graphs they live in the graphs' memory, which
        # this step's replays reuse once it begins.
        self.opt.zero_grad(set_to_none=True)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.forward_loss(x, y)
        if marks is not None:
            marks += (t0, time.perf_counter())
        loss.backward()
        if marks is not None:
            marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        if marks is not None:
            marks.append(time.perf_counter())
        loss_value = loss.item()  # waits for the GPU: the step is done when its loss is known
        if self.cuda_graphs:
            # The gradients are outputs of the backward's graph, in the pool every stage's graphs share
            # (one per device): the next stage's replays overwrite them, and reading one after that
            # (even its size, for resident_bytes) is an error. The step is done with them.
            self.opt.zero_grad(set_to_none=True)
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        if marks is not None:
            marks.append(end)
        run.step_ms.append((end - t0) * 1e3)
        run.losses.append(loss_value)
        if self.on_gpu:
            peak = resident + torch.cuda.max_memory_allocated(self.device) - before
            run.peak_memory_bytes = max(run.peak_memory_bytes or 0, int(peak))
        return loss_value


def _error_status(e: BaseException) -> str:
    first = (str(e).splitlines() or [""])[0]
    return f"error: {type(e).__name__}: {first}"[:400]


def _release(on_gpu: bool) -> None:
    """Free what a stage that stopped still held (its model, its saved tensors in a traceback)."""
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()


def train_lockstep(attentions: dict[str, AttentionFn], model_cfg: ModelConfig, cfg: TrainConfig, *,
                   device: str | torch.device = "cpu", log: Callable[[str], None] | None = None,
                   log_every: int = 0, raise_errors: bool = False) -> dict[str, TrainRun]:
    """Train one fresh :class:`GPT` per entry of ``attentions`` (stage name -> attention function), in
    lockstep, for ``cfg.steps`` steps; return each stage's :class:`TrainRun`, in the order given.

    Every stage's model, optimizer and batches are set up first: the initial weights and the batches
    depend only on ``cfg.seed``, so the models are the same and see the same data, and their loss
    curves differ only by what the attention computes. Then, step by step, every stage takes its
    step in turn, in an order that rotates (step ``i`` starts with the stage ``i mod n`` of the
    list), and each step is timed on its own between two device synchronizations. Step times of
    different stages are then measured side by side, so a drift of the clocks, the temperature or
    the host's load over the run hits every stage alike, and none is always first (or always after
    the same neighbour) in a step.

    With ``cfg.block`` > 1 the turns go by blocks of that many steps (block ``b`` starts with stage
    ``b mod n``), and the first step of each block, the one right after another model's steps, is
    recorded (``TrainRun.after_switch``) and left out of the median step time. A real training run
    steps one model after the other, and a host-bound step right after another model's pays for the
    host's caches and predictors warmed on other code (4-9 % on an H100, performance-log entry 97).

    Peak memory (GPU only): with every model resident at once, ``max_memory_allocated`` is shared,
    so each stage's is measured around its own steps: ``reset_peak_memory_stats`` just before the
    step, and the step's peak is ``max_memory_allocated`` during it minus ``memory_allocated`` before
    it (what the step adds: its batch, activations, saved tensors, new gradients, optimizer
    temporaries), plus what the stage keeps resident between steps (its weights, gradients and AdamW
    moments, counted from its tensors as the allocator rounds them) and the shared token data. The
    largest over its steps is the stage's ``peak_memory_bytes``: the peak of a training step of that
    stage as if it trained alone. Memory of the process that no stage owns (cuBLAS's workspace, other
    stages' models) is not counted.

    A stage that fails (an exception at set-up or in a step: an out-of-memory, a kernel error, no
    backward) gets ``status`` ``"error: <type>: <message>"`` and no losses; a non-finite loss stops
    the stage with ``"error: loss is ... at step ..."`` and keeps the losses until then. Either way
    its memory is released and the other stages go on. With ``raise_errors`` the exception is raised
    instead (as :func:`train` does).
    """
    device = torch.device(device)
    on_gpu = device.type == "cuda"
    if on_gpu and device.index is None:  # tensors live on "cuda:0", and torch.device("cuda") != that
        device = torch.device("cuda", torch.cuda.current_device())
    names = list(attentions)
    if not names:
        raise ValueError("attentions is empty: nothing to train")
    runs: dict[str, TrainRun] = {}

    def stop(name: str, result: TrainRun) -> None:
        runs[name] = result
        if log:
            log(f"  {name:>6}  {result.status}")
        # Outside the ``except`` block, so the traceback (and the activations its frames hold) is gone.
        _release(on_gpu)

    batches = _Batches(model_cfg, cfg, device)
    trainers: dict[str, _StageTrainer] = {}
    for name in names:
        error = None
        try:
            trainers[name] = _StageTrainer(name, attentions[name], model_cfg, cfg, device, batches)
        except Exception as e:  # an OOM while allocating the model: record it, go on
            if raise_errors:
                raise
            error = _error_status(e)
        if error is not None:
            stop(name, TrainRun(stage=name, status=error))
    if on_gpu:
        gc.collect()
        torch.cuda.synchronize(device)
    n = len(names)
    for start in range(0, cfg.steps, cfg.block):
        end = min(start + cfg.block, cfg.steps)
        for turn in range(n):  # block b starts with stage b mod n: the order rotates
            name = names[(start // cfg.block + turn) % n]
            trainer = trainers.get(name)
            if trainer is None:  # failed or stopped
                continue
            for step in range(start, end):
                error = None
                try:
                    loss_value = trainer.step(step)
                except Exception as e:  # no backward, an OOM, a kernel error: record it, the others go on
                    if raise_errors:
                        raise
                    error = _error_status(e)
                if error is None and math.isfinite(loss_value):
                    if step == start and cfg.block > 1 and n > 1:
                        trainer.run.after_switch.append(len(trainer.run.step_ms) - 1)
                    continue
                if error is None:  # the losses until the stage diverged are kept
                    result = trainer.run
                    result.status = f"error: loss is {loss_value} at step {step}"
                else:
                    result = TrainRun(stage=name, status=error)
                del trainers[name], trainer
                stop(name, result)
                break
        if log and log_every and any((step + 1) % log_every == 0 or step == 0 or step + 1 == cfg.steps
                                     for step in range(start, end)):
            for name in names:
                if name in trainers:
                    record = trainers[name].run
                    tps = record.tokens_per_step / (record.step_ms[-1] / 1e3)
                    log(f"  step {end:>4}/{cfg.steps}  {name:>6}  loss {record.losses[-1]:.4f}  "
                        f"{record.step_ms[-1]:8.1f} ms  {tps:>10,.0f} tok/s")
    for name, trainer in trainers.items():
        runs[name] = trainer.run
    return {name: runs[name] for name in names}


def train(attention: AttentionFn, model_cfg: ModelConfig, cfg: TrainConfig, *, device: str | torch.device = "cpu",
          stage: str = "", log: Callable[[str], None] | None = None, log_every: int = 0) -> TrainRun:
    """Train a fresh :class:`GPT` with ``attention`` alone for ``cfg.steps`` steps; return the losses and times.

    :func:`train_lockstep` with one stage: the initial weights and the batches depend only on
    ``cfg.seed``, so two calls with different attention functions train the same model on the same
    data. Raises :class:`NoBackwardError` if ``attention`` is not differentiable (and any other error
    of a step).
    """
    return train_lockstep({stage: attention}, model_cfg, cfg, device=device, log=log, log_every=log_every,
                          raise_errors=True)[stage]


def max_loss_gap(losses: list[float], reference: list[float]) -> float:
    """The largest |loss - reference loss| over the steps both curves have (inf if they share none)."""
    pairs = list(zip(losses, reference))
    if not pairs or len(losses) != len(reference):
        return math.inf
    return max(abs(a - b) for a, b in pairs)


# ------------------------------------------------------------------------------------------ result files

def _fmt(value) -> str:
    """How the training files write a value (``results.append_rows``'s ``fmt``)."""
    if value is None:
        return ""
    if isinstance(value, float):
        # 9 significant digits hold a float32 loss exactly: the gap between two stages can be 1e-7
        return f"{value:.9g}" if math.isfinite(value) else str(value)
    return str(value)


def write_run(out_dir: Path, run_id: str, run: TrainRun, model_cfg: ModelConfig, cfg: TrainConfig, *,
              device: str, reference_losses: list[float] | None) -> dict:
    """Append one stage's losses and its summary row under ``out_dir/train/``; return the summary row."""
    from .results import append_rows

    train_dir = Path(out_dir) / "train"
    append_rows(train_dir / LOSSES_CSV, LOSS_FIELDS,
                [{"run_id": run_id, "stage": run.stage, "dtype": cfg.dtype, "step": i + 1, "loss": loss, "step_ms": ms}
                 for i, (loss, ms) in enumerate(zip(run.losses, run.step_ms))], fmt=_fmt)
    gap = None if reference_losses is None else max_loss_gap(run.losses, reference_losses)
    row = {"run_id": run_id, "stage": run.stage, "device": device, **asdict(model_cfg), **asdict(cfg),
           "step_ms_median": run.step_ms_median, "tokens_per_s": run.tokens_per_s,
           "peak_memory_bytes": run.peak_memory_bytes,
           "first_loss": run.losses[0] if run.losses else None,
           "final_loss": run.losses[-1] if run.losses else None,
           "reference": REFERENCE if reference_losses is not None else "", "max_loss_gap": gap,
           "tolerance": LOSS_TOLERANCE[cfg.dtype], "status": run.status}
    append_rows(train_dir / SUMMARY_CSV, SUMMARY_FIELDS, [row], SUMMARY_DEFAULTS, fmt=_fmt)
    return row


#: How each compile mode's table is titled in the results page.
COMPILE_TITLES = {"off": "eager steps", "inductor": "compiled steps (Inductor)",
                  "cudagraphs": "compiled steps replayed as CUDA graphs (Inductor, reduce-overhead)"}


def load_summary(results_dir) -> list[dict]:
    """The rows of ``results_dir/train/summary.csv`` as strings, ``compile`` filled for rows written
    before it existed ([] without the file)."""
    path = Path(results_dir) / "train" / SUMMARY_CSV
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return [{**SUMMARY_DEFAULTS, **{k: v for k, v in row.items() if v is not None}} for row in csv.DictReader(f)]


def _float(text) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def summary_tables(rows: list[dict]) -> str:
    """Markdown: per compile mode, its latest run's stages (the reference first): median step time,
    tokens/s, speed against the reference's step of the same run (above 1: faster), peak memory and the
    largest loss gap to the reference. '' without rows."""
    from .views import fmt_bytes, label

    parts = []
    for mode, title in COMPILE_TITLES.items():
        runs = [r for r in rows if r.get("compile") == mode]
        if not runs:
            continue
        run_id = max(r["run_id"] for r in runs)
        at = sorted((r for r in runs if r["run_id"] == run_id), key=lambda r: (r["stage"] != REFERENCE, r["stage"]))
        r0 = at[0]
        block = int(r0.get("block") or 1)
        turns = ", in turns step by step" if block == 1 else f", in turns by blocks of {block} steps"
        parts.append(f"#### {title[0].upper() + title[1:]}: run {run_id}, {r0['steps']} steps{turns}")
        parts.append(f"{r0['n_layer']} layers, {r0['n_head']} query heads sharing {r0['n_kv_head']} K/V heads of "
                     f"{r0['head_dim']}, context {r0['context']}, batch {r0['batch']}, {r0['dtype']} attention.")
        ref = next((r for r in at if r["stage"] == REFERENCE and r["status"] == "ok"), None)
        ref_ms = _float(ref["step_ms_median"]) if ref else None
        lines = ["| stage | ms per step | tokens/s | × SDPA | peak memory | max \\|Δloss\\| vs SDPA | status |",
                 "|---|--:|--:|--:|--:|--:|---|"]
        for r in at:
            ms, tps, peak, gap = (_float(r[k]) for k in ("step_ms_median", "tokens_per_s", "peak_memory_bytes",
                                                         "max_loss_gap"))
            name = "SDPA" if r["stage"] == REFERENCE else label(r["stage"])
            lines.append("| " + " | ".join([
                name, "—" if ms is None else f"{ms:.2f}", "—" if tps is None else f"{tps:,.0f}",
                "—" if ms is None or ref_ms is None else f"{ref_ms / ms:.2f}×",
                "—" if peak is None else fmt_bytes(peak), "" if gap is None else f"{gap:.3f}",
                r["status"].replace("|", "\\|")]) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def render_block(results_dir, readme_dir=".") -> str:
    """The results page's ``train`` block from ``results_dir/train/summary.csv``."""
    from .report import _generated_note, _posix_rel
    from .results import ResultsError, load_env
    from .views import HINTS

    results_dir = Path(results_dir)
    note = _generated_note(_posix_rel(results_dir, Path(readme_dir)), f"train/{SUMMARY_CSV}")
    rows = load_summary(results_dir)
    if not rows:
        return note + f"\n\n_No training runs yet: run `{HINTS['train']}` on a GPU._\n"
    try:
        env = load_env(results_dir / "train")
    except ResultsError:
        env = {}
    where = env.get("gpu_name") or "an unknown device"
    text = (f"Measured on **{where}**. Each stage trains its own copy of the same model from the same "
            "weights on the same batches, the stages taking turns (step by step, or by blocks of steps), each "
            "step timed alone (forward, loss, backward, gradient clipping, AdamW). ms per step: the median after "
            "the first tenth of the steps (compilation, autotuning, CUDA-graph recording), by blocks without "
            "each block's first step, the one right after another model's (a cost of taking turns that a real "
            "run, one model step after step, never pays). × SDPA: SDPA's step time over "
            "the stage's, in the same run (above 1: the stage is faster). Eager, a step of this small model is "
            "paid partly on the host, where a stage's autograd node is Python and SDPA's is C++; compiled, the "
            "forward and backward are one graph each, and with CUDA graphs no Python runs per layer. Loss gap: "
            "the largest difference to SDPA's loss at any step, which the run checks against what rounding "
            "alone leaves room for (`LOSS_TOLERANCE` in harness/train.py: "
            + ", ".join(f"{tol:g} nats in {dtype}" for dtype, tol in LOSS_TOLERANCE.items()) + ").")
    return "\n\n".join([note, text, summary_tables(rows)]) + "\n"


def load_losses(results_dir) -> dict[str, dict]:
    """The stages of the latest run in ``results_dir/train/losses.csv`` (the run appended last):
    ``{stage: {"run_id", "dtype", "steps": [...], "losses": [...]}}`` (empty without the file). One run,
    not each stage's latest: curves from runs of other lengths, modes or data would not compare."""
    path = Path(results_dir) / "train" / LOSSES_CSV
    if not path.exists():
        return {}
    by_run: dict[str, dict[str, dict]] = {}
    last = None
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            stages = by_run.setdefault(row["run_id"], {})
            entry = stages.setdefault(row["stage"], {"run_id": row["run_id"], "dtype": row["dtype"], "steps": [],
                                                     "losses": []})
            entry["steps"].append(int(row["step"]))
            entry["losses"].append(float(row["loss"]))
            last = row["run_id"]  # rows are appended in time order: the last run is the latest
    return by_run.get(last, {})


# ---------------------------------------------------------------------------------------------- figure

def _compile_label(results_dir, run_id: str) -> str:
    """", compiled (<mode>)" for a run its summary rows mark compiled; "" for an eager one or none found."""
    mode = next((r["compile"] for r in load_summary(results_dir) if r["run_id"] == run_id), "off")
    return "" if mode in ("off", "") else f", compiled ({mode})"


_COLORS = {"a": "#d62728", "b": "#ff7f0e", "c": "#2ca02c", "sdpa": "#1f77b4"}
GAP_FLOOR = 1e-9  # a log axis cannot show 0: identical losses are drawn here


def plot_train_losses(results_dir, out_dir=None) -> Path | None:
    """Draw the loss curves of the latest run's stages, and each one's gap to SDPA's with the tolerance,
    from ``results_dir/train/losses.csv`` into ``<out_dir or results_dir>/figures/train_loss.png``.
    Returns the PNG's path, or None (with a printed reason) when there is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = load_losses(results_dir)
    if not curves:
        print(f"train plot: no {Path(results_dir) / 'train' / LOSSES_CSV}; run `python -m harness train` first")
        return None
    ref = curves.get(REFERENCE)
    fig = Figure(figsize=(12, 4.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_gap = fig.subplots(1, 2)
    # The reference last, dashed, so it stays visible on top of curves that coincide with it.
    for stage, curve in sorted(curves.items(), key=lambda item: item[0] == REFERENCE):
        color = _COLORS.get(stage)
        style = "--" if stage == REFERENCE else "-"
        ax_loss.plot(curve["steps"], curve["losses"], style, color=color, lw=1.5, label=stage)
        if ref is not None and stage != REFERENCE and len(curve["losses"]) == len(ref["losses"]):
            gaps = [max(abs(a - b), GAP_FLOOR) for a, b in zip(curve["losses"], ref["losses"])]
            ax_gap.plot(curve["steps"], gaps, color=color, lw=1.2, label=stage)
    run_id = next(iter(curves.values()))["run_id"]
    ax_loss.set(xlabel="step", ylabel="training loss (nats per character)",
                title=f"loss curves, same init and batches\nrun {run_id[:19]}{_compile_label(results_dir, run_id)}")
    ax_loss.legend()
    if ref is not None:
        tol = LOSS_TOLERANCE.get(ref["dtype"])
        if tol:
            ax_gap.axhline(tol, color="0.3", ls=":", label=f"tolerance ({ref['dtype']}): {tol:g}")
        ax_gap.set_yscale("log")
        ax_gap.legend()
    else:
        ax_gap.text(0.5, 0.5, "no sdpa run to compare with", ha="center", va="center", transform=ax_gap.transAxes)
    ax_gap.set(xlabel="step", ylabel="|loss - loss of sdpa| (nats)",
               title=f"gap to PyTorch SDPA (equal losses drawn at {GAP_FLOOR:g})")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
    figures = Path(out_dir or results_dir) / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / "train_loss.png"
    fig.savefig(path, dpi=100, metadata={"Software": None})
    return path


# ------------------------------------------------------------------------------------------------- CLI

def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _names, _positive_int

    which = p.add_mutually_exclusive_group()
    which.add_argument("--stage", default=None, metavar="NAME",
                       help="one attention to train with: a, b, c, sdpa or another registered stage with a backward")
    which.add_argument("--stages", type=_names, default=None, metavar="a,b,c,sdpa",
                       help="several, from the same init and batches, trained in lockstep: every step (or block of "
                            "--block steps), each stage takes its turn (default: a,b,c,sdpa)")
    p.add_argument("--block", type=_positive_int, default=DEFAULT_BLOCK,
                   help=f"steps each stage takes in a row in lockstep; a block's first step, right after another "
                        f"model's, is left out of the median step time (default {DEFAULT_BLOCK}: step by step)")
    p.add_argument("--steps", type=_positive_int, default=None, help="optimizer steps (GPU 200, CPU tiny 15)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the text and the batches (default 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="results directory; files go to OUT/train/ (default results/<gpu>/ on a GPU, "
                        "a temporary directory on a CPU)")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="the tiny CPU configuration (2 layers, 2 heads, head dim 16, context 32, batch 4); "
                        "default: on without a GPU")
    p.add_argument("--layers", type=_positive_int, default=None, help="transformer blocks (GPU default 4)")
    p.add_argument("--heads", type=_positive_int, default=None, help="query heads (GPU default 8)")
    p.add_argument("--kv-heads", type=_positive_int, default=None,
                   help="key/value heads; fewer than --heads is grouped-query attention (GPU default 2)")
    p.add_argument("--head-dim", type=_positive_int, default=None, help="head dim (GPU default 64)")
    p.add_argument("--context", type=_positive_int, default=None, help="tokens per sequence (GPU default 1024)")
    p.add_argument("--batch", type=_positive_int, default=None, help="sequences per step (GPU default 16)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (GPU default 1e-3)")
    p.add_argument("--dtype", choices=list(LOSS_TOLERANCE), default=None,
                   help="the attention's dtype (default bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--compile", choices=list(COMPILE_MODES), default="off",
                   help="off (default): eager steps; inductor: forward and backward through torch.compile "
                        "(fullgraph); cudagraphs: the same, replayed as CUDA graphs (GPU only)")
    p.add_argument("--log-every", type=_positive_int, default=None, help="print every this many steps")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="only draw DIR/figures/train_loss.png from DIR/train/losses.csv, no training")


def _configs(args, on_gpu: bool) -> tuple[ModelConfig, TrainConfig]:
    from stages.contract import HEAD_DIMS

    parser = args._parser
    tiny = (not on_gpu) if args.tiny is None else args.tiny
    model0, train0 = (TINY_MODEL, TINY_TRAIN) if tiny else (GPU_MODEL, GPU_TRAIN)
    heads = args.heads or model0.n_head
    kv_heads = args.kv_heads or (min(model0.n_kv_head, heads) if heads % model0.n_kv_head == 0 else heads)
    if heads % kv_heads:
        parser.error(f"argument --kv-heads: --heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    head_dim = args.head_dim or model0.head_dim
    if head_dim not in HEAD_DIMS:
        parser.error(f"argument --head-dim: must be a multiple of 8 from 8 to 256, got {head_dim}")
    model = ModelConfig(n_layer=args.layers or model0.n_layer, n_head=heads, n_kv_head=kv_heads, head_dim=head_dim,
                        context=args.context or model0.context)
    lr = train0.lr if args.lr is None else args.lr
    if not (lr > 0 and math.isfinite(lr)):
        parser.error(f"argument --lr: must be a finite positive number, got {lr}")
    if args.compile == "cudagraphs" and not on_gpu:
        parser.error("argument --compile: cudagraphs replays CUDA graphs and needs a CUDA GPU; "
                     "use off or inductor here")
    cfg = TrainConfig(steps=args.steps or train0.steps, batch=args.batch or train0.batch, lr=lr, seed=args.seed,
                      dtype=args.dtype or ("bf16" if on_gpu else "fp32"), warmup=train0.warmup,
                      compile=args.compile, block=args.block)
    return model, cfg


def run(args: argparse.Namespace) -> int:
    from .cli import _console, _environment, default_out_dir
    from .results import run_id_now, write_env

    parser = args._parser
    if args.plot is not None:
        path = plot_train_losses(args.plot)
        if path:
            print(f"figure written to {path}")
        return 0 if path else 1
    choices = trainable_stage_names()
    names = [args.stage] if args.stage is not None else (args.stages or ["a", "b", "c", REFERENCE])
    flag = "--stage" if args.stage is not None else "--stages"
    for name in names:
        if name not in choices:
            parser.error(f"argument {flag}: unknown stage {name!r}; choose from {', '.join(choices)}")
    on_gpu = torch.cuda.is_available()
    model_cfg, cfg = _configs(args, on_gpu)
    device = "cuda" if on_gpu else "cpu"
    out = args.out or default_out_dir()
    run_id = run_id_now()
    write_env(Path(out) / "train", _environment(run_id))
    console = _console()
    where = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU (Triton interpreter: times are not GPU times)"
    console.print(f"[bold]train[/bold] a {model_cfg.n_layer}-layer GPT, {model_cfg.n_head} heads "
                  f"({model_cfg.n_kv_head} K/V), head dim {model_cfg.head_dim}, context {model_cfg.context}, "
                  f"batch {cfg.batch}, {cfg.steps} steps, {cfg.dtype} attention, seed {cfg.seed}, "
                  f"{'eager' if cfg.compile == 'off' else 'compiled: ' + cfg.compile}, on {where}")
    log_every = args.log_every or max(1, cfg.steps // 10)
    # Rows are written with the reference first, then the stages in the order asked for (each once).
    order = list(dict.fromkeys(([REFERENCE] if REFERENCE in names else []) + names))
    if len(order) > 1:
        console.print(f"  in lockstep: {', '.join(order)} take their turns "
                      + ("step by step" if cfg.block == 1 else f"by blocks of {cfg.block} steps")
                      + " (the first of the turn rotates), each step timed alone", markup=False)
    results = train_lockstep({name: attention_for(name) for name in order}, model_cfg, cfg, device=device,
                             log=lambda line: console.print(line, markup=False), log_every=log_every)
    ref = results.get(REFERENCE)
    ref_losses = ref.losses if ref is not None and ref.status == "ok" else None
    rows = [write_run(out, run_id, results[name], model_cfg, cfg, device=device,
                      reference_losses=None if name == REFERENCE else ref_losses)
            for name in order]
    return _report(console, rows, cfg, out)


def _report(console, rows: list[dict], cfg: TrainConfig, out) -> int:
    from rich.table import Table

    from .views import fmt_bytes

    tol = LOSS_TOLERANCE[cfg.dtype]
    steps = "eager" if cfg.compile == "off" else f"compiled ({cfg.compile})"
    table = Table(title=f"training, {cfg.steps} {steps} steps, {cfg.dtype} attention", header_style="bold")
    for col in ("stage", "first loss", "final loss", "ms/step (median)", "tokens/s", "peak memory",
                f"max |Δloss| vs {REFERENCE}", "agrees", "status"):
        table.add_column(col, justify="left" if col in ("stage", "status") else "right")
    failed = False
    for r in rows:
        gap = r["max_loss_gap"]
        agrees = "" if gap is None else ("yes" if gap <= tol else "NO")
        failed |= r["status"] != "ok" or agrees == "NO"
        table.add_row(r["stage"], _num(r["first_loss"], ".4f"), _num(r["final_loss"], ".4f"),
                      _num(r["step_ms_median"], ".1f"), _num(r["tokens_per_s"], ",.0f"),
                      "" if r["peak_memory_bytes"] is None else fmt_bytes(r["peak_memory_bytes"]),
                      _num(gap, ".2e"), agrees, r["status"][:60])
    console.print(table)
    console.print(f"Agreement: every step's loss within {tol:g} nats of {REFERENCE}'s ({cfg.dtype}: only rounding "
                  f"separates correct kernels; see harness/train.py LOSS_TOLERANCE). Step time: median after the "
                  f"first steps (compilation)" + (" and each block's first (after another model's)"
                                                  if cfg.block > 1 else "")
                  + "; the stages took their steps in turns, each timed alone. Peak "
                  "memory: a stage's own training step (its model, optimizer state, data, activations).")
    path = plot_train_losses(out)
    console.print(f"rows written to {Path(out) / 'train'}" + (f"; figure {path}" if path else ""))
    return 1 if failed else 0


def _num(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.train ...`` works as well as ``python -m harness train ...``."""
    __import__("stages")  # chooses the Triton interpreter before triton loads, without a GPU

    parser = argparse.ArgumentParser(prog="harness train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args._parser = parser
    return run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
