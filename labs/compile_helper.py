"""Compiling a lab's kernel for a real GPU target on a machine without one.

Under the Triton interpreter (``TRITON_INTERPRET=1``, set by ``import stages`` when there is no GPU)
``@triton.jit`` functions are plain Python and cannot be compiled, and the switch is read once, at
import. So the compile runs in a child process with the interpreter off (as ``stages/launch.py``
does for the stages) and returns the PTX text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

#: the instructions lab 3 counts (static occurrences at the start of a PTX line)
COUNTED = ("cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group", "ld.global")

_CHILD = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
req = json.loads(sys.stdin.read())
# Load the module by its file, so a copy graded from anywhere (python -m labs check --file) compiles too.
spec = importlib.util.spec_from_file_location(req["module"], req["file"])
mod = importlib.util.module_from_spec(spec)
sys.modules[req["module"]] = mod
spec.loader.exec_module(mod)
fn = getattr(mod, req["kernel"])
# fp16 pointers, fp32 scale, int32 length; pointers and the length marked divisible by 16 as the
# launcher would mark 16-byte aligned tensors: that licenses the 16-byte vector and cp.async forms.
sig, consts, attrs = {}, {}, {}
for i, name in enumerate(fn.arg_names):
    if fn.params[i].is_constexpr:
        sig[name] = "constexpr"; consts[name] = req["constexprs"][name]
    elif name == "scale":
        sig[name] = "fp32"
    elif name.startswith("N"):
        sig[name] = "i32"; attrs[(i,)] = [["tt.divisibility", 16]]
    else:
        sig[name] = "*fp16"; attrs[(i,)] = [["tt.divisibility", 16]]
src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
k = triton.compile(src, target=GPUTarget("cuda", req["arch"], 32),
                   options={"num_warps": 4, "num_stages": req["num_stages"]})
print(json.dumps(k.asm["ptx"]))
"""


def compile_ptx(module: str, kernel: str, *, num_stages: int, constexprs: dict | None = None,
                arch: int = 80) -> str:
    """PTX of ``module.kernel`` compiled for ``sm_<arch>`` with ``num_stages`` and 4 warps; its
    constexprs are ``constexprs``, by default the module's globals of the same name (D, BLOCK_M, BLOCK_N)."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an int >= 1, got {num_stages!r}")
    mod = sys.modules[module]
    if constexprs is None:
        constexprs = {name: getattr(mod, name) for name in ("D", "BLOCK_M", "BLOCK_N")}
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    request = json.dumps({"module": module, "file": mod.__file__, "kernel": kernel, "constexprs": constexprs,
                          "arch": arch, "num_stages": num_stages})
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=request, text=True, capture_output=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"compiling {module}.{kernel} for sm_{arch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def count_instructions(ptx: str, names: tuple[str, ...] = COUNTED) -> dict[str, int]:
    """How many PTX lines start with each of ``names``."""
    lines = [line.strip() for line in ptx.splitlines()]
    return {name: sum(1 for line in lines if line.startswith(name)) for name in names}
