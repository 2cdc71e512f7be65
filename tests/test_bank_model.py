"""Hand-worked cases for stages/bank_model.py (32 banks x 4 bytes; see its docstring)."""

import pytest

from stages.bank_model import access_patterns, ideal_wavefronts, predicted_conflicts, wavefronts
from stages.contract import Problem


def test_row_contiguous_4_byte_access_is_conflict_free():
    # 32 lanes x 4 bytes, consecutive: banks 0..31 once each
    addrs = [4 * l for l in range(32)]
    assert wavefronts(addrs, 4) == 1 and ideal_wavefronts(addrs, 4) == 1


def test_broadcast_is_one_wavefront():
    assert wavefronts([256] * 32, 4) == 1
    assert wavefronts([256] * 32, 16) == 1


def test_column_access_with_128_byte_rows_is_32_way():
    # lane l reads element 0 of row l; rows are 64 halves = 128 bytes = exactly the 32 banks
    addrs = [128 * l for l in range(32)]
    assert wavefronts(addrs, 4) == 32 and ideal_wavefronts(addrs, 4) == 1


def test_one_bank_of_padding_fixes_the_column_access():
    # rows of 64 + 2 halves = 132 bytes: row l starts at bank l
    assert wavefronts([132 * l for l in range(32)], 4) == 1


def test_two_lanes_same_bank_is_2_way():
    addrs = [4 * l for l in range(32)]
    addrs[1] = 128  # lane 1 now hits bank 0 with a different word than lane 0
    assert wavefronts(addrs, 4) == 2


def test_16_byte_accesses_go_in_quarter_warp_phases():
    # 32 lanes x 16 contiguous bytes = 512 bytes: 4 phases of 128 bytes, no conflict
    addrs = [16 * l for l in range(32)]
    assert wavefronts(addrs, 16) == 4 and ideal_wavefronts(addrs, 16) == 4


def test_ldmatrix_rows_128_bytes_apart_are_8_way():
    # one phase = 8 rows of 16 bytes; rows 128 B apart all start in banks 0-3
    unpadded = [128 * (l % 8) + 16 * (l // 8) * 0 for l in range(8)]
    assert wavefronts(unpadded, 16) == 8 and ideal_wavefronts(unpadded, 16) == 1
    padded = [144 * (l % 8) for l in range(8)]  # +16 bytes per row: banks 0-3, 4-7, ..., 28-31
    assert wavefronts(padded, 16) == 1


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("e", [2])
def test_c_kernel_patterns(D, e):
    unpadded = {p.name: p for p in access_patterns("c_cuda", False, D, e)}
    padded = access_patterns("c_cuda", True, D, e)
    swizzled = access_patterns("c_cuda", False, D, e, swizzle=True)
    for name, p in unpadded.items():
        if name.startswith("ldmatrix"):
            assert p.conflict_degree == 8 and p.extra == 28  # 4 phases x 8 wavefronts instead of 4
        else:  # the cp.async copy: each quarter-warp writes 128 contiguous bytes of one row
            assert p.extra == 0
    for p in padded + swizzled:
        assert p.extra == 0, p.name


@pytest.mark.parametrize("D", [64, 128])
def test_b_kernel_patterns(D):
    unpadded = {p.name.split(" (")[0]: p for p in access_patterns("b_cuda", False, D, 2)}
    assert unpadded["K column read"].conflict_degree == 8  # LDS.128: 8 K rows per phase in banks 0-3
    assert all(p.extra == 0 for n, p in unpadded.items() if n != "K column read")
    assert all(p.extra == 0 for p in access_patterns("b_cuda", True, D, 2))


def test_predicted_totals():
    p = Problem(1, 1, 128, 64)
    # c unpadded: per warp Q 4 + per tile (16 K + 16 V) ldmatrix.x4, 28 extra each; 2 Q tiles x 2 K/V tiles, 4 warps
    assert predicted_conflicts("c_cuda", p, smem_pad=False) == {"ld": 28 * 4 * (4 * 2 + 32 * 4), "st": 0}
    assert predicted_conflicts("c_cuda", p) == {"ld": 0, "st": 0}
    assert predicted_conflicts("c_cuda", p, smem_pad=False, swizzle=True) == {"ld": 0, "st": 0}
    causal = predicted_conflicts("c_cuda", Problem(1, 1, 128, 64, causal=True), smem_pad=False)
    assert causal["ld"] == 28 * 4 * (4 * 2 + 32 * 3)  # tile visits 1 + 2
    # b unpadded: D/8 = 8 LDS.128 K reads per tile per warp, 4 x 4 tile visits, 4 warps
    assert predicted_conflicts("b_cuda", p) == {"ld": 28 * 8 * 16 * 4, "st": 0}
    assert predicted_conflicts("b_cuda", p, smem_pad=True) == {"ld": 0, "st": 0}
    assert predicted_conflicts("a", p) is None
    assert predicted_conflicts("c_cuda", Problem(1, 1, 128, 64, dtype="fp32")) is None
