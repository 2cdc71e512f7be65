"""Summarize Nsight Compute warp-state sampling per SASS instruction: where a kernel's warps wait, and why.

Nsight Compute's ``SourceCounters`` section samples, at a fixed interval on every SM sub-partition,
one warp's program counter and the reason it did not issue (``stall_wait``: a fixed-latency
dependency; ``stall_long_sb``: an mbarrier or memory result; ``stall_barrier``: a warp barrier;
``stall_selected``: it issued; ...). Exported per instruction, that says which instructions a kernel
spends its time at. The files this reads come from::

    ncu --profile-from-start off --section SourceCounters --section WarpStateStats -o rep \\
        python my_one_call.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > kernel.sass.csv

(``results/h200/experiments/pc_sampling/`` holds four, gzipped; ``python -m harness pc-sampling
FILE ...`` prints the summary below for each.) A sample is a warp at a moment, so a warp that
sits at a barrier for the whole kernel (the idle warps of a producer warpgroup) collects samples
without costing any issue slot; read the shares next to the instruction that collects them.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from .ncu import csv_lines

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Summary:
    """Sampled warp states of one kernel, by stall reason and by instruction mnemonic."""

    kernel: str
    instructions: int = 0
    samples: int = 0
    executed: int = 0
    by_reason: Counter = field(default_factory=Counter)
    by_opcode: dict[str, Counter] = field(default_factory=dict)
    executed_by_opcode: Counter = field(default_factory=Counter)

    def share(self, n: int) -> float:
        """n samples as a percentage of all of this kernel's samples."""
        return 100.0 * n / self.samples if self.samples else 0.0


def mnemonic(sass: str) -> str:
    """``@!P2 MUFU.EX2 R24, R24`` -> ``MUFU``: the instruction without predicate and modifiers."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def read_text(path: str | Path) -> str:
    """A source-page CSV, plain or gzipped."""
    path = Path(path)
    data = path.read_bytes()
    return gzip.decompress(data).decode() if data[:2] == b"\x1f\x8b" else data.decode()


def summarize(text: str) -> Summary:
    """Parse ncu's ``--page source --csv --print-source sass`` output (one kernel)."""
    kernel = next((re.sub(r'^"Kernel Name","?|"?,?$', "", ln) for ln in text.splitlines()
                   if ln.startswith('"Kernel Name"')), "?")
    table = csv_lines(text, first_column="Address")
    if not table:
        raise ValueError("no per-instruction table (a header line starting with \"Address\") in this file")
    reader = csv.DictReader(io.StringIO("\n".join(table)))
    if SAMPLES not in (reader.fieldnames or []):
        raise ValueError(f"no {SAMPLES!r} column: collect the SourceCounters section")
    reasons = [c for c in reader.fieldnames if c.startswith("stall_") and "(Not Issued)" not in c]
    s = Summary(kernel)
    for row in reader:
        if row["Address"] == "Address":  # a repeated header
            continue
        op = mnemonic(row["Source"])
        s.instructions += 1
        s.samples += int(row[SAMPLES] or 0)
        executed = int(row.get(EXECUTED) or 0)
        s.executed += executed
        s.executed_by_opcode[op] += executed
        counts = s.by_opcode.setdefault(op, Counter())
        for reason in reasons:
            n = int(row[reason] or 0)
            if n:
                name = reason.removeprefix("stall_")
                counts[name] += n
                s.by_reason[name] += n
    return s


def format_summary(s: Summary, top: int = 12) -> str:
    out = [f"{s.kernel}: {s.instructions} SASS instructions, {s.executed:,} executed (warp level), "
           f"{s.samples:,} samples",
           "  by reason: " + ", ".join(f"{r} {s.share(n):.1f}%" for r, n in s.by_reason.most_common(8)),
           f"  {'instruction':<12} {'samples':>8} {'executed':>12}  top reasons (% of all samples)"]
    ranked = sorted(s.by_opcode, key=lambda op: -sum(s.by_opcode[op].values()))[:top]
    for op in ranked:
        c = s.by_opcode[op]
        out.append(f"  {op:<12} {s.share(sum(c.values())):7.1f}% {s.executed_by_opcode[op]:>12,}  "
                   + ", ".join(f"{r} {s.share(n):.1f}" for r, n in c.most_common(3)))
    return "\n".join(out)


def add_arguments(p) -> None:
    p.add_argument("files", nargs="+", help="ncu source-page CSV exports (.csv or .csv.gz)")
    p.add_argument("--top", type=int, default=12, help="instructions to list per kernel (default 12)")


def run(args) -> int:
    status = 0
    for path in args.files:
        try:
            print(format_summary(summarize(read_text(path)), args.top))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            print(f"harness pc-sampling: {path}: {e}", file=sys.stderr)
            status = 1
    return status
