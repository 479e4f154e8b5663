"""The bundled prose: present, header-free, long enough, and cut to exact token counts."""

import pytest

from kvdemo import texts


def test_prose_is_real_header_free_text():
    p = texts.prose()
    assert 60_000 <= len(p) <= 120_000
    assert p.startswith("Chapter 1\n\nIt is a truth universally acknowledged")
    assert "Gutenberg" not in p and "_" not in p
    assert p.count("\n\n") > 300  # paragraphs, one per line
    assert all(line.strip() == line and line for line in p.split("\n\n"))


def test_held_out_is_a_different_book():
    h, p = texts.held_out(), texts.prose()
    assert h.startswith("CHAPTER 1\n\nThe family of Dashwood")
    assert len(h) >= 60_000
    paragraphs = {x for x in p.split("\n\n") if len(x) > 80}
    assert not any(x in paragraphs for x in h.split("\n\n"))


def test_bad_token_counts_are_value_errors():
    for bad in (0, -5, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            texts.prose_ids(object(), bad)


@pytest.mark.model
def test_prose_ids_exact_counts_and_prefix(lm):
    tok = lm.tokenizer
    full = tok(texts.prose(), add_special_tokens=False)["input_ids"]
    assert len(full) > 3 * 8192  # far more than the embedded model's context, without repeating
    for n in (1, 17, 1000, 8192):
        ids = texts.prose_ids(lm, n)
        assert len(ids) == n
        assert ids == full[:n]
    assert texts.prose_ids(tok, 50) == full[:50]  # a bare tokenizer works too
    assert tok.decode(texts.prose_ids(lm, 5)).startswith("Chapter 1")
    specials = set(tok.all_special_ids)
    assert not specials & set(texts.prose_ids(lm, 8192))


@pytest.mark.model
def test_prose_ids_repeat_past_the_end(lm):
    full = lm.tokenizer(texts.prose(), add_special_tokens=False)["input_ids"]
    n = len(full) + 300
    ids = texts.prose_ids(lm, n)
    assert len(ids) == n
    assert ids[: len(full) - 5] == full[: len(full) - 5]  # the first copy, then a paragraph break
    tail = lm.tokenizer.decode(ids[len(full) - 5 :])
    assert "\n\nChapter 1\n\nIt is a truth" in tail


@pytest.mark.model
def test_held_out_ids_exact(lm):
    full = lm.tokenizer(texts.held_out(), add_special_tokens=False)["input_ids"]
    assert len(full) > 2 * 8192 - 1000
    for n in (3, 4096, 8192):
        assert texts.held_out_ids(lm, n) == full[:n]
