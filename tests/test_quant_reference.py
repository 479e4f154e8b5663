"""Round-trip error bounds per format, exact pack/unpack."""

import pytest
import torch

from kvdemo.quant import reference

FORMATS = ["int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"]


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_pack_unpack_is_exact(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (2, 3, 17, 64), generator=g, dtype=torch.uint8)
    packed = reference.pack(codes, bits)
    assert packed.shape == (2, 3, 17, 64 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(reference.unpack(packed, bits), codes)


def test_packing_is_planar():
    codes = torch.arange(8, dtype=torch.uint8).view(1, 1, 1, 8) % 4  # channels 0..7, 2-bit
    packed = reference.pack(codes, 2)  # byte c holds channels c, c+2, c+4, c+6
    assert packed.flatten().tolist() == [0 | 2 << 2 | 0 << 4 | 2 << 6, 1 | 3 << 2 | 1 << 4 | 3 << 6]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("axis,group", [("channel", 32), ("channel", 128), ("token", 64), ("token", 16)])
def test_round_trip_within_bound(fmt, axis, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 128, 64, generator=g) * 3
    x[..., 5] *= 20  # an outlier channel, as keys have
    q = reference.quantize(x, fmt, axis, group)
    y = reference.dequantize(q)
    bound = reference.max_abs_error_bound(x, fmt, axis, group)
    assert torch.isfinite(y).all()
    assert (y - x).abs().le(bound).all(), float(((y - x).abs() - bound).max())


def test_error_shrinks_with_bits():
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(1))
    errs = [
        (reference.dequantize(reference.quantize(x, f, "channel", 32)) - x).pow(2).mean()
        for f in ("int2", "int4", "int8")
    ]
    assert errs[0] > errs[1] > errs[2]


def test_per_channel_beats_per_token_on_outlier_channels():
    """Why keys go per channel (KIVI): an outlier channel ruins per-token groups, not per-channel ones."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 128, 64, generator=g)
    x[..., 3] += 30
    per_channel = (reference.dequantize(reference.quantize(x, "int4", "channel", 128)) - x).pow(2).mean()
    per_token = (reference.dequantize(reference.quantize(x, "int4", "token", 64)) - x).pow(2).mean()
    assert per_channel < per_token / 4


def test_metadata_is_16_bit_and_shapes():
    x = torch.randn(2, 3, 256, 64)
    q = reference.quantize(x, "int4", "channel", 128)
    assert q.scale.dtype == torch.float16 and q.zero.dtype == torch.float16
    assert q.scale.shape == (2, 3, 2, 64) and q.codes.shape == (2, 3, 256, 32)
    v = reference.quantize(x, "int2", "token", 32)
    assert v.scale.shape == (2, 3, 256, 2) and v.codes.shape == (2, 3, 256, 16)
    f = reference.quantize(x, "fp8_e4m3", "token", 64)
    assert f.zero is None and f.codes.shape == (2, 3, 256, 64)
