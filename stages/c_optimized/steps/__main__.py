"""``python -m stages.c_optimized.steps``: write docs/stage-c-steps/ (``--check``: only compare)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import facts, render

#: the files the generator owns in the output folder (anything else there is left alone)
OWNED = re.compile(r"(README\.md|\d\d_[\w-]+\.(md|py)|" + re.escape(facts.CACHE_NAME) + ")")


def generate(out_dir: Path, *, recompile: bool = False, may_compile: bool = True) -> dict[str, str]:
    """Every file of ``out_dir`` as the generator writes it now: name -> text."""
    step_facts, cache = facts.facts_for(out_dir, recompile=recompile, may_compile=may_compile)
    files = render.build(step_facts)
    files[facts.CACHE_NAME] = facts.cache_text(cache)
    return files


def differences(out_dir: Path, files: dict[str, str]) -> list[str]:
    """The files of ``out_dir`` that differ from ``files``: changed, missing, or stale leftovers."""
    out = []
    for name, text in files.items():
        path = out_dir / name
        if not path.exists():
            out.append(f"{name}: missing")
        elif path.read_text() != text:
            out.append(f"{name}: differs")
    if out_dir.exists():
        out += [f"{p.name}: not generated any more" for p in sorted(out_dir.iterdir())
                if OWNED.fullmatch(p.name) and p.name not in files]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stages.c_optimized.steps", description=__doc__)
    p.add_argument("--out", type=Path, default=render.OUT_DIR, help="output folder (default: docs/stage-c-steps)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 when the folder differs from what would be written")
    p.add_argument("--recompile", action="store_true",
                   help=f"compile every step again instead of reusing {facts.CACHE_NAME}'s matching entries")
    args = p.parse_args(argv)
    try:
        files = generate(args.out, recompile=args.recompile, may_compile=not args.check)
    except facts.StaleFacts as e:  # --check compiles nothing
        print(e)
        return 1
    diff = differences(args.out, files)
    if args.check:
        print("\n".join(diff) if diff else f"{args.out}: up to date")
        return 1 if diff else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for line in diff:
        name = line.split(":", 1)[0]
        if line.endswith("not generated any more"):
            (args.out / name).unlink()
        else:
            (args.out / name).write_text(files[name])
    print(f"{args.out}: {len(files)} files, {len(diff)} written or removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
