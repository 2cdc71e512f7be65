"""Stage C: fused attention with pipelining, TMA, tuned tiles, exp2, causal skipping and, on Hopper,
warp specialization (see README.md)."""

from .. import register
from ..contract import Stage
from . import hopper_ws as _hopper_ws
from .configs import Config, candidate_configs, choose_config
from .kernels import attention, attention_with_lse, compile, hbm_bytes, workspace_bytes

try:  # the backward kernels (backward.py); the stage registers without their models until it exists
    from . import backward as _backward
except ImportError:
    _backward = None

#: The ablation. "+name": cumulative steps from stage B's settings (every switch off), adding one
#: optimization at a time in this order; "-name": all on but one. The stage with no keyword
#: arguments is the "all" row.
#:
#: Between "+causal_skip" (the tl kernel with every other optimization) and "+warp_specialization"
#: (the full Hopper kernel) the chain climbs the warp-specialization ladder (``hopper_ws.LADDER``):
#: "+ws<k>-<name>" runs the Hopper kernel with rungs 1..k on and the rest off, every other switch on.
#: The ladder's last rung (lazy rescale) is "+warp_specialization" itself. Elsewhere than sm_90,
#: fp16/bf16, D 40-256 (multiples of 8) and Nq == Nk the harness records the rung rows as unsupported.
SWITCHES = ("tuned_tiles", "pipelining", "tma", "exp2", "causal_skip", "warp_specialization")
WS_LADDER = {f"+ws{k}-{name}": {"ws_rung": k}
             for k, (name, _) in enumerate(_hopper_ws.LADDER[:-1], start=1)}
_cumulative = {}
for _i, _name in enumerate(SWITCHES):
    if _name == "warp_specialization":
        _cumulative.update(WS_LADDER)
    _cumulative["+" + _name] = {s: (j <= _i) for j, s in enumerate(SWITCHES)}
#: "deterministic": the stage with every optimization on and the backward's fixed summation order (dQ by
#: its own kernel, no atomics): what bitwise-reproducible training costs (``--pass bwd --ablation
#: deterministic``; the forward is the same kernel either way).
VARIANTS = {"+none": {s: False for s in SWITCHES}, **_cumulative,
            **{"-" + s: {s: False} for s in SWITCHES}, "deterministic": {"deterministic": True}}

STAGE = register(Stage(
    name="c",
    title="C: optimized",
    techniques=("tiles tuned per head dim and GPU (shared-memory budget checked)",
                "software pipelining of K/V loads (cp.async / TMA, num_stages > 1)",
                "TMA tensor descriptors on sm_90", "exp2 with log2(e) folded into the scale",
                "causal tile skipping (mask only the diagonal)",
                "Hopper: warp-specialized Gluon kernel (producer warp, ping-pong consumer warpgroups, "
                "softmax overlapped with wgmma, persistent grid)",
                "tensor-core MMA with register-resident accumulators (always on)",
                "swizzled shared memory (always on)"),
    attention=attention,
    hbm_bytes=hbm_bytes,
    workspace_bytes=workspace_bytes,
    kernel_names=("optimized_attention_kernel", "ws_attention_kernel", "split_kv_attention_kernel",
                  "merge_splits_kernel"),
    variants=VARIANTS,
    compile=compile,
    bwd_hbm_bytes=getattr(_backward, "bwd_hbm_bytes", None),
    train_workspace_bytes=getattr(_backward, "train_workspace_bytes", None),
    key_ranges=True,
))

__all__ = ["STAGE", "SWITCHES", "VARIANTS", "WS_LADDER", "Config", "attention", "attention_with_lse",
           "candidate_configs", "choose_config", "compile", "hbm_bytes", "workspace_bytes"]

from . import cuda_twin  # noqa: E402,F401  (registers the CUDA C++ twin; compiles on first use)
