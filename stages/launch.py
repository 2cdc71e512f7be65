"""A kernel launch written down as data, so the same description can be run or compiled.

Each stage turns a problem into a list of :class:`Launch` es. ``attention`` runs them; ``compile``
hands the same launches to Triton's compiler for an sm_80 or sm_90 target, which needs no GPU. So the
PTX that ``harness inspect`` and the compiled-code tests read is the code the GPU would run, with
the same tiles, warps, pipeline depth and pointer alignment, not a lookalike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type

from .contract import CompiledKernel


@dataclass
class Launch:
    kernel: triton.JITFunction
    grid: tuple
    args: dict                      # every kernel parameter by name, constexprs included
    num_warps: int = 4
    num_stages: int = 1
    extra: dict = field(default_factory=dict)  # other launch options (e.g. maxnreg)

    def run(self) -> None:
        self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages, **self.extra)

    def compile(self, arch: int) -> CompiledKernel:
        """Compile for ``cuda:arch`` (80 or 90), specializing arguments as the JIT would on a GPU.

        Like Triton's launcher, pointers to 16-byte aligned memory and integers divisible by 16 are
        marked ``tt.divisibility = 16``: that is what licenses 16-byte vector loads and ``cp.async``.
        """
        fn = self.kernel
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = self.args[name]
            if fn.params[i].is_constexpr or value is None:  # None arguments are constexpr to the JIT too
                signature[name] = "constexpr"
                constexprs[name] = value
                continue
            signature[name] = mangle_type(value)
            aligned = (isinstance(value, torch.Tensor) and value.data_ptr() % 16 == 0) or (
                isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0)
            if aligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
        source = ASTSource
        if getattr(fn, "is_gluon", lambda: False)():
            from triton.experimental.gluon._runtime import GluonASTSource as source
        src = source(fn, signature, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra}
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        return CompiledKernel(name=fn.__name__, asm=dict(compiled.asm), shared_bytes=int(compiled.metadata.shared),
                              num_warps=self.num_warps, num_stages=self.num_stages)


def meta_inputs(B: int, H: int, N: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Storage-free stand-ins for q, k, v (``device="meta"``): shapes, strides and dtype, no memory,
    so compiling a plan for N = 16384 allocates nothing."""
    return tuple(torch.empty((B, H, N, D), dtype=dtype, device="meta") for _ in range(3))


# --------------------------------------------------------------------------------------------------
# Compiling while the interpreter is on. Under TRITON_INTERPRET=1 every @triton.jit function is an
# interpreted Python function that the compiler cannot take, and the switch is read once, at import.
# So a stage's compile() hands the job to a child process started with the interpreter off; it
# compiles (no GPU needed) and sends the results back as JSON.
# --------------------------------------------------------------------------------------------------

_TEXT_ASM = ("ttir", "ttgir", "llir", "ptx")


def compiles_without_interpreter(compile_fn):
    """Decorator for a stage's ``compile(problem, arch, **switches)``: runs it in a child process
    with the interpreter off when this process interprets, and as it is otherwise."""
    import functools

    @functools.wraps(compile_fn)
    def wrapper(problem, arch: int, **switches):
        from . import interpreted

        if not interpreted():
            return compile_fn(problem, arch, **switches)
        return _compile_in_child(compile_fn.__module__, compile_fn.__name__, problem, arch, switches)

    return wrapper


def _compile_in_child(module: str, name: str, problem, arch: int, switches: dict) -> list[CompiledKernel]:
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    request = {"module": module, "name": name, "problem": dataclasses.asdict(problem), "arch": arch,
               "switches": switches}
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "stages.launch"], input=json.dumps(request, default=_encode),
                          text=True,
                          capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {module}.{name} for sm_{arch} failed:\n{compile_error_summary(proc.stderr)}")
    return [CompiledKernel(**k) for k in json.loads(proc.stdout)]


#: lines the compiler child prints that never explain a failure: some Triton builds report every
#: nanobind object still alive at exit, hundreds of lines that would push the real error out of view
_NOISE_PREFIXES = ("nanobind: ",)
#: lines that state a cause: the exception itself, MLIR/LLVM diagnostics, ptxas
_CAUSE_MARKERS = ("error:", "Error:", "ptxas fatal", "ptxas error", "fatal error")


def compile_error_summary(stderr: str, tail_chars: int = 3000) -> str:
    """The compiler child's stderr made readable: noise dropped, the lines that state the cause first
    (the exception line, ``error:`` diagnostics, ``ptxas fatal``), then the last ``tail_chars``
    characters of what is left, for context."""
    lines = [line for line in stderr.splitlines() if not line.startswith(_NOISE_PREFIXES)]
    causes = [line for line in lines if any(marker in line for marker in _CAUSE_MARKERS)]
    # A traceback ends with "SomeError: message" at column 0; it is the cause even without a marker.
    exception_lines = [line for line in lines if line and not line[0].isspace() and ": " in line
                       and line.split(":", 1)[0].endswith(("Error", "Exception")) and line not in causes]
    first = list(dict.fromkeys(causes + exception_lines))
    tail = "\n".join(lines)[-tail_chars:]
    if not first:
        return tail
    return "\n".join(first) + "\n--- end of the compiler's output ---\n" + tail


def _encode(obj) -> dict:
    """Switch values that are not JSON (stage C's ``Config``) travel as text plus a ``parse`` classmethod."""
    return {"__parse__": f"{type(obj).__module__}:{type(obj).__qualname__}", "text": str(obj)}


def _decode(d: dict):
    if "__parse__" not in d:
        return d
    import importlib

    module, name = d["__parse__"].split(":")
    return getattr(importlib.import_module(module), name).parse(d["text"])


def _child_main() -> None:
    import dataclasses
    import importlib
    import json
    import sys

    from .contract import Problem

    request = json.load(sys.stdin, object_hook=_decode)
    fn = getattr(importlib.import_module(request["module"]), request["name"])
    kernels = fn(Problem(**request["problem"]), request["arch"], **request["switches"])
    out = []
    for k in kernels:
        d = dataclasses.asdict(k)
        d["asm"] = {key: k.asm[key] for key in _TEXT_ASM if key in k.asm}
        out.append(d)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    _child_main()
