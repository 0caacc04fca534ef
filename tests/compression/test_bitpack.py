import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedge.compression import bitpack


@given(bits=st.integers(1, 8), data=st.data())
def test_pack_unpack_round_trip(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=300))
    array = np.array(values, dtype=np.uint8)
    packed = bitpack.pack(array, bits)
    assert len(packed) == bitpack.packed_size(len(values), bits)
    np.testing.assert_array_equal(bitpack.unpack(packed, len(values), bits), array)


def test_layout_is_little_endian_within_a_byte() -> None:
    assert bitpack.pack(np.array([1, 2, 3, 0], dtype=np.uint8), 2) == bytes([0b00111001])
    assert bitpack.pack(np.array([0xA, 0x5], dtype=np.uint8), 4) == bytes([0x5A])


def test_unpack_rejects_wrong_length() -> None:
    with pytest.raises(ValueError):
        bitpack.unpack(b"\x00\x00\x00", 3, 4)


@pytest.mark.parametrize("bits", [0, 9])
def test_bits_out_of_range(bits: int) -> None:
    with pytest.raises(ValueError):
        bitpack.packed_size(4, bits)
