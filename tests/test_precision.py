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


@pytest.mark.parametrize(
    "text,key,value,label",
    [
        ("knuq4vnuq2", "nuq4", "nuq2", "knuq4vnuq2"),
        ("k8vnuq3:o1", "int8", "nuq3", "k8vnuq3:o1"),
        ("kint4vint3", "int4", "int3", "k4v3"),  # integer parts by their bits
        ("kfp8v4:s2", "fp8_e4m3", "int4", "kfp8v4:s2"),
        ("kfp8-e5m2v2", "fp8_e5m2", "int2", "kfp8-e5m2v2"),
        ("knvfp4vnvfp4", "nvfp4", "nvfp4", "nvfp4"),  # one format for both: the preset itself
        ("kint8vint4", "int8", "int4", "k8v4"),
    ],
)
def test_keys_and_values_take_any_two_formats(text, key, value, label):
    spec = parse_precision(text)
    assert (spec.key_format, spec.value_format, spec.label) == (key, value, label)
    assert parse_precision(spec.label) == spec  # pages and reports parse labels back


def test_mixed_formats_keep_each_parts_rules():
    assert parse_precision("knvfp4v8").key_axis == "token"  # nvfp4 keys are scaled per token
    assert parse_precision("k8vnvfp4").key_axis == "channel"
    bits = parse_precision("knuq4vnuq2").bits_per_element(64)
    assert bits["key"] == pytest.approx(4.25) and bits["value"] == pytest.approx(2.25)  # K: scale + zero per 128
    assert parse_precision("knuq4vnuq2").codebook_levels() == {"key": 16, "value": 4}
    with pytest.raises(ValueError, match="no per-channel key mode"):
        parse_precision("knvfp4v8:kchannel")
    with pytest.raises(ValueError, match="key format fp8_e4m3 scales by its absmax"):
        parse_precision("kfp8v4:o1")
    for bad in ("k5v4", "kv4", "k4v", "kfullv4", "knuq5v2"):
        with pytest.raises(ValueError, match=r"k<key>v<value>.*8, 4, 3, 2, fp8, fp8-e5m2, nuq4, nuq3, nuq2, nvfp4"):
            parse_precision(bad)
