"""``python -m labs`` lists the labs; ``python -m labs check <name> [--solution]`` grades one."""

from __future__ import annotations

import argparse
import sys

from . import LABS, check, find, gap_still_open


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labs", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("list", help="list the labs (the default)")
    p_check = sub.add_parser("check", help="grade one lab")
    p_check.add_argument("name")
    p_check.add_argument("--solution", action="store_true", help="grade the reference solution instead")
    args = parser.parse_args(argv)

    if args.command in (None, "list"):
        width = max(len(lab.name) for lab in LABS)
        for i, lab in enumerate(LABS, 1):
            print(f"{i}. {lab.name:<{width}}  {lab.title}  [{lab.teaches}]")
        print("\npython -m labs check <name>   grades labs/<name>.py (your copy); add --solution for the reference")
        return 0

    try:
        find(args.name)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    which = "solution" if args.solution else "your template"
    try:
        summary = check(args.name, solution=args.solution)
    except AssertionError as e:
        print(f"{args.name} ({which}): NOT YET: {e}")
        return 1
    except Exception as e:  # noqa: BLE001 - a learner's kernel can fail in any way; say which
        if gap_still_open(e):
            print(f"{args.name} ({which}): a TODO(lab) gap is still open ({type(e).__name__}: {e})")
        else:
            print(f"{args.name} ({which}): the code raised {type(e).__name__}: {e}")
        return 1
    print(f"{args.name} ({which}): PASS: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
