"""Decode and training speed of small transformers models with each attention (stages inside a model).

``python -m harness generate`` builds GPT-2- and Llama-shaped models from a config with random
weights (nothing is downloaded) and runs them with each attention implementation: the lab's stages
through :mod:`stages.hf` (``attn_implementation="lab_c"``, ...) and transformers' own ``"sdpa"``.
It measures the two things a model does with attention:

* **decode**: ``model.generate()`` with its KV cache, greedy, a fixed number of new tokens
  (``min_new_tokens = max_new_tokens``, so no sequence stops early): tokens per second over the
  whole call, the time to the first token (a ``generate`` of one new token: the prefill of the
  prompt plus one step) and the time per later decode step. Each decode step calls every layer's
  attention with one query against a cache one key longer than the step before, the shape the
  kernels' host path must not recompile or re-plan for. The new tokens are compared with SDPA's,
  for information: greedy decoding follows the argmax, and on a random model whose logits are
  nearly flat one rounding difference can change a token and everything after it. ``--cache``
  picks the KV cache: ``dynamic`` (transformers' default: the cache grows by concatenation, every
  step runs eagerly, so its Python and launches are part of each step) and ``static``
  (``cache_implementation="static"``: tensors as long as the prompt plus the new tokens, filled in
  place; on a GPU ``generate`` then compiles the decode step with ``torch.compile`` and replays it
  as a CUDA graph, so a step costs its GPU work; the lab's stages take the filled length as a key
  range, :mod:`stages.hf`). Each cache is timed in turns of its own, and its rows say which.
* **train**: one training step (forward, cross-entropy loss on next-token prediction, backward,
  AdamW step) at the training shape: its median time over a few steps after warm-up steps, and the
  peak memory. The step's weights are the model's own dtype (``--dtype``), AdamW's state too.

All impls share one model (same weights; the attention implementation is switched between calls
with ``model.set_attn_implementation``) and are timed in turns: warm-up calls of every impl first
(compilation, autotuning), then repetition 1 of every impl, repetition 2 of every impl, ..., so
clock drift on a GPU at its power cap hits every impl alike. On a GPU every timed call is
bracketed by ``torch.cuda.synchronize()``. Training steps change the weights; decode runs first,
on the initial weights. An OOM or a kernel error in one impl becomes that row's status and the run
goes on without it.

Rows go to ``<out>/runs.csv`` with the :data:`COLUMNS` (units in the names), one per (model, impl,
pass), appended when a pass of a model is done, and provenance (GPU, driver, torch, triton,
transformers, git commit, command line) to ``<out>/env.json``. ``--out`` defaults to
``results/<gpu>/generate/`` on a GPU. Without a GPU the stages run in the Triton interpreter: the
models shrink to 2 layers of hidden size 64, 16-token prompts and sequences, a few new tokens, the
rows go to a temporary folder, and the times are interpreter times, not GPU times.

``python -m harness report results/<gpu> --update`` renders the latest run as the results page's
``generate`` block (:func:`render_block`).
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

GENERATE_DIR = "generate"
RUNS_CSV = "runs.csv"

#: ``--cache`` values: transformers' growing cache, or a static one (compiled and CUDA-graphed on a GPU)
CACHES = ("dynamic", "static")

#: ``pass`` column values
PASSES = ("decode", "train")
#: transformers' own attention implementations the command accepts beside the lab's stages
TRANSFORMERS_IMPLS = ("sdpa", "eager")
#: the impl every other is compared with (× SDPA, same tokens as SDPA)
REFERENCE = "sdpa"

#: Columns of ``generate/runs.csv``. Empty = not measured or not meaningful for the pass.
#:
#: run_id, model (gpt2 / llama), impl (a stage name, or sdpa / eager: transformers' own), pass
#: (decode / train), cache (decode: dynamic / static, see ``--cache``; empty for train, and read as
#: dynamic in files written before the column existed), device (gpu / interpreter), dtype; the
#: model's shape: layers, heads (query), kv_heads, head_dim, hidden, vocab; the run's: batch (sequences), prompt_len and new_tokens
#: (decode), seq_len (train: tokens per sequence), reps (timed repetitions);
#: ms_median, ms_min, ms_max: one generate() call (decode) or one training step (train), ms;
#: tokens_per_s: decode, batch · new_tokens / the median generate() time; train, batch · seq_len /
#: the median step time;
#: ttft_ms: decode, median time of a generate() of one new token (prefill + first token), ms;
#: decode_step_ms: decode, (median generate time − ttft_ms) / (new_tokens − 1): one later step, ms;
#: peak_mem_bytes: the most ``torch.cuda.max_memory_allocated`` read after a timed call (weights,
#: optimizer state, KV cache and activations included), bytes; GPU only;
#: same_tokens_frac: decode, the fraction of the new tokens equal to SDPA's at the same position;
#: status: ok, oom, unsupported: <why>, error: <what>; note: free text.
COLUMNS: tuple[str, ...] = (
    "run_id", "model", "impl", "pass", "cache", "device", "dtype", "layers", "heads", "kv_heads", "head_dim", "hidden",
    "vocab", "batch", "prompt_len", "new_tokens", "seq_len", "reps", "ms_median", "ms_min", "ms_max",
    "tokens_per_s", "ttft_ms", "decode_step_ms", "peak_mem_bytes", "same_tokens_frac", "status", "note",
)
INT_COLUMNS = frozenset({"layers", "heads", "kv_heads", "head_dim", "hidden", "vocab", "batch", "prompt_len",
                         "new_tokens", "seq_len", "reps", "peak_mem_bytes"})
FLOAT_COLUMNS = frozenset({"ms_median", "ms_min", "ms_max", "tokens_per_s", "ttft_ms", "decode_step_ms",
                           "same_tokens_frac"})


# --------------------------------------------------------------------------------------- models and sizes

@dataclass(frozen=True)
class ModelShape:
    """A model's shape: ``heads`` query heads of ``head_dim``, so hidden = heads · head_dim."""

    family: str          # "gpt2" or "llama"
    layers: int
    heads: int
    kv_heads: int        # < heads: grouped-query attention (Llama); GPT-2 has heads = kv_heads
    head_dim: int
    vocab: int

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    def describe(self) -> str:
        kv = f" ({self.kv_heads} K/V)" if self.kv_heads != self.heads else ""
        return f"{self.layers} layers, {self.heads} heads{kv}, head dim {self.head_dim}, hidden {self.hidden}"


#: GPU shapes: GPT-2 small's attention (12 heads of 64) and a Llama-style one with grouped-query
#: attention (16 query heads sharing 4 K/V heads of 128, Llama 3's head dim), 6 layers each so a
#: run takes minutes. Vocabularies: GPT-2's own, Llama 2's.
GPU_SHAPES = {"gpt2": ModelShape("gpt2", 6, 12, 12, 64, 50257), "llama": ModelShape("llama", 6, 16, 4, 128, 32000)}
#: interpreter shapes: the same kinds, 2 layers of hidden size 64, a 128-token vocabulary
TINY_SHAPES = {"gpt2": ModelShape("gpt2", 2, 4, 4, 16, 128), "llama": ModelShape("llama", 2, 4, 2, 16, 128)}
MODEL_NAMES = tuple(GPU_SHAPES)


@dataclass(frozen=True)
class RunSizes:
    """How much each pass does: decode ``batch`` sequences of ``prompt_len`` tokens + ``new_tokens``;
    train on ``train_batch`` sequences of ``train_seq`` tokens; ``warmup`` untimed then ``reps``
    timed calls per impl."""

    batch: int
    prompt_len: int
    new_tokens: int
    train_batch: int
    train_seq: int
    reps: int
    warmup: int


GPU_SIZES = RunSizes(batch=4, prompt_len=128, new_tokens=64, train_batch=8, train_seq=2048, reps=5, warmup=2)
TINY_SIZES = RunSizes(batch=2, prompt_len=16, new_tokens=4, train_batch=2, train_seq=16, reps=2, warmup=1)


def llama_intermediate_size(hidden: int) -> int:
    """Llama's MLP width: 8/3 of the hidden size rounded up to a multiple of 256 (5632 for 2048)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


def model_config(shape: ModelShape, max_positions: int):
    """A transformers config of ``shape`` with no dropout anywhere (the kernels have none, and the
    impls must see the same computation)."""
    import transformers

    if shape.family == "gpt2":
        return transformers.GPT2Config(vocab_size=shape.vocab, n_positions=max_positions, n_embd=shape.hidden,
                                       n_layer=shape.layers, n_head=shape.heads, attn_pdrop=0.0, resid_pdrop=0.0,
                                       embd_pdrop=0.0, bos_token_id=shape.vocab - 1, eos_token_id=shape.vocab - 1)
    return transformers.LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden,
                                    intermediate_size=llama_intermediate_size(shape.hidden),
                                    num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                                    num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                                    max_position_embeddings=max_positions, attention_dropout=0.0,
                                    bos_token_id=1, eos_token_id=2)


def build_model(shape: ModelShape, sizes: RunSizes, dtype, device, seed: int):
    """A causal LM of ``shape`` with random weights (seeded), on ``device`` in ``dtype``, built
    directly there (no host copy of the weights first)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(shape, max(sizes.prompt_len + sizes.new_tokens, sizes.train_seq))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=REFERENCE)
    # transformers picks the loss by the class name, which "GPT2LMHeadModel" does not spell (it would
    # warn that it guessed): name it, next-token cross-entropy, for every model
    model.loss_type = "ForCausalLM"
    return model.eval()


# ---------------------------------------------------------------------------------------------- timing

def _sync(on_gpu: bool) -> None:
    if on_gpu:
        import torch

        torch.cuda.synchronize()


def timed_call(fn: Callable[[], object], on_gpu: bool) -> tuple[object, float, int | None]:
    """``(fn(), ms, peak bytes)``: wall time of one call, synchronized on both sides on a GPU, and
    ``max_memory_allocated`` during it (None on a CPU)."""
    import torch

    _sync(on_gpu)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn()
    _sync(on_gpu)
    ms = (time.perf_counter() - t0) * 1e3
    return out, ms, (int(torch.cuda.max_memory_allocated()) if on_gpu else None)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:300]


def status_of(e: BaseException) -> str:
    """The row status for a failed call: ``oom``, ``unsupported: ...`` (a ValueError or
    NotImplementedError: the stages' and stages.hf's way of refusing) or ``error: <type>: ...``."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "oom"
    if isinstance(e, (ValueError, NotImplementedError)):
        return f"unsupported: {type(e).__name__}: {first_line(e)}"
    return f"error: {type(e).__name__}: {first_line(e)}"


def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclass
class ImplRun:
    """One impl's calls in one pass, while they are being made."""

    impl: str
    times_ms: list[float]
    ttft_ms: list[float]
    peak_bytes: int | None = None
    tokens: object = None            # decode: the last call's new tokens [batch, new_tokens], on the CPU
    status: str = "ok"

    def add_peak(self, peak: int | None) -> None:
        if peak is not None:
            self.peak_bytes = max(self.peak_bytes or 0, peak)


def attn_implementation(impl: str) -> str:
    """The ``attn_implementation`` string of an impl: ``lab_<stage>`` for a stage, transformers' own as is."""
    from stages import hf

    return impl if impl in TRANSFORMERS_IMPLS else hf.implementation_name(impl)


def in_turns(impls: list[str], warmup: int, reps: int, call: Callable[[ImplRun, bool], None],
             on_call: Callable[[str], None] | None = None) -> dict[str, ImplRun]:
    """Run ``call(run, timed)`` for every impl: ``warmup`` untimed rounds of every impl, then ``reps``
    timed rounds, each round one call of every impl in order. An impl whose call raises gets the
    status of the exception and makes no further calls; the others go on. ``on_call(impl)`` after
    each call (progress)."""
    import torch

    runs = {name: ImplRun(name, [], []) for name in impls}
    for timed in [False] * warmup + [True] * reps:
        for name in impls:
            run = runs[name]
            if run.status == "ok":
                try:
                    call(run, timed)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except Exception as e:  # an OOM, a refusal, a kernel error: this impl's row says so
                    run.status = status_of(e)
                    if isinstance(e, torch.cuda.OutOfMemoryError):
                        free_memory()
            if on_call:
                on_call(name)
    return runs


# ------------------------------------------------------------------------------------------------ passes

def measure_decode(model, impls: list[str], sizes: RunSizes, *, on_gpu: bool, seed: int,
                   on_call=None, cache: str = "dynamic") -> dict[str, ImplRun]:
    """Greedy ``generate()`` of ``sizes.new_tokens`` tokens from random prompts, per impl in turns:
    each call times a one-token generate (time to first token), then the full one. ``cache``: one
    of :data:`CACHES` (a static cache's compiled step is compiled and captured in the warm-up
    calls)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, model.config.vocab_size, (sizes.batch, sizes.prompt_len), generator=g)
    prompt = prompt.to(model.device)
    ones = torch.ones_like(prompt)  # a pad-free batch: every token is real

    options = {"cache_implementation": "static"} if cache == "static" else {}

    def generate(new_tokens: int):
        with torch.no_grad():
            return model.generate(prompt, attention_mask=ones, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  do_sample=False, num_beams=1, pad_token_id=model.config.eos_token_id, **options)

    def call(run: ImplRun, timed: bool) -> None:
        model.set_attn_implementation(attn_implementation(run.impl))
        _, ttft, _ = timed_call(lambda: generate(1), on_gpu)
        out, ms, peak = timed_call(lambda: generate(sizes.new_tokens), on_gpu)
        if timed:
            run.ttft_ms.append(ttft)
            run.times_ms.append(ms)
            run.add_peak(peak)
            run.tokens = out[:, sizes.prompt_len:].cpu()

    model.eval()
    return in_turns(impls, sizes.warmup, sizes.reps, call, on_call)


def measure_train(model, impls: list[str], sizes: RunSizes, *, on_gpu: bool, seed: int,
                  on_call=None) -> dict[str, ImplRun]:
    """One AdamW training step per call (forward, next-token loss, backward, step) on random tokens
    [train_batch, train_seq], per impl in turns, all on the one model."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, model.config.vocab_size, (sizes.train_batch, sizes.train_seq), generator=g)
    tokens = tokens.to(model.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def call(run: ImplRun, timed: bool) -> None:
        model.set_attn_implementation(attn_implementation(run.impl))
        try:
            _, ms, peak = timed_call(step, on_gpu)
        finally:
            optimizer.zero_grad(set_to_none=True)  # a failed step leaves no gradients for the next impl
        if timed:
            run.times_ms.append(ms)
            run.add_peak(peak)

    model.train()
    try:
        return in_turns(impls, sizes.warmup, sizes.reps, call, on_call)
    finally:
        model.eval()
        del optimizer
        free_memory()


def decode_rows(runs: dict[str, ImplRun], base: dict, sizes: RunSizes, cache: str = "dynamic") -> list[dict]:
    """One ``pass = decode`` row per impl from its calls (see :data:`COLUMNS`)."""
    ref = runs.get(REFERENCE)
    ref_tokens = ref.tokens if ref is not None and ref.status == "ok" else None
    rows = []
    for name, run in runs.items():
        row = {**base, "impl": name, "pass": "decode", "cache": cache, "batch": sizes.batch,
               "prompt_len": sizes.prompt_len,
               "new_tokens": sizes.new_tokens, "reps": len(run.times_ms), "status": run.status,
               "peak_mem_bytes": run.peak_bytes}
        if run.times_ms:
            ms = statistics.median(run.times_ms)
            ttft = statistics.median(run.ttft_ms)
            row.update(ms_median=ms, ms_min=min(run.times_ms), ms_max=max(run.times_ms),
                       tokens_per_s=sizes.batch * sizes.new_tokens / (ms / 1e3), ttft_ms=ttft)
            if sizes.new_tokens > 1:
                row["decode_step_ms"] = (ms - ttft) / (sizes.new_tokens - 1)
        if ref_tokens is not None and run.tokens is not None:
            row["same_tokens_frac"] = (run.tokens == ref_tokens).float().mean().item()
        rows.append(row)
    return rows


def train_rows(runs: dict[str, ImplRun], base: dict, sizes: RunSizes) -> list[dict]:
    """One ``pass = train`` row per impl from its steps (see :data:`COLUMNS`)."""
    rows = []
    for name, run in runs.items():
        row = {**base, "impl": name, "pass": "train", "batch": sizes.train_batch, "seq_len": sizes.train_seq,
               "reps": len(run.times_ms), "status": run.status, "peak_mem_bytes": run.peak_bytes}
        if run.times_ms:
            ms = statistics.median(run.times_ms)
            row.update(ms_median=ms, ms_min=min(run.times_ms), ms_max=max(run.times_ms),
                       tokens_per_s=sizes.train_batch * sizes.train_seq / (ms / 1e3))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ result files

def _format(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def append_rows(out_dir: str | os.PathLike, rows: list[dict]) -> Path:
    """Append ``rows`` to ``out_dir/runs.csv`` (header when new), flushed and fsynced: a crash
    later loses none of them. A file with other columns raises ``ResultsError`` naming it."""
    from .results import ResultsError, _fresh_line_prefix

    path = Path(out_dir) / RUNS_CSV
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with path.open(newline="") as f:
            header = tuple(next(csv.reader(f), []))
        if header == tuple(c for c in COLUMNS if c != "cache"):
            _add_cache_column(path)
        elif header != COLUMNS:
            raise ResultsError(f"{path}: its columns are not those of `harness generate` ({', '.join(COLUMNS)}); "
                               f"write to another --out")
    prefix = "" if new else _fresh_line_prefix(path)  # a row cut off by a crash keeps the next one whole
    with path.open("a", newline="") as f:
        f.write(prefix)
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: _format(row.get(c)) for c in COLUMNS})
        f.flush()
        os.fsync(f.fileno())
    return path


def _add_cache_column(path: Path) -> None:
    """Rewrite a ``runs.csv`` written before the ``cache`` column existed with it: its decode rows
    were all measured with the dynamic cache (``results.rewrite_csv``: a crash leaves either file whole)."""
    from .results import rewrite_csv

    with path.open(newline="") as f:
        old = list(csv.DictReader(f))
    rewrite_csv(path, COLUMNS, ({**row, "cache": "dynamic" if row.get("pass") == "decode" else ""} for row in old))


def load_rows(path: str | os.PathLike) -> list[dict]:
    """The rows of a ``generate/runs.csv`` (or of the results folder holding ``generate/``), typed;
    ``ResultsError`` naming the file and line for missing columns or a number that does not parse."""
    from .results import ResultsError

    path = Path(path)
    if path.is_dir():
        path = path / GENERATE_DIR / RUNS_CSV if (path / GENERATE_DIR).is_dir() else path / RUNS_CSV
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ()) and c != "cache"]
        if missing:
            raise ResultsError(f"{path}: missing columns {missing}")
        rows = []
        for raw in reader:
            row = {}
            for c in COLUMNS:
                text = (raw.get(c) or "").strip()
                try:
                    row[c] = (None if not text else int(float(text)) if c in INT_COLUMNS
                              else float(text) if c in FLOAT_COLUMNS else text)
                except ValueError:
                    raise ResultsError(f"{path}:{reader.line_num}: column {c!r} should be a number, "
                                       f"got {text!r}") from None
            if row["pass"] == "decode" and not row["cache"]:
                row["cache"] = "dynamic"  # (a row written before the column existed)
            rows.append(row)
    return rows


def latest_rows(rows: list[dict]) -> list[dict]:
    """The row of the latest run (largest run_id) of each (model, impl, pass, cache), in first-seen order."""
    latest: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["impl"], r["pass"], r.get("cache") or "")
        if key not in latest or str(r["run_id"]) >= str(latest[key]["run_id"]):
            latest[key] = r
    return list(latest.values())


# ----------------------------------------------------------------------------------------------- report

MODEL_TITLES = {"gpt2": "GPT-2 shape", "llama": "Llama shape"}
HINT = "python -m harness generate"


def _impl_label(impl: str) -> str:
    from .views import label

    return {"sdpa": "transformers SDPA", "eager": "transformers eager"}.get(impl, label(impl))


def _impl_order(impl: str) -> tuple:
    from .views import impl_sort_key

    return (impl in TRANSFORMERS_IMPLS, impl_sort_key(impl))


def _ok(row: dict) -> bool:
    return row["status"] == "ok" and bool(row.get("ms_median"))


def _num(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _amount(value) -> str:
    """A time or rate for the tables: whole numbers with separators from 100 up, else 3 digits."""
    if value is None:
        return "—"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _versus(row: dict, ref: dict | None, faster: Callable[[dict, dict], float]) -> str:
    if ref is None or not (_ok(row) and _ok(ref)):
        return "—"
    return f"{faster(row, ref):.2f}×"


def _shape_of(row: dict) -> str:
    heads = (f"{row['heads']} query heads sharing {row['kv_heads']} K/V heads" if row["kv_heads"] != row["heads"]
             else f"{row['heads']} heads")
    return f"{row['layers']} layers, {heads}, head dim {row['head_dim']}, hidden {row['hidden']}"


def generate_tables(rows: list[dict]) -> str:
    """Markdown from ``generate/runs.csv`` rows (the latest of each (model, impl, pass) is used):
    per model, a decode table per KV cache (tokens/s and × SDPA, by the median call and by the fastest, time to
    first token, ms per decode step, the
    share of tokens equal to SDPA's, peak memory) and a training table (step ms and × SDPA,
    tokens/s, peak memory). × SDPA is above 1 when the impl is faster, and compares an impl's row
    with SDPA's row *of the same run* (the impls of a run take turns; rows of different runs are
    not timed side by side): '—' where that run had no SDPA row. '' without rows."""
    from .views import fmt_bytes

    every = rows
    rows = latest_rows(rows)
    parts = []
    for model in sorted({r["model"] for r in rows}, key=lambda m: (m not in MODEL_TITLES, m)):
        for pass_, cache in [("decode", c) for c in CACHES] + [("train", "")]:
            def same(r, pass_=pass_, cache=cache):
                return r["model"] == model and r["pass"] == pass_ and (r.get("cache") or "") == cache

            at = sorted((r for r in rows if same(r)), key=lambda r: _impl_order(r["impl"]))
            if not at:
                continue
            refs = {r["run_id"]: r for r in every if same(r) and r["impl"] == REFERENCE}
            r0 = at[0]
            title = MODEL_TITLES.get(model, model)
            if pass_ == "decode":
                how = ("static cache, its decode step compiled and replayed as a CUDA graph" if cache == "static"
                       else "dynamic cache")
                parts.append(f"#### {title} ({_shape_of(r0)}), decode ({how}): batch {r0['batch']}, prompt "
                             f"{r0['prompt_len']} tokens, {r0['new_tokens']} new tokens, {r0['dtype']}")
                lines = ["| impl | tokens/s | × SDPA | × SDPA, fastest calls | first token, ms | ms per decode step "
                         "| same tokens as SDPA | peak memory | status |", "|---|--:|--:|--:|--:|--:|--:|--:|---|"]
                for r in at:
                    ok = _ok(r)
                    lines.append("| " + " | ".join([
                        _md(_impl_label(r["impl"])), _amount(r["tokens_per_s"] if ok else None),
                        _versus(r, refs.get(r["run_id"]), lambda a, b: a["tokens_per_s"] / b["tokens_per_s"]),
                        _versus(r, refs.get(r["run_id"]), lambda a, b: b["ms_min"] / a["ms_min"]),
                        _amount(r["ttft_ms"] if ok else None), _amount(r["decode_step_ms"] if ok else None),
                        _num(r["same_tokens_frac"], ".0%"),
                        "—" if r["peak_mem_bytes"] is None else fmt_bytes(r["peak_mem_bytes"]),
                        _md(r["status"])]) + " |")
            else:
                parts.append(f"#### {title} ({_shape_of(r0)}), training step: batch {r0['batch']} × "
                             f"{r0['seq_len']} tokens, {r0['dtype']}, AdamW")
                lines = ["| impl | step ms | × SDPA | tokens/s | peak memory | status |", "|---|--:|--:|--:|--:|---|"]
                for r in at:
                    ok = _ok(r)
                    lines.append("| " + " | ".join([
                        _md(_impl_label(r["impl"])), _amount(r["ms_median"] if ok else None),
                        _versus(r, refs.get(r["run_id"]), lambda a, b: b["ms_median"] / a["ms_median"]),
                        _amount(r["tokens_per_s"] if ok else None),
                        "—" if r["peak_mem_bytes"] is None else fmt_bytes(r["peak_mem_bytes"]),
                        _md(r["status"])]) + " |")
            parts.append("\n".join(lines))
    return "\n\n".join(parts)


def render_block(results_dir, readme_dir=".") -> str:
    """The README's ``generate`` block from ``results_dir/generate/runs.csv``: a do-not-edit note,
    how the numbers were made, and :func:`generate_tables`."""
    from .report import _generated_note, _posix_rel
    from .results import ResultsError, load_env

    results_dir = Path(results_dir)
    rel = _posix_rel(results_dir, Path(readme_dir))
    note = _generated_note(rel, f"{GENERATE_DIR}/{RUNS_CSV}")
    path = results_dir / GENERATE_DIR / RUNS_CSV
    rows = load_rows(path) if path.exists() else []
    if not rows:
        return note + f"\n\n_No generate rows yet: run `{HINT}` on a GPU._\n"
    latest = latest_rows(rows)
    interpreted = any(r["device"] == "interpreter" for r in latest)
    runs = sorted({str(r["run_id"]) for r in latest})  # one per model when they were measured apart
    try:
        env = load_env(results_dir / GENERATE_DIR)
    except ResultsError:
        env = {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "driver") if env.get(k))
    where = env.get("gpu_name") or ("a CPU (Triton interpreter)" if interpreted else "an unknown GPU")
    measured = (f"Measured on **{_md(where)}**, run{'s' if len(runs) > 1 else ''} {_md(', '.join(runs))}"
                + (f" ({_md(versions)})" if versions else "") + ".")
    text = ("Small transformers models with random weights, built from a config, with each attention: the lab's "
            "stages through `stages.hf` (`attn_implementation=\"lab_c\"`, ...) and transformers' own SDPA. "
            "Decode: greedy `model.generate()` with the KV cache, a fixed number of new tokens; tokens/s over "
            "the whole call (median of the timed calls), the first token's time (a one-token generate: the "
            "prompt's prefill and one step) and the time of each later step. With the dynamic cache "
            "(transformers' default) every step runs eagerly, its Python and launches included; with a static "
            "cache `generate` compiles the decode step and replays it as a CUDA graph, and the lab's stages "
            "read the cache's filled length as a key range. Same tokens as SDPA: the share "
            "of the new tokens equal to SDPA's (random weights give nearly flat logits, so one rounding "
            "difference can change a token and all after it). Training step: forward, loss, backward and "
            "AdamW step, median over the timed steps. × SDPA: above 1 when the impl is faster, against SDPA's "
            "row of the same run (the impls of a run share one model and take turns; each impl's latest run "
            "is shown, so impls can come from different runs). × SDPA, fastest calls: the same from each "
            "impl's fastest `generate()` call, steadier than the median where the host is noisy (a decode "
            "step is host-bound: a host that stalls in stretches moves the median by more than the impls "
            "differ). Peak memory: the most allocated during a call, weights, "
            "optimizer state and cache included (1 GB = 10⁹ bytes).")
    if interpreted:
        text += " **Some rows ran in the Triton interpreter on a CPU: their times are not GPU times.**"
    return "\n\n".join([note, measured + " " + text, generate_tables(rows)]) + "\n"


# ------------------------------------------------------------------------------------------------- CLI

def _choice_list(allowed, singular: str, plural: str):
    """An argparse type: a comma-separated list of names from ``allowed``, duplicates dropped."""
    from .cli import _list_of

    def one(name: str) -> str:
        if name not in allowed:
            raise argparse.ArgumentTypeError(f"{singular} must be one of {', '.join(allowed)}, got {name!r}")
        return name

    return lambda text: list(dict.fromkeys(_list_of(one, plural)(text)))


_model_list = _choice_list(MODEL_NAMES, "model", "models")
_pass_list = _choice_list(PASSES, "pass", "passes")
_cache_list = _choice_list(CACHES, "cache", "caches")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import _names, _positive_int
    from stages.contract import DTYPES

    g, t = GPU_SIZES, TINY_SIZES
    p.add_argument("--model", dest="models", type=_model_list, default=list(MODEL_NAMES), metavar="gpt2,llama",
                   help="model shapes: gpt2 (6 layers, 12 heads of 64), llama (6 layers, 16 query / 4 K/V heads of "
                        "128); default both")
    p.add_argument("--impls", type=_names, default=None, metavar="a,b,c,sdpa",
                   help="attention implementations: lab stages (a, b, c, and the CUDA twins on a GPU) and "
                        "transformers' sdpa or eager (default: every stage this machine runs, then sdpa)")
    p.add_argument("--pass", dest="passes", type=_pass_list, default=list(PASSES), metavar="decode,train",
                   help="what to measure (default decode,train)")
    p.add_argument("--cache", dest="caches", type=_cache_list, default=["dynamic"], metavar="dynamic,static",
                   help="decode: the KV cache, dynamic (transformers' default, eager steps) and/or static (on a GPU "
                        "its decode step is compiled and replayed as a CUDA graph); default dynamic")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="model dtype (default bf16 on a GPU, fp32 on a CPU)")
    p.add_argument("--tiny", action=argparse.BooleanOptionalAction, default=None,
                   help="the interpreter sizes (2 layers, hidden 64, 16-token prompts and sequences, "
                        f"{t.new_tokens} new tokens); default: on without a GPU")
    p.add_argument("--layers", type=_positive_int, default=None, help="transformer blocks (GPU default 6)")
    p.add_argument("--heads", type=_positive_int, default=None, help="query heads (GPU default: gpt2 12, llama 16)")
    p.add_argument("--kv-heads", type=_positive_int, default=None,
                   help="key/value heads of the llama shape (GQA; GPU default 4); gpt2 has one per query head")
    p.add_argument("--head-dim", type=_positive_int, default=None, help="head dim (GPU default: gpt2 64, llama 128)")
    p.add_argument("--batch", type=_positive_int, default=None, help=f"decode: sequences (GPU default {g.batch})")
    p.add_argument("--prompt-len", type=_positive_int, default=None,
                   help=f"decode: prompt tokens per sequence (GPU default {g.prompt_len})")
    p.add_argument("--new-tokens", type=_positive_int, default=None,
                   help=f"decode: tokens generated per sequence (GPU default {g.new_tokens})")
    p.add_argument("--train-batch", type=_positive_int, default=None,
                   help=f"train: sequences per step (GPU default {g.train_batch})")
    p.add_argument("--train-seq", type=_positive_int, default=None,
                   help=f"train: tokens per sequence (GPU default {g.train_seq})")
    p.add_argument("--reps", type=_positive_int, default=None,
                   help=f"timed calls per impl and pass (GPU default {g.reps}, CPU {t.reps})")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed calls per impl first (GPU default {g.warmup}, CPU {t.warmup})")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens (default 0)")
    p.add_argument("--out", type=Path, default=None,
                   help="results folder for runs.csv and env.json (default results/<gpu>/generate/ on a GPU, "
                        "a temporary folder on a CPU)")


def resolve_impls(parser: argparse.ArgumentParser, names: list[str] | None) -> list[str]:
    """The impls to run, checked: registered stages this machine can run, and transformers' own."""
    import stages
    from stages import hf

    from .impls import default_stage_names

    runnable = hf.runnable_stage_names()
    if names is None:
        return [n for n in default_stage_names() if n in runnable] + [REFERENCE]
    for n in names:
        if n in TRANSFORMERS_IMPLS or n in runnable:
            continue
        if n in stages.STAGES:
            parser.error(f"argument --impls: stage {n!r} needs a CUDA GPU and this machine has none")
        choices = ", ".join(runnable + list(TRANSFORMERS_IMPLS))
        parser.error(f"argument --impls: unknown impl {n!r}; choose from {choices}")
    return list(dict.fromkeys(names))


def _shapes_and_sizes(args, on_gpu: bool) -> tuple[dict[str, ModelShape], RunSizes]:
    from stages.contract import HEAD_DIMS

    parser = args._parser
    tiny = (not on_gpu) if args.tiny is None else args.tiny
    shapes0, sizes0 = (TINY_SHAPES, TINY_SIZES) if tiny else (GPU_SHAPES, GPU_SIZES)
    shapes = {}
    for name in args.models:
        s = shapes0[name]
        heads = args.heads or s.heads
        if name == "gpt2":
            kv_heads = heads
        else:
            kv_heads = args.kv_heads or (s.kv_heads if heads % s.kv_heads == 0 else heads)
            if heads % kv_heads:
                parser.error(f"argument --kv-heads: the query heads ({heads}) must be a multiple of the key/value "
                             f"heads ({kv_heads})")
        head_dim = args.head_dim or s.head_dim
        if head_dim not in HEAD_DIMS:
            parser.error(f"argument --head-dim: must be a multiple of 8 from {HEAD_DIMS[0]} to {HEAD_DIMS[-1]}, "
                         f"got {head_dim}")
        shapes[name] = replace(s, layers=args.layers or s.layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"argument --warmup: must be 0 or more, got {args.warmup}")
    given = {k: getattr(args, k) for k in ("batch", "prompt_len", "new_tokens", "train_batch", "train_seq", "reps",
                                            "warmup") if getattr(args, k) is not None}
    return shapes, replace(sizes0, **given)


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from stages import hf
    from stages.contract import DTYPES

    from . import cli
    from .results import run_id_now, write_env

    parser = args._parser
    try:
        import transformers
    except ImportError:
        parser.error("transformers is not installed: `pip install -e \".[hf]\"` (transformers 5.17) first")
    impls = resolve_impls(parser, args.impls)
    on_gpu = torch.cuda.is_available()
    shapes, sizes = _shapes_and_sizes(args, on_gpu)
    dtype_name = args.dtype or ("bf16" if on_gpu else "fp32")
    device = torch.device("cuda" if on_gpu else "cpu")
    out = cli._out_dir(args, GENERATE_DIR)  # created and checked writable before anything is measured
    hf.register([n for n in impls if n not in TRANSFORMERS_IMPLS])
    run_id = run_id_now()
    env = cli._environment(run_id)
    env["transformers"] = transformers.__version__
    write_env(out, env)

    console = cli._console()
    where = f"GPU {torch.cuda.get_device_name()}" if on_gpu else "CPU: the stages run in the Triton interpreter"
    console.print(f"[bold]generate[/bold]: {', '.join(args.models)} × {', '.join(impls)}, {dtype_name}, on {where}")
    if not on_gpu:
        console.print("[bold yellow]Times are interpreter times (Triton's CPU interpreter and PyTorch's CPU "
                      "kernels), not GPU times.[/bold yellow]")
    calls_per_pass = (sizes.warmup + sizes.reps) * len(impls)
    rows_written = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as progress:
        # (decode once per cache)
        passes = [(p, c) for p in args.passes for c in (args.caches if p == "decode" else [""])]
        task = progress.add_task("measuring", total=calls_per_pass * len(passes) * len(shapes))
        for name, shape in shapes.items():
            progress.update(task, description=f"{name}: building the model")
            model = build_model(shape, sizes, DTYPES[dtype_name], device, args.seed)
            base = {"run_id": run_id, "model": name, "device": "gpu" if on_gpu else "interpreter", "dtype": dtype_name,
                    "layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads,
                    "head_dim": shape.head_dim, "hidden": shape.hidden, "vocab": shape.vocab}
            progress.console.print(f"  {name}: {shape.describe()}, vocabulary {shape.vocab}, "
                                   f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M parameters")
            for pass_, cache in passes:
                measure, make_rows = PASS_FUNCTIONS[pass_]
                what = f"{pass_} ({cache} cache)" if cache else pass_

                def on_call(impl, name=name, what=what):
                    progress.update(task, description=f"{name} {what}: {impl}")
                    progress.advance(task)

                kind = {"cache": cache} if cache else {}
                runs = measure(model, impls, sizes, on_gpu=on_gpu, seed=args.seed, on_call=on_call, **kind)
                rows = make_rows(runs, base, sizes, **kind)
                append_rows(out, rows)
                rows_written += rows
                for r in rows:
                    progress.console.print("  " + _row_line(r), markup=False)
            del model
            free_memory()
    console.print(f"rows written to {Path(out) / RUNS_CSV} (provenance in env.json)")
    return 0


#: what measures a pass, and what turns its calls into rows
PASS_FUNCTIONS = {"decode": (measure_decode, decode_rows), "train": (measure_train, train_rows)}


def _row_line(r: dict) -> str:
    what = f"{r['model']} {r['pass']:<6}{' ' + r['cache'] if r.get('cache') else ''} {r['impl']:>6}"
    if r.get("ms_median") is None:
        return f"{what}  {r['status']}"
    if r["pass"] == "decode":
        step = "" if r.get("decode_step_ms") is None else f", {r['decode_step_ms']:.2f} ms per later step"
        same = "" if r.get("same_tokens_frac") is None else f", same tokens as sdpa {r['same_tokens_frac']:.0%}"
        return (f"{what}  {r['tokens_per_s']:,.1f} tokens/s, first token {r['ttft_ms']:.1f} ms{step}{same}  "
                f"{r['status']}")
    return f"{what}  {r['ms_median']:.1f} ms per step, {r['tokens_per_s']:,.0f} tokens/s  {r['status']}"
