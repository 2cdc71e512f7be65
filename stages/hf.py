"""The stages inside Hugging Face transformers models: ``attn_implementation="lab_c"``.

    import stages.hf
    stages.hf.register()                      # lab_a, lab_b, lab_c (and the CUDA twins on a GPU)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="lab_c")
    model.set_attn_implementation("lab_b")    # switch an existing model

This module is optional: ``import stages`` never imports transformers, only ``import stages.hf``
does (``pip install -e ".[hf]"``). It is written against transformers 5.17.

**Why the growing KV cache is the case to care about.** A benchmark calls attention on one fixed
shape. A model generating text calls it on a different shape every step. ``model.generate()``
first runs the prompt through the model (the *prefill*: Nq = Nk = prompt length, causal) and keeps
every layer's keys and values in a cache; each following step feeds one new token, so each layer
calls attention with Nq = 1 against a cache that is one key longer than the step before
(transformers' default ``DynamicCache`` concatenates the new key onto the old ones, so K and V
are fresh tensors at a new address every step). Two things follow. First, masking: the single new
query may see every key in the cache, and a prompt fed in chunks after earlier ones (chunked
prefill, a follow-up turn with ``past_key_values``) must see all the earlier keys plus the causal
triangle of its own. The stages' causal mask is aligned to the bottom right (query i sees key j
iff j <= i + Nk - Nq), which is exactly this rule for every one of those calls, so ``causal=True``
is right in all of them and no mask tensor is needed. Second, cost: a kernel whose host path
recompiled or re-planned per sequence length would pay that on every generated token; the stages
key their compile caches on what changes the kernel (dtype, head dim, GQA ratio, causal), never on
Nk, so the thousandth step costs what the first did.

**What the mask function does.** transformers builds one attention mask per forward pass and
hands it to every layer. Which builder it calls is looked up by the attention implementation's
name in ``AttentionMaskInterface``; a name it does not find there gets *no mask at all*, whatever
padding the batch has. So an attention implementation registered alone would silently attend to
padding tokens. :func:`lab_mask` is registered beside each stage under the same name. It looks at
what the mask would have to express and returns ``None`` exactly when bottom-right causal (or
unmasked, for a bidirectional model) attention over the keys passed is the whole story: no padding
in the batch, no sliding window, no extra mask pattern, and the queries are the newest positions of
the cache (always true of the dynamic cache). That is SDPA's own shortcut
(``masking_utils.sdpa_mask`` with ``allow_is_causal_skip``) with one difference: SDPA's causal flag
is aligned to the top left, so for a prefill chunk after a cache SDPA needs a materialized mask,
while the stages need none. Anything else (padding, a static cache whose unfilled slots must be
masked, packed sequences) gets SDPA's materialized boolean mask, and the attention function refuses
it with one line that says what the kernels take and what to use instead.

**Under torch.compile.** The stages are custom ops (``stages/ops.py``), so ``torch.compile(model,
fullgraph=True)`` traces a whole forward and backward. Give the model a cache (``use_cache=True``, the
default of ``generate``): without one, transformers looks for packed sequences in the position ids,
which it cannot do while tracing, and so builds a mask, which the attention function refuses.

**The attention function** (:func:`attention_forward`) has the signature of transformers'
``sdpa_attention_forward`` and returns what it returns: the output transposed to [B, N, H, D] and
``None`` for the attention weights (the kernels never form them). Query, key and value arrive as
[B, H, N, D] views (the query a transpose of the projection's [B, N, H, D] output, the keys and
values the cache's own tensors), which the stages read in place; grouped-query attention passes
fewer key/value heads than query heads, which the stages take as they are (no ``repeat_kv`` copy).
"""

from __future__ import annotations

import torch

from . import STAGES, get_stage

#: implementation names are this prefix + the stage name: ``lab_a``, ``lab_b``, ``lab_c``, ``lab_c_cuda``
PREFIX = "lab_"

#: Keyword arguments some transformers models pass to their attention function that change what
#: attention computes, none of which the stages implement, with what each one means. A call that
#: sets one (to anything but None) is refused, naming it: a silently ignored window or soft cap would
#: be a wrong answer. Every other keyword (position_ids, use_cache, ...) carries no attention math.
UNSUPPORTED_KWARGS: dict[str, str] = {
    "sliding_window": "sliding-window (local) attention",
    "softcap": "soft-capped attention scores (tanh soft cap, as in Gemma 2)",
    "s_aux": "attention sinks (learned extra logits, as in gpt-oss)",
    "position_bias": "an additive position bias on the scores (T5-style relative attention)",
    "cu_seq_lens_q": "packed variable-length sequences (cumulative sequence lengths)",
    "cu_seq_lens_k": "packed variable-length sequences (cumulative sequence lengths)",
    "max_length_q": "packed variable-length sequences",
    "max_length_k": "packed variable-length sequences",
    "seq_idx": "packed sequences (a sequence index per token)",
    "indices": "sparse attention over selected key indices",
    "block_indices": "block-sparse attention over selected key blocks",
}

#: what the stages compute, for the error messages
_SUPPORTED = "the lab's kernels take causal (bottom-right aligned) or unmasked attention without padding"


class UnsupportedAttention(ValueError):
    """A model asked a lab attention implementation for something the stages do not compute."""


def implementation_name(stage_name: str) -> str:
    """``"c"`` -> ``"lab_c"``: the ``attn_implementation`` string a stage is registered under."""
    return PREFIX + stage_name


def runnable_stage_names() -> list[str]:
    """Every registered stage this machine can run (the CUDA twins only with a CUDA GPU)."""
    return [name for name, s in STAGES.items() if not s.requires_cuda or torch.cuda.is_available()]


# ------------------------------------------------------------------------------------ attention function

def _refuse(impl: str, what: str, instead: str) -> UnsupportedAttention:
    return UnsupportedAttention(f'attn_implementation="{impl}": {what}; {instead}')


def check_supported(impl: str, attention_mask, dropout: float, kwargs: dict, config=None) -> None:
    """Raise :class:`UnsupportedAttention` (one line: what was asked, what the stages take, what to
    use instead) when a call needs anything beyond causal or unmasked, dropout-free attention.
    ``config``: the model's config, whose ``output_attentions`` asks for the weights as the keyword does."""
    if attention_mask is not None:
        shape = "x".join(map(str, getattr(attention_mask, "shape", ()))) or type(attention_mask).__name__
        raise _refuse(impl, f"got an attention mask ({shape}: padding in the batch, a static cache's unfilled "
                            f"slots, packed sequences or a model-specific mask pattern), but {_SUPPORTED}",
                      'use a pad-free batch (equal-length sequences, the default dynamic cache) or '
                      'attn_implementation="sdpa"')
    if dropout:
        raise _refuse(impl, f"attention dropout p={dropout:g} (the model is in training mode), but the kernels "
                            "have no dropout",
                      "set the config's attention dropout to 0 (attention_dropout=0.0 for Llama, attn_pdrop=0.0 "
                      'for GPT-2) or use attn_implementation="sdpa"')
    # Eager, one set operation finds the usual call clean; Dynamo traces the loop (it has no isdisjoint).
    tracing = torch.compiler.is_compiling()
    if tracing or not UNSUPPORTED_KWARGS.keys().isdisjoint(kwargs):
        for name, meaning in UNSUPPORTED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise _refuse(impl, f"the model asks for {meaning} ({name}={_short(kwargs[name])}), but "
                                    f"{_SUPPORTED}", 'use attn_implementation="eager" (transformers\' reference, '
                                                     'which implements it) for this model')
    if kwargs.get("output_attentions") or _config_wants_weights(config, tracing):
        raise _refuse(impl, "output_attentions=True, but the kernels never form the attention weights",
                      'use attn_implementation="eager" to get them')


def _config_wants_weights(config, tracing: bool = False) -> bool:
    """The config's ``output_attentions``. transformers keeps it as ``_output_attentions`` behind a
    property; read from the instance's own attributes (``object.__getattribute__``: not through the
    config class's attribute hooks, which cost microseconds on every attention call of every layer)."""
    if config is None:
        return False
    if tracing:  # (Dynamo reads the property as it is; the hooks cost nothing at run time there)
        return bool(getattr(config, "output_attentions", False))
    try:
        attributes = object.__getattribute__(config, "__dict__")
    except AttributeError:  # (an object without instance attributes)
        attributes = {}
    if "_output_attentions" in attributes:
        return bool(attributes["_output_attentions"])
    return bool(getattr(config, "output_attentions", False))


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor of shape {tuple(value.shape)}"
    return repr(value)[:40]


def attention_forward(stage_name: str):
    """The attention function of stage ``stage_name`` for ``transformers.AttentionInterface``.

    Returns ``forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
    is_causal=None, **kwargs) -> (attn_output [B, Nq, Hq, D], None)``, the signature and result of
    transformers' ``sdpa_attention_forward``. What it does with each argument:

    * ``query`` [B, Hq, Nq, D], ``key``/``value`` [B, Hkv, Nk, D]: passed to the stage as they are
      (strided views are part of the stage contract; Hkv < Hq is grouped-query attention);
    * ``attention_mask``: must be None (:func:`lab_mask` returns None whenever the stages' own
      causal flag says it all); anything else is refused;
    * ``dropout``: must be 0 (it is whenever the model is in eval mode or its config sets no dropout);
    * ``scaling``: the softmax scale (``sm_scale``; None means 1/sqrt(D));
    * ``is_causal``: the call's flag if given, else the module's ``is_causal`` (True for decoder
      self-attention, False for cross-attention and encoders); bottom-right aligned, so right for
      the prefill, for every decode step (one query sees the whole cache) and for a prefill chunk
      after a cache;
    * ``kwargs``: the math-changing ones (:data:`UNSUPPORTED_KWARGS`, ``output_attentions=True``)
      are refused; the rest (position_ids, use_cache, ...) do not concern attention and are ignored.
    """
    impl = implementation_name(stage_name)

    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        check_supported(impl, attention_mask, dropout, kwargs, getattr(module, "config", None))
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        # Looked up per call, so a stage re-registered under the same name (a notebook's own kernel) is used.
        stage = get_stage(stage_name)
        out = stage.attention(query, key, value, causal=causal, sm_scale=scaling)
        # (Eager only: a traced output carries no grad_fn to look at, and the tracer refuses an op without a
        # backward itself.)
        if (not torch.compiler.is_compiling() and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad)
                and out.grad_fn is None):
            # The rest of the model would still backpropagate and train, silently, without the attention's
            # share of the gradient: refuse instead.
            raise _refuse(impl, f"stage {stage_name!r} has no backward pass (its output has no grad_fn), and this "
                                "call needs gradients",
                          "train with lab_a, lab_b or lab_c, or run under torch.no_grad()")
        # [B, Hq, Nq, D] -> [B, Nq, Hq, D], contiguous as sdpa_attention_forward returns it: the models
        # reshape it to [B, Nq, Hq * D] for the output projection.
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = forward.__qualname__ = f"{impl}_attention_forward"
    forward.__doc__ = f"Stage {stage_name!r}'s attention for transformers (see stages.hf.attention_forward)."
    return forward


# ------------------------------------------------------------------------------------------ mask function

def _no_padding(padding_mask: torch.Tensor | None, kv_length: int, kv_offset: int) -> bool:
    """True when no key among the ``kv_length`` ones from ``kv_offset`` on is masked out by the 2-D
    ``padding_mask`` [B, >= kv_offset + kv_length] (True = a real token)."""
    from transformers.utils.import_utils import is_tracing

    if padding_mask is None:
        return True
    if is_tracing(padding_mask):
        # Under torch.compile/export the mask's values are not known while tracing; a branch on them
        # would be baked into the graph. Pass attention_mask=None (a pad-free batch) to compile.
        return False
    window = padding_mask[:, kv_offset:kv_offset + kv_length]
    return bool(window.sum() == window.numel())


def lab_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
             mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
             allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, **kwargs):
    """The mask builder registered beside each stage in ``transformers.AttentionMaskInterface``.

    Called once per forward pass by transformers' ``create_causal_mask`` (or
    ``create_bidirectional_mask``) with the sizes of the attention calls to come: ``q_length``
    queries at positions ``q_offset``.., ``kv_length`` keys at positions ``kv_offset``.., the 2-D
    ``attention_mask`` [B, tokens so far] (True or 1 = a real token, False or 0 = padding) and
    ``local_size`` (a sliding window's size). Returns None, meaning "the stage's own causal flag
    says it all", when

    * no key in the window is padding, no window limits it, and the builder did not add a pattern of
      its own (``allow_is_causal_skip`` / ``allow_is_bidirectional_skip`` say so), and
    * for causal attention, the queries are the newest positions (``q_offset + q_length ==
      kv_offset + kv_length``): then bottom-right alignment is the true mask. The dynamic cache
      always satisfies it; a static cache, whose tensors are longer than the tokens written into
      them, does not.

    Otherwise it returns SDPA's materialized boolean mask [B, 1, q_length, kv_length] (through
    ``masking_utils.sdpa_mask``), which :func:`attention_forward` refuses with a clear error.
    """
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    if mask_function is None:  # (not `or`: under torch.compile a mask function is not a bool)
        mask_function = causal_mask_function
    padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    unpadded = _no_padding(padding_mask, kv_length, kv_offset)
    unwindowed = local_size is None or kv_length < local_size  # a window no longer than the keys changes nothing
    if unpadded and unwindowed:
        newest = q_offset + q_length == kv_offset + kv_length
        if allow_is_causal_skip and bool(newest):
            return None
        if allow_is_bidirectional_skip:
            return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                     **kwargs)


# ----------------------------------------------------------------------------------------------- register

#: one attention function per stage, made once, so registering again installs the very same object
_FORWARDS: dict[str, object] = {}


def register(names: list[str] | tuple[str, ...] | str | None = None) -> list[str]:
    """Register stages as transformers attention implementations; returns the names registered.

    ``names``: stage names (``["c"]``, ``"b,c"``); default every registered stage this machine can
    run (:func:`runnable_stage_names`). Each stage ``s`` is registered as ``"lab_" + s`` in
    ``transformers.AttentionInterface`` (so ``attn_implementation="lab_c"`` works in
    ``from_config``/``from_pretrained`` and ``model.set_attn_implementation``) with :func:`lab_mask`
    under the same name in ``transformers.AttentionMaskInterface``. Registering again is harmless:
    the same functions are installed again. An unknown stage, or a CUDA-only stage without a CUDA
    GPU, raises ``ValueError`` naming the choices.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    runnable = runnable_stage_names()
    chosen = list(runnable if names is None else names)
    for name in chosen:
        if name not in STAGES:
            raise ValueError(f"stages.hf.register: unknown stage {name!r}; registered stages: {', '.join(STAGES)}")
        if name not in runnable:
            raise ValueError(f"stages.hf.register: stage {name!r} needs a CUDA GPU and this machine has none; "
                             f"stages it can run: {', '.join(runnable)}")
    registered = []
    for name in chosen:
        impl = implementation_name(name)
        forward = _FORWARDS.setdefault(name, attention_forward(name))
        AttentionInterface.register(impl, forward)
        AttentionMaskInterface.register(impl, lab_mask)
        registered.append(impl)
    return registered


__all__ = ["PREFIX", "UNSUPPORTED_KWARGS", "UnsupportedAttention", "attention_forward", "check_supported",
           "implementation_name", "lab_mask", "register", "runnable_stage_names"]
