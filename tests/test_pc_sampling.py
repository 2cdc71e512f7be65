"""harness pc-sampling: Nsight Compute's per-instruction warp sampling, summarized (no GPU needed)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from harness import cli, pc_sampling

STORED = Path(__file__).resolve().parents[1] / "results" / "h200" / "experiments" / "pc_sampling"

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_wait","stall_selected","stall_wait (Not Issued)"')


def _csv(*rows: str) -> str:
    return '"Kernel Name","k",\n' + HEADER + "\n" + "\n".join(rows) + "\n"


def test_samples_are_summed_per_mnemonic_and_reason():
    text = _csv('"0x0","      MUFU.EX2 R24, R24","5","4","100","0","4","1","4"',
                '"0x10","@!P2  MUFU.EX2 R25, R25","3","3","100","0","3","0","3"',
                '"0x20","      NOP","10","10","1","10","0","0","0"',
                '"0x30","      FADD R1, R2, R3","0","0","100","0","0","0","0"')
    s = pc_sampling.summarize(text)
    assert (s.kernel, s.instructions, s.samples, s.executed) == ("k", 4, 18, 301)
    assert s.by_opcode["MUFU"] == {"wait": 7, "selected": 1}  # the "(Not Issued)" column is not added twice
    assert s.by_reason == {"barrier": 10, "wait": 7, "selected": 1}
    assert s.executed_by_opcode["FADD"] == 100 and s.share(10) == pytest.approx(100 * 10 / 18)
    assert "MUFU" in pc_sampling.format_summary(s)


def test_a_file_without_the_table_or_the_samples_is_refused(tmp_path):
    with pytest.raises(ValueError, match="Address"):
        pc_sampling.summarize("no table here\n")
    with pytest.raises(ValueError, match="SourceCounters"):
        pc_sampling.summarize('"Address","Source","Instructions Executed"\n"0x0","NOP","1"\n')
    bad = tmp_path / "bad.csv"
    bad.write_text("nothing\n")
    args = cli.build_parser().parse_args(["pc-sampling", str(bad)])
    assert args._run(args) == 1


def test_gzipped_and_plain_files_read_the_same(tmp_path):
    text = _csv('"0x0","      NOP","2","2","1","2","0","0","0"')
    (tmp_path / "a.csv").write_text(text)
    (tmp_path / "a.csv.gz").write_bytes(gzip.compress(text.encode()))
    assert pc_sampling.read_text(tmp_path / "a.csv") == pc_sampling.read_text(tmp_path / "a.csv.gz")


def test_stored_h200_samples_show_the_exponentials_waiting_in_c_not_in_cudnn():
    """What docs/performance-log/softmax.md entry 23 reads from the stored files: in C's two-consumer kernel before the
    change the exponentials (MUFU) wait on fixed latencies several times as often as cuDNN's."""
    c = pc_sampling.summarize(pc_sampling.read_text(STORED / "c_main_fp16_D64_N2048_c1.sass.csv.gz"))
    cudnn = pc_sampling.summarize(pc_sampling.read_text(STORED / "sdpa_cudnn_fp16_D64_N2048_c1.sass.csv.gz"))
    assert c.kernel == "ws_attention_kernel" and "cudnn" in cudnn.kernel
    c_wait, cudnn_wait = (s.share(s.by_opcode["MUFU"]["wait"]) for s in (c, cudnn))
    assert c_wait > 3 * cudnn_wait, (c_wait, cudnn_wait)


def test_stored_h200_samples_show_the_exponential_turns_emptying_the_unit_queue():
    """What docs/performance-log/softmax.md entry 24 reads from the stored files: with the two consumers taking turns at
    the exponentials, their MUFU instructions no longer wait on the unit's queue (``mio``), where
    they did with turns at wgmma issue; the kernel is sampled less often (it ran shorter)."""
    before = pc_sampling.summarize(pc_sampling.read_text(STORED / "c_one_block_fp16_D64_N2048_c1.sass.csv.gz"))
    after = pc_sampling.summarize(pc_sampling.read_text(STORED / "c_exp_turns_fp16_D64_N2048_c1.sass.csv.gz"))
    mio_before, mio_after = (s.share(s.by_opcode["MUFU"]["mio"]) for s in (before, after))
    assert mio_before > 2.0 > 0.5 > mio_after, (mio_before, mio_after)
    assert after.samples < before.samples
