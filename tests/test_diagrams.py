"""Each conceptual diagram renders to a PNG, and the command draws them all."""

from __future__ import annotations

import pytest

from harness import diagrams

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", sorted(diagrams.DIAGRAMS))
def test_diagram_renders_a_png(tmp_path, name):
    path = diagrams.DIAGRAMS[name](tmp_path / name)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000  # a drawing, not an empty canvas


def test_main_writes_every_diagram(tmp_path, capsys):
    assert diagrams.main([str(tmp_path / "out")]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(diagrams.DIAGRAMS)
    assert diagrams.main(["--help"]) == 2
