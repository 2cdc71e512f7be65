"""Compiled-code facts without a GPU (``harness inspect``).

Each stage with a ``compile(problem, arch)`` hook hands back its kernels compiled by Triton for an
NVIDIA target (``GPUTarget("cuda", arch, 32)``: no GPU needed). From each kernel we read:

* the PTX instruction mix that tells what the kernel really does (:func:`count_instructions`):
  global loads by width (``ld.global.v4`` = 16 bytes per thread per instruction), the Ampere async
  copies (``cp.async.cg.shared.global`` + ``commit_group``/``wait_group``: software pipelining),
  Hopper TMA (``cp.async.bulk.tensor``) and its ``mbarrier`` handshakes, tensor-core MMA
  (``mma.sync`` + ``ldmatrix`` on sm_80, ``wgmma.mma_async`` on sm_90), ``ex2.approx`` (exp2),
  ``bar.sync``. Counts are *static* (instructions in the code, after unrolling), not executed counts;
* registers and spills from the ``ptxas`` shipped inside the triton package, run with ``-v`` on the
  PTX (:func:`run_ptxas`, :func:`parse_ptxas`);
* the shared-memory layouts from the TTGIR (:func:`smem_layouts`): ``#ttg.swizzled_shared<{vec,
  perPhase, maxPhase}>`` (XOR swizzle for ldmatrix; maxPhase = 1 means none), ``#ttg.nvmma_shared<{
  swizzlingByteWidth = 128}>`` (the 128-byte swizzle TMA and wgmma use), ``#ttg.padded_shared``.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

#: result keys of :func:`count_instructions`, in display order
INSTRUCTION_KEYS: tuple[str, ...] = (
    "ld.global.v4", "ld.global.v2", "ld.global.scalar",
    "st.global.v4", "st.global.v2", "st.global.scalar",
    "cp.async.cg.shared.global", "cp.async.ca.shared.global", "cp.async.commit_group", "cp.async.wait_group",
    "cp.async.bulk.tensor", "mbarrier",
    "ld.shared", "st.shared", "ldmatrix", "mma.sync", "wgmma.mma_async",
    "ex2.approx", "bar.sync",
)

_PREDICATE = re.compile(r"^@!?%\w+\s+")


def _opcodes(ptx: str):
    """Yield the opcode of every instruction in ``ptx`` (directives, labels, comments skipped)."""
    for line in ptx.splitlines():
        line = line.split("//", 1)[0]
        for stmt in line.split(";"):
            stmt = stmt.strip().lstrip("{}").strip()
            if not stmt or stmt.startswith((".", "$", "}")) or stmt.endswith(":"):
                continue
            stmt = _PREDICATE.sub("", stmt)
            if not stmt or not stmt[0].isalpha():
                continue
            yield stmt.split()[0]


def _width(parts: list[str]) -> str:
    for part in parts:
        if part in ("v2", "v4", "v8"):
            return part
    return "scalar"


def count_instructions(ptx: str) -> dict[str, int]:
    """Static counts of the instructions that matter for attention kernels (keys: INSTRUCTION_KEYS)."""
    counts = dict.fromkeys(INSTRUCTION_KEYS, 0)
    for op in _opcodes(ptx):
        parts = op.split(".")
        if op.startswith(("ld.global", "st.global")):
            width = _width(parts[2:])
            key = f"{parts[0]}.global.{'v4' if width == 'v8' else width}"
            counts[key] += 1
        elif op.startswith("cp.async.bulk.tensor"):
            counts["cp.async.bulk.tensor"] += 1
        elif op.startswith("cp.async.cg.shared.global"):
            counts["cp.async.cg.shared.global"] += 1
        elif op.startswith("cp.async.ca.shared.global"):
            counts["cp.async.ca.shared.global"] += 1
        elif op.startswith("cp.async.commit_group"):
            counts["cp.async.commit_group"] += 1
        elif op.startswith("cp.async.wait_group") or op.startswith("cp.async.wait_all"):
            counts["cp.async.wait_group"] += 1
        elif op.startswith("mbarrier"):
            counts["mbarrier"] += 1
        elif op.startswith("ld.shared"):
            counts["ld.shared"] += 1
        elif op.startswith("st.shared"):
            counts["st.shared"] += 1
        elif op.startswith("ldmatrix"):
            counts["ldmatrix"] += 1
        elif op.startswith("mma.sync"):
            counts["mma.sync"] += 1
        elif op.startswith("wgmma.mma_async"):
            counts["wgmma.mma_async"] += 1
        elif op.startswith("ex2.approx"):
            counts["ex2.approx"] += 1
        elif op.startswith(("bar.sync", "barrier.sync")):
            counts["bar.sync"] += 1
    return counts


def ptx_target(ptx: str) -> str | None:
    """The ``.target`` of a PTX file (``sm_90a``, ``sm_80``)."""
    m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    return m.group(1) if m else None


def ptxas_path() -> Path:
    """The ptxas Triton compiles with (its bundled one unless ``TRITON_PTXAS_PATH`` names another, as a
    machine with a newer CUDA may): Triton writes the PTX version that ptxas reads, so an older one
    would refuse the code ("Unsupported .version")."""
    from triton import knobs

    return Path(knobs.nvidia.ptxas.path)


def parse_ptxas(text: str) -> dict:
    """``ptxas -v`` output -> registers, spill stores/loads (bytes), stack frame (bytes); max over functions."""
    out = {"registers": None, "spill_stores": None, "spill_loads": None, "stack_bytes": None}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("stack_bytes", r"(\d+) bytes stack frame")):
        values = [int(v) for v in re.findall(pattern, text)]
        out[key] = max(values) if values else None
    return out


def _assemble(ptx: str, arch: str | None, directory: str, timeout_s: float, *flags: str):
    """Run the ptxas Triton uses on ``ptx`` inside ``directory``: the finished process and the path
    of the cubin it wrote (when it succeeded). Raises what ``subprocess.run`` raises."""
    src, cubin = Path(directory) / "kernel.ptx", Path(directory) / "kernel.cubin"
    src.write_text(ptx)
    arch = arch or ptx_target(ptx) or "sm_90a"
    proc = subprocess.run([str(ptxas_path()), *flags, f"-arch={arch}", str(src), "-o", str(cubin)],
                          capture_output=True, text=True, timeout=timeout_s)
    return proc, cubin


def run_ptxas(ptx: str, arch: str | None = None, timeout_s: float = 120) -> dict:
    """Assemble ``ptx`` with the ptxas Triton uses (:func:`ptxas_path`), ``-v``; parse_ptxas's dict, or
    {"ptxas_error": ...}."""
    exe = ptxas_path()
    if not exe.exists():
        return {"ptxas_error": f"{exe} not found"}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc, _ = _assemble(ptx, arch, tmp, timeout_s, "-v")
        except (OSError, subprocess.SubprocessError) as e:
            return {"ptxas_error": f"{type(e).__name__}: {e}"}
    text = proc.stdout + proc.stderr
    if proc.returncode != 0:
        lines = text.strip().splitlines() or ["failed"]
        # the first "ptxas fatal"/"error" line names the cause; later lines are often only its echo
        causes = [line for line in lines if "fatal" in line or "error" in line.lower()]
        return {"ptxas_error": (causes or lines[-1:])[0][:300]}
    return parse_ptxas(text)


def sass(ptx: str, arch: str | None = None, timeout_s: float = 120) -> str:
    """The machine code (SASS) ptxas makes of ``ptx``, disassembled by the cuobjdump shipped next to
    it; "" when either tool is missing or fails. PTX is not the last word: ptxas schedules it again,
    and may move a wait that the PTX placed late (see stage C's README)."""
    dump = ptxas_path().with_name("cuobjdump")
    if not (ptxas_path().exists() and dump.exists()):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc, cubin = _assemble(ptx, arch, tmp, timeout_s)
            if proc.returncode != 0:
                return ""
            return subprocess.run([str(dump), "-sass", str(cubin)], capture_output=True, text=True,
                                  timeout=timeout_s, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return ""


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
_SASS_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)\s*$")


@dataclass(frozen=True)
class SassLoop:
    """An innermost loop of disassembled SASS: the addresses of its first and last instruction (the
    backward branch), and per pass through it the instructions, the local-memory loads and stores
    (spilled registers reloaded and saved) and the wgmma instructions (``HGMMA``) it runs."""

    start: int
    end: int
    instructions: int
    local_loads: int
    local_stores: int
    wgmma: int


def _sass_opcode(text: str) -> str:
    """``@!P0 LDL.LU R4, [R1+0x10]`` -> ``LDL.LU``: the opcode, past a predicate."""
    words = text.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def sass_loops(sass_text: str, min_instructions: int = 64) -> list[SassLoop]:
    """The innermost loops of ``sass_text`` (cuobjdump's listing, :func:`sass`), in address order: each
    backward branch spans a loop from its target to itself; an innermost one holds no other of at
    least ``min_instructions`` (shorter ones are polling loops, an mbarrier wait's). Where a kernel
    runs one function in several warp-specialized partitions, each partition's copy is a loop of its
    own. What a loop does per pass, statically: every instruction between the bounds counts once,
    whichever branch a pass takes inside."""
    code = [(int(a, 16), text) for a, text in _SASS_LINE.findall(sass_text)]
    spans = []
    for address, text in code:
        m = _SASS_TARGET.search(text)
        if m and int(m.group(1), 16) < address:
            spans.append((int(m.group(1), 16), address))
    sizes = {span: sum(1 for a, _ in code if span[0] <= a <= span[1]) for span in spans}
    big = [span for span in spans if sizes[span] >= min_instructions]
    loops = []
    for lo, hi in sorted(set(big)):
        if any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in big):
            continue
        ops = [_sass_opcode(text) for a, text in code if lo <= a <= hi]
        loops.append(SassLoop(lo, hi, len(ops), sum(op.startswith("LDL") for op in ops),
                              sum(op.startswith("STL") for op in ops), sum(op.startswith("HGMMA") for op in ops)))
    return loops


def first_mma_loop(sass_text: str, min_instructions: int = 64) -> SassLoop | None:
    """The first innermost loop (by address) that issues wgmma: in a warp-specialized kernel, the tile
    loop of the partition laid out first (each consumer partition has a copy of its own). None where
    there is none. Not the loop with the most wgmma: ptxas lays some blocks of a loop out of line,
    after the code, and a span that reaches them holds more instructions than one pass runs."""
    return next((loop for loop in sass_loops(sass_text, min_instructions) if loop.wgmma), None)


_LAYOUT = re.compile(r"#ttg\.(\w*shared\w*)<(.*?)>(?=\s*(?:$|\n|,|\)|\s))", re.M)


def smem_layouts(ttgir: str) -> list[str]:
    """Distinct shared-memory layouts in a TTGIR, e.g. ``swizzled_shared<{vec = 8, perPhase = 1, ...}>``."""
    seen: list[str] = []
    for kind, body in _LAYOUT.findall(ttgir):
        if kind == "shared_memory":
            continue
        text = f"{kind}<{body}>"
        if text not in seen:
            seen.append(text)
    return seen


def describe_layout(layout: str) -> str:
    """One short phrase per layout: what the swizzle is."""
    nums = dict((k, int(v)) for k, v in re.findall(r"(\w+) = (\d+)", layout))
    if layout.startswith("swizzled_shared"):
        if nums.get("maxPhase", 1) <= 1:
            return "unswizzled"
        return f"XOR swizzle vec={nums.get('vec')} perPhase={nums.get('perPhase')} maxPhase={nums.get('maxPhase')}"
    if layout.startswith("nvmma_shared"):
        width = nums.get("swizzlingByteWidth", 0)
        return f"{width}B swizzle (TMA/wgmma)" if width else "nvmma unswizzled"
    if layout.startswith("padded_shared"):
        return "padded"
    return layout.split("<", 1)[0]


def inspect_kernel(kernel, *, ptxas: bool = True) -> dict:
    """Facts of one :class:`stages.contract.CompiledKernel`, JSON-ready."""
    ptx = kernel.asm.get("ptx", "") if isinstance(kernel.asm, dict) else ""
    ttgir = kernel.asm.get("ttgir", "") if isinstance(kernel.asm, dict) else ""
    facts = {"kernel": kernel.name, "target": ptx_target(ptx), "num_warps": kernel.num_warps,
             "num_stages": kernel.num_stages, "shared_bytes": kernel.shared_bytes,
             "instructions": count_instructions(ptx),
             "smem_layouts": smem_layouts(ttgir)}
    facts["smem_layouts_described"] = [describe_layout(x) for x in facts["smem_layouts"]]
    if ptxas and ptx:
        facts.update(run_ptxas(ptx))
    return facts


def compile_stage(stage, problem, arch: int, variant_kwargs: dict | None = None):
    """``stage.compile(problem, arch, **variant_kwargs)``; TypeError when the hook takes no such kwargs."""
    kwargs = variant_kwargs or {}
    if kwargs:
        inspect.signature(stage.compile).bind(problem, arch, **kwargs)  # raises TypeError if not accepted
    return stage.compile(problem, arch, **kwargs)


def inspect_stage(stage, problem, arch: int, variant: str = "", variant_kwargs: dict | None = None,
                  ptxas: bool = True) -> list[dict]:
    """Facts of every kernel the stage compiles for ``arch`` (one dict per kernel, with stage/arch/variant)."""
    kernels = compile_stage(stage, problem, arch, variant_kwargs)
    return [{"stage": stage.name, "variant": variant, "arch": arch, **inspect_kernel(k, ptxas=ptxas)}
            for k in kernels]
