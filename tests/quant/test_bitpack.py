import numpy as np
import pytest

from arraykv.ops import pack_bits, set_kernels_enabled, unpack_bits
from arraykv.quant import bitpack
from arraykv.quant.bitpack import packed_nbytes

from conftest import asarray, to_np


def pack_loops(codes, bits):
    """One bit at a time, straight from the documented layout."""
    codes = np.asarray(codes)
    n = codes.shape[-1]
    rows = codes.reshape(-1, n)
    out = np.zeros((rows.shape[0], packed_nbytes(n, bits)), np.uint8)
    for r in range(rows.shape[0]):
        for i in range(n):
            for j in range(bits):
                if (int(rows[r, i]) >> j) & 1:
                    pos = i * bits + j
                    out[r, pos // 8] |= 1 << (pos % 8)
    return out.reshape(codes.shape[:-1] + (out.shape[-1],))


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (3, 13), (2, 2, 64)])
@pytest.mark.parametrize("kernels", [False, True])
def test_pack_matches_bit_by_bit_and_round_trips(xp, rng, bits, shape, kernels):
    codes = rng.integers(0, 2**bits, size=shape, dtype=np.uint8)
    with set_kernels_enabled(kernels):
        packed = pack_bits(asarray(xp, codes), bits)
        np.testing.assert_array_equal(to_np(packed), pack_loops(codes, bits))
        back = unpack_bits(packed, bits, shape[-1])
    np.testing.assert_array_equal(to_np(back), codes)


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_numba_threaded_path_matches_loops(rng, bits):
    """Large calls take Numba's multi-threaded path; force it on small inputs and compare."""
    from arraykv.ops.numba import bitpack as nbp
    from arraykv.ops.numba.threads import serial_below

    codes = rng.integers(0, 2**bits, size=(5, 3, 37), dtype=np.uint8)
    with serial_below(0):
        packed = nbp.pack_bits(codes, bits)
        np.testing.assert_array_equal(packed, pack_loops(codes, bits))
        np.testing.assert_array_equal(nbp.unpack_bits(packed, bits, 37), codes)


def test_known_bytes():
    assert bitpack.pack_bits(np.array([1, 2], np.uint8), 4).tolist() == [0x21]  # the array-API front
    assert pack_bits(np.array([1, 2], np.uint8), 4).tolist() == [0x21]
    assert pack_bits(np.array([3, 0, 1, 2], np.uint8), 2).tolist() == [0b10010011]
    assert pack_bits(np.arange(8, dtype=np.uint8), 3).tolist() == [0b10001000, 0b11000110, 0b11111010]


def test_bad_input():
    with pytest.raises(ValueError, match="bits"):
        pack_bits(np.zeros(4, np.uint8), 9)
    with pytest.raises(TypeError, match="uint8"):
        pack_bits(np.zeros(4, np.int32), 4)
    with pytest.raises(ValueError, match="bytes on its last axis"):
        unpack_bits(np.zeros(3, np.uint8), 4, 8)
