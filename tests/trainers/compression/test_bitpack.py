"""Bit packing (trainers/compression/bitpack.py): the round trip at every width, the bytes low bits first, and the
byte-wise path (widths dividing 8) laying out the same bytes as the stream of bits written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.compression.bitpack import pack_bits, packed_nbytes, unpack_bits


@pytest.mark.parametrize("width", [0, 1, 2, 3, 7, 8, 12, 13, 16, 24])
@pytest.mark.parametrize("count", [0, 1, 5, 8, 333])
def test_bits_round_trip(width, count):
    values = torch.randint(0, 2**width, (count,), generator=torch.Generator().manual_seed(width))
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, width) == math.ceil(count * width / 8)
    assert torch.equal(unpack_bits(packed, width, count), values)


def test_bits_are_packed_low_first():
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    # Two 12-bit values in three bytes, as templar's 12-bit index packing lays them out.
    assert pack_bits(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


def _by_hand(values: list[int], width: int) -> list[int]:
    """The stream as one integer: value i at bit i * width, little-endian bytes."""
    stream = sum(v << (i * width) for i, v in enumerate(values))
    return list(stream.to_bytes(packed_nbytes(len(values), width), "little"))


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int64])
def test_every_width_packs_the_bit_stream_by_hand(width, dtype):
    values = torch.randint(0, 2**width, (37,), generator=torch.Generator().manual_seed(width)).to(dtype)
    assert pack_bits(values, width).tolist() == _by_hand(values.tolist(), width)
