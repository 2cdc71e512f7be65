"""Tile configurations for stage C: which ones exist, which fit, which one a problem gets.

A configuration is (BLOCK_M, BLOCK_N, num_warps, num_stages). Bigger BLOCK_M re-reads K and V fewer
times and gives the tensor cores bigger tiles; bigger BLOCK_N amortizes the softmax bookkeeping;
more stages hide more latency. All three cost shared memory and registers, and a tile that does not
fit either fails to launch or drops occupancy to one program per SM. So:

1. ``candidate_configs`` lists a few sensible shapes per head dim (the tests run every one of them);
2. ``fits`` checks one against the GPU's shared-memory budget (estimate below);
3. ``choose_config`` takes the tuned winner for this GPU from ``tuned/<gpu-slug>.json`` when the
   tuner (``python -m stages.c_optimized.tune``) has measured one, else the first candidate that fits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch

from ..contract import cdiv, padded_head_dim, slugify
from . import hopper_ws

TUNED_DIR = Path(__file__).with_name("tuned")


@dataclass(frozen=True)
class Config:
    """A Triton-``tl`` kernel config ``M128-N64-w4-s3``, or, with ``ws``, one of the Hopper
    warp-specialized kernel (``hopper_ws.py``): ``WS-M128-N128-s3-P`` has 128/64 = 2 consumer
    warpgroups, 128-row K/V tiles, a 3-slot K/V ring and (``-P``) a persistent grid; ``-E`` marks
    the eager rescale of O on every tile (else lazy: only when a row's maximum grew past 2^8,
    ``hopper_ws._rescale_if_needed``); ``-Q3`` marks three Q buffers per consumer (a persistent
    program fetches each item's Q two items ahead, ``hopper_ws.q_buffers``); ``-pad`` runs a head
    dim that would take a main part and a narrow tail (``hopper_ws.tile_widths``) in tiles of the
    next power of two instead (the ablation of the tail); ``-P2`` is a persistent grid of two programs
    per SM, for one consumer (``WS-M64-...``: ``hopper_ws.register_budget`` halves each program's
    registers, and the shared memory must fit twice)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    ws: bool = False
    persistent: bool = False
    lazy_rescale: bool = True
    deep_q: bool = False
    pad_head_dim: bool = False
    programs_per_sm: int = 1

    def with_stages(self, num_stages: int) -> "Config":
        return replace(self, num_stages=num_stages)

    @property
    def consumers(self) -> int:
        return self.block_m // 64

    def ws_options(self, ws_rung: int | None = None) -> dict:
        """``hopper_ws.plan``'s keyword arguments for this warp-specialized config; with ``ws_rung``,
        those of that rung of the ladder built on it (``hopper_ws.rung_options``)."""
        options = dict(block_n=self.block_n, stages=self.num_stages, consumers=self.consumers,
                       persistent=self.persistent, lazy_rescale=self.lazy_rescale, deep_q=self.deep_q,
                       programs_per_sm=self.programs_per_sm)
        if ws_rung is not None:
            options.update(hopper_ws.rung_options(ws_rung, self.consumers, self.persistent, self.lazy_rescale))
            if not options["persistent"]:  # (a rung below the persistent grid: one program per item, the
                options["programs_per_sm"] = 1  # full register pool, as ws_rung_config names it)
        return options

    def __str__(self) -> str:
        if self.ws:
            persistent = ("-P" + ("2" if self.programs_per_sm == 2 else "")) if self.persistent else ""
            return (f"WS-M{self.block_m}-N{self.block_n}-s{self.num_stages}" + persistent
                    + ("" if self.lazy_rescale else "-E") + ("-Q3" if self.deep_q else "")
                    + ("-pad" if self.pad_head_dim else ""))
        return f"M{self.block_m}-N{self.block_n}-w{self.num_warps}-s{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "Config":
        m = re.fullmatch(r"M(\d+)-N(\d+)-w(\d+)-s(\d+)", text)
        if m:
            return cls(*(int(g) for g in m.groups()))
        m = re.fullmatch(r"WS-M(\d+)-N(\d+)-s(\d+)(-P(2)?)?(-E)?(-Q3)?(-pad)?", text)
        if m:
            bm, bn, st = (int(g) for g in m.groups()[:3])
            return ws_config(bm, bn, st, persistent=bool(m.group(4)), lazy_rescale=not m.group(6),
                             deep_q=bool(m.group(7)), pad_head_dim=bool(m.group(8)),
                             programs_per_sm=2 if m.group(5) else 1)
        raise ValueError(f"config must look like 'M128-N64-w4-s3' or 'WS-M128-N128-s3-P(2)(-E)(-Q3)(-pad)', "
                         f"got {text!r}")


def ws_config(block_m: int, block_n: int, num_stages: int, persistent: bool, lazy_rescale: bool = True,
              deep_q: bool = False, pad_head_dim: bool = False, programs_per_sm: int = 1) -> Config:
    """A warp-specialized config: ``block_m // 64`` consumer warpgroups of 4 warps each."""
    if deep_q and not persistent:
        raise ValueError("deep_q (three Q buffers) needs a persistent config: one item per program has no next Q")
    if programs_per_sm != 1 and not (persistent and block_m == 64):
        raise ValueError(f"programs_per_sm={programs_per_sm} needs a persistent config of one consumer (M64), "
                         f"got M{block_m}, persistent={persistent}")
    return Config(block_m, block_n, 4 * (block_m // 64), num_stages, ws=True, persistent=persistent,
                  lazy_rescale=lazy_rescale, deep_q=deep_q, pad_head_dim=pad_head_dim,
                  programs_per_sm=programs_per_sm)


def ws_rung_config(config: Config, ws_rung: int) -> Config:
    """The warp-specialized ``config`` cut down to rung ``ws_rung`` of the ladder (``hopper_ws.LADDER``):
    its K/V tile and ring depth, with the consumers, persistent grid and lazy rescale that rung has
    (what the traffic model and the config's name need; ``Config.ws_options(ws_rung)`` adds the
    rung's other switches)."""
    o = config.ws_options(ws_rung)
    return ws_config(hopper_ws.ROWS_PER_CONSUMER * o["consumers"], config.block_n, config.num_stages,
                     o["persistent"], o["lazy_rescale"], deep_q=o["deep_q"] and o["persistent"],
                     pad_head_dim=config.pad_head_dim, programs_per_sm=o["programs_per_sm"])


#: Stage B's configuration. With every switch off, stage C runs exactly this.
BASELINE = Config(64, 64, 4, 1)

#: Shared memory per thread block, bytes (CUDA programming guide, "compute capabilities" table).
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 87: 163 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def shared_memory_bytes(config: Config, D: int, element_bytes: int) -> int:
    """Estimated shared memory of one program: the Q tile (staged through shared memory by TMA and
    by wgmma operand loads) plus ``num_stages`` buffers of one K and one V tile; the persistent
    warp-specialized kernel keeps two Q tiles (the next item's lands while this one runs), three
    with ``deep_q``. Triton 3.6
    on sm_90 allocates exactly this plus a few bytes of mbarriers (compared for every candidate:
    e.g. 229 400 B compiled vs 229 376 B estimated for 128×128 tiles, 3 stages, D = 128)."""
    q_tiles = hopper_ws.q_buffers(config.persistent, config.deep_q) if config.ws else 1
    q_tile = config.block_m * D * element_bytes
    kv_stage = 2 * config.block_n * D * element_bytes
    return q_tiles * q_tile + max(config.num_stages, 1) * kv_stage


def fits(config: Config, D: int, element_bytes: int, arch: int) -> bool:
    """Whether ``config`` fits the shared memory of an sm_``arch`` block at head dim ``D`` (as wide as
    the kernel's tiles first: the ``tl`` kernel's are the next power of two, the warp-specialized
    kernel's that or a main part and a narrow tail, ``hopper_ws.tile_widths``)."""
    limit = SHARED_MEMORY_LIMIT.get(arch, 99 * 1024)
    width = hopper_ws.tile_width(D, config.pad_head_dim) if config.ws else padded_head_dim(D)
    # 1 KB for barriers; programs sharing an SM share its shared memory (and each has 1 KB reserved)
    programs = config.programs_per_sm
    return programs * (shared_memory_bytes(config, width, element_bytes) + 2048) - 1024 <= limit


def candidate_configs(D: int, dtype: torch.dtype, arch: int, warp_specialization: bool = True) -> list[Config]:
    """The configurations worth trying for this head dim and GPU, best guess first; only those that
    fit. On Hopper (fp16/bf16, D 40-256) the warp-specialized kernel's configs come first. A head dim
    that is not a power of two (72, 200, ...) takes the configs of its padded tile width."""
    # The warp-specialized kernel runs a head dim between the powers of two at its tiles' width
    # (hopper_ws.PADDED_HEAD_DIMS, hopper_ws.tile_widths): ws_shapes gives that width's configs.
    head_dim = D
    D = padded_head_dim(D)
    if dtype == torch.float32:
        # fp32 products run on the FMA units ("ieee"), where each thread holds its slice of both
        # operands across the whole head dim: registers are the limit, and the tiles are chosen by
        # what ptxas reports, not by timing (fp32 has never been tuned on a GPU). The 64x32 tiles used
        # before spilled 0.3-3 KB per thread at D = 32-64 and 6-22 KB at D = 128-256 on sm_90, and
        # 68-148 KB at D = 128-256 on sm_80; the first candidates here spill nothing (D = 256 on
        # sm_90: ~0.9 KB, the least of every shape tried). experiments/resource_check.py checks them.
        wide_on_hopper = arch >= 90 and D > 64
        shapes = [Config(16, 16, 8, 2)] if wide_on_hopper else [Config(32, 32, 8, 2), Config(16, 32, 4, 2)]
    elif arch >= 90:
        # Hopper: wgmma wants BLOCK_M a multiple of 64 per warpgroup; 8 warps = 2 warpgroups.
        shapes = {
            16: [Config(128, 64, 4, 3), Config(128, 128, 4, 3)],
            32: [Config(128, 64, 4, 3), Config(128, 128, 4, 3)],
            64: [Config(128, 64, 4, 3), Config(128, 64, 4, 4), Config(128, 128, 8, 3), Config(64, 64, 4, 3)],
            128: [Config(128, 128, 8, 3), Config(128, 64, 8, 3), Config(128, 64, 4, 3), Config(64, 64, 4, 3)],
            256: [Config(64, 64, 4, 2), Config(64, 32, 4, 2), Config(128, 32, 8, 2)],
        }[D]
        if warp_specialization and arch == 90 and hopper_ws.supported(dtype, head_dim, arch):
            shapes = ws_shapes(head_dim) + shapes
    else:
        shapes = {
            16: [Config(128, 64, 4, 3), Config(64, 64, 4, 3)],
            32: [Config(128, 64, 4, 3), Config(64, 64, 4, 3)],
            64: [Config(128, 64, 4, 3), Config(128, 32, 4, 3), Config(64, 64, 4, 3)],
            128: [Config(128, 32, 8, 3), Config(64, 64, 4, 3), Config(128, 64, 8, 2)],
            256: [Config(64, 32, 4, 2), Config(32, 32, 4, 2)],
        }[D]
    e = torch.tensor([], dtype=dtype).element_size()
    fitting = [c for c in shapes if fits(c, head_dim, e, arch)]
    return fitting or [Config(32, 32, 4, 1)]


#: The warp-specialized kernel's configs (sm_90, fp16/bf16). D = 64: three consumer warpgroups
#: (192 query rows) share each K/V tile, as FlashAttention-3 does for small heads, or two; D = 128:
#: two, because three would spill registers (checked by a compiled-code test). Persistent and one
#: program per work item both stay: which wins depends on N and causality (tuning.csv). At D = 128
#: the persistent kernel's second Q buffer leaves room for a 2-slot K/V ring only (FlashAttention-3
#: uses 2 there too); one program per item keeps 3. Every config rescales O lazily (only when a
#: row's maximum grew past 2^8); the two-consumer D = 64 config also comes eager (``-E``): on causal
#: problems that config ran 0.3-1.8 % faster eager, where every other cell gained from the lazy
#: rescale (docs/performance-log/softmax.md, entry 35). D = 256: two consumers with 64-key tiles and a
#: 2-slot ring, one program per item (no room for the persistent kernel's second Q buffer); tuned on
#: the H200 over N 1k-16k, fp16 and bf16, causal both, it won all 20 cells (first-pass times): 32-key
#: tiles in a 4-slot ring ran 10-25 % slower, the eager rescale 0.3-5.5 % slower, the best tl config
#: 1.4-1.7x slower (docs/performance-log/model-shapes.md, entry 44). The last D = 64 config is one
#: consumer with 64-row items, two programs to an SM (``-P2``): never the first guess, it is what
#: :func:`shape_aware_config` takes where the wider items would be mostly padding (entry 88).
WS_SHAPES = {
    64: [ws_config(192, 128, 3, True), ws_config(192, 128, 3, False), ws_config(128, 128, 3, True),
         ws_config(128, 128, 3, True, lazy_rescale=False), ws_config(64, 64, 3, True, programs_per_sm=2)],
    128: [ws_config(128, 128, 2, True), ws_config(128, 128, 3, False)],
    256: [ws_config(128, 64, 2, False), ws_config(128, 32, 4, False), ws_config(128, 64, 2, False, lazy_rescale=False)],
}

#: Registers per consumer thread a warp-specialized config's tiles may take: the 64 × width fp32
#: accumulator (width / 2), the 64 × BLOCK_N fp32 scores (BLOCK_N / 2) and P in 16 bits (BLOCK_N / 4).
#: The tuned configs take 160 (D 128, 128-key tiles) and 176 (D 256, 64-key tiles) of the 240, and
#: compile without spills; the rest holds addresses, row statistics and loop state.
TILE_REGISTERS = 176


def ws_shapes(D: int) -> list[Config]:
    """The warp-specialized kernel's configs for head dim ``D``, by the width of its tiles
    (``hopper_ws.tile_width``): :data:`WS_SHAPES` at a power of two; a main part with a tail (80,
    96, 144, 160, 192 columns) takes two consumers, as D 128 does (three would spill), the widest
    key tile whose registers fit :data:`TILE_REGISTERS`, and up to 128 columns a persistent grid
    first, as D 128 does; wider, one program per item, as D 256 does: compiled for sm_90a, the
    persistent kernel (more state live across an item's boundary) spilled 32-424 bytes per thread at
    144-192 columns, one program per item none. Not tuned on a GPU: the tuner's winners, where it
    ran, come first (``choose_config``)."""
    width = hopper_ws.tile_width(D)
    if width in WS_SHAPES:
        return WS_SHAPES[width]
    block_n = 128 if tile_registers(width, 128) <= TILE_REGISTERS else 64
    shapes = [ws_config(128, block_n, 2, False), ws_config(128, block_n, 3, False)]
    if width <= 128:
        shapes.insert(0, ws_config(128, block_n, 2, True))
    if block_n == 64 and tile_registers(width, 96) <= TILE_REGISTERS:
        # Where 128-key tiles spill, 96 = 64 + 32 keys in two parts (hopper_ws.key_widths), as
        # FlashAttention-3 takes 112-key tiles at 192 columns: half again the keys per tile for the
        # same barriers and turns, in the shared memory a 2-slot ring leaves. Last: on the H200 it ran
        # 3-7 % slower than the 64-key tiles at D 192 (performance-log entry 69); the tuner still races it.
        shapes.append(ws_config(128, 96, 2, False))
    return [c for c in shapes if fits(c, D, 2, 90)]


def tile_registers(width: int, block_n: int) -> int:
    """Registers per consumer thread of a warp-specialized config's tiles (:data:`TILE_REGISTERS`)."""
    return width // 2 + 3 * block_n // 4


def device_arch(device: torch.device | None) -> int:
    """Compute capability as 80, 90, ...; the portable sm_80 path for CPUs and the interpreter."""
    if device is not None and device.type == "cuda":
        return _cuda_arch(_cuda_index(device))
    if device is None and torch.cuda.is_available():
        return _cuda_arch(torch.cuda.current_device())
    return 80


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@lru_cache(maxsize=None)
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


@lru_cache(maxsize=None)
def gpu_slug() -> str | None:
    """This GPU's name as the tuning cache names it (None without a GPU)."""
    return slugify(torch.cuda.get_device_name()) if torch.cuda.is_available() else None


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid's size)."""
    return _cuda_sms(_cuda_index(device))


#: The SM count assumed where there is no GPU to ask (the CPU interpreter, ``compile`` for a target,
#: the traffic models): the H200 this lab is tuned on has 132.
DEFAULT_SMS = 132


def sm_count(device: torch.device | None) -> int:
    """SMs of ``device`` when it is a CUDA GPU, else ``DEFAULT_SMS``: the number the shape-aware
    choice (``shape_aware_config``) and the split-KV path size their grids by."""
    if device is not None and device.type == "cuda":
        return num_sms(device)
    return DEFAULT_SMS


@lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def tuning_file(slug: str | None, suffix: str = "", arch: int | None = None) -> Path | None:
    """The tuning file a GPU named ``slug`` reads: ``tuned/<slug><suffix>.json`` (``suffix`` "" for the
    forward's, "-backward" for the backward's) when it was tuned itself, else, given its compute
    capability ``arch``, one tuned on another GPU of the same architecture (first by name). An H100
    has a backward file of its own and reads the H200's forward one: the Hopper GPUs share the SM (its
    tensor cores, 228 KB of shared memory, 64 K registers), so the tiles and kernels that won on one
    are the best guess for another, far better than the untuned first candidate (whose backward never
    runs the Hopper kernels). Its own ``tune``/``tune_backward`` run replaces the guess. None where
    neither exists."""
    if slug is None:
        return None
    own = TUNED_DIR / f"{slug}{suffix}.json"
    if own.exists():
        return own
    return _same_arch_file(suffix, arch) if arch is not None else None


@lru_cache(maxsize=None)
def _same_arch_file(suffix: str, arch: int) -> Path | None:
    for path in sorted(TUNED_DIR.glob(f"*{suffix}.json")):
        if not suffix and path.stem.endswith("-backward"):
            continue
        try:
            if json.loads(path.read_text()).get("arch") == arch:
                return path
        except (OSError, ValueError):  # (a damaged file is no guess)
            continue
    return None


def seed_tuning(path: Path, suffix: str) -> dict:
    """What a tuner starts a GPU's first file ``path`` from: the same-architecture file this GPU read
    until now (:func:`tuning_file`), its cells copied and its name kept under ``seeded_from``, so a
    run that tunes only some cells leaves the others at the borrowed winners rather than untuned (a
    GPU's own file shadows the borrowed one whole). Empty where there is nothing to borrow."""
    arch = this_arch()
    borrowed = _same_arch_file(suffix, arch) if arch is not None else None
    if borrowed is None or borrowed == path:
        return {}
    data = json.loads(borrowed.read_text())
    return {key: value for key, value in data.items() if key not in ("gpu", "N")} | {"seeded_from": borrowed.stem}


def this_arch() -> int | None:
    """This process's GPU's compute capability (None without a GPU): what a borrowed tuning file must match."""
    return _cuda_arch(torch.cuda.current_device()) if torch.cuda.is_available() else None


@lru_cache(maxsize=None)
def tuned_table(slug: str | None, table: str = "best") -> dict:
    """The tuner's winners for one GPU: ``{"fp16/D64/causal0/N4096": "M128-N64-w4-s3", ...}``, from
    :func:`tuning_file` (its own, or a same-architecture GPU's). ``table="best_tl"`` holds the best
    ``tl``-kernel config of each cell (warp specialization off)."""
    path = tuning_file(slug, "", this_arch())
    if path is None:
        return {}
    return json.loads(path.read_text()).get(table, {})


def tuned_head_dim(D: int, dtype: torch.dtype, arch: int, warp_specialization: bool = True) -> int:
    """The head dim the tuning table keys ``D``'s winners under: where the warp-specialized kernel runs
    it, the width of its tiles (``hopper_ws.tile_width``: D 168-192 all run 128 + 64 columns, so one
    tuning of D 192 serves them), else ``D`` itself."""
    if warp_specialization and arch == 90 and hopper_ws.supported(dtype, D, arch):
        return hopper_ws.tile_width(D)
    return D


def tuned_key(dtype: torch.dtype, D: int, causal: bool, N: int) -> str:
    name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    return f"{name}/D{D}/causal{int(causal)}/N{N}"


@lru_cache(maxsize=4096)  # on every call's path: keep the launch short (see hopper_ws.plan)
def choose_config(D: int, dtype: torch.dtype, causal: bool, arch: int, N: int,
                  warp_specialization: bool = True) -> Config:
    """The tuned configuration for the nearest tuned N on this GPU (of the head dim's tile width:
    :func:`tuned_head_dim`), else the first candidate that fits. With ``warp_specialization=False``
    only ``tl``-kernel configs are eligible."""
    table = tuned_table(gpu_slug(), "best" if warp_specialization else "best_tl")
    if table:
        key_D = tuned_head_dim(D, dtype, arch, warp_specialization)
        prefix = tuned_key(dtype, key_D, causal, 0).rsplit("/N", 1)[0]
        tuned_ns = sorted(int(k.rsplit("/N", 1)[1]) for k in table if k.startswith(prefix + "/N"))
        if not tuned_ns and dtype == torch.bfloat16:
            # bf16 has fp16's size and tensor-core rate: an fp16 winner is the best guess.
            return choose_config(D, torch.float16, causal, arch, N, warp_specialization)
        if tuned_ns:
            nearest = min(tuned_ns, key=lambda n: abs(n.bit_length() - N.bit_length()))
            config = Config.parse(table[tuned_key(dtype, key_D, causal, nearest)])
            e = torch.tensor([], dtype=dtype).element_size()
            if fits(config, D, e, arch) and (warp_specialization or not config.ws):
                return config
    return candidate_configs(D, dtype, arch, warp_specialization)[0]


def work_items(B: int, Hq: int, Nq: int, block_m: int) -> int:
    """Programs of a one-pass kernel: one per (batch, query head, BLOCK_M query rows)."""
    return B * Hq * cdiv(Nq, block_m)


#: Relative cost of one query row in a work item, by kernel: three consumer warpgroups sharing each
#: K/V tile (192 rows) do a row a little cheaper than two (the tuner picks them on the long grid
#: cells), and the ``tl`` kernel (no warp specialization) a row about a fifth dearer than the
#: two-consumer kernel (the ablation's warp-specialization step at N = 4096). Read off the H200's
#: measurements; only their order matters much for the choice below.
ROW_COST = {"ws192": 0.95, "ws128": 1.0, "tl": 1.2, "ws64x2": 2.0}
#: ``ws64x2``: one consumer, two programs to an SM (``-P2``), per program: each runs at about half an
#: SM's pace, so a row costs about what it does in the two-consumer kernel with twice the programs
#: dealing the work. Read off an H100 (``experiments/small_tiles.py``, five D 64 suite cells forced
#: to ``WS-M64-N64-s3-P2`` and ``WS-M64-N128-s3-P2``): 1.8 where the chosen tiles were mostly padding
#: (257-row sequences: 50.1 against 62.6 µs), 1.9-2.1 on one- to four-tile items, 2.2 causal.

#: A config other than the tuned one is taken only when the model says it is this much cheaper:
#: the tuned winner was measured, the model is an estimate.
SWITCH_MARGIN = 0.9


def _waves(items: int, sms: int) -> int:
    """Rounds of programs the SMs run (a persistent grid deals items round-robin: the same count)."""
    return cdiv(items, sms)


def grid_cost(B: int, Hq: int, Nq: int, block_m: int, sms: int, row_cost: float) -> float:
    """The time model behind :func:`shape_aware_config`, in row-units: waves × rows per item × the
    kernel's cost per row. It charges a tile's padding (Nq = 197 in 192-row items is two items, the
    second nearly empty) and the last, partly idle wave (172 items on 132 SMs take two waves, the
    same as 264)."""
    return _waves(work_items(B, Hq, Nq, block_m), sms) * block_m * row_cost


def _ws_grid_cost(config: Config, B: int, Hq: int, Nq: int, sms: int) -> float:
    """:func:`grid_cost` of a warp-specialized config: its programs are ``programs_per_sm`` × ``sms``, each
    at its row cost (``ws<rows>``, with ``x<programs>`` where programs share an SM)."""
    pairs = config.programs_per_sm
    key = f"ws{config.block_m}" + (f"x{pairs}" if pairs > 1 else "")
    return grid_cost(B, Hq, Nq, config.block_m, sms * pairs, ROW_COST[key])


@lru_cache(maxsize=4096)
def shape_aware_config(config: Config, B: int, Hq: int, Nq: int, D: int, dtype: torch.dtype, arch: int,
                       sms: int) -> Config:
    """Adjust the (tuned) ``config`` to the work the GPU will really see. The tuned table was measured
    on the FlashAttention-paper grid, where B·Hq·⌈Nq/BLOCK_M⌉ is thousands of programs; it knows
    nothing of a problem whose programs leave SMs idle or whose tiles are mostly padding.

    The rule: estimate each eligible config's time with :func:`grid_cost` (waves of programs × rows
    per program × a kernel's cost per row, :data:`ROW_COST`) and take the cheapest, but leave the
    tuned config only for one that is :data:`SWITCH_MARGIN` cheaper. Eligible: the tuned config; on
    Hopper with the warp-specialized kernel, its 192- and 128-row configs (persistent, as tuned:
    one program per SM measured faster even with fewer items than SMs), at D 64 its 64-row config
    two programs to an SM (``-P2``: it wins where the wider items are mostly padding), and the ``tl``
    kernel's 64-row config (one item of a tiny problem: no producer/consumer machinery to start); elsewhere
    the ``tl`` config with BLOCK_M halved down to 64.

    Measured on the H200 (GPU-only time, ``experiments/suite_configs.py``): 4 heads of 8192 rows
    (172 items of 192 rows, 256 of 128) ran 0.188 ms tuned and 0.151 ms with 128 rows; 197-row
    sequences 0.070 → 0.048 ms; one 64-row head 0.0091 → 0.0075 ms with the ``tl`` kernel; the grid
    cells keep their tuned configs (their costs differ by under 10 %).
    """
    e = torch.tensor([], dtype=dtype).element_size()
    if config.ws:
        options = [(config, _ws_grid_cost(config, B, Hq, Nq, sms))]
        for c in ws_shapes(D):
            if c.block_m != config.block_m and c.persistent:
                options.append((c, _ws_grid_cost(c, B, Hq, Nq, sms)))
        tl64 = next((c for c in candidate_configs(D, dtype, arch, False) if c.block_m == 64), None)
        if tl64 is not None:
            options.append((tl64, grid_cost(B, Hq, Nq, 64, sms, ROW_COST["tl"])))
        tuned_cost = options[0][1]
        best, best_cost = min(options, key=lambda o: o[1])
        return best if best_cost < SWITCH_MARGIN * tuned_cost else config
    block_m = config.block_m
    while block_m > 64 and (Nq <= block_m // 2 or work_items(B, Hq, Nq, block_m) < sms):
        block_m //= 2
    if block_m == config.block_m:
        return config
    # Half the rows: half the accumulator per warp as well, so half the warps (not below 4).
    smaller = replace(config, block_m=block_m, num_warps=max(4, config.num_warps * block_m // config.block_m))
    return smaller if fits(smaller, D, e, arch) else config


#: A persistent program's items average fewer K/V tiles than this: its Q is fetched two items ahead
#: (``deep_q``, three Q buffers per consumer). Measured on the H200 (``experiments/deep_q.py``, GPU
#: time, in turns): items of one tile (B 128, H 16, N 128, D 64) 46.5 -> 40.5 us; causal items of
#: one or two (N 256, D 128) 85.2 -> 81.3 us; two tiles each (N 197) and longer items 0-3 % slower
#: (the extra buffer for nothing: the next Q already arrives in time).
DEEP_Q_BELOW_TILES = 2


def mean_kv_tiles(N: int, block_m: int, block_n: int, causal: bool) -> float:
    """K/V tiles a work item of a square problem visits, on average over its ``block_m``-row blocks:
    all ⌈N/block_n⌉ of them, or under the causal mask those up to the block's last row."""
    tiles = cdiv(N, block_n)
    n_m = cdiv(N, block_m)
    if not causal or tiles >= 4:  # (causal items of 4+ tiles average well above DEEP_Q_BELOW_TILES)
        return tiles
    return sum(min(tiles, cdiv((r + 1) * block_m, block_n)) for r in range(n_m)) / n_m


def with_deep_q(config: Config, N: int, causal: bool, D: int, element_bytes: int, arch: int) -> Config:
    """``config`` with three Q buffers where its items are too short for the next Q to arrive in time
    (:data:`DEEP_Q_BELOW_TILES`) and the third buffer fits; else ``config`` unchanged."""
    if not (config.ws and config.persistent) or config.deep_q or config.programs_per_sm > 1:
        return config  # (-P2: the SM's other program works while one waits for a late Q; not measured deeper)
    if mean_kv_tiles(N, config.block_m, config.block_n, causal) >= DEEP_Q_BELOW_TILES:
        return config
    deep = replace(config, deep_q=True)
    return deep if fits(deep, D, element_bytes, arch) else config
