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
padding tokens. :func:`lab_mask` is registered beside each stage under the same name, and it
returns the least that says what the mask would:

* ``None`` when bottom-right causal (or unmasked, for a bidirectional model) attention over the
  keys passed is the whole story: no padding in the batch, no sliding window, no extra mask
  pattern, and the queries are the newest positions of the cache (always true of the dynamic
  cache). That is SDPA's own shortcut (``masking_utils.sdpa_mask`` with ``allow_is_causal_skip``)
  with one difference: SDPA's causal flag is aligned to the top left, so for a prefill chunk after
  a cache SDPA needs a materialized mask, while the stages need none.
* **key ranges** (:func:`key_ranges_mask`: one start and one end per sequence, int32) when each
  sequence's keys are one unbroken range: a **static cache** (``cache_implementation="static"``), whose
  tensors are as long as the longest sequence they will hold while only the first slots are
  filled, and a **left-padded batch** (prompts of different lengths, padded on the left as
  ``generate`` wants them), whose pads the starts skip. Stages that take key ranges
  (``Stage.key_ranges``: stage C) attend to exactly those keys, causal aligned to the range's end,
  and stage C's backward takes them too, so a left-padded batch also trains.
  The ranges are computed on the device from transformers' own padding mask and cache position,
  without waiting for the GPU, so a compiled decode step replays in a CUDA graph; that is what
  ``generate`` does with a static cache on a GPU, and it takes the host (Python, transformers, the
  launches) out of each step. The mask itself is built before that step, eagerly, once per token,
  so it is one kernel launch (``stages/key_ranges.py``), not the 30 small tensor operations the same
  computation takes written out (those remain for a traced call, which fuses them). They travel as
  a 4-D int32 tensor [B, 1, 1, 2], because ``generate`` builds a static cache's mask before the
  compiled forward and hands it back to the model as its ``attention_mask``, which transformers
  passes on untouched only as a 4-D tensor (the masks it makes itself are bool or float, never int32).
* None again for a causal model's **right padding** (a training batch padded at the end, as data
  collators do it): causality already hides a sequence's trailing pads from each of its real
  tokens, so plain causal attention gives every real token SDPA's output, in every stage. Only the
  pads' own rows differ, and no implementation agrees on those (SDPA attends them to the real
  keys, transformers' FlashAttention-2 path writes zeros, the lab attends them causally, pads
  included); no real token reads them, and a loss that leaves the pads out (labels of -100) gives
  them no gradient, so the logits of the real tokens and every parameter's gradient are SDPA's.
  (A loss over the pads' positions too, or a model's auxiliary loss over every token, would see
  the difference.) Generating after a right-padded prompt puts the new tokens behind the pads, a
  hole, which is refused.
* SDPA's materialized boolean mask for anything else (padding with holes, sliding windows, packed
  sequences, model-specific patterns), which the attention function refuses with one line that
  says what the kernels take and what to use instead.

**Under torch.compile.** The stages are custom ops (``stages/ops.py``), so ``torch.compile(model,
fullgraph=True)`` traces a whole forward and backward. Without a cache and a padding mask (a training
step), transformers looks for packed sequences in the position ids, which it cannot rule out while
tracing, so it composes the causal rule with a packed-sequence mask; :func:`lab_mask` checks on the
device that the composition is the plain rule and hands the kernels plain causal attention (a packed
batch stops at a device-side assert). With a padding mask, the traced call cannot know whether
anything is padded, so it takes key ranges, which on Hopper run the ``tl`` kernels.

**The attention function** (:func:`attention_forward`) has the signature of transformers'
``sdpa_attention_forward`` and returns what it returns: the output transposed to [B, N, H, D] and
``None`` for the attention weights (the kernels never form them). Query, key and value arrive as
[B, H, N, D] views (the query a transpose of the projection's [B, N, H, D] output, the keys and
values the cache's own tensors), which the stages read in place; grouped-query attention passes
fewer key/value heads than query heads, which the stages take as they are (no ``repeat_kv`` copy).
"""

from __future__ import annotations

import torch

from . import STAGES, get_stage, key_ranges

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
_SUPPORTED = ("the lab's kernels take causal (bottom-right aligned) or unmasked attention over one unbroken "
              "range of keys per sequence (padding on one side, never holes)")


class UnsupportedAttention(ValueError):
    """A model asked a lab attention implementation for something the stages do not compute."""


def key_ranges_mask(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The key ranges :func:`lab_mask` hands the attention calls when every sequence's keys are one
    range: sequence b attends to keys ``starts[b] <= j < lengths[b]`` (int32 [B]), causal aligned to
    the range's end; a stage whose ``key_ranges`` is True takes them as ``key_starts`` and
    ``key_lengths``. As a 4-D int32 tensor [B, 1, 1, 2] (start, end), laid out so that each column
    is contiguous and reaches the kernels without a copy."""
    return key_ranges.ranges_mask(torch.stack([starts, lengths]).to(torch.int32))


def is_key_ranges(mask) -> bool:
    """Whether an attention mask is :func:`key_ranges_mask`'s (an int32 [B, 1, 1, 2] tensor)."""
    return (isinstance(mask, torch.Tensor) and mask.dtype == torch.int32 and mask.dim() == 4
            and tuple(mask.shape[1:]) == (1, 1, 2))


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
                      'pad each sequence on one side only (a pad-free batch always works), or use '
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
    * ``attention_mask``: None (:func:`lab_mask` returns None whenever the stages' own causal flag
      says it all) or key ranges (:func:`key_ranges_mask`; a static cache, a left-padded batch:
      passed to a stage that takes them, refused by the others); a boolean or float mask is refused;
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
        # Looked up per call, so a stage re-registered under the same name (a notebook's own kernel) is used.
        stage = get_stage(stage_name)
        ranges = None
        if is_key_ranges(attention_mask):
            if not stage.key_ranges:
                raise _refuse(impl, f"the keys of each sequence are a range (a static cache's filled slots, a "
                                    f"left-padded batch), and stage {stage_name!r} takes no key ranges",
                              'use attn_implementation="lab_c", the default dynamic cache with a pad-free batch, '
                              'or attn_implementation="sdpa"')
            ranges, attention_mask = attention_mask, None
        check_supported(impl, attention_mask, dropout, kwargs, getattr(module, "config", None))
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if ranges is None:
            out = stage.attention(query, key, value, causal=causal, sm_scale=scaling)
        else:
            out = stage.attention(query, key, value, causal=causal, sm_scale=scaling, key_starts=ranges[:, 0, 0, 0],
                                  key_lengths=ranges[:, 0, 0, 1])
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

def _maybe_packed_while_tracing(mask_function, attention_mask, q_length: int, kv_length: int, q_offset,
                                kv_offset: int) -> bool:
    """Whether this is the mask transformers builds for a traced call with neither a cache nor a padding
    mask: the causal rule and (``and_masks``) a packed-sequence mask from the position ids, which
    under tracing it cannot rule out (eager, it finds none and passes the plain rule)."""
    return (torch.compiler.is_compiling() and attention_mask is None and getattr(mask_function, "__name__", "")
            == "and_mask" and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
            and q_length == kv_length)


def lab_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
             mask_function=None, attention_mask: torch.Tensor | None = None, local_size: int | None = None,
             allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False, **kwargs):
    """The mask builder registered beside each stage in ``transformers.AttentionMaskInterface``.

    Called once per forward pass by transformers' ``create_causal_mask`` (or
    ``create_bidirectional_mask``) with the sizes of the attention calls to come: ``q_length``
    queries at positions ``q_offset``.. (a 0-d tensor under a static cache), ``kv_length`` keys at
    positions ``kv_offset``.., the 2-D ``attention_mask`` [B, tokens so far] (True or 1 = a real
    token, False or 0 = padding), ``local_size`` (a sliding window's size) and ``mask_function``
    (transformers' causal or bidirectional rule, or a composition of it with a model's own
    pattern, packed sequences or a block overlay). Returns

    * None when the stage's own causal flag says it all: no padding (or, causal, only right
      padding, which causality hides from every real token: see the module's docstring), no
      window, the plain causal or bidirectional rule, and (causal) the queries are the newest
      positions (``q_offset + q_length == kv_offset + kv_length``, always true of the dynamic
      cache);
    * key ranges (:func:`key_ranges_mask`) when the plain rule over one range of keys per sequence
      does: a static cache (the queries are not the newest slots: the ones after them are
      unfilled), left padding. A static cache's call (``q_offset`` a tensor) waits for nothing: its
      ranges are checked by a device-side assert, so a compiled step can be replayed as a CUDA
      graph; a dynamic cache's eager call reads the padding's verdict on the host once, and a mask
      that no range can express gets the refusal below;
    * otherwise SDPA's materialized boolean mask [B, 1, q_length, kv_length] (through
      ``masking_utils.sdpa_mask``), which :func:`attention_forward` refuses with a clear error.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

    if mask_function is None:  # (not `or`: under torch.compile a mask function is not a bool)
        mask_function = causal_mask_function
    causal = mask_function is causal_mask_function
    plain = causal or mask_function is bidirectional_mask_function
    unwindowed = local_size is None or kv_length < local_size  # a window no longer than the keys changes nothing
    if plain and unwindowed:
        from transformers.utils.import_utils import is_tracing

        static = isinstance(q_offset, torch.Tensor)  # (a static cache's filled length, on the device)
        newest = not static and q_offset + q_length == kv_offset + kv_length
        if attention_mask is None and not static and (newest or not causal):
            return None
        device = kwargs.get("device") or (attention_mask.device if attention_mask is not None else None)
        if device is None and static:
            device = q_offset.device
        # One launch where it can (a static cache's step builds this mask eagerly for every token).
        ranges, flags = key_ranges.key_ranges(attention_mask, batch_size, q_length, kv_length, q_offset, kv_offset,
                                              causal, device)
        if static or (attention_mask is not None and is_tracing(attention_mask)):
            # A compiled or captured step: nothing may wait for the GPU, so a device-side assert
            # stops the program where a range would attend to the wrong keys.
            torch._assert_async(flags[0].all(), "stages.hf: a padding mask with holes cannot be expressed as one key "
                                                "range per sequence")
            return ranges
        fits, whole = flags.tolist()  # (eager, dynamic cache: the one read on the host)
        if all(fits):
            return None if all(whole) else ranges
    elif unwindowed and _maybe_packed_while_tracing(mask_function, attention_mask, q_length, kv_length, q_offset,
                                                    kv_offset):
        # Traced without a cache or a padding mask (a compiled training step), transformers cannot tell
        # whether the position ids pack several sequences into a row, so it always composes the causal
        # rule with a packed-sequence mask. Check on the device that the composition is the plain rule
        # (one sequence per row), without waiting for the GPU, and run plain causal attention.
        device = kwargs.get("device")
        packed = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=0, kv_offset=0,
                           mask_function=mask_function, attention_mask=None, allow_is_causal_skip=False,
                           allow_is_bidirectional_skip=False, **kwargs)
        i, j = torch.arange(q_length, device=device), torch.arange(kv_length, device=device)
        torch._assert_async((packed == (j[None, :] <= i[:, None])).all(), "stages.hf: a mask other than the causal "
                             "rule (packed sequences: position ids that restart inside a row; or a model's own "
                             "pattern), which the lab's kernels do not take")
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
           "implementation_name", "is_key_ranges", "key_ranges_mask", "lab_mask", "register", "runnable_stage_names"]
