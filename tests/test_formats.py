"""The format registry (kvdemo/formats.py): one entry per format, read by the parser, the size formulas, the
cache, the reference codec and the kernels. A toy 1-bit format registered for a test goes through all of them
with no other change (docs/adding-a-format.md)."""

import pytest
import torch

from kvdemo import formats, layout, ppl
from kvdemo.cache import QuantizedKVCache
from kvdemo.formats import Format
from kvdemo.measured import SCALE_MODEL
from kvdemo.models import random_model
from kvdemo.precision import PRESETS, parse_precision
from kvdemo.quant import reference
from kvdemo.quant.triton_quantize import supports_quantize, supports_quantize_methods

INT1 = Format("int1", "int", 1, "1", zero="always", narrowable=True)  # two levels per group: its min and its max


def test_every_built_in_format_states_its_size_and_names():
    for f in formats.all_formats():
        assert formats.get(f.name) is f and formats.by_part(f.part) is f
        assert parse_precision(f.label).key_format == f.name  # its own name parses, keys and values alike
    assert formats.get("int4").meta_bits("channel", 128, 128) == 32 / 128  # fp16 scale + zero per 128 tokens
    assert formats.get("fp8_e4m3").meta_bits("token", 128, 64) == 16 / 64  # absmax scale, per token
    assert formats.get("nuq3").has_zero("channel") and not formats.get("nuq3").has_zero("token")
    nvfp4 = formats.get("nvfp4")  # E4M3 per 16 channels + one fp32 per block of 128 tokens and head
    assert nvfp4.meta_bits("token", 128, 64) == 8 / 16 + 32 / (128 * 64) and nvfp4.group(128, 64, "channel") == 16
    assert formats.code_bits("full") == 16 and formats.get("int3").packed_width(64) == 24
    with pytest.raises(ValueError, match="unknown format 'int5'; formats: full, int8"):
        formats.get("int5")
    with pytest.raises(ValueError, match="cannot be packed"):
        Format("int5", "int", 5, "5")
    with pytest.raises(ValueError, match="already registered: int4"), formats.registered(formats.get("int4")):
        pass


def test_the_kernels_read_their_formats_from_the_registry():
    assert supports_quantize("int4", 64) and supports_quantize("fp8_e5m2", 64)
    assert not supports_quantize("nuq4", 64)  # a codebook format: the method kernels
    assert supports_quantize_methods("nuq4", "channel", 128, 64, levels=torch.linspace(-1, 1, 16).half())
    with formats.registered(INT1):  # no kernel lists it: every call goes to the reference
        assert not supports_quantize("int1", 64) and not supports_quantize_methods("int1", "token", 64, 64)


def test_a_registered_toy_format_parses_sizes_and_codes():
    with pytest.raises(ValueError, match="unknown precision 'int1'"):
        parse_precision("int1")
    with formats.registered(INT1):
        spec = parse_precision("int1:g64")
        assert (spec.key_format, spec.value_format, spec.group_size, spec.label) == ("int1", "int1", 64, "int1:g64")
        assert parse_precision("k8v1").label == "k8v1" and parse_precision("k1v4").key_format == "int1"
        bits = spec.bits_per_element(64)  # 1-bit codes + fp16 scale and zero per 64 elements
        assert bits == {"key": 1.5, "value": 1.5, "mean": 1.5}
        assert layout.bytes_per_token(2, 2, 64, spec) == 2 * 2 * 64 * 3 / 8
        x = torch.randn(1, 2, 128, 64)
        q = reference.quantize(x, "int1", "token", 64)
        assert q.codes.shape == (1, 2, 128, 8) and q.plain  # 8 codes per byte
        back = reference.dequantize(q)
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)  # each value lands on its group's min or max
        assert bool(((back - lo).abs().lt(1e-2) | (back - hi).abs().lt(1e-2)).all())
        assert "int1" in formats.names() and "int1" not in PRESETS  # a format, not a preset
    with pytest.raises(ValueError, match="unknown precision 'int1'"):
        parse_precision("int1")  # gone with the block


def test_a_toy_format_runs_through_a_cache_and_a_perplexity_call():
    lm = random_model(SCALE_MODEL, "cpu")
    ids = torch.randint(1, 4096, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    with formats.registered(INT1):
        spec = parse_precision("int1:g32:r32")
        cache = QuantizedKVCache(spec, num_layers=lm.num_layers)
        keys = torch.randn(1, lm.kv_heads, 100, lm.head_dim)
        for layer in range(lm.num_layers):
            cache.update(keys, keys.flip(-2), layer)
        regions = cache.layers[0].regions
        formula = layout.region_bytes(regions, lm.num_layers, lm.kv_heads, lm.head_dim, spec, 32)
        assert regions.coded == 96 and cache.nbytes()["total"] == formula["total"]  # live bytes = the formula
        report = ppl.run_ppl(lm, ["int1:g32:r32", "int4:g32:r32"], tokens=256, prefix=64, text=("random ids", ids))
    rows = {r.precision: r for r in report.results}
    assert list(rows) == ["full", "int1:g32:r32", "int4:g32:r32"]
    assert rows["int1:g32:r32"].logit_kl > rows["int4:g32:r32"].logit_kl > 0  # fewer bits, larger error
    assert rows["int1:g32:r32"].ratio_vs_fp16 > rows["int4:g32:r32"].ratio_vs_fp16 > 1
