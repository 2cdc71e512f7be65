"""The README's results section, generated from a results directory, never typed by hand.

    python -m harness report results/h200                       # print the Markdown
    python -m harness report results/h200 --readme README.md    # rewrite the README's block
    python -m harness report results/h200 --readme README.md --check   # exit 1 if it is stale

The README holds the generated text between two marker lines, which stay in place::

    <!-- results:begin -->
    ... generated ...
    <!-- results:end -->

What is generated (:func:`render_table`): for each headline cell (N = 4096, D = 64 and 128, fp16,
causal no/yes) one table of every stage and peer: time, TFLOPS, speedup over stage A, DRAM bytes
(Nsight Compute measured, traffic model in parentheses), peak extra memory, relative error, status;
then stage C's throughput as a fraction of SDPA CUDNN's over N. :func:`render_block` adds links to
the figures ``python -m harness plot`` wrote.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from pathlib import Path

from . import views
from .results import ResultsError
from .views import dram_bytes, fmt_bytes, fmt_num, is_ok, label, select

BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"

FIGURE_CAPTIONS = (
    ("waterfall.png", "A → B → C at the headline cell, stage C's optimizations one by one"),
    ("throughput.png", "TFLOPS vs N, stages and SDPA backends"),
    ("dram_bytes.png", "DRAM bytes vs N: traffic model and Nsight Compute measurement"),
    ("peak_memory.png", "peak extra memory vs N, OOM points"),
    ("roofline.png", "roofline with the device's measured ceilings"),
    ("energy.png", "energy per call and TFLOP per joule"),
)


class ReadmeError(ValueError):
    """The README lacks the results markers (or has them twice, or out of order)."""


def _cell_title(N: int, D: int, dtype: str, causal: int, B: int | None = None, H: int | None = None) -> str:
    shape = f" (B = {B}, H = {H})" if B is not None else ""
    return f"N = {N}, D = {D}, {dtype}, {'causal' if causal else 'non-causal'}{shape}"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _speedup(row: dict, base: dict | None) -> str:
    if base is None or not (is_ok(base) and is_ok(row)) or not base["ms_median"] or not row["ms_median"]:
        return "—"
    return f"{base['ms_median'] / row['ms_median']:.2f}×"


def _measured_model(measured, model) -> str:
    if measured is None and model is None:
        return "—"
    if model is None:
        return fmt_bytes(measured)
    if measured is None:
        return f"— ({fmt_bytes(model)})"
    return f"{fmt_bytes(measured)} ({fmt_bytes(model)})"


def cell_table(rows: list[dict], *, N: int, D: int, dtype: str, causal: int) -> str:
    """One headline cell as a Markdown table (heading included); '' when the cell has no rows."""
    at = views.plain(views.cell_rows(rows, N=N, D=D, dtype=dtype, causal=causal))
    if not at:
        return ""
    at.sort(key=lambda r: views.impl_sort_key(r["impl"]))
    base = next((r for r in at if r["impl"] == "a"), None)
    lines = [f"#### {_cell_title(N, D, dtype, causal, at[0]['B'], at[0]['H'])}", "",
             "| impl | ms | TFLOPS | speedup vs A | DRAM bytes measured (model) | peak extra memory (model) "
             "| rel err | status |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in at:
        ok = is_ok(r)
        lines.append("| " + " | ".join([
            _md(label(r["impl"])),
            fmt_num(r["ms_median"], ".3g") if ok else "—",
            fmt_num(r["tflops"], ".0f") if ok else "—",
            _speedup(r, base),
            _measured_model(dram_bytes(r, "measured"), dram_bytes(r, "model")),
            _measured_model(r["peak_mem_measured"], r["peak_mem_model"]),
            fmt_num(r["rel_err"], ".1e"),
            _md(r["status"]),
        ]) + " |")
    return "\n".join(lines)


def ratio_table(rows: list[dict], *, dtype: str = "fp16", impl: str = "c", peer: str = "sdpa_cudnn") -> str:
    """``impl``'s throughput as a fraction of ``peer``'s over N, one line per (D, causal); '' without data."""
    data = [r for r in views.plain(rows) if r["dtype"] == dtype and is_ok(r) and r["tflops"]]
    ratios: dict[tuple, dict[int, float]] = {}
    for D, causal in sorted({(r["D"], int(r["causal"])) for r in data}):
        for N in sorted({r["N"] for r in select(data, D=D, causal=causal)}):
            at = views.cell_rows(data, N=N, D=D, dtype=dtype, causal=causal)
            mine, theirs = select(at, impl=impl), select(at, impl=peer)
            if mine and theirs:
                ratios.setdefault((D, causal), {})[N] = mine[-1]["tflops"] / theirs[-1]["tflops"]
    if not ratios:
        return ""
    Ns = sorted({n for line in ratios.values() for n in line})
    lines = [f"#### {label(impl)} vs {label(peer)}: TFLOPS ratio over N ({dtype}; above 1: {label(impl)} is faster)",
             "",
             "| D | causal | " + " | ".join(f"N = {n}" for n in Ns) + " |",
             "|--:|---|" + "--:|" * len(Ns)]
    for (D, causal), line in ratios.items():
        cells = [f"{line[n]:.2f}" if n in line else "—" for n in Ns]
        lines.append(f"| {D} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_table(rows: list[dict], env: dict, *, dtype: str = "fp16") -> str:
    """The README's results tables (Markdown) from de-duplicated rows and ``env.json``'s contents."""
    gpu = env.get("gpu_name") or "an unknown GPU"
    date = str(env.get("date") or "")[:10] or "undated"
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton", "driver", "cuda_runtime") if env.get(k))
    parts = [f"Measured on **{_md(gpu)}**, {date}" + (f" ({_md(versions)})" if versions else "") + ". "
             "FLOPs = 4·B·H·N²·D, half of it for causal; forward pass only. DRAM bytes: Nsight Compute "
             "`dram__bytes_read.sum + dram__bytes_write.sum` over the impl's kernels, its traffic model in "
             "parentheses. Peak extra memory: `max_memory_allocated` during one call beyond the inputs "
             "(workspace model in parentheses). Decimal units: 1 GB = 10⁹ bytes. "
             "rel err: ‖o − ref‖/‖ref‖ against a float64 reference."]
    if views.interpreted(rows):
        parts.append("> **Note:** some rows ran in the Triton interpreter on a CPU: their times are not GPU times.")
    any_cell = False
    for D in views.HEADLINE_DS:
        for causal in (0, 1):
            N = views.headline_n(rows, D=D, dtype=dtype, causal=causal)
            if N is None:
                continue
            table = cell_table(rows, N=N, D=D, dtype=dtype, causal=causal)
            if table:
                parts.append(table)
                any_cell = True
    if not any_cell:
        parts.append(f"_No {dtype} rows at D = {' or '.join(map(str, views.HEADLINE_DS))} yet: "
                     f"run `{views.HINTS['rows']}`._")
    ratio = ratio_table(rows, dtype=dtype)
    if ratio:
        parts.append(ratio)
    return "\n\n".join(parts) + "\n"


def _posix_rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def render_block(results_dir, readme_dir=".", *, dtype: str = "fp16") -> str:
    """What goes between the markers: a do-not-edit note, :func:`render_table`, and links (relative
    to ``readme_dir``) to the figures present in ``<results_dir>/figures``."""
    results_dir, readme_dir = Path(results_dir), Path(readme_dir)
    rows, env = views.load(results_dir)
    rel = _posix_rel(results_dir, readme_dir)
    parts = [f"<!-- generated by `python -m harness report {rel} --readme <this file>` from {rel}/runs.csv; "
             "edit the results, not this block -->",
             render_table(rows, env, dtype=dtype).rstrip("\n")]
    figures = [(name, caption) for name, caption in FIGURE_CAPTIONS if (results_dir / "figures" / name).exists()]
    if figures:
        parts.append("\n\n".join(f"![{caption}]({rel}/figures/{name})" for name, caption in figures))
    return "\n\n".join(parts) + "\n"


def _split(text: str, path) -> tuple[str, str, str]:
    """README text -> (text up to and including BEGIN, the old block, text from END on)."""
    nb, ne = text.count(BEGIN), text.count(END)
    if nb != 1 or ne != 1:
        raise ReadmeError(
            f"{path}: expected exactly one '{BEGIN}' and one '{END}' line (found {nb} and {ne}); "
            "put them where the generated results should go")
    b, e = text.index(BEGIN), text.index(END)
    if e < b:
        raise ReadmeError(f"{path}: '{END}' comes before '{BEGIN}'")
    head_end = b + len(BEGIN)
    return text[:head_end], text[head_end:e], text[e:]


def readme_with_block(readme_text: str, block: str, path="README") -> str:
    """``readme_text`` with the text between the markers replaced by ``block``."""
    head, _old, tail = _split(readme_text, path)
    return head + "\n" + block.strip("\n") + "\n" + tail


def expected_readme(readme_path, results_dir, *, dtype: str = "fp16") -> tuple[str, str]:
    """(current README text, README text with a freshly generated block)."""
    readme_path = Path(readme_path)
    if not readme_path.exists():
        raise ReadmeError(f"{readme_path}: no such README")
    current = readme_path.read_text()
    block = render_block(results_dir, readme_path.parent, dtype=dtype)
    return current, readme_with_block(current, block, readme_path)


def update_readme(readme_path, results_dir, *, dtype: str = "fp16") -> bool:
    """Rewrite the README's results block from ``results_dir``; True if the file changed."""
    current, new = expected_readme(readme_path, results_dir, dtype=dtype)
    if new == current:
        return False
    Path(readme_path).write_text(new)
    return True


def check_readme(readme_path, results_dir, *, dtype: str = "fp16") -> str:
    """'' when the README's block is what :func:`update_readme` would write, else a unified diff."""
    current, new = expected_readme(readme_path, results_dir, dtype=dtype)
    if new == current:
        return ""
    return "".join(difflib.unified_diff(current.splitlines(True), new.splitlines(True),
                                        f"{readme_path} (committed)", f"{readme_path} (generated)"))


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``report RESULTS_DIR [--readme README.md] [--check] [--dtype fp16]``."""
    p = subparsers.add_parser("report", help="the README's results tables, from a results directory",
                              description="Print the results tables, or rewrite/check the README block "
                                          f"between '{BEGIN}' and '{END}'.")
    p.add_argument("results_dir", help="a results/<gpu>/ directory holding runs.csv and env.json")
    p.add_argument("--readme", default=None, help="README to rewrite between the results markers")
    p.add_argument("--check", action="store_true",
                   help="do not write: exit 1 if the README's block differs from what would be generated "
                        "(README.md unless --readme is given)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="dtype of the tables")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    try:
        if args.check:
            readme = args.readme or "README.md"
            diff = check_readme(readme, args.results_dir, dtype=args.dtype)
            if diff:
                print(diff, end="")
                print(f"report: {readme}'s results block is stale; regenerate it with "
                      f"`python -m harness report {args.results_dir} --readme {readme}`", file=sys.stderr)
                return 1
            print(f"report: {readme}'s results block is up to date")
            return 0
        if args.readme:
            changed = update_readme(args.readme, args.results_dir, dtype=args.dtype)
            print(f"report: {'updated' if changed else 'unchanged'} {args.readme}")
            return 0
        print(render_block(args.results_dir, ".", dtype=args.dtype), end="")
        return 0
    except (ResultsError, ReadmeError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.report")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return run(parser.parse_args(["report", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
