"""Bit packing: non-negative integers below 2^width as a stream of ``width`` bits each, low bits first.

Value i's bits start at bit i * width of the stream, so a width that divides 8 puts ``8 // width`` values in each
byte, value j of a byte at bits ``j * width`` and up. Built from shifts and masks, the bytes do not depend on the
host's endianness. Widths that divide 8 (the int-k quantizer's codes) take a byte-wise path, tens to hundreds of times
faster than the general one that any other width (SparseLoCo's 12-bit indices) takes; both lay out the same bytes.
"""

from __future__ import annotations

import math

import torch


def packed_nbytes(count: int, width: int) -> int:
    return math.ceil(count * width / 8)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """``values`` (flattened, each below 2^width) as a uint8 stream of ``packed_nbytes(numel, width)`` bytes."""
    flat = values.reshape(-1)
    if width and 8 % width == 0:
        return _pack_whole_bytes(flat.to(torch.uint8), width)
    return _pack_spans(flat.to(torch.int64), width)


def unpack_bits(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` values of ``width`` bits, as a LongTensor."""
    if buf.numel() != packed_nbytes(count, width):
        raise ValueError(f"{count} values of {width} bits are {packed_nbytes(count, width)} bytes; got {buf.numel()}")
    if width and 8 % width == 0:
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=buf.device)
        codes = (buf.unsqueeze(1) >> shifts) & (2**width - 1)
        return codes.reshape(-1)[:count].to(torch.int64)
    return _unpack_spans(buf, width, count)


def _pack_whole_bytes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 ``codes``, ``8 // width`` to a byte, the last byte padded with zeros."""
    per_byte = 8 // width
    codes = torch.nn.functional.pad(codes, (0, -codes.numel() % per_byte)).view(-1, per_byte)
    packed = codes[:, 0].clone()
    for i in range(1, per_byte):
        packed |= codes[:, i] << (i * width)
    return packed


def _spans(count: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, range]:
    """Value i's bits start at bit i * width of the stream: (its first byte, its bit offset in that byte, the bytes
    after that first one it can reach: a value and its offset fit in ceil((7 + width) / 8) bytes)."""
    offsets = torch.arange(count, device=device) * width
    return offsets >> 3, offsets & 7, range((7 + width + 7) // 8)


def _pack_spans(flat: torch.Tensor, width: int) -> torch.Tensor:
    """Any width: each value is shifted to its bit offset and its bytes are added into the stream; values never share
    a bit, so the sums are the bits themselves."""
    nbytes = packed_nbytes(flat.numel(), width)
    if width == 0 or nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=flat.device)
    first, shift, reach = _spans(flat.numel(), width, flat.device)
    shifted = flat << shift
    stream = torch.zeros(nbytes + len(reach), dtype=torch.int64, device=flat.device)
    for j in reach:
        stream.index_add_(0, first + j, (shifted >> (8 * j)) & 0xFF)
    return stream[:nbytes].to(torch.uint8)


def _unpack_spans(buf: torch.Tensor, width: int, count: int) -> torch.Tensor:
    if width == 0 or count == 0:
        return torch.zeros(count, dtype=torch.int64, device=buf.device)
    first, shift, reach = _spans(count, width, buf.device)
    stream = torch.nn.functional.pad(buf.to(torch.int64), (0, len(reach)))
    window = sum(stream[first + j] << (8 * j) for j in reach)
    return (window >> shift) & ((1 << width) - 1)
