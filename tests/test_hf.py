"""The stages inside transformers models (stages/hf.py): tiny random Llama (grouped-query attention)
and GPT-2 models whose attention runs through ``attn_implementation="lab_<stage>"``, checked against
transformers' own ``"sdpa"`` on the same weights and tokens: logits, every parameter's gradient,
greedy ``generate()`` with the KV cache, a prompt fed in two chunks; and the clear refusals
(padding with holes, dropout, sliding windows, a stage without a backward).

CPU: the stages run in the Triton interpreter, so the models are tiny (2 layers, hidden 64, head
dim 16, a dozen tokens).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is the optional [hf] extra")

import stages  # noqa: E402
from stages import hf  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 128
TOKENS = 12

#: Relative error bounds against SDPA on the same weights, by the model's dtype. fp32: both compute
#: exact attention in fp32 and differ only in summation order (measured here: 2e-7 on the logits,
#: 5e-7 on the worst parameter's gradient). bf16: every activation is rounded to 8 significant bits
#: along the way, in different places by the two (measured: up to 5e-3 on the logits, 1e-2 on a
#: gradient, stage A's unfused softmax the furthest).
LOGITS_REL_ERR = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
GRAD_REL_ERR = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


def llama_config(**overrides):
    """A tiny Llama with grouped-query attention: 4 query heads share 2 K/V heads, head dim 16."""
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
               attention_dropout=0.0)
    return transformers.LlamaConfig(**{**cfg, **overrides})


def gpt2_config(**overrides):
    """A tiny GPT-2: 4 heads of head dim 16, no dropout (the kernels have none)."""
    cfg = dict(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
               attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    return transformers.GPT2Config(**{**cfg, **overrides})


MODELS = {"llama": (transformers.LlamaForCausalLM, llama_config),
          "gpt2": (transformers.GPT2LMHeadModel, gpt2_config)}


@pytest.fixture(scope="module", autouse=True)
def registered():
    return hf.register()


def make_model(kind: str, dtype=torch.float32, **overrides):
    cls, config = MODELS[kind]
    torch.manual_seed(0)
    return cls(config(**overrides)).to(DEVICE, dtype).eval()


def token_ids(batch: int = 2, n: int = TOKENS, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, n), generator=g).to(DEVICE)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def logits(model, impl: str, ids, **kwargs) -> torch.Tensor:
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(ids, **kwargs).logits.float()


# ------------------------------------------------------------------------------------------ registering

def test_register_names_every_runnable_stage():
    names = hf.register()
    assert names == [f"lab_{n}" for n in hf.runnable_stage_names()]
    assert {"lab_a", "lab_b", "lab_c"} <= set(names)
    assert hf.register(["c"]) == ["lab_c"] and hf.register("b,c") == ["lab_b", "lab_c"]


def test_register_is_idempotent():
    from transformers import AttentionInterface, AttentionMaskInterface

    hf.register()
    first = AttentionInterface._global_mapping["lab_c"]
    hf.register()
    hf.register(["c"])
    assert AttentionInterface._global_mapping["lab_c"] is first
    assert AttentionMaskInterface._global_mapping["lab_c"] is hf.lab_mask
    model = make_model("llama")
    ids = token_ids()
    assert rel_err(logits(model, "lab_c", ids), logits(model, "sdpa", ids)) < LOGITS_REL_ERR[torch.float32]


def test_register_refuses_unknown_and_cuda_only_stages():
    with pytest.raises(ValueError, match="unknown stage .zz.; registered stages: a, b, "):
        hf.register(["zz"])
    cuda_only = [n for n, s in stages.STAGES.items() if s.requires_cuda]
    if cuda_only and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            hf.register([cuda_only[0]])


def test_import_stages_does_not_import_transformers():
    code = "import sys, stages; sys.exit(1 if 'transformers' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0


def test_from_config_takes_the_lab_name():
    cls, config = MODELS["llama"]
    model = cls._from_config(config(), attn_implementation="lab_c")
    assert model.config._attn_implementation == "lab_c"


# ------------------------------------------------------------------------------------- forward and backward

@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", ["c", "b", "a"])
def test_logits_match_sdpa(kind, stage):
    model = make_model(kind)
    ids = token_ids()
    err = rel_err(logits(model, f"lab_{stage}", ids), logits(model, "sdpa", ids))
    assert err < LOGITS_REL_ERR[torch.float32], err


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_logits_match_sdpa_bf16(kind):
    model = make_model(kind, torch.bfloat16)
    ids = token_ids()
    err = rel_err(logits(model, "lab_c", ids), logits(model, "sdpa", ids))
    assert err < LOGITS_REL_ERR[torch.bfloat16], err


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_attention_is_causal(kind):
    """A token's logits cannot depend on later tokens; with is_causal=False they do, so the check
    has teeth (and the non-causal run still matches SDPA's non-causal one)."""
    model = make_model(kind)
    ids = token_ids()
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    before, after = logits(model, "lab_c", ids), logits(model, "lab_c", changed)
    assert torch.equal(before[:, :-1], after[:, :-1])
    full = logits(model, "lab_c", ids, is_causal=False)
    assert rel_err(full, before) > 1e-2
    assert rel_err(full, logits(model, "sdpa", ids, is_causal=False)) < LOGITS_REL_ERR[torch.float32]


def gradients(model, impl: str, ids) -> dict[str, torch.Tensor]:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind, stage, dtype", [(kind, stage, torch.float32) for kind in ("llama", "gpt2")
                                                for stage in ("c", "b", "a")]
                         + [("llama", "c", torch.bfloat16), ("gpt2", "c", torch.bfloat16)])
def test_gradients_match_sdpa(kind, stage, dtype):
    model = make_model(kind, dtype).train()  # no dropout in these configs: train mode changes nothing else
    ids = token_ids()
    mine, ref = gradients(model, f"lab_{stage}", ids), gradients(model, "sdpa", ids)
    assert mine.keys() == ref.keys() and len(ref) == len(list(model.parameters()))
    errors = {name: rel_err(mine[name], ref[name]) for name in ref}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRAD_REL_ERR[dtype], (worst, errors[worst])
    # the attention's own weights get gradients only through the stage's backward
    attn = [n for n in ref if ("q_proj" in n or "k_proj" in n or "c_attn" in n)]
    assert attn and all(mine[n].abs().sum() > 0 for n in attn)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_compiled_training_step_is_one_graph_and_equals_eager(kind):
    """``torch.compile(fullgraph=True)`` of a transformers model's loss with lab_c, as a training step
    calls it (no cache, no padding mask: transformers composes a packed-sequence mask it cannot rule out
    while tracing, which the lab's mask checks on the device): one graph, the stage's custom ops inside
    it with no key ranges, loss and every gradient as in eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = make_model(kind).train()
    model.set_attn_implementation("lab_c")
    ids = token_ids()

    def loss(ids):  # (the loss by hand: GPT-2's own loss path logs a one-time warning, which Dynamo cannot trace)
        logits = model(ids, use_cache=False).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)(ids)
    compiled.backward()
    traced = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager = loss(ids)
    eager.backward()
    assert counter.frame_count == 1
    forwards = [n for n in counter.graphs[0].graph.nodes if n.target is torch.ops.attention_lab.c_forward.default]
    ranged = [n for n in forwards if n.kwargs.get("key_starts") is not None or any(
        isinstance(a, torch.fx.Node) for a in n.args[16:])]
    assert forwards and not ranged, "expected the plain causal call, no key ranges"
    assert torch.equal(compiled, eager)
    for name, p in model.named_parameters():
        torch.testing.assert_close(traced[name], p.grad, rtol=0, atol=0, msg=name)
    torch._dynamo.reset()


def test_a_packed_batch_under_compile_stops_on_the_device():
    """Position ids that restart inside a row pack two sequences: eager, transformers sees it and the
    lab refuses its mask in one line; traced, it cannot see it, and the lab's device-side check stops
    the program (on the CPU, at once) instead of attending across the two sequences."""
    model = make_model("llama")
    model.set_attn_implementation("lab_c")
    ids = token_ids(batch=1)
    packed = torch.cat([torch.arange(5), torch.arange(TOKENS - 5)])[None].to(DEVICE)
    with pytest.raises(hf.UnsupportedAttention):
        model(ids, position_ids=packed, use_cache=False)
    if DEVICE == "cuda":
        # A device-side assert leaves the process's CUDA context unusable (every later call in it
        # fails): trip it in a child process and read the assert's message from its stderr.
        here = Path(__file__).resolve().parent
        path = os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=path)
        child = subprocess.run([sys.executable, "-c", "import test_hf; test_hf._run_packed_batch_compiled()"],
                               cwd=str(here), env=env, capture_output=True, text=True, timeout=600)
        assert child.returncode != 0 and "packed sequences" in child.stderr, child.stderr[-2000:]
        return
    with pytest.raises(RuntimeError, match="packed sequences"):
        _run_packed_batch_compiled()


def _run_packed_batch_compiled():
    """The traced call of a packed batch (``test_a_packed_batch_under_compile_stops_on_the_device``)."""
    hf.register(["c"])
    model = make_model("llama")
    model.set_attn_implementation("lab_c")
    ids = token_ids(batch=1)
    packed = torch.cat([torch.arange(5), torch.arange(TOKENS - 5)])[None].to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids, pos: model(ids, position_ids=pos, use_cache=False).logits,
                             backend="aot_eager", fullgraph=True)
    try:
        compiled(ids, packed)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    finally:
        torch._dynamo.reset()


# -------------------------------------------------------------------------------------------- the KV cache

@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", ["c", "b", "a"])
def test_generate_with_kv_cache_matches_sdpa(kind, stage):
    """Greedy decoding: the prefill (Nq = Nk = prompt) then one-token steps against a cache that
    grows by one key per step, all with causal=True (bottom-right: one query sees every key)."""
    model = make_model(kind)
    ids = token_ids()

    def greedy(impl):
        model.set_attn_implementation(impl)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, min_new_tokens=5,
                             do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:]

    mine, ref = greedy(f"lab_{stage}"), greedy("sdpa")
    assert mine.shape == (2, 5) and torch.equal(mine, ref)


def pad_left(ids: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` with its first ``pads[b]`` tokens of sequence b turned into padding, and the mask."""
    mask = torch.ones_like(ids)
    for b, n in enumerate(pads):
        mask[b, :n] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_left_padded_batch_matches_sdpa(kind):
    """Prompts of different lengths padded on the left: each sequence's real tokens get SDPA's logits
    (the pads are skipped by a key range per sequence; the pads' own rows are not compared)."""
    model = make_model(kind)
    ids, mask = pad_left(token_ids(batch=3), [3, 0, 7])
    mine, ref = logits(model, "lab_c", ids, attention_mask=mask), logits(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    assert rel_err(mine[real], ref[real]) < LOGITS_REL_ERR[torch.float32]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("cache", ["static", "dynamic"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
def test_generate_with_a_static_cache_or_left_padding_matches_sdpa(kind, cache, padded):
    """A static cache (its K/V as long as prompt + new tokens, the filled length a key range) and a
    left-padded batch (the pads skipped), in greedy generation: SDPA's tokens."""
    model = make_model(kind)
    ids, mask = pad_left(token_ids(), [4, 0] if padded else [0, 0])
    options = {"cache_implementation": "static"} if cache == "static" else {}

    def greedy(impl):
        model.set_attn_implementation(impl)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             pad_token_id=0, **options)
        return out[:, ids.shape[1]:]

    assert torch.equal(greedy("lab_c"), greedy("sdpa"))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_static_cache_generate_compiles_its_decode_step_into_one_graph(kind):
    """What ``generate`` does with a static cache on a GPU, with the ``aot_eager`` backend here: the
    decode step compiled with ``fullgraph=True`` (the stage a custom op, the key ranges tensors), one
    graph for every step (the growing length is data, not a shape), SDPA's tokens."""
    model = make_model(kind)
    ids, mask = pad_left(token_ids(), [4, 0])
    compile_config = transformers.CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    compile_config._compile_all_devices = True  # (transformers compiles only on accelerators otherwise)
    graphs = []
    real_compile = torch.compile

    def counting_compile(fn, **kwargs):
        backend = kwargs.pop("backend")

        def count(gm, example_inputs):
            graphs.append(gm)
            return torch._dynamo.lookup_backend(backend)(gm, example_inputs)
        return real_compile(fn, backend=count, **kwargs)

    def greedy(impl, **options):
        model.set_attn_implementation(impl)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             pad_token_id=0, cache_implementation="static", **options)
        return out[:, ids.shape[1]:]

    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", counting_compile)
        mine = greedy("lab_c", compile_config=compile_config)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 decode steps"
    assert any(node.target is torch.ops.attention_lab.c_forward.default for node in graphs[0].graph.nodes)
    assert torch.equal(mine, greedy("sdpa"))


def test_prompt_in_two_chunks_matches_sdpa():
    """The second chunk's 5 queries against 12 keys: causal bottom-right (query i sees the 7 cached
    keys and its own chunk up to i). SDPA needs a materialized mask here; the lab mask needs none."""
    model = make_model("llama")
    ids = token_ids()

    def second_chunk(impl):
        model.set_attn_implementation(impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :7], past_key_values=cache, use_cache=True)
            return model(ids[:, 7:], past_key_values=cache, use_cache=True).logits

    whole = logits(model, "sdpa", ids)[:, 7:]
    mine = second_chunk("lab_c")
    assert rel_err(mine, second_chunk("sdpa")) < LOGITS_REL_ERR[torch.float32]
    assert rel_err(mine, whole) < LOGITS_REL_ERR[torch.float32]


# --------------------------------------------------------------------------------------------- the mask

def test_mask_is_none_without_padding_and_for_the_growing_cache():
    ones = torch.ones(2, 12, dtype=torch.bool)
    assert hf.lab_mask(2, 12, 12) is None
    assert hf.lab_mask(2, 12, 12, attention_mask=ones) is None
    assert hf.lab_mask(2, 1, 12, q_offset=11, attention_mask=ones) is None      # a decode step
    assert hf.lab_mask(2, 5, 12, q_offset=7, attention_mask=ones) is None       # a chunk after a cache


def ranges_of(mask) -> list[tuple[int, int]]:
    assert hf.is_key_ranges(mask), mask
    return [tuple(r) for r in mask[:, 0, 0].tolist()]


def test_left_padding_and_a_static_cache_are_key_ranges():
    padded = torch.ones(2, 12, dtype=torch.bool)
    padded[0, :3] = False
    assert ranges_of(hf.lab_mask(2, 12, 12, attention_mask=padded)) == [(3, 12), (0, 12)]
    assert ranges_of(hf.lab_mask(2, 1, 13, q_offset=12, attention_mask=torch.cat(  # a decode step after it
        [padded, torch.ones(2, 1, dtype=torch.bool)], dim=1))) == [(3, 13), (0, 13)]
    # A static cache: 16 slots, the first 12 filled; its length is a device tensor (so nothing waits for it).
    filled = torch.tensor(11)
    assert ranges_of(hf.lab_mask(2, 1, 16, q_offset=filled, attention_mask=torch.ones(2, 12, dtype=torch.bool))) == [
        (0, 12), (0, 12)]
    assert ranges_of(hf.lab_mask(2, 1, 16, q_offset=filled, attention_mask=padded)) == [(3, 12), (0, 12)]
    # A bidirectional model's right padding: each sequence's range ends at its last real token.
    right = torch.ones(2, 12, dtype=torch.bool)
    right[1, 9:] = False
    assert ranges_of(hf.lab_mask(2, 12, 12, attention_mask=right,
                                 mask_function=transformers.masking_utils.bidirectional_mask_function)) == [
        (0, 12), (0, 9)]


def test_mask_is_materialized_for_holes():
    holes = torch.ones(2, 12, dtype=torch.bool)
    holes[0, 5] = False
    mask = hf.lab_mask(2, 12, 12, attention_mask=holes)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 12, 12) and not mask[0, 0, :, 5].any()
    # A decode step after a right-padded prompt: the new token sits behind the pads.
    after_right = torch.ones(2, 13, dtype=torch.bool)
    after_right[1, 9:12] = False
    assert hf.lab_mask(2, 1, 13, q_offset=12, attention_mask=after_right).dtype == torch.bool


def test_right_padding_of_a_causal_model_needs_no_mask():
    """Causality hides a sequence's trailing pads from its real tokens: plain causal attention (None)
    for right padding alone, one range per sequence (its start) for padding on both sides."""
    right = torch.ones(3, 12, dtype=torch.bool)
    right[1, 9:] = False
    right[2, 1:] = False  # (one real token)
    assert hf.lab_mask(3, 12, 12, attention_mask=right) is None
    both = right.clone()
    both[0, :2] = False
    assert ranges_of(hf.lab_mask(3, 12, 12, attention_mask=both)) == [(2, 12), (0, 12), (0, 12)]
    # A static cache's prefill of right-padded prompts: the filled slots, each sequence from its start.
    assert ranges_of(hf.lab_mask(3, 12, 16, q_offset=torch.tensor(0), attention_mask=both)) == [
        (2, 12), (0, 12), (0, 12)]


def test_a_static_cache_mask_with_holes_stops_on_the_device():
    """A static cache's ranges are not read on the host (that would wait for the GPU every step): a
    mask they cannot express trips a device-side assert instead (on the CPU, at once)."""
    holes = torch.ones(2, 12, dtype=torch.bool)
    holes[0, 5] = False
    with pytest.raises(RuntimeError, match="cannot be expressed as one key range per sequence"):
        hf.lab_mask(2, 1, 16, q_offset=torch.tensor(11), attention_mask=holes)


# ------------------------------------------------------------------------------------------ the refusals

def one_line_error(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text
    return text


def test_a_mask_with_holes_is_refused_in_one_line():
    model = make_model("llama")
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, 4] = 0
    model.set_attn_implementation("lab_c")
    with pytest.raises(hf.UnsupportedAttention) as excinfo:
        model(ids, attention_mask=mask)
    text = one_line_error(excinfo)
    assert "lab_c" in text and "never holes" in text and "one side only" in text and '"sdpa"' in text


def pad_right(ids: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``ids`` with its last ``pads[b]`` tokens of sequence b turned into padding, and the mask."""
    mask = torch.ones_like(ids)
    for b, n in enumerate(pads):
        if n:
            mask[b, -n:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("stage", ["c", "b", "a"])
def test_right_padded_batch_matches_sdpa(kind, stage):
    """A batch padded on the right, as training batches are: every stage runs it as plain causal
    attention, and each real token gets SDPA's logits (the pads' own rows differ and are not compared)."""
    model = make_model(kind)
    ids, mask = pad_right(token_ids(batch=3), [0, 4, 9])
    mine, ref = logits(model, f"lab_{stage}", ids, attention_mask=mask), logits(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    assert rel_err(mine[real], ref[real]) < LOGITS_REL_ERR[torch.float32]


def test_a_batch_padded_on_both_sides_matches_sdpa():
    model = make_model("llama")
    ids, mask = pad_right(token_ids(batch=3), [3, 0, 5])
    mask[1:, :2] = 0
    ids = ids.masked_fill(mask == 0, 0)
    mine, ref = logits(model, "lab_c", ids, attention_mask=mask), logits(model, "sdpa", ids, attention_mask=mask)
    real = mask.bool()
    assert rel_err(mine[real], ref[real]) < LOGITS_REL_ERR[torch.float32]


def test_generating_after_a_right_padded_prompt_is_refused_in_one_line():
    """The prompt runs (its real tokens are right); the first new token would follow the pads, a hole."""
    model = make_model("llama")
    ids, mask = pad_right(token_ids(), [0, 3])
    model.set_attn_implementation("lab_c")
    with pytest.raises(hf.UnsupportedAttention) as excinfo:
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert "never holes" in one_line_error(excinfo)


@pytest.mark.parametrize("kind,side,stage", [("llama", "left", "c"), ("gpt2", "left", "c"),
                                             ("llama", "right", "c"), ("gpt2", "right", "b")])
def test_a_padded_batch_trains_with_sdpa_s_gradients(kind, side, stage):
    """A padded batch in training. Left padding: the key ranges go through stage C's backward (keys
    outside a range get zero gradients). Right padding: plain causal attention, in any stage with a
    backward; the pads' rows are not SDPA's, and take no part in the loss. Either way every
    parameter's gradient equals SDPA's on the same loss over the real tokens."""
    model = make_model(kind)
    ids, mask = (pad_left if side == "left" else pad_right)(token_ids(batch=3), [3, 0, 6])
    labels = ids.masked_fill(mask == 0, -100)  # the pads take no part in the loss

    def grads(impl):
        model.set_attn_implementation(impl)
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=labels).loss.backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    mine, ref = grads(f"lab_{stage}"), grads("sdpa")
    assert mine.keys() == ref.keys()
    worst = max(rel_err(mine[n], ref[n]) for n in ref)
    assert worst < GRAD_REL_ERR[torch.float32], worst


@pytest.mark.parametrize("stage", ["b", "a"])
def test_a_stage_without_key_ranges_refuses_padding_in_one_line(stage):
    model = make_model("llama")
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model.set_attn_implementation(f"lab_{stage}")
    with pytest.raises(hf.UnsupportedAttention) as excinfo:
        model(ids, attention_mask=mask)
    text = one_line_error(excinfo)
    assert f"lab_{stage}" in text and "takes no key ranges" in text and '"lab_c"' in text


def test_dropout_in_training_is_refused():
    model = make_model("gpt2", attn_pdrop=0.1).train()
    model.set_attn_implementation("lab_c")
    with pytest.raises(hf.UnsupportedAttention) as excinfo:
        model(token_ids())
    assert "dropout p=0.1" in one_line_error(excinfo)
    model.eval()  # no dropout at inference: fine
    with torch.no_grad():
        model(token_ids())


@pytest.mark.parametrize("kwarg, value", [("sliding_window", 4), ("softcap", 30.0), ("s_aux", torch.zeros(4)),
                                          ("position_bias", torch.zeros(1, 4, 3, 3)),
                                          ("cu_seq_lens_q", torch.tensor([0, 3])), ("output_attentions", True)])
def test_math_changing_kwargs_are_refused(kwarg, value):
    forward = hf.attention_forward("c")
    q = k = v = torch.randn(1, 4, 3, 16, device=DEVICE)
    with pytest.raises(hf.UnsupportedAttention) as excinfo:
        forward(torch.nn.Module(), q, k, v, None, **{kwarg: value})
    assert kwarg in one_line_error(excinfo)
    # None (a full-attention layer of a model that has windows elsewhere) is fine
    if kwarg != "output_attentions":
        out, weights = forward(torch.nn.Module(), q, k, v, None, **{kwarg: None}, position_ids=None, use_cache=True)
        assert out.shape == (1, 3, 4, 16) and weights is None


def test_a_config_asking_for_the_attention_weights_is_refused():
    """``output_attentions`` set on the model's config (read without the config's attribute hooks,
    so a wrong read would let it through silently)."""
    from types import SimpleNamespace

    forward = hf.attention_forward("c")
    q = k = v = torch.randn(1, 4, 3, 16, device=DEVICE)
    wants = transformers.GPT2Config(output_attentions=True)
    assert wants.output_attentions
    with pytest.raises(hf.UnsupportedAttention, match="output_attentions"):
        forward(SimpleNamespace(config=wants, is_causal=True), q, k, v, None)
    with pytest.raises(hf.UnsupportedAttention, match="output_attentions"):
        forward(SimpleNamespace(config=SimpleNamespace(output_attentions=True)), q, k, v, None)
    out, _ = forward(SimpleNamespace(config=transformers.GPT2Config(), is_causal=True), q, k, v, None)
    assert out.shape == (1, 3, 4, 16)


def test_a_stage_without_a_backward_is_refused_under_grad(fake_stages):
    from dataclasses import replace

    c = stages.get_stage("c")
    fake_stages(replace(c, name="nobwd", attention=lambda q, k, v, **kw: c.attention(q, k, v, **kw).detach()))
    forward = hf.attention_forward("nobwd")
    q = torch.randn(1, 2, 3, 16, device=DEVICE, requires_grad=True)
    with pytest.raises(hf.UnsupportedAttention, match="no backward"):
        forward(torch.nn.Module(), q, q, q, None)
    with torch.no_grad():
        forward(torch.nn.Module(), q, q, q, None)  # inference needs none


# ---------------------------------------------------------------------------------------------- on a GPU

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_cuda_twins_serve_a_model_and_refuse_to_train_it(kind):
    """The CUDA C++ twins have no backward: a model decodes with them and gives SDPA's logits, and a
    training step is refused instead of training without the attention's gradients."""
    twins = [n for n, s in stages.STAGES.items() if s.requires_cuda]
    assert twins, "no CUDA twin registered"
    # The twins take what flash_b.cu and flash_c.cu were written for: head dim 64 or 128, one K/V head
    # per query head (no GQA), and a prefill (Nq = Nk).
    wide = {"llama": dict(hidden_size=256, head_dim=64, num_key_value_heads=4), "gpt2": dict(n_embd=256)}[kind]
    model = make_model(kind, torch.bfloat16, **wide)
    ids = token_ids()
    ref = logits(model, "sdpa", ids)
    for twin in twins:
        err = rel_err(logits(model, f"lab_{twin}", ids), ref)
        assert err < LOGITS_REL_ERR[torch.bfloat16], (twin, err)
        model.train()
        with pytest.raises(hf.UnsupportedAttention, match="no backward"):
            gradients(model, f"lab_{twin}", ids)
        model.eval()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_gpu_static_cache_generate_replays_cuda_graphs(kind):
    """On a GPU, ``generate`` with a static cache compiles the decode step (inductor,
    ``mode="reduce-overhead"``: CUDA graphs) by itself: with stage C (a custom op taking the filled
    length as a key range) it runs, with a left-padded batch too, and gives SDPA's tokens (fp32, so
    that rounding cannot flip a greedy choice); later calls replay what the first captured, running
    none of the stage's Python in their decode steps."""
    model = make_model(kind)
    ids, mask = pad_left(token_ids(), [4, 0])

    def greedy(impl):
        model.set_attn_implementation(impl)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0, cache_implementation="static")
        return out[:, ids.shape[1]:]

    from stages.c_optimized import kernels

    torch._dynamo.reset()
    first = greedy("lab_c")
    assert torch.equal(greedy("lab_c"), first)
    # Recorded by now: a third call's decode steps run none of the stage's Python (a graph that was not
    # captured, or is recorded again every step, would call it once per layer and step).
    calls = []
    with pytest.MonkeyPatch.context() as mp:
        real = kernels._forward
        mp.setattr(kernels, "_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        assert torch.equal(greedy("lab_c"), first)
    layers = model.config.num_hidden_layers  # (the prompt's prefill, one call per layer)
    assert len(calls) <= layers, f"{len(calls)} calls of stage C's Python in one generate(): the decode steps ran it"
    assert torch.equal(first, greedy("sdpa"))
