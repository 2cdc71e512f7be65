"""``python -m labs`` lists the labs; ``python -m labs check <name> [--solution] [--file PATH]`` grades one.

The grade runs in a child process: a learner's kernel that kills the Python process (a segfault in
the Triton interpreter, an illegal address on a GPU) is then reported as a failing grade with a
likely cause instead of taking the grader down with it. Exit status: 0 PASS, 1 not passed (a gap
still open, a wrong answer, an exception or a crash), 2 a usage error, 3 SKIPPED (the lab needs a
CUDA GPU and there is none). ``--traceback`` (or ``LABS_TRACEBACK=1``) adds the full traceback of an
exception, for debugging; by default a grade is one line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import traceback

from . import LABS, find, grade


def _crash_message(returncode: int) -> str:
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return (f"NOT YET: your code crashed the Python process ({name}); a likely cause: a load or store "
            "outside a tensor that the bounds check could not see (a raw pointer, a kernel run outside "
            "the check), or native code called with bad arguments; rerun with --in-process --traceback "
            "to see where")


def _grade_here(args) -> int:
    which = "solution" if args.solution else (args.file or "your template")
    result = grade(args.name, solution=args.solution, path=args.file)
    if args.traceback and result.error is not None:
        traceback.print_exception(result.error)
    print(f"{args.name} ({which}): {result.message}", flush=True)
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="list the labs (the default)")
    p_check = sub.add_parser("check", help="grade one lab")
    p_check.add_argument("name")
    p_check.add_argument("--solution", action="store_true", help="grade the reference solution instead")
    p_check.add_argument("--file", help="grade this copy of the lab instead of labs/<name>.py")
    p_check.add_argument("--traceback", action="store_true", default=bool(os.environ.get("LABS_TRACEBACK")),
                         help="also print the full traceback of an exception (or set LABS_TRACEBACK=1)")
    p_check.add_argument("--in-process", action="store_true",
                         help="grade in this process (faster; a crash then takes the grader down too)")
    args = parser.parse_args(argv)

    if args.command in (None, "list"):
        width = max(len(lab.name) for lab in LABS)
        for i, lab in enumerate(LABS, 1):
            print(f"{i:>2}. {lab.name:<{width}}  {lab.title}  [{lab.teaches}]")
        print("\npython -m labs check <name>   grades labs/<name>.py (your copy); add --solution for the reference")
        return 0

    try:
        find(args.name)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.file and not os.path.isfile(args.file):
        print(f"--file {args.file}: no such file", file=sys.stderr)
        return 2
    if args.in_process:
        return _grade_here(args)

    cmd = [sys.executable, "-m", "labs", "check", args.name, "--in-process"]
    cmd += ["--solution"] * args.solution + (["--file", os.path.abspath(args.file)] if args.file else [])
    cmd += ["--traceback"] * args.traceback
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    sys.stdout.flush()
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode < 0:
        which = "solution" if args.solution else (args.file or "your template")
        print(f"{args.name} ({which}): {_crash_message(proc.returncode)}", flush=True)
        return 1
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
