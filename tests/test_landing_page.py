"""The landing page (README.md) and the pages it sends a reader to: short, the Quickstart CI runs,
the reading path complete, links that resolve, no private references.

Pure text checks (no GPU, no stages run, well under a second). Whether the generated blocks are
up to date with results/ is checked in test_plots_report.py (``test_committed_h200_readme_blocks_are_current``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from harness import report

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS_README = ROOT / "results" / "h200" / "README.md"

#: The landing page's budget. Counted by :func:`prose_words`: prose and tables (the generated
#: headline table included), not fenced code blocks (the Quickstart commands, the layout) or HTML
#: comments (the generated blocks' markers and notes), and only tokens with a letter or digit in
#: them (a table's pipes and rules are not words).
MAX_WORDS = 1000

#: The pages this project's reviewers read for private references.
PUBLIC_PAGES = ("README.md", "results/h200/README.md", "harness/README.md", "docs/README.md")

#: Files another engineer is writing now: a link to one is accepted while it is missing, and checked
#: like any other (anchors included) once it exists.
PENDING = {"docs/glossary.md", "notebooks/10_ring_attention.ipynb"}


def strip_code_and_comments(text: str) -> str:
    text = re.sub(r"^```.*?^```[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"<!--.*?-->", "", text, flags=re.S)


def prose_words(text: str) -> int:
    return sum(1 for w in strip_code_and_comments(text).split() if re.search(r"\w", w))


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next heading of level 1 or 2 (a ``#`` line inside a
    code block is a shell comment, not a heading)."""
    out, inside, fenced = [], False, False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,2} ", line):
            if inside:
                break
            inside = line.rstrip("\n") == f"## {heading}"
            continue
        if inside:
            out.append(line)
    assert out, f"no '## {heading}' section"
    return "".join(out)


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: link syntax reduced to its text, lowercase, every
    character but letters, digits, '_', '-' and spaces dropped, spaces to hyphens."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = strip_code_and_comments(path.read_text()) if path.suffix == ".md" else ""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M):
        slug = github_anchor(heading)
        n = seen.get(slug, 0)
        found.add(slug if n == 0 else f"{slug}-{n}")  # GitHub numbers repeated headings
        seen[slug] = n + 1
    found |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", path.read_text()))
    return found


def links(text: str) -> list[str]:
    """Targets of Markdown links and images outside code blocks (inline code spans dropped too)."""
    text = re.sub(r"`[^`\n]*`", "", strip_code_and_comments(text))
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


# ------------------------------------------------------------------------------ the landing page

def test_landing_page_is_short():
    words = prose_words(README.read_text())
    assert words <= MAX_WORDS, (f"README.md has {words} words of prose and tables (code blocks and HTML comments "
                                f"not counted), over the landing page's {MAX_WORDS}: move detail to a stage "
                                "README, results/h200/README.md, harness/README.md or docs/")


def test_quickstart_holds_the_two_commands_ci_runs_verbatim():
    """.ci/run runs exactly the Quickstart's two commands in a fresh venv: each command line of .ci/run
    is a line of the Quickstart's code block, and the block has no other command."""
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci) == 2, ci
    blocks = code_blocks(section(README.read_text(), "Quickstart"))
    assert len(blocks) == 1
    commands = [ln for ln in blocks[0].splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands == ci


def test_landing_page_holds_the_headline_block_only():
    """One generated table on the landing page; every other block lives on the results page."""
    text = README.read_text()
    held = [name for name in report.BLOCKS if report.markers(name)[0] in text]
    assert held == ["headline"]
    assert "](results/h200/figures/waterfall.png)" in text  # the waterfall, as an image
    assert "](results/h200/README.md)" in text


def test_results_page_holds_every_results_section():
    text = RESULTS_README.read_text()
    for name, _heading, _what, command in report.RESULTS_PAGE_SECTIONS:
        assert report.markers(name)[0] in text and report.markers(name)[1] in text, name
        assert command in text, f"the {name} section does not say how to rerun it: {command}"


def test_reading_path_lists_the_stage_lessons_notebooks_labs_and_docs():
    path = section(README.read_text(), "The reading path")
    for target in ("stages/a_naive/README.md", "stages/b_tiled/README.md", "stages/c_optimized/README.md",
                   "labs/README.md", "docs/README.md", "docs/glossary.md", "results/h200/README.md"):
        assert f"]({target})" in path, target
    notebooks = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    for name in sorted(set(notebooks) | {"10_ring_attention.ipynb"}):
        assert f"](notebooks/{name})" in path, name
    numbers = [int(m) for m in re.findall(r"\]\(notebooks/(\d\d)_", path)]
    assert numbers == sorted(numbers) and numbers[:1] == [1], numbers


def test_supported_versions_name_the_pins():
    """pyproject.toml points at this section; it names what pyproject.toml pins."""
    versions = section(README.read_text(), "Supported versions")
    for needle in ("| torch | 2.11 |", "| triton | 3.6.0 |", "| numpy | < 2.3 |", "| transformers | 5.17.0"):
        assert needle in versions, needle


# ------------------------------------------------------------------------------ every public page

@pytest.mark.parametrize("page", PUBLIC_PAGES)
def test_no_tracker_or_unnamed_article_references(page):
    """A reader has no access to the project's tracker or its private sources: cite public ones
    (the FlashAttention papers, the CUDA C++ Programming Guide, the Triton tutorials) or say it."""
    text = (ROOT / page).read_text()
    for pattern in (r"\bissues?\s*#?\d+", r"\bPR\s*#?\d+", r"\bpull request", r"(?<![\w#&/])#\d+\b",
                    r"\bseeds?/", r"\bseed (?:article|text|paper)s?\b", r"\barticles?\b"):
        hits = [m.group(0) for m in re.finditer(pattern, text, flags=re.I)]
        assert not hits, f"{page}: {hits} ({pattern})"


@pytest.mark.parametrize("page", PUBLIC_PAGES)
def test_relative_links_resolve(page):
    """Every relative link (generated blocks included) points at a file of the repository, and every
    #anchor at a heading of it; links to files being written now (:data:`PENDING`) may dangle."""
    source = ROOT / page
    broken = []
    for target in links(source.read_text()):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (source.parent / path_part).resolve() if path_part else source
        rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if not path.exists():
            if rel not in PENDING:
                broken.append(target)
            continue
        if anchor and path.is_file() and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"


def test_glossary_anchors_the_landing_page_uses():
    """The jargon of the landing page links to docs/glossary.md#<term> (GitHub anchors); the list
    is what the glossary must define (checked by test_relative_links_resolve once it exists)."""
    used = sorted(set(re.findall(r"\]\(docs/glossary\.md#([^)]+)\)", README.read_text())))
    assert used == ["cpasync", "gluon", "hbm", "nsight-compute", "online-softmax", "roofline", "sm",
                    "sram--shared-memory", "tensor-core", "tma", "warp-specialization"]
    assert github_anchor("cp.async") == "cpasync" and github_anchor("Warp specialization") == "warp-specialization"
    assert github_anchor("SRAM / shared memory") == "sram--shared-memory"
