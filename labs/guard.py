"""What keeps a grade honest and readable: three small tools the checks and the CLI share.

* :func:`forbid_calls`: while a learner's *prediction* runs, no code from the files that could answer
  it for them (the compiler helper, the bank model, the stages' traffic models, the checks and the
  solutions) may run. A profile hook (``sys.setprofile``) sees every Python call, so an alias made at
  import (``from stages.bank_model import wavefronts as w``) is caught as surely as a direct call;
  patching names would miss it.
* :func:`bounds_checked`: under the Triton interpreter a load or store outside a tensor is a raw
  memory access: a few rows too far corrupts memory silently, far enough kills the process with a
  segfault. While a check runs, every unmasked lane of every load, store and atomic is compared with
  the tensors the kernel was launched with, and a stray one raises ``IndexError`` ("out-of-bounds
  store ...") naming the argument and the program, before the access happens.
* :func:`explain`: turns whatever a learner's code raised into one line (type, first line of the
  message, and a likely cause) instead of a traceback.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterable

import numpy as np

LABS_DIR = Path(__file__).resolve().parent
ROOT = LABS_DIR.parent


class ShortcutError(AssertionError):
    """The prediction called code that computes the answer instead of predicting it."""


# -------------------------------------------------------------------------------------------------
# forbid_calls

def _spawners() -> set[int]:
    """The C functions that start another process or program: a prediction never needs one, and a
    child process could run the forbidden code where the profile hook cannot see it."""
    import _posixsubprocess  # noqa: PLC0415  (POSIX only, like the interpreter checks)

    names = ("system", "fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "spawnv", "spawnve")
    found = [getattr(os, n) for n in names if hasattr(os, n)] + [_posixsubprocess.fork_exec]
    return {id(f) for f in found}


@contextlib.contextmanager
def forbid_calls(paths: Iterable[Path | str], *, allow: Iterable[Path | str] = (), what: str = "the prediction"):
    """Raise :class:`ShortcutError` as soon as a function defined in one of ``paths`` (files, or
    folders: everything under them) is called inside the ``with`` block, or a process is started;
    ``allow`` exempts files (the module being graded, when it lives under a forbidden folder)."""
    banned = [Path(p).resolve() for p in paths]
    allowed = {Path(p).resolve() for p in allow}
    spawners = _spawners()
    verdicts: dict[str, Path | None] = {}  # co_filename -> the banned path it falls under, or None

    def banned_path(filename: str) -> Path | None:
        if filename not in verdicts:
            verdicts[filename] = None
            if not filename.startswith("<"):
                f = Path(filename).resolve()
                if f not in allowed:
                    verdicts[filename] = next((b for b in banned if f == b or b in f.parents), None)
        return verdicts[filename]

    entry = sys._getframe(2)  # the frame with the `with` statement (past contextlib's __enter__)

    def called_from_graded_code(frame) -> bool:
        # The check's own helpers (a comprehension in checks.py) may run inside the block; what may
        # not is forbidden code reached from the learner's: walk up to the `with` frame and see
        # whether a frame of some other file (the lab, or anything it called) is on the way.
        f = frame.f_back
        while f is not None and f is not entry:
            if banned_path(f.f_code.co_filename) is None:
                return True
            f = f.f_back
        return f is None

    def hook(frame, event, arg):
        if event == "call":
            hit = banned_path(frame.f_code.co_filename)
            if hit is not None and called_from_graded_code(frame):
                sys.setprofile(None)
                name = frame.f_code.co_name
                where = _rel(Path(frame.f_code.co_filename).resolve())
                raise ShortcutError(f"{what} must not call {where}:{name}(); the check compares your "
                                    f"answer with {_rel(hit)}, so asking it is not predicting: work it out")
        elif event == "c_call" and id(arg) in spawners:
            sys.setprofile(None)
            raise ShortcutError(f"{what} must not start a process ({getattr(arg, '__name__', arg)}): "
                                "work the answer out instead of running a tool for it")

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def answer_sources(graded_file: str | None) -> tuple[list[Path], list[Path]]:
    """(forbidden, allowed) paths common to every prediction: the checks and the solutions, except
    the file being graded (when it is a solution)."""
    forbidden = [LABS_DIR / "checks.py", LABS_DIR / "solutions"]
    return forbidden, [Path(graded_file)] if graded_file else []


# -------------------------------------------------------------------------------------------------
# bounds_checked

_launches: list[list[tuple[str, int, int, str]]] = []  # one list of extents per running launch


def _extents(arg_names, args, kwargs) -> list[tuple[str, int, int, str]]:
    out = []
    named = list(zip(arg_names, args)) + list(kwargs.items())
    for name, value in named:
        if hasattr(value, "untyped_storage") and hasattr(value, "data_ptr"):
            storage = value.untyped_storage()
            start = storage.data_ptr()
            desc = f"{name} {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
            out.append((name, start, start + storage.nbytes(), desc))
    return out


def _check_access(op: str, ptrs, mask) -> None:
    if not _launches:
        return
    extents = _launches[-1]
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    lanes = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape) if mask is not None else None
    if lanes is not None:
        addr = addr[lanes]
    else:
        addr = addr.reshape(-1)
    if addr.size == 0:
        return
    width = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    inside = np.zeros(addr.shape, dtype=bool)
    for _, start, end, _ in extents:
        inside |= (addr >= start) & (addr + width <= end)
    if inside.all():
        return
    stray = addr[~inside]
    a = int(stray[0])
    # Name the tensor the stray lanes were most likely meant for: the nearest one below the address.
    below = [e for e in extents if e[1] <= a]
    if below:
        _, start, end, desc = max(below, key=lambda e: e[1])
        where = f"the first at element {(a - start) // width} of {desc}, whose storage holds {(end - start) // width}"
    elif extents:
        _, start, end, desc = min(extents, key=lambda e: e[1])
        where = f"the first {(start - a) // width} element(s) before the start of {desc}"
    else:
        where = "no tensor argument at all"
    from triton.runtime.interpreter import interpreter_builder

    pid = tuple(interpreter_builder.grid_idx) if interpreter_builder.grid_idx is not None else "?"
    raise IndexError(f"out-of-bounds {op}: {stray.size} lane(s) of program {pid} reach outside every "
                      f"tensor argument ({where})")


_patched = False


def _install() -> None:
    """Wrap the interpreter's memory operations once; the wrappers do nothing outside bounds_checked."""
    global _patched
    if _patched:
        return
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    rmw, cas = builder.create_atomic_rmw, builder.create_atomic_cas

    # Pass every other argument through as given: the interpreter's builder takes some by keyword
    # (a load's cache_modifier, eviction_policy), and a kernel outside any lab calls these too.
    def create_masked_load(self, ptrs, mask, other, *rest, **options):
        _check_access("load", ptrs, mask)
        return load(self, ptrs, mask, other, *rest, **options)

    def create_masked_store(self, ptrs, value, mask, *rest, **options):
        _check_access("store", ptrs, mask)
        return store(self, ptrs, value, mask, *rest, **options)

    def create_atomic_rmw(self, op, ptr, val, mask, *rest, **options):
        _check_access("atomic", ptr, mask)
        return rmw(self, op, ptr, val, mask, *rest, **options)

    def create_atomic_cas(self, ptr, cmp, val, *rest, **options):
        _check_access("atomic", ptr, None)
        return cas(self, ptr, cmp, val, *rest, **options)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store
    builder.create_atomic_rmw = create_atomic_rmw
    builder.create_atomic_cas = create_atomic_cas

    call, init_args = interpreter.GridExecutor.__call__, interpreter.GridExecutor._init_args_hst

    def grid_call(self, *args, **kwargs):
        if not _active:
            return call(self, *args, **kwargs)
        _launches.append([])
        try:
            return call(self, *args, **kwargs)
        finally:
            _launches.pop()

    def init_args_hst(self, args_dev, kwargs):
        # The extents of the tensors the kernel really addresses: the host copies (for CPU tensors,
        # the same storage), taken where the interpreter makes them.
        args_hst, kwargs_hst = init_args(self, args_dev, kwargs)
        if _active and _launches:
            _launches[-1][:] = _extents(self.arg_names, args_hst, kwargs_hst)
        return args_hst, kwargs_hst

    interpreter.GridExecutor._init_args_hst = init_args_hst
    interpreter.GridExecutor.__call__ = grid_call
    _patched = True


_active = 0


@contextlib.contextmanager
def bounds_checked():
    """Inside the block, interpreted kernels raise ``IndexError("out-of-bounds ...")`` instead of touching memory
    outside their tensor arguments (whole storages: a view may legally reach its base's other rows).
    Does nothing when the kernels are compiled for a GPU (there the process is the guard)."""
    global _active
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        yield
        return
    _install()
    _active += 1
    try:
        yield
    finally:
        _active -= 1


# -------------------------------------------------------------------------------------------------
# explain

def root_cause(exc: BaseException) -> tuple[BaseException, bool]:
    """(the innermost exception, whether it came through the Triton interpreter, i.e. from a kernel).
    The interpreter re-raises anything from a kernel as ``InterpreterError(repr(e)) from e``."""
    in_kernel = False
    seen = 0
    while seen < 10:
        if type(exc).__name__ == "InterpreterError":
            in_kernel = True
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None or type(exc).__name__ not in ("InterpreterError", "CompilationError"):
            break
        exc, seen = nxt, seen + 1
    return exc, in_kernel


def likely_cause(exc: BaseException) -> str:
    text = str(exc)
    low = text.lower()
    oob = isinstance(exc, IndexError) and text.startswith("out-of-bounds")
    if oob and text.startswith("out-of-bounds store"):
        return ("a tl.store without a mask for the rows (or columns) past the end: the last tile is ragged, "
                "so mask it, e.g. mask=rows[:, None] < N")
    if oob:
        return ("a tl.load without a mask (or with the wrong one) for the rows or columns past the end, "
                "or a pointer offset with a wrong stride or head offset")
    if isinstance(exc, ShortcutError):
        return "the prediction asked the tool it is graded against"
    if "broadcast" in low or "shape" in low or "incompatible" in low:
        return ("tile shapes that do not match: check the [:, None] / [None, :] broadcasts, tl.trans, and "
                "that a reduction uses the right axis")
    if "constexpr" in low or "tl.constexpr" in low:
        return "a value used as a tile size or in tl.arange that is not a tl.constexpr"
    if isinstance(exc, ZeroDivisionError):
        return "a division by a count or size that can be zero"
    if isinstance(exc, TypeError):
        return "a call with the wrong arguments or a value of the wrong type (a tensor where an int belongs?)"
    if isinstance(exc, (NameError, AttributeError)):
        return "a name that is not defined where it is used (a typo, or a Triton function under another name)"
    if isinstance(exc, KeyError):
        return ("a lookup in a table that lacks this input: the check draws its inputs at random when it "
                "runs, so answer with a formula, not a table")
    if isinstance(exc, IndexError):
        return "an index past the end of a list or tensor"
    if "cuda" in low and ("illegal" in low or "memory" in low):
        return "a load or store outside a tensor (a missing mask): rerun on the CPU to see which"
    return "see the full traceback with --traceback (or LABS_TRACEBACK=1)"


def raised_by_grader(exc: BaseException) -> bool:
    """Whether an AssertionError is a check's verdict (raised in labs/checks.py or by this module)
    rather than an ``assert`` in the learner's own code."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return True
    f = Path(last.tb_frame.f_code.co_filename).resolve()
    return f in (LABS_DIR / "checks.py", Path(__file__).resolve())


def explain(exc: BaseException) -> str:
    """One line for an exception raised by a learner's code (not a gap, not a wrong answer)."""
    inner, in_kernel = root_cause(exc)
    first = (str(inner).strip().splitlines() or [""])[0]
    if len(first) > 300:
        first = first[:300] + " ..."
    who = "your kernel" if in_kernel else "your code"
    return f"{who} raised {type(inner).__name__}: {first}; a likely cause: {likely_cause(inner)}"
