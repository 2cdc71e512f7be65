"""Helpers shared by the stage tests: fresh inputs and the error checks against float64."""

from __future__ import annotations

import torch

from harness.reference import (reference_attention, reference_gradients, rel_err, torch_same_precision,
                               torch_same_precision_gradients)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: Errors below this are rounding noise whatever PyTorch achieves (fp32 errors are ~1e-7).
ABS_FLOOR = {"fp16": 2e-3, "bf16": 1.6e-2, "fp32": 1e-5}


def make_qkv(B, H, N, D, dtype, device, *, layout="bhnd", scale=1.0, seed=None, Hkv=None, Nk=None):
    """Fresh random q ``[B, H, N, D]`` and k, v ``[B, Hkv, Nk, D]`` (Hkv, Nk default to H, N).
    ``layout="bnhd"`` gives strided views: a [B, N, H, D] tensor transposed to [B, H, N, D], as a
    model that keeps heads interleaved would pass them."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    Hkv = H if Hkv is None else Hkv
    Nk = N if Nk is None else Nk

    def one(h, n):
        shape = (B, n, h, D) if layout == "bnhd" else (B, h, n, D)
        t = (torch.randn(shape, generator=g) * scale).to(dtype).to(device)
        return t.transpose(1, 2) if layout == "bnhd" else t
    return one(H, N), one(Hkv, Nk), one(Hkv, Nk)


def _bound(torch_err: float, dtype_name: str, factor: float) -> float:
    return max(factor * torch_err, ABS_FLOOR[dtype_name])


def check_against_reference(o, q, k, v, *, causal, dtype_name, sm_scale=None, factor=2.0):
    """The stage's error must be within ``factor``× PyTorch's own same-precision error (or under the
    rounding floor), every element finite, shape and dtype preserved. Returns (err, torch_err)."""
    assert o.shape == q.shape and o.dtype == q.dtype
    assert torch.isfinite(o).all(), "output has NaN/inf: an element was not written, or overflowed"
    ref = reference_attention(q, k, v, causal=causal, sm_scale=sm_scale)
    err = rel_err(o, ref)
    same = torch_same_precision(q, k, v, causal=causal, sm_scale=sm_scale)
    torch_err = rel_err(same, ref)
    assert err <= _bound(torch_err, dtype_name, factor), (
        f"relative error {err:.3e} vs PyTorch same-precision {torch_err:.3e}")
    # Each head separately, so a batch/head offset bug (an error of order 1) cannot hide behind a good
    # average. A head's rounding error may be 4x the whole call's bound, or 4x what PyTorch's same-precision
    # formulation makes on that head: a head of a few elements at huge logits is one rounding of a score
    # or two, whichever formulation makes it. A head whose reference is all zeros (every row masked) must
    # be exactly zero.
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            if not ref[b, h].any():
                assert not o[b, h].any(), f"head (b={b}, h={h}) should be all zeros"
                continue
            head_err = rel_err(o[b, h], ref[b, h])
            if head_err <= 4 * _bound(torch_err, dtype_name, factor):
                continue
            assert head_err <= 4 * rel_err(same[b, h], ref[b, h]), (
                f"head (b={b}, h={h}) error {head_err:.3e}")
    return err, torch_err


def check_gradients(attention, q, k, v, *, causal, dtype_name, sm_scale=None, factor=3.0, do=None, abs_floor=None,
                    reference=reference_gradients, **kwargs):
    """Run ``attention`` forward and backward; dq, dk, dv must each be within ``factor``× PyTorch's
    same-precision autograd error against float64 autograd (or under the rounding floor), finite,
    and of their input's shape and dtype. ``abs_floor`` replaces the dtype's rounding floor (a number,
    or a callable ``(q, k, v, do) -> {"dq": floor, ...}``); ``reference`` the float64 gradients the
    kernel's are held to (a function like :func:`reference_gradients`). Returns {name: (err, torch_err)}."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o = attention(q, k, v, causal=causal, sm_scale=sm_scale, **kwargs)
    if do is None:
        do = torch.randn(o.shape, dtype=torch.float32).to(o.dtype).to(o.device)
    o.backward(do)
    if callable(abs_floor):
        floors = abs_floor(q, k, v, do)
    elif abs_floor is None and dtype_name in ("fp16", "bf16"):
        floors = half_rounding_floors(q, k, v, do, causal=causal, sm_scale=sm_scale)
    else:
        floors = dict.fromkeys(("dq", "dk", "dv"), ABS_FLOOR[dtype_name] if abs_floor is None else abs_floor)
    exact = reference_gradients(q, k, v, do, causal=causal, sm_scale=sm_scale)
    refs = exact if reference is reference_gradients else reference(q, k, v, do, causal=causal, sm_scale=sm_scale)
    same = torch_same_precision_gradients(q, k, v, do, causal=causal, sm_scale=sm_scale)
    out = {}
    for name, t, ref, tp, ex in zip(("dq", "dk", "dv"), (q, k, v), refs, same, exact):
        g = t.grad
        assert g is not None, f"{name} was not computed"
        assert g.shape == t.shape and g.dtype == t.dtype, f"{name}: shape/dtype {g.shape}/{g.dtype}"
        assert torch.isfinite(g).all(), f"{name} has NaN/inf"
        if not ref.any():
            # e.g. dq when every row sees one key (softmax of one score is 1 whatever the score):
            # zero in exact arithmetic, rounding noise in a kernel that computes P·(dP - delta)
            bound = max(ABS_FLOOR[dtype_name], cancellation_floors(q, k, v, do, sm_scale=sm_scale)[name])
            assert g.abs().max() <= bound, f"{name} should be zero, max |{name}| = {g.abs().max()} (bound {bound:.2e})"
            out[name] = (0.0, 0.0)
            continue
        err, torch_err = rel_err(g, ref), rel_err(tp, ex)  # (PyTorch's error: against the exact gradients)
        assert err <= max(factor * torch_err, floors[name]), (
            f"{name}: relative error {err:.3e} vs PyTorch same-precision {torch_err:.3e}")
        out[name] = (err, torch_err)
    return out


def cancellation_floors(q, k, v, do, *, sm_scale=None) -> dict:
    """Per gradient, the rounding noise a correct kernel leaves in a gradient that is exactly zero (dQ and
    dK where every row sees one key, whose probability is 1 whatever its score): dS = P ∘ (dP − Δ) is then
    zero only in exact arithmetic, and float32's dot products for dP = dO·Vᵀ and Δ = rowsum(dO ∘ O) leave
    about 2⁻²³·|dO_i|·|V_j| in it, which dQ = scale·dS·K carries times |K_j| and dK = scale·dSᵀ·Q times |Q_i|
    (summed over up to a group's rows: their square root). 8× that, from the rows' largest norms: it grows
    with the inputs' scale, where a fixed floor would not (logits of a few hundred make it 1e-5 in fp32)."""
    import math

    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    norm = lambda t: t.detach().double().norm(dim=-1).max().item() if t.numel() else 0.0  # noqa: E731
    noise = 8 * 2.0 ** -23 * scale * norm(do) * norm(v)
    rows = q.shape[1] // k.shape[1] * q.shape[2]  # (query rows adding into one key's dK)
    return {"dq": noise * norm(k), "dk": noise * norm(q) * math.sqrt(rows), "dv": 0.0}


class _Float64Backward:
    """The FlashAttention backward's pieces in float64 (on ``device``, default the inputs'), for emulating
    a kernel's roundings:
    scores (masked bottom-right when causal), the K and V heads repeated over each query group, and the
    three gradients formed as the backward forms them from P and dS."""

    def __init__(self, q, k, v, do, *, causal, sm_scale=None, device=None):
        import math

        self.scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
        self.group = q.shape[1] // k.shape[1]
        self.q, k64, v64, self.do = (t.detach().double().to(device or q.device) for t in (q, k, v, do))
        self.k, self.v = k64.repeat_interleave(self.group, dim=1), v64.repeat_interleave(self.group, dim=1)
        s = (self.q @ self.k.transpose(-2, -1)) * self.scale
        if causal:
            Nq, Nk = s.shape[-2:]
            rows, cols = torch.arange(Nq, device=s.device), torch.arange(Nk, device=s.device)
            s = s.masked_fill(cols[None, :] > rows[:, None] + (Nk - Nq), float("-inf"))
        self.s = s
        self.dp = self.do @ self.v.transpose(-2, -1)

    def gradients(self, p, ds) -> tuple:
        """(dq, dk, dv) from P and dS: dQ = dS·K·scale, dK = dSᵀ·Q·scale, dV = Pᵀ·dO (dK, dV summed
        over each K/V head's query group)."""
        dq = ds @ self.k * self.scale
        dk = (ds.transpose(-2, -1) @ self.q * self.scale).unflatten(1, (-1, self.group)).sum(2)
        dv = (p.transpose(-2, -1) @ self.do).unflatten(1, (-1, self.group)).sum(2)
        return dq, dk, dv


def half_rounding_floors(q, k, v, do, *, causal, sm_scale=None) -> dict:
    """Per gradient, 3× the relative error of the FlashAttention backward in fp16/bf16 from the roundings
    its formulation cannot avoid, emulated in float64 (or the dtype's rounding floor, if larger): the
    forward's O stored in the inputs' dtype, from which Δ = rowsum(dO ∘ O) is formed, and P and
    dS = P ∘ (dP − Δ) rounded to that dtype as the operands of dV = Pᵀ·dO, dK = dSᵀ·Q and dQ = dS·K.

    Where dP − Δ cancels (a row that sees few keys: one query row against three keys), PyTorch's
    softmax backward, Δ = rowsum(P ∘ dP), cancels exactly and the FlashAttention formulation cannot:
    an emulated kernel with only these roundings exceeded 3× PyTorch's dQ error in 10–21 of 300 draws
    of dO (three runs) at B 1, H 2, Nq 1, Nk 3, D 128, bf16 (by up to 6.7×), where well-conditioned
    problems put this floor well under that bound."""
    f = _Float64Backward(q, k, v, do, causal=causal, sm_scale=sm_scale)
    stored = lambda t: t.to(q.dtype).double()  # noqa: E731 - (rounded to the inputs' dtype, as a kernel stores it)
    p = torch.softmax(f.s, dim=-1).nan_to_num(0.0)  # (a row that sees no key: all zeros)
    o = p @ f.v
    exact = f.gradients(p, p * (f.dp - (f.do * o).sum(-1, keepdim=True)))
    got = f.gradients(stored(p), stored(p * (f.dp - (f.do * stored(o)).sum(-1, keepdim=True))))
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[q.dtype]
    return {n: max(ABS_FLOOR[name], 3.0 * (rel_err(gg, ref) if ref.any() else 0.0))
            for n, gg, ref in zip(("dq", "dk", "dv"), got, exact)}


def fp32_rounding_floors(q, k, v, do, *, causal, sm_scale=None, draws=3, seed=0) -> dict:
    """Per gradient, the relative error a correct float32 kernel of the FlashAttention backward (stages
    B and C) makes at these logits, emulated in float64 and taken 3× over: the largest of ``draws``
    draws of its rounding, each gradient formed as the backward forms it, dS = P ∘ (dP − Δ).

    * P is rebuilt as 2^(s·log2e − lse) from the saved log-sum-exp, both terms about the largest
      logit: the difference carries float32's spacing there, |lse|·2⁻²³, so every P is multiplied by
      2^(u·4·spacing), u uniform in [−1, 1] per element (the forward's exponentials alike, in O).
    * dP = dO·Vᵀ and Δ = rowsum(dO ∘ O) are float32 dot products over the head dim (and O is stored
      in float32): each gets an absolute error u·2⁻²⁴·|dO||V| (|dO||O| for Δ).

    At large logits P is nearly one-hot and the exact dS nearly zero (dP − Δ cancels), so dQ and dK
    are dominated by the second: PyTorch's softmax backward, Δ = rowsum(P ∘ dP), cancels exactly
    where the FlashAttention formulation, Δ from O, cannot, and 3× PyTorch's error failed a correct
    kernel about once in a hundred draws."""
    f = _Float64Backward(q, k, v, do, causal=causal, sm_scale=sm_scale, device="cpu")  # (the noise is drawn there)
    lse = torch.logsumexp(f.s, dim=-1, keepdim=True)
    p = torch.exp(f.s - lse).nan_to_num(0.0)  # (a row that sees no key: all zeros)
    lse2 = (lse * 1.4426950408889634).abs().nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp_min(1.0)
    spacing = torch.exp2(torch.floor(torch.log2(lse2)) - 23)  # float32's spacing at |lse| in base 2
    dot_eps = 2.0 ** -24
    do_norm = f.do.norm(dim=-1, keepdim=True)
    g = torch.Generator().manual_seed(seed)

    def noise(shape):
        return torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1

    def grads(pp, p_fwd, dp_err, delta_err):
        o = (p_fwd @ f.v) / p_fwd.sum(-1, keepdim=True).clamp_min(1e-300)
        delta = (f.do * o).sum(-1, keepdim=True) + delta_err * do_norm * o.norm(dim=-1, keepdim=True)
        return f.gradients(pp, pp * (f.dp + dp_err * do_norm * f.v.norm(dim=-1).unsqueeze(-2) - delta))

    exact = grads(p, p, 0.0, 0.0)
    worst = dict.fromkeys(("dq", "dk", "dv"), 0.0)
    for _ in range(draws):
        p_bwd, p_fwd = (p * torch.exp2(noise(p.shape) * 4 * spacing) for _ in range(2))
        got = grads(p_bwd, p_fwd, noise(p.shape) * dot_eps, noise(lse.shape) * dot_eps)
        for name, gg, ref in zip(worst, got, exact):
            worst[name] = max(worst[name], rel_err(gg, ref) if ref.any() else 0.0)
    return {name: max(ABS_FLOOR["fp32"], 3.0 * e) for name, e in worst.items()}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """``python -m harness ARGV`` in-process: (exit code, stdout, stderr); argparse's exits included."""
    from harness import cli

    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def fake_attention(q, k, v, *, causal=False, sm_scale=None):
    """A correct attention from torch ops in the inputs' precision: a stand-in stage for harness tests."""
    return torch_same_precision(q, k, v, causal=causal, sm_scale=sm_scale)


def fake_stage(name: str, attention=fake_attention, **kw):
    """A registrable :class:`stages.contract.Stage` around ``attention`` with simple models."""
    from stages.contract import HbmTraffic, Stage

    return Stage(name=name, title=f"fake {name}", techniques=(), attention=attention,
                 hbm_bytes=lambda p: HbmTraffic(read=p.qkvo_bytes * 3 // 4, write=p.qkvo_bytes // 4),
                 workspace_bytes=lambda p: 0, **kw)
