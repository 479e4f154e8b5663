import pytest

from kvdemo.precision import PRESETS, PrecisionSpec, parse_precision, parse_precision_list


def test_every_preset_parses_to_itself():
    for name, spec in PRESETS.items():
        assert parse_precision(name) == spec
        assert parse_precision(spec.label) == spec


def test_mixed_presets_and_options():
    spec = parse_precision("int4:g64:r128:s4")
    assert (spec.key_format, spec.value_format, spec.group_size, spec.residual, spec.sinks) == (
        "int4",
        "int4",
        64,
        128,
        4,
    )
    k8v4 = parse_precision("k8v4")
    assert (k8v4.key_format, k8v4.value_format) == ("int8", "int4")
    assert parse_precision("k8v4:ktoken").key_axis == "token"
    assert parse_precision("INT8").label == "int8"
    assert parse_precision("int4:g32").residual == 128  # residual kept a multiple of the group


def test_unknown_strings_list_the_presets():
    with pytest.raises(ValueError, match="presets: full, fp8"):
        parse_precision("int5")
    with pytest.raises(ValueError, match="unknown precision option"):
        parse_precision("int4:x9")
    with pytest.raises(ValueError, match="takes no options"):
        parse_precision("full:g64")
    with pytest.raises(ValueError, match="multiple of the group size"):
        parse_precision("int4:g128:r64")
    with pytest.raises(ValueError, match="group size 48 not supported"):
        parse_precision("int4:g48")
    with pytest.raises(ValueError, match="smaller than the group size"):
        parse_precision("int4:g16:s16")
    with pytest.raises(ValueError):
        PrecisionSpec("int4", "full")
    with pytest.raises(ValueError, match="no precision given"):
        parse_precision_list(" , ")


def test_bits_per_element_matches_the_design_table():
    # INT4 with fp16 scale+zero and group 128 is 4.25 bits (keys); values group along head_dim.
    bits = parse_precision("int4").bits_per_element(head_dim=128)
    assert bits["key"] == pytest.approx(4.25) and bits["value"] == pytest.approx(4.25)
    assert 16 / bits["mean"] == pytest.approx(3.765, abs=1e-3)
    small = parse_precision("int4").bits_per_element(head_dim=64)
    assert small["value"] == pytest.approx(4.5)  # value groups capped at head_dim
    assert parse_precision("fp8").bits_per_element(128)["key"] == pytest.approx(8.125)  # scale only
    assert parse_precision("full").bits_per_element(64, full_bits=32)["mean"] == 32


def test_precision_list_dedupes_and_keeps_order():
    assert [s.label for s in parse_precision_list("full,int8,int8,k8v4")] == ["full", "int8", "k8v4"]
