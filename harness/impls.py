"""What gets measured: an :class:`Impl` is one callable attention with its models.

Built from the stage registry (a stage, or one of its ablation ``variants``) or from a peer, so the
measuring code never needs to know which is which. Ablation variant names follow the stages'
convention: ``+x`` are cumulative steps from stage B's settings (in dict order), ``-x`` leave one
optimization out of the all-on configuration, and ``all`` is the stage with no keyword arguments.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

import stages
from stages.contract import HbmTraffic, Problem

from . import peers


@dataclass(frozen=True)
class Impl:
    name: str                    # results' impl column: stage name or peer name
    kind: str                    # "stage", "peer" or "ablation"
    variant: str                 # "" for plain rows
    attention: Callable[..., torch.Tensor]
    hbm_bytes: Callable[[Problem], HbmTraffic] | None
    workspace_bytes: Callable[[Problem], int] | None
    kernel_names: tuple[str, ...] = ()
    variant_kwargs: dict = field(default_factory=dict)
    #: the backward's models (None: none given): bytes the backward requests given a saved forward,
    #: and the extra memory at the peak of a training step besides q, k, v, o, dO, dq, dk, dv
    bwd_hbm_bytes: Callable[[Problem], HbmTraffic] | None = None
    train_workspace_bytes: Callable[[Problem], int] | None = None

    @property
    def label(self) -> str:
        return f"{self.name} {self.variant}" if self.variant else self.name


def cuda_ok(stage) -> bool:
    return (not stage.requires_cuda) or torch.cuda.is_available()


def default_stage_names() -> list[str]:
    """a, b, c first, then every other registered stage this machine can run."""
    names = [n for n in ("a", "b", "c") if n in stages.STAGES]
    names += [n for n, s in stages.STAGES.items() if n not in names and cuda_ok(s)]
    return names


def default_peer_names() -> list[str]:
    """All four on a GPU; on a CPU only the backends PyTorch has CPU kernels for."""
    if torch.cuda.is_available():
        return list(peers.PEERS)
    return ["sdpa_flash", "sdpa_math"]


def stage_impl(name: str, variant: str = "") -> Impl:
    """The stage ``name`` (variant "" or "all": no kwargs; else one of ``stage.variants``)."""
    stage = stages.get_stage(name)
    kwargs: dict = {}
    if variant and variant != "all":
        if variant not in stage.variants:
            raise KeyError(f"stage {name!r} has no variant {variant!r}; it has {list(stage.variants)}")
        kwargs = dict(stage.variants[variant])
    fn = functools.partial(stage.attention, **kwargs) if kwargs else stage.attention
    # A variant's traffic model takes the variant's switches (stage contract): C with B's tiles
    # requests B's bytes.
    hbm = functools.partial(stage.hbm_bytes, **kwargs) if kwargs else stage.hbm_bytes
    bwd_hbm = stage.bwd_hbm_bytes
    if bwd_hbm is not None and kwargs:
        bwd_hbm = functools.partial(bwd_hbm, **kwargs)
    return Impl(name=name, kind="ablation" if variant else "stage", variant=variant, attention=fn,
                hbm_bytes=hbm, workspace_bytes=stage.workspace_bytes,
                kernel_names=tuple(stage.kernel_names), variant_kwargs=kwargs,
                bwd_hbm_bytes=bwd_hbm, train_workspace_bytes=_with_accepted(stage.train_workspace_bytes, kwargs))


def _with_accepted(model, kwargs: dict):
    """``model`` with the variant's switches that it takes (a training-memory model depends on a few
    of them, e.g. stage B's ``dq_method``, and has no use for the rest)."""
    import inspect

    if model is None or not kwargs:
        return model
    params = inspect.signature(model).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    accepted = {k: v for k, v in kwargs.items() if takes_all or k in params}
    return functools.partial(model, **accepted) if accepted else model


def ablation_impls(name: str) -> list[Impl]:
    """``all`` then every entry of ``stage.variants`` in dict order."""
    stage = stages.get_stage(name)
    return [stage_impl(name, "all")] + [stage_impl(name, v) for v in stage.variants]


def peer_impl(name: str) -> Impl:
    return Impl(name=name, kind="peer", variant="", attention=peers.peer_attention(name),
                hbm_bytes=functools.partial(peers.peer_hbm_bytes, name),
                workspace_bytes=functools.partial(peers.peer_workspace_bytes, name),
                bwd_hbm_bytes=functools.partial(peers.peer_bwd_hbm_bytes, name),
                train_workspace_bytes=functools.partial(peers.peer_train_workspace_bytes, name))


def build_impls(stage_names: list[str], peer_names: list[str], ablation: bool | list[str] = False) -> list[Impl]:
    """Stages in order (each followed by its ablation rows when asked: ``True`` every variant, a list
    the named ones a stage has, "all" the stage itself), then the peers."""
    out: list[Impl] = []
    for name in stage_names:
        out.append(stage_impl(name))
        variants = stages.get_stage(name).variants
        if ablation is True and variants:
            out.extend(ablation_impls(name))
        elif isinstance(ablation, list):
            out.extend(stage_impl(name, v) for v in ablation if v == "all" or v in variants)
    out.extend(peer_impl(p) for p in peer_names)
    return out


def resolve_impl(name: str, variant: str = "") -> Impl:
    """An impl by its results-row identity (for the ncu child process)."""
    if name in peers.PEERS:
        return peer_impl(name)
    return stage_impl(name, variant)
