"""Ring attention: one attention over a sequence too long for one GPU, sharded across W of them.

Context parallelism cuts the *sequence*: rank r holds its share of the rows of Q, K and V
(``[B, H, n, D]`` with n = N / W) and computes the output rows of its own queries. Each of those
rows needs every key, and the keys are spread over all the ranks. The ring brings them round:

**The ring.** At step 0 a rank attends its queries to its own K/V block. Then every rank passes the
block in hand to its right neighbour (r → r + 1) and receives one from its left: at step s rank r
holds the block of rank r − s. After W steps every query has met every key, and no rank ever held
more than two K/V blocks (the one in use and the one arriving). The transfer of the next block is
posted *before* the current block's compute (``torch.distributed.batch_isend_irecv``), so the
network works while the GPU does: when a block's FLOPs take longer than its bytes take to cross the
link, the communication is hidden entirely (``harness/ring.py`` measures how much is).

**The merge.** Softmax is not a sum, but it merges: this is split-KV decoding's merge
(``stages/c_optimized/decode.py``), its splits living on different GPUs. A stage call over one block
returns the block's normalized output O_b and its row log-sum-exp L_b = log Σ_{j in b} exp(s_j)
(natural log here; −inf where the row sees no key of the block). Then

    L = log Σ_b exp(L_b),      O = Σ_b exp(L_b − L) · O_b,

folded in one block at a time with the running maximum (:func:`merge_partials`), so a stage that
returns L can be the ring's local kernel unchanged. Which stages do: :data:`LSE_STAGES`.

**Causal, balanced.** With a causal mask, cutting the sequence into W contiguous pieces gives rank
0 almost nothing to do (its queries see only its own keys) and rank W − 1 a whole row of blocks.
Instead the sequence is cut into 2W chunks and rank r holds chunks r and 2W − 1 − r (an early one
and its mirror image: the layout of Llama 3's context parallelism, which gathers K/V with an
all-gather instead of a ring): every rank then computes the same number of (query, key) pairs at
every step. With c = n / 2 rows per chunk, the block of rank s in rank r's hands is

* s = r (step 0): its own two chunks, a causal call (Nq = Nk, so the stage's bottom-right causal is
  the ordinary one, and it is exactly the global mask: positions increase through the shard);
* s < r: chunk s is in the past of both query chunks, chunk 2W − 1 − s in the future of both:
  all n queries against the block's first c keys, no mask;
* s > r: the block lies in the future of query chunk r and in the past of chunk 2W − 1 − r:
  the last c queries against all n keys, no mask.

So each step is *one* stage call of n·c pairs (the diagonal step n(n + 1)/2), blocks entirely in the
future are never computed, and only the diagonal step is masked (:func:`block_call`).

**Backward.** The forward saves O and the global L. Given those, each block's share of the gradient
is exactly FlashAttention's backward restricted to the block: P_ij = exp(s_ij − L_i) is the *global*
probability and δ_i = dO_i · O_i the global row term, so the stage's own backward, called with the
global O and L on one block, returns that block's exact dQ, dK and dV contributions. dQ stays on its
rank (summed over the steps); dK and dV (fp32 accumulators) travel around the ring *with* their K/V
block, each rank adding its share, and one last hop delivers them to the block's owner.

GQA: K and V travel with their Hkv heads (Hq / Hkv times fewer bytes than the queries would be); the
stages group the query heads themselves. Uses the default process group (``torch.distributed``:
NCCL on GPUs, gloo on CPUs); with no process group initialized it runs as a world of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from . import STAGES, ops
from .contract import validate_inputs

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------- the local kernels

@dataclass(frozen=True)
class LseKernel:
    """A stage's attention with its row log-sum-exp, and its backward given that O and L, in the
    ring's convention: L in natural log, −inf for a row that sees no key.

    ``forward(q, k, v, causal, scale) -> (o, lse)``: o in q's dtype, lse fp32 ``[B, Hq, Nq]``.
    ``backward(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)``: the gradients of attention whose
    softmax is normalized by ``lse`` (any O and L, not necessarily this call's own).
    """

    stage: str
    forward: Callable
    backward: Callable


def _lse_from_stage(lse: torch.Tensor, to_natural: float) -> torch.Tensor:
    # The stages write +inf for a row that sees no key (their backward's P = exp(s − inf) = 0); for a
    # merge that row has no mass: −inf.
    return torch.where(torch.isposinf(lse), float("-inf"), lse * to_natural)


def _lse_to_stage(lse: torch.Tensor, from_natural: float) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), float("inf"), lse * from_natural).contiguous()


def _stage_c() -> LseKernel:
    # Stage C exports both: attention_with_lse (base-2 L, its exp2 convention) and attention_backward.
    from .c_optimized import attention_with_lse
    from .c_optimized.backward import attention_backward

    def forward(q, k, v, causal, scale):
        o, lse2 = attention_with_lse(q, k, v, causal=causal, sm_scale=scale)
        return o, _lse_from_stage(lse2, LN2)

    def backward(do, q, k, v, o, lse, causal, scale):
        return attention_backward(do, q, k, v, o, _lse_to_stage(lse, 1.0 / LN2), causal=causal, scale=scale)

    return LseKernel("c", forward, backward)


def _stage_b() -> LseKernel:
    # Stage B exports both too, in natural log.
    from .b_tiled import attention_backward, attention_with_lse

    def forward(q, k, v, causal, scale):
        o, lse = attention_with_lse(q, k, v, causal=causal, sm_scale=scale)
        return o, _lse_from_stage(lse, 1.0)

    def backward(do, q, k, v, o, lse, causal, scale):
        return attention_backward(do, q, k, v, o, _lse_to_stage(lse, 1.0), causal=causal, scale=scale)

    return LseKernel("b", forward, backward)


#: The stages that can be the ring's local kernel: those that return the row log-sum-exp and take it
#: back in their backward. Stage A keeps P instead of L (nothing to merge by); the CUDA twins return
#: O only.
LSE_STAGES: dict[str, Callable[[], LseKernel]] = {"b": _stage_b, "c": _stage_c}


def lse_kernel(stage: str) -> LseKernel:
    """The local kernel of stage ``stage``; a ValueError naming the stages that can be one otherwise."""
    allowed = [name for name in LSE_STAGES if name in STAGES]
    if stage not in allowed:
        why = "is not a registered stage" if stage not in STAGES else "does not return the row log-sum-exp"
        raise ValueError(f"stage {stage!r} {why}; the ring merges its blocks by their row log-sum-exp, which "
                         f"stages {', '.join(allowed)} return: choose one of those")
    return LSE_STAGES[stage]()


# ----------------------------------------------------------------------------------- the merge

def merge_partials(o: torch.Tensor, lse: torch.Tensor, o_block: torch.Tensor, lse_block: torch.Tensor):
    """Fold one block's normalized output and log-sum-exp into the running ones: returns (o, lse).

    ``o`` fp32 ``[..., n, D]`` and ``lse`` fp32 ``[..., n]`` so far; ``o_block``, ``lse_block`` the
    block's (any float dtype; natural log). −inf means "no key seen": a row with −inf on both sides
    stays o = 0, lse = −inf, with no NaN (the max is replaced by 0 before subtracting, as in the
    kernels' online softmax, because −inf − (−inf) is NaN).
    """
    lse_block = lse_block.float()
    m = torch.maximum(lse, lse_block)
    m_safe = torch.where(torch.isneginf(m), 0.0, m)
    w_old, w_block = torch.exp(lse - m_safe), torch.exp(lse_block - m_safe)  # ≤ 1 each: nothing overflows
    total = w_old + w_block
    seen = total > 0
    total = torch.where(seen, total, 1.0)
    o_new = (w_old / total).unsqueeze(-1) * o + (w_block / total).unsqueeze(-1) * o_block.float()
    lse_new = torch.where(seen, m_safe + torch.log(total), float("-inf"))
    return o_new, lse_new


# ----------------------------------------------------------------------------------- the layout

def chunk_ids(rank: int, world_size: int, causal: bool) -> tuple[int, ...]:
    """The chunks of the sequence rank ``rank`` holds, in order: causal, ``(r, 2W − 1 − r)`` of 2W
    chunks (the balanced layout); otherwise ``(r,)`` of W (any layout balances a full mask)."""
    return (rank, 2 * world_size - 1 - rank) if causal else (rank,)


def chunks_per_sequence(world_size: int, causal: bool) -> int:
    """How many equal chunks the sequence is cut into: 2W causal, W otherwise."""
    return 2 * world_size if causal else world_size


def shard(x: torch.Tensor, rank: int, world_size: int, causal: bool, dim: int = 2) -> torch.Tensor:
    """Rank ``rank``'s rows of a whole-sequence tensor (the sequence along ``dim``), contiguous."""
    chunks = x.chunk(chunks_per_sequence(world_size, causal), dim=dim)
    if len(chunks) != chunks_per_sequence(world_size, causal) or x.shape[dim] % len(chunks):
        raise ValueError(f"a sequence of {x.shape[dim]} rows cannot be cut into "
                         f"{chunks_per_sequence(world_size, causal)} equal chunks (world size {world_size}"
                         f"{', causal: 2 per rank' if causal else ''})")
    return torch.cat([chunks[c] for c in chunk_ids(rank, world_size, causal)], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], causal: bool, dim: int = 2) -> torch.Tensor:
    """The whole sequence back from every rank's shard (``shards[r]`` from rank r): :func:`shard`'s inverse."""
    world_size = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for rank, s in enumerate(shards):
        ids = chunk_ids(rank, world_size, causal)
        pieces.update(zip(ids, s.chunk(len(ids), dim=dim)))
    return torch.cat([pieces[c] for c in range(chunks_per_sequence(world_size, causal))], dim=dim)


@dataclass(frozen=True)
class BlockCall:
    """One ring step's stage call: the local query rows against the rows of the K/V block in hand."""

    q_rows: slice
    kv_rows: slice
    causal: bool


def block_call(rank: int, source: int, world_size: int, causal: bool, n: int) -> BlockCall:
    """What rank ``rank`` computes with the block of rank ``source`` (shards of ``n`` rows): the
    module docstring's three cases. Together the calls of all ranks and steps compute every (query,
    key) pair of the global mask exactly once and no other."""
    everything = slice(0, n)
    if not causal:
        return BlockCall(everything, everything, False)
    c = n // 2
    if source == rank:
        return BlockCall(everything, everything, True)
    if source < rank:
        return BlockCall(everything, slice(0, c), False)   # both query chunks see the block's early chunk
    return BlockCall(slice(c, n), everything, False)        # only the late query chunk sees this block


# ----------------------------------------------------------------------------------- communication

def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def pass_along(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """Post, for each (send, receive) pair, a send of ``send`` to the right neighbour and a receive into
    ``receive`` from the left one; returns the requests to ``wait()`` on. Nothing waits here: the
    transfers run while the caller computes (on a GPU, NCCL's own stream; ``wait`` orders the caller's
    stream after them)."""
    rank, world = rank_and_world()
    ops_ = []
    for send, receive in pairs:
        ops_.append(dist.P2POp(dist.isend, send, (rank + 1) % world))
        ops_.append(dist.P2POp(dist.irecv, receive, (rank - 1) % world))
    return dist.batch_isend_irecv(ops_)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows]


# ----------------------------------------------------------------------------------- forward, backward

def ring_forward(q, k, v, *, causal: bool, scale: float, kernel: LseKernel, on_step=None, communicate=True):
    """The ring's forward on this rank's shards: (o in q's dtype, lse fp32 ``[B, Hq, n]`` natural log).

    Two measurement hooks (``harness/ring.py``): ``on_step(i)`` is called as step i starts and once
    more, ``on_step(W)``, at the end (it records a CUDA event there); ``communicate=False`` makes the
    same stage calls without the transfers, every step reusing the block in hand: the right shapes,
    a wrong answer, the compute alone.
    """
    rank, world = rank_and_world()
    n = q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))  # the block in hand (rank r's own at step 0): K and V in one message
    for step in range(world):
        if on_step:
            on_step(step)
        source = (rank - step) % world
        incoming, requests = None, []
        if communicate and step < world - 1:  # post the next block's transfer first: it overlaps this compute
            incoming = torch.empty_like(kv)
            requests = pass_along([(kv, incoming)])
        call = block_call(rank, source, world, causal, n)
        o_block, lse_block = kernel.forward(_rows(q, call.q_rows), _rows(kv[0], call.kv_rows),
                                            _rows(kv[1], call.kv_rows), call.causal, scale)
        rows = call.q_rows
        out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], o_block, lse_block)
        for request in requests:
            request.wait()
        if incoming is not None:
            kv = incoming
    if on_step:
        on_step(world)
    return out.to(q.dtype), lse


def ring_backward(do, q, k, v, o, lse, *, causal: bool, scale: float, kernel: LseKernel, on_step=None,
                  communicate=True):
    """The ring's backward on this rank's shards, given the forward's O and global L: (dq, dk, dv) of
    this rank's q, k, v, in their dtypes. ``on_step`` and ``communicate`` as for :func:`ring_forward`.

    K/V go round once more (posted before each step's compute, as in the forward), and beside them the
    fp32 dK/dV accumulator of the block in hand: a rank adds its share to the accumulator it received
    and sends it on after its compute, so that transfer overlaps the *next* step's compute. After W
    steps each accumulator has met every rank; a last hop brings it home.
    """
    rank, world = rank_and_world()
    n = q.shape[2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack((k, v))
    dkv = None                          # the block in hand's dK/dV accumulator, fp32 [2, B, Hkv, n, D]
    dkv_incoming, dkv_requests = None, []
    for step in range(world):
        if on_step:
            on_step(step)
        source = (rank - step) % world
        incoming, requests = None, []
        if communicate and step < world - 1:
            incoming = torch.empty_like(kv)
            requests = pass_along([(kv, incoming)])
        call = block_call(rank, source, world, causal, n)
        qr, kr = call.q_rows, call.kv_rows
        dq_block, dk_block, dv_block = kernel.backward(
            _rows(do, qr), _rows(q, qr), _rows(kv[0], kr), _rows(kv[1], kr), _rows(o, qr), lse[:, :, qr],
            call.causal, scale)
        dq[:, :, qr] += dq_block
        if step == 0:
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        elif communicate:  # the accumulator of this block, from the left neighbour (sent after its compute)
            for request in dkv_requests:
                request.wait()
            dkv = dkv_incoming
        dkv[0][:, :, kr] += dk_block
        dkv[1][:, :, kr] += dv_block
        if communicate and world > 1:  # on towards the block's owner (the last step's hop arrives home)
            dkv_incoming = torch.empty_like(dkv)
            dkv_requests = pass_along([(dkv, dkv_incoming)])
        for request in requests:
            request.wait()
        if incoming is not None:
            kv = incoming
    if communicate and world > 1:
        for request in dkv_requests:
            request.wait()
        dkv = dkv_incoming  # this rank's own block, back from its round trip
    if on_step:
        on_step(world)
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float, kernel: LseKernel):
        o, lse = ring_forward(q, k, v, causal=causal, scale=scale, kernel=kernel)
        ctx.save_for_backward(q, k, v, o, lse)  # O and L, as B and C save them: P is recomputed per block
        ctx.args = (causal, scale, kernel)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        causal, scale, kernel = ctx.args
        dq, dk, dv = ring_backward(ops.maybe_contiguous(do), q, k, v, o, lse, causal=causal, scale=scale,
                                   kernel=kernel)
        return dq, dk, dv, None, None, None


def check_shards(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """The ring's own conditions on a rank's shards (beyond the stage contract's): self-attention
    sharded alike (Nq = Nk per rank), and with causal two chunks of equal length (n even)."""
    n, nk = q.shape[2], k.shape[2]
    if n != nk:
        raise ValueError(f"ring attention shards one sequence: q and k must hold the same rows on each rank "
                         f"(Nq = Nk), got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and n % 2:
        raise ValueError(f"with causal=True each rank holds two chunks of equal length (the balanced layout: "
                         f"chunks r and 2W-1-r), so a shard's length must be even, got {n}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   sm_scale: float | None = None, stage: str = "c") -> torch.Tensor:
    """Attention over a sequence sharded across the ranks of the default process group.

    q ``[B, Hq, n, D]``, k and v ``[B, Hkv, n, D]``: this rank's shard of the sequence (:func:`shard`
    cuts one: causal, chunks r and 2W − 1 − r of 2W; otherwise chunk r of W). Returns this rank's
    rows of the output, differentiable (the backward is the ring's too). ``causal`` is the global
    causal mask of the whole sequence; ``stage`` is the local kernel, one of :data:`LSE_STAGES`.
    Every rank must call it with the same shapes and arguments.
    """
    kernel = lse_kernel(stage)
    scale = validate_inputs(q, k, v, causal=causal, sm_scale=sm_scale)
    check_shards(q, k, v, causal)
    if ops.needs_grad(q, k, v):
        return _RingAttention.apply(q, k, v, causal, scale, kernel)
    return ring_forward(q, k, v, causal=causal, scale=scale, kernel=kernel)[0]


__all__ = ["BlockCall", "LSE_STAGES", "LseKernel", "block_call", "check_shards", "chunk_ids", "chunks_per_sequence",
           "lse_kernel", "merge_partials", "pass_along", "rank_and_world", "ring_attention", "ring_backward",
           "ring_forward", "shard", "unshard"]
