"""The step files: one Markdown page per step of stage C's walk, the resolved kernel of each ``tl``
step as a Python file, and the index (``docs/stage-c-steps/``).

Everything on a page is read from the code and the results, never typed: the paragraph from the
module docstrings of ``kernels.py`` and ``hopper_ws.py``, the kernel from ``resolve.py``, the launch
from the stage's ``plan``, the numbers from ``results/h200/runs.csv``, the compiled-code facts from
Triton's output (``facts.py``).
"""

from __future__ import annotations

import ast
import difflib
import functools
import re
from pathlib import Path

import triton

from .. import STAGE, SWITCHES, hopper_ws
from ..configs import BASELINE
from . import facts as facts_mod
from . import ladder, measured
from .ladder import CELLS, FACTS_CELL, STEPS, TL_FUNCTIONS, Step, previous
from .resolve import function_sources, resolve_functions

COMMAND = "python -m stages.c_optimized.steps"
REPO = Path(__file__).resolve().parents[3]
KERNELS_PY = REPO / "stages" / "c_optimized" / "kernels.py"
HOPPER_WS_PY = REPO / "stages" / "c_optimized" / "hopper_ws.py"
STAGE_B_PY = REPO / "stages" / "b_tiled" / "kernels.py"
OUT_DIR = REPO / "docs" / "stage-c-steps"


# --------------------------------------------------------------------------------------------------
# The words: from the module docstrings.
# --------------------------------------------------------------------------------------------------

def _md(text: str) -> str:
    """reStructuredText-ish docstring prose as Markdown: ``code`` → `code`, lines joined."""
    return re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))


def switch_paragraphs() -> dict[str, str]:
    """``kernels.py``'s docstring: the paragraph of each switch (``name``  text...), and the
    paragraphs that start "Always on" and "With every switch off"."""
    doc = ast.get_docstring(ast.parse(KERNELS_PY.read_text()))
    out, current = {}, None
    for para in doc.split("\n\n"):
        for line in para.splitlines():
            m = re.match(r"``(\w+)``\s+(.*)", line)
            if m:
                current = m.group(1)
                out[current] = m.group(2)
            elif current and line.startswith(" "):
                out[current] += " " + line.strip()
            else:
                current = None
        if para.startswith("Always on"):
            out["always on"] = para
        elif para.startswith("With every switch off"):
            out["every switch off"] = para
    missing = [s for s in (*SWITCHES, "always on", "every switch off") if s not in out]
    if missing:
        raise LookupError(f"kernels.py's docstring has no paragraph for {missing}")
    return {k: _md(v) for k, v in out.items()}


def rung_paragraphs() -> dict[int, tuple[str, str, list[str]]]:
    """``hopper_ws.py``'s docstring: rung k -> (title, paragraph, the code it names in the
    parentheses after its title: functions and constexprs)."""
    doc = ast.get_docstring(ast.parse(HOPPER_WS_PY.read_text()))
    items, current = {}, None
    for line in doc.splitlines():
        m = re.match(r"(\d)\. \*\*", line)
        if m:
            current = int(m.group(1))
            items[current] = line
        elif current is not None and line.startswith(" "):
            items[current] += "\n" + line
        else:
            current = None
    out = {}
    for k, item in items.items():
        m = re.match(r"\d\. \*\*(.+?)\*\*\s*(?:\(([^)]*)\))?\.?\s*(.*)", item, re.S)
        out[k] = (m.group(1), _md(m.group(3)), re.findall(r"``(\w+)``", m.group(2) or ""))
    missing = [k for k in range(1, len(hopper_ws.LADDER) + 1) if k not in out]
    if missing:
        raise LookupError(f"hopper_ws.py's docstring has no numbered paragraph for rungs {missing}")
    return out


def adds(step: Step) -> str:
    """A short phrase: what the step adds (the stage's ``techniques`` for the switches, the ladder's
    descriptions for the rungs)."""
    if step.index == 0:
        return f"every switch off: stage B's tiles ({BASELINE}), `exp`, pointer loads, every causal tile masked"
    if step.is_ws:
        return hopper_ws.LADDER[step.rung - 1][1].removeprefix("+ ")
    return STAGE.techniques[SWITCHES.index(step.name)]


def title(step: Step) -> str:
    if step.index == 0:
        return "`+none`: stage C with every switch off"
    if step.is_ws:
        name, _ = hopper_ws.LADDER[step.rung - 1]
        return f"`{step.variant}`: warp-specialization rung {step.rung}, {name}"
    return f"`{step.variant}`"


def what_it_changes(step: Step) -> str:
    words = switch_paragraphs()
    if step.index == 0:
        return "\n\n".join([
            f"The walk starts from stage B's settings: every switch off, so the kernel runs stage B's "
            f"`{BASELINE}` tiles ({BASELINE.block_m}×{BASELINE.block_n}, {BASELINE.num_warps} warps, "
            f"{BASELINE.num_stages} stage: no pipelining), reads through pointers, takes `exp` of the scaled "
            f"scores and visits (and masks) every K/V tile of a causal row. {words['every switch off']}",
            words["always on"]])
    if not step.is_ws:
        return words[step.name]
    name, text, _ = rung_paragraphs()[step.rung]
    text = f"**{name}**{text}" if text.startswith(",") else f"**{name}.** {text}"
    if step.rung == 1:
        return words["warp_specialization"] + "\n\n" + f"Rung 1, {text}"
    if step.rung == len(hopper_ws.LADDER):
        return (f"{text}\n\nThis is the top of the ladder: the kernel stage C runs by default on the H200 "
                f"(`attention(q, k, v)` with no keyword).")
    return text


# --------------------------------------------------------------------------------------------------
# The kernel of a step.
# --------------------------------------------------------------------------------------------------

#: What the ablation's calls leave out: no key ranges (a static cache's filled lengths, the pads of a
#: batch), so a step's page does not show the branch that only ranged calls compile.
NO_KEY_RANGES = {"KEY_STARTS": None, "KEY_LENGTHS": None}
#: And their strides (D 64 and 128, contiguous) Triton itself sees to be multiples of 16 bytes, so the
#: kernel's own telling of it (``ALIGN``, aligned.py) resolves away too.
ROWS_TRITON_SEES = {"ALIGN": 1}


@functools.lru_cache(maxsize=None)
def resolved_kernel(step: Step) -> str:
    """The ``tl`` kernel's source as this step compiles it on the H200 (switches fixed, no key ranges)."""
    fixed = {**ladder.switch_values(step), **NO_KEY_RANGES, **ROWS_TRITON_SEES}
    return resolve_functions(KERNELS_PY.read_text(), TL_FUNCTIONS, fixed)


def kernel_module(step: Step) -> str:
    """The resolved kernel as a module a learner can open, import and launch."""
    values = ladder.switch_values(step)
    fixed = ", ".join(f"{k}={v}" for k, v in values.items())
    return (f'"""Stage C at step {step.file_stem} (`{step.variant}`): the forward kernel of\n'
            f"stages/c_optimized/kernels.py with {fixed}, as the H200 compiles it.\n\n"
            f"Generated by `{COMMAND}`; do not edit (edit kernels.py and rerun). Launch it with the\n"
            f"arguments stage C's `plan` gives, minus those this step no longer reads.\n"
            f'"""\n\nimport triton\nimport triton.language as tl\n\n\n' + resolved_kernel(step))


def _tl_before(step: Step) -> Step | None:
    prev = previous(step)
    return prev if prev is not None and not prev.is_ws else None


def kernel_diff(step: Step) -> str:
    """Unified diff of the resolved kernel against the step before (step 00: against stage B's)."""
    prev = _tl_before(step)
    if prev is None:
        (b_src,) = function_sources(STAGE_B_PY.read_text(), ("tiled_attention_kernel",)).values()
        before, name = b_src, "stages/b_tiled/kernels.py (tiled_attention_kernel)"
    else:
        before, name = resolved_kernel(prev), f"{prev.file_stem}.py"
    diff = difflib.unified_diff(before.splitlines(), resolved_kernel(step).splitlines(), fromfile=name,
                                tofile=f"{step.file_stem}.py", lineterm="", n=3)
    return "\n".join(diff)


def rung_code(step: Step) -> list[tuple[str, str]]:
    """(heading, source) excerpts of ``hopper_ws.py`` for the code a rung's docstring paragraph
    names: a function whole; a constexpr as every ``if`` of the Gluon kernel that tests it (or,
    when none does, the lines that read it)."""
    source = HOPPER_WS_PY.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    gluon = [n for n in functions.values() if any("jit" in ast.unparse(d) for d in n.decorator_list)]
    _, _, names = rung_paragraphs()[step.rung]
    out, shown = [], set()
    for name in names:
        if name in functions:
            node = functions[name]
            out.append((f"`{name}` (hopper_ws.py, line {node.lineno})", function_sources(source, (name,))[name]))
            shown |= set(range(node.lineno, node.end_lineno + 1))
            continue
        found = False
        for fn in gluon:
            for node in ast.walk(fn):
                if (isinstance(node, ast.If) and name in {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                        and node.lineno not in shown):
                    text = "\n".join(lines[node.lineno - 1:node.end_lineno])
                    indent = node.col_offset
                    text = "\n".join(ln[indent:] for ln in text.splitlines())
                    out.append((f"`if` on `{name}` in `{fn.name}` (hopper_ws.py, line {node.lineno})", text + "\n"))
                    shown |= set(range(node.lineno, node.end_lineno + 1))
                    found = True
        if not found:
            every = {n.lineno for fn in gluon for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name}
            if not every:
                raise LookupError(f"hopper_ws.py's docstring names {name} for rung {step.rung}: no such code")
            reads = sorted(every - shown)
            if not reads:  # every read is in an excerpt above
                continue
            text = "\n".join(f"{ln:4d}  {lines[ln - 1].strip()}" for ln in reads)
            out.append((f"lines that read `{name}` (hopper_ws.py)", text + "\n"))
            shown |= set(reads)
    return out


# --------------------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------------------

def _fmt_tflops(t, ms) -> str:
    return "—" if t is None else f"{t:.0f} ({ms:.3g} ms)"


def _fmt_share(s: measured.Share) -> str:
    if s.speedup is None:
        return "—"
    part = "" if s.share is None else f" ({s.share:+.0%})"
    return f"{s.speedup:.2f}×{part}"


def share_table(step: Step, rows: list[dict]) -> str:
    first = measured.share(rows, step, CELLS[0])
    lines = [f"| cell | B × H | before: {first.before if first.before == 'stage B' else f'`{first.before}`'} "
             f"TFLOPS (ms) | after: `{step.variant}` TFLOPS (ms) | × (share of B → C) |",
             "|---|---|--:|--:|--:|"]
    for cell in CELLS:
        s = measured.share(rows, step, cell)
        lines.append(f"| {cell.label} | {cell.B} × {cell.H} | {_fmt_tflops(s.tflops_before, s.ms_before)} | "
                     f"{_fmt_tflops(s.tflops_after, s.ms_after)} | {_fmt_share(s)} |")
    return "\n".join(lines)


def settings_table(step: Step) -> str:
    now = {cell: ladder.settings(step, cell) for cell in CELLS}
    prev = previous(step)
    before = {cell: ladder.settings(prev, cell) for cell in CELLS} if prev else None
    labels = list(now[CELLS[0]])
    lines = ["| setting | " + " | ".join(c.label for c in CELLS) + " |", "|---|" + "---|" * len(CELLS)]
    for label in labels:
        cells = []
        for cell in CELLS:
            value = now[cell][label]
            old = before[cell].get(label) if before else None
            cells.append(f"**{value}** (was {old})" if old is not None and old != value else value)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def settings_changes(step: Step) -> list[str]:
    """The settings (labels) this step changes at some cell (empty: none, or a different kernel)."""
    prev = previous(step)
    if prev is None:
        return []
    now = {cell: ladder.settings(step, cell) for cell in CELLS}
    before = {cell: ladder.settings(prev, cell) for cell in CELLS}
    return [label for label in now[CELLS[0]]
            if any(before[c].get(label) is not None and before[c][label] != now[c][label] for c in CELLS)]


def _fact(value) -> str:
    return "—" if value is None else str(value) if not isinstance(value, int) else f"{value:,}"


def facts_table(step: Step, facts: dict) -> str:
    prev = previous(step)
    this, before = facts[step.variant], facts[prev.variant] if prev else None
    archs = [a for a in (90, 80) if a in this]
    head = "| fact | " + " | ".join(
        (f"sm_{a} `{prev.variant}` | sm_{a} **this step**" if before else f"sm_{a}") for a in archs) + " |"
    lines = [head, "|---|" + "--:|" * (len(archs) * (2 if before else 1))]
    for key, label in facts_mod.FACT_KEYS:
        cells = []
        for a in archs:
            new = this[a].get(key)
            if before:
                old = before.get(a, {}).get(key) if before.get(a) else None
                cells.append(_fact(old))
                cells.append(f"**{_fact(new)}**" if old is not None and old != new else _fact(new))
            else:
                cells.append(_fact(new))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def facts_changes(step: Step, facts: dict) -> list[str]:
    """The curated facts that this step changed, per architecture, as "label: a → b"."""
    prev = previous(step)
    if prev is None:
        return []
    out = []
    for a in (90, 80):
        new, old = facts[step.variant].get(a), facts[prev.variant].get(a)
        if not (new and old):
            continue
        changed = [f"{label} {_fact(old[k])} → {_fact(new[k])}" for k, label in facts_mod.FACT_KEYS
                   if old.get(k) != new.get(k)]
        out.append(f"sm_{a}: " + ("; ".join(changed) if changed else "no change"))
    return out


# --------------------------------------------------------------------------------------------------
# Pages.
# --------------------------------------------------------------------------------------------------

def _generated_note(sources: str) -> str:
    return (f"<!-- Generated by `{COMMAND}`: do not edit; edit {sources} and rerun. -->")


def _nav(step: Step) -> str:
    parts = []
    if step.index:
        prev = STEPS[step.index - 1]
        parts.append(f"[← {prev.file_stem}]({prev.file_stem}.md)")
    parts.append("[index](README.md)")
    if step.index + 1 < len(STEPS):
        nxt = STEPS[step.index + 1]
        parts.append(f"[{nxt.file_stem} →]({nxt.file_stem}.md)")
    return " · ".join(parts)


def _cell_words(cell) -> str:
    return (f"B {cell.B}, H {cell.H}, N {cell.N}, D {cell.D}, {'causal' if cell.causal else 'non-causal'}, "
            f"{cell.dtype}")


def step_page(step: Step, rows: list[dict], facts: dict) -> str:
    prev = previous(step)
    switches = ", ".join(f"{k}={v}" for k, v in step.kwargs.items())
    out = [_generated_note("stages/c_optimized/ (kernels.py, hopper_ws.py, configs.py, tuned/h200.json) or "
                           "results/h200/runs.csv"),
           f"# Step {step.index:02d} — {title(step)}", "",
           f"_Generated by `{COMMAND}` from the code of stages/c_optimized/ and results/h200/runs.csv; do not "
           f"edit by hand._", "", _nav(step), "",
           "## What this step changes", "", what_it_changes(step), "",
           f"Ablation variant `{step.variant}`: `attention(q, k, v, {switches})`."]
    if not step.is_ws:
        values = ladder.switch_values(step)
        old = ladder.switch_values(prev) if prev and not prev.is_ws else None
        changed = {k: v for k, v in values.items() if old and old[k] != v}
        if changed:
            out.append("In the kernel: " + ", ".join(f"`{k}` {old[k]} → {v}" for k, v in changed.items())
                       + " (the `if` on it is resolved below).")
        elif old is not None:
            out.append("In the kernel: nothing. This step is host-side only: the kernel source is the same as "
                       f"step {prev.file_stem}'s; what changes is the launch (below) and, through it, the "
                       f"compiled code.")
    out += ["", "## What it is worth (H200, fp16, forward, N = 4096)", "", share_table(step, rows), "",
            "TFLOPS: 4·B·H·N²·D / median time of the eager call (causal: the visible pairs only, ≈ half), "
            "from the newest `ok` ablation rows of results/h200/runs.csv (`kind = ablation`, "
            f"`variant = {step.variant}`) and of the row before. Share: this step's part of the logarithm of "
            "the whole stage B → stage C speedup at that cell, so the shares of the walk add up to about "
            "100 %; a negative share is a step that slowed the kernel down at this point of the walk "
            "(stage C's README has the leave-one-out numbers: each switch with all the others on).", "",
            "## The launch (what the host passes, on the H200)", "",
            "Read from stage C's own `plan` and `select` for sm_90 with 132 SMs and the H200's tuning table "
            "(`tuned/h200.json`), at each cell above. Bold: changed by this step.", "", settings_table(step)]
    changes = settings_changes(step)
    if changes:
        out += ["", "Changed by this step: " + ", ".join(changes) + "."]
    if not step.is_ws:
        out += ["", "## The kernel", ""]
        diff = kernel_diff(step)
        against = ("stage B's kernel (`tiled_attention_kernel` in stages/b_tiled/kernels.py)" if prev is None
                   else f"step {prev.file_stem}")
        if diff:
            out += [f"The kernel as this step compiles it (`kernels.py` with the switches above resolved: "
                    f"`if` branches not taken, dead assignments and parameters removed), against {against}:",
                    "", "```diff", diff, "```"]
        else:
            out += [f"The same source as {against}: nothing to diff."]
        out += ["", f"<details><summary>The whole kernel at this step ({step.file_stem}.py)</summary>", "",
                "```python", resolved_kernel(step).rstrip(), "```", "", "</details>"]
    else:
        out += ["", "## Where it is in the code", "",
                "The warp-specialized kernel is `ws_attention_kernel` in stages/c_optimized/hopper_ws.py (Gluon); "
                "each rung of its ladder is a constexpr or launch option of that one kernel "
                "(`hopper_ws.rung_options`, `kernel_constants`), so instead of a resolved copy this page shows "
                "the code the rung's docstring paragraph names:"]
        for heading, text in rung_code(step):
            out += ["", heading + ":", "", "```python", text.rstrip(), "```"]
    out += ["", f"## In the compiled code ({_cell_words(FACTS_CELL)})", "",
            f"Compiled by Triton {triton.__version__} without a GPU, as the stage compiles the step "
            "(`kernels.compile`): sm_90 with the H200's configs, sm_80 with the configs stage C takes where "
            "it has no tuning table (the `tl` steps only). Static counts in the PTX (instructions in the "
            "code, not executed), registers from the `ptxas` shipped with Triton.", "", facts_table(step, facts)]
    changes = facts_changes(step, facts)
    if changes:
        out += ["", "What this step changed: " + ". ".join(changes) + "."]
    top = facts_mod.top_changes(facts[prev.variant].get(90) if prev else None, facts[step.variant][90])
    if top:
        out += ["", "The PTX opcodes whose counts changed most on sm_90: "
                + ", ".join(f"`{op}` {a:,} → {b:,}" for op, a, b in top) + "."]
    out += ["", _nav(step), ""]
    return "\n".join(out)


def index_page(rows: list[dict]) -> str:
    head = "| step | what it adds | " + " | ".join(c.label for c in CELLS) + " |"
    lines = [_generated_note("stages/c_optimized/ or results/h200/runs.csv"), "# Stage C, one step at a time", "",
             f"_Generated by `{COMMAND}` from the code of stages/c_optimized/ and results/h200/runs.csv; do not "
             "edit by hand._", "",
             "Stage C's optimizations are switches of one kernel, so its source holds all of them at once. "
             "These pages take them apart along the ablation walk (`python -m harness sweep --stages c "
             "--ablation`): from every switch off (stage B's settings) add one optimization at a time, then "
             "climb the warp-specialization ladder of the Hopper kernel. Each page shows what the step changes, "
             "what it is worth on the H200, the launch settings it changes, the kernel source it compiles "
             "(switches resolved; the diff against the step before) and what it changes in the compiled code.",
             "",
             "Each cell: the step's speedup over the step before on the H200 (fp16, forward, N = 4096, "
             "B·N = 16384, H·D = 2048), and in parentheses its share of the logarithm of the whole "
             "stage B → stage C speedup; a negative share is a step that slowed the kernel down at that point "
             "of the walk.", "", head, "|---|---|" + "--:|" * len(CELLS)]
    for step in STEPS:
        cells = [_fmt_share(measured.share(rows, step, c)) for c in CELLS]
        link = f"[{step.file_stem}]({step.file_stem}.md)"
        lines.append(f"| {link} | {adds(step)} | " + " | ".join(cells) + " |")
    totals = []
    for cell in CELLS:
        b, c = measured.stage_totals(rows, cell)
        totals.append("—" if not (b and c) else f"{b['tflops']:.0f} → {c['tflops']:.0f} TFLOPS "
                      f"({b['ms_median'] / c['ms_median']:.2f}×)")
    lines.append("| stage B → stage C | the whole walk (C: the `all` row) | " + " | ".join(totals) + " |")
    lines += ["", "The `tl` steps (00–05) each come with their kernel as a Python file "
              "(`NN_<step>.py`): `kernels.py`'s forward kernel with that step's switches fixed, importable "
              "and launchable on its own (tests/test_stage_c_steps.py runs two of them against a float64 "
              "reference). The warp-specialized rungs (06–11) switch constexprs of the one Gluon kernel in "
              "`hopper_ws.py`; their pages show the code each rung turns on and its compiled facts.",
              "", f"Regenerate after changing the kernels, the configs or the results: `{COMMAND}` "
              f"(`--check` only compares; `--recompile` compiles every step again instead of reusing "
              f"`{facts_mod.CACHE_NAME}`).", ""]
    return "\n".join(lines)


def build(facts: dict, rows: list[dict] | None = None) -> dict[str, str]:
    """Every generated file of docs/stage-c-steps/ (but the facts cache): name -> text."""
    rows = measured.load_rows() if rows is None else rows
    out = {"README.md": index_page(rows)}
    for step in STEPS:
        out[f"{step.file_stem}.md"] = step_page(step, rows, facts)
        if not step.is_ws:
            out[f"{step.file_stem}.py"] = kernel_module(step)
    return out


__all__ = ["OUT_DIR", "build", "index_page", "kernel_diff", "kernel_module", "resolved_kernel", "rung_code",
           "rung_paragraphs", "step_page", "switch_paragraphs"]
