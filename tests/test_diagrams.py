"""Each conceptual diagram renders to a PNG, and the command draws them all."""

from __future__ import annotations

import matplotlib.text
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


# ------------------------------------------------------------------ round_trips.png: bytes from the models

def _problem(**kw):
    from stages.contract import Problem

    return Problem(**{**diagrams.ROUND_TRIP_PROBLEM, **kw})


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"N": 1000, "D": 128}, {"dtype": "fp32", "N": 300},
                                {"H": 8, "Hkv": 2, "N": 200, "Nk": 700}])
def test_round_trip_arrows_add_up_to_the_traffic_models(kw):
    """Each stage's arrows split its ``hbm_bytes`` exactly, for the headline cell and for shapes the
    split could get wrong (causal, ragged N, fp32's smaller tiles, GQA with Nq != Nk)."""
    from stages.a_naive.kernels import hbm_bytes as a_bytes
    from stages.b_tiled.kernels import hbm_bytes as b_bytes

    p = _problem(**kw)
    arrows = diagrams.round_trip_crossings(p)
    for stage, model in (("a", a_bytes(p)), ("b", b_bytes(p))):
        xs = arrows[stage]
        assert sum(x.nbytes for x in xs if x.direction == "read") == model.read, stage
        assert sum(x.nbytes for x in xs if x.direction == "write") == model.write, stage
        assert all(x.nbytes > 0 for x in xs), stage
    # the physics the split assumes: S and P written once each, one N×N matrix of all heads; O once
    nn = p.B * p.H * p.N * p.Nk * p.element_bytes
    written = {x.tensor: x.nbytes for x in arrows["a"] if x.direction == "write"}
    assert written == {"S": nn, "P": nn, "O": p.q_bytes}
    assert not any(x.nn for x in arrows["b"])  # stage B moves no N×N matrix
    assert [x.nbytes for x in arrows["b"] if x.tensor in ("Q", "O")] == [p.q_bytes, p.q_bytes]


def test_round_trip_figure_draws_the_model_bytes(tmp_path):
    """The labels drawn are the arrows' labels, and their byte figures are the models' (headline cell)."""
    from harness.views import fmt_bytes
    from stages.a_naive.kernels import hbm_bytes as a_bytes
    from stages.b_tiled.kernels import hbm_bytes as b_bytes

    p = _problem()
    fig, arrows = diagrams.round_trip_figure(p)
    texts = {t.get_text() for t in fig.findobj(matplotlib.text.Text)}
    diagrams.plt.close(fig)
    for x in arrows["a"] + arrows["b"]:
        assert x.label in texts, x.label
        assert fmt_bytes(x.nbytes) in x.label, x.label
    nn = p.B * p.H * p.N * p.N * p.element_bytes
    s_written = next(x for x in arrows["a"] if x.tensor == "S" and x.direction == "write")
    assert s_written.label == f"S written\n{fmt_bytes(nn)}"  # 4.29 GB at the headline cell
    titles = " ".join(texts)
    assert f"Model: {fmt_bytes(a_bytes(p).total)} per call" in titles
    assert f"Model: {fmt_bytes(b_bytes(p).total)} per call, 0 B of it S and P" in titles
    assert f"N = {p.N}, D = {p.D}, {p.dtype}, B = {p.B}, H = {p.H}" in titles


def test_round_trip_arrows_refuse_a_model_they_do_not_split(monkeypatch):
    """If a stage's traffic model changes so that the split no longer adds up, drawing fails loudly
    instead of showing stale arrows."""
    from stages.a_naive import kernels as a_kernels
    from stages.contract import HbmTraffic

    real = a_kernels.hbm_bytes
    # S stored in fp32, say: the writes no longer weigh what the tensors do
    monkeypatch.setattr(a_kernels, "hbm_bytes", lambda p: HbmTraffic(real(p).read, real(p).write + 1))
    with pytest.raises(AssertionError, match="stage A's arrows"):
        diagrams.round_trip_crossings()
    # reads too few to hold the S and P reads: the rest (V) would come out negative
    monkeypatch.setattr(a_kernels, "hbm_bytes", lambda p: HbmTraffic(real(p).read // 4, real(p).write))
    with pytest.raises(AssertionError, match="stage A's arrows"):
        diagrams.round_trip_crossings()
