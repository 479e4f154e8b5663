"""kvdemo.documents: good files of every kind and every bad upload a user can make, with fixtures built here.

PDFs are written by hand (a content stream per page, Helvetica), encrypted with pypdf's writer;
docx files are written with python-docx; nothing binary is committed.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import threading
import tomllib
import zipfile
from pathlib import Path

import docx
import pypdf
import pytest

from kvdemo import documents
from kvdemo.documents import (
    MAX_UPLOAD_BYTES,
    MAX_UPLOAD_MB,
    Document,
    DocumentError,
    count_tokens,
    document_budget,
    extract_bytes,
    fit_to_context,
    hold_document,
    truncation_note,
)

ROOT = Path(__file__).resolve().parents[1]


# --- fixtures built in memory ---------------------------------------------------------------------


def make_pdf(pages: list[str], image_pages: tuple[int, ...] = ()) -> bytes:
    """A minimal valid PDF: one page per string (lines drawn with Helvetica), optional image pages."""
    n = len(pages)
    font, img = 3 + 2 * n, 4 + 2 * n
    objs = {
        1: b"<< /Type /Catalog /Pages 2 0 R >>",
        2: f"<< /Type /Pages /Kids [{' '.join(f'{3 + 2 * i} 0 R' for i in range(n))}] /Count {n} >>".encode(),
        font: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        img: b"<< /Type /XObject /Subtype /Image /Width 2 /Height 2 /ColorSpace /DeviceGray "
        b"/BitsPerComponent 8 /Length 4 >>\nstream\n\x00\xff\xff\x00\nendstream",
    }
    for i, text in enumerate(pages):
        ops, y = [], 720
        for line in text.split("\n") if text else []:
            esc = line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
            ops.append(f"BT /F1 12 Tf 72 {y} Td ({esc}) Tj ET")
            y -= 16
        resources = f"/Font << /F1 {font} 0 R >>"
        if i in image_pages:
            ops.append("q 200 0 0 200 72 300 cm /Im1 Do Q")
            resources += f" /XObject << /Im1 {img} 0 R >>"
        stream = "\n".join(ops).encode("latin-1")
        objs[3 + 2 * i] = (
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << {resources} >> "
            f"/Contents {4 + 2 * i} 0 R >>"
        ).encode()
        objs[4 + 2 * i] = b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream"
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}
    for k in sorted(objs):
        offsets[k] = out.tell()
        out.write(b"%d 0 obj\n" % k + objs[k] + b"\nendobj\n")
    xref, size = out.tell(), max(objs) + 1
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % size)
    for k in range(1, size):
        out.write(b"%010d 00000 n \n" % offsets[k])
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (size, xref))
    return out.getvalue()


def encrypt_pdf(data: bytes, user_password: str, algorithm: str | None = None) -> bytes:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(data)))
    writer.encrypt(user_password, "owner-secret", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def make_docx() -> bytes:
    d = docx.Document()
    d.add_heading("Quarterly report", level=1)
    d.add_paragraph("Revenue grew in every region.")
    table = d.add_table(rows=2, cols=2)
    for (r, c), text in {(0, 0): "region", (0, 1): "growth", (1, 0): "north", (1, 1): "12%"}.items():
        table.cell(r, c).text = text
    d.add_paragraph("The table above is the summary.")
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


def make_zip(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return out.getvalue()


PDF_TEXT = ["The pass key is 68213. Remember it.\nSecond line (with parentheses).", "Page two says hello."]


def rejects(data: bytes, name: str, pattern: str, **kwargs) -> str:
    with pytest.raises(DocumentError) as info:
        extract_bytes(data, name, **kwargs)
    message = str(info.value)
    assert re.search(pattern, message), message
    assert "\n" not in message and len(message) < 200, message
    return message


# --- good files -----------------------------------------------------------------------------------


def test_utf8_text_keeps_paragraphs_and_normalises_whitespace():
    doc = extract_bytes(b"First line.  \r\nSecond line.\r\n\r\n\r\n\r\nNew paragraph.\x07\n", "notes.txt")
    assert doc.kind == "txt" and doc.encoding == "utf-8" and doc.warnings == []
    assert doc.text == "First line.\nSecond line.\n\nNew paragraph."
    assert doc.characters == len(doc.text) and doc.pages is None


def test_markdown_keeps_indentation():
    doc = extract_bytes(b"# Title\n\n    code   block\n- item", "README.md")
    assert doc.kind == "md"
    assert doc.text == "# Title\n\n    code   block\n- item"


def test_pdf_text_in_page_order():
    doc = extract_bytes(make_pdf(PDF_TEXT), "paper.pdf")
    assert doc.kind == "pdf" and doc.pages == 2 and doc.warnings == []
    assert "68213" in doc.text and "(with parentheses)" in doc.text
    assert doc.text.index("68213") < doc.text.index("Page two")
    assert "\n\n" in doc.text  # pages are paragraphs


def test_docx_paragraphs_and_tables_in_document_order():
    doc = extract_bytes(make_docx(), "report.docx")
    assert doc.kind == "docx" and doc.warnings == []
    assert doc.text == (
        "Quarterly report\n\nRevenue grew in every region.\n\nregion | growth\nnorth | 12%\n\n"
        "The table above is the summary."
    )


def test_html_drops_script_and_style_and_decodes_entities():
    page = (
        b"<!doctype html><html><head><title>Notes</title><style>p{color:red}</style>"
        b"<script>alert('x')</script></head><body><h1>Header</h1><p>Fish &amp; chips<br>second line</p>"
        b"<table><tr><td>a</td><td>b</td></tr></table><noscript>enable js</noscript></body></html>"
    )
    doc = extract_bytes(page, "page.html")
    assert doc.kind == "html" and doc.encoding == "utf-8"
    assert doc.text == "Notes\n\nHeader\n\nFish & chips\nsecond line\n\na | b"
    assert "alert" not in doc.text and "color" not in doc.text and "enable js" not in doc.text


def test_html_meta_charset_is_honoured():
    page = '<html><head><meta charset="windows-1251"></head><body><p>Привет, мир</p></body></html>'
    doc = extract_bytes(page.encode("cp1251"), "ru.htm")
    assert doc.text == "Привет, мир" and doc.encoding == "windows-1251 (meta charset)"


def test_to_dict_is_json_ready():
    d = extract_bytes(b"hello", "a.txt").to_dict()
    assert set(d) == {"name", "kind", "text", "pages", "characters", "encoding", "warnings"}
    assert json.loads(json.dumps(d))["characters"] == 5


def test_mislabelled_pdf_and_docx_are_read_by_content():
    doc = extract_bytes(make_pdf(PDF_TEXT), "paper.txt")
    assert doc.kind == "pdf" and "68213" in doc.text and "named .txt" in doc.warnings[0]
    doc = extract_bytes(make_docx(), "report")  # no extension: sniffed
    assert doc.kind == "docx" and doc.warnings == []


# --- bad input: empty, binary, unsupported, too large ---------------------------------------------


@pytest.mark.parametrize("name", ["a.txt", "a.md", "a.pdf", "a.docx", "a.html"])
def test_empty_file(name):
    assert rejects(b"", name, "^empty file$")


@pytest.mark.parametrize("name", ["a.txt", "a.md", "a.html"])
def test_whitespace_only_has_no_text(name):
    rejects(b" \n\t\r\n   \n", name, "^no text found")


def test_binary_garbage_named_txt_is_rejected_not_mojibake():
    rng = random.Random(7)
    with_zeros = bytes(rng.randrange(256) for _ in range(4096))
    rejects(with_zeros, "notes.txt", "binary data, not text")
    no_zeros = bytes(rng.randrange(1, 256) for _ in range(4096))  # passes the zero-byte test: control chars
    rejects(no_zeros, "notes.txt", "binary data, not text .*control characters")
    rejects(b"\x89PNG\r\n\x1a\n" + no_zeros, "photo.md", "PNG image, not text")
    rejects(make_zip({"a.bin": no_zeros}), "archive.txt", "zip archive, not text")


def test_binary_garbage_named_pdf():
    rng = random.Random(8)
    garbage = bytes(rng.randrange(256) for _ in range(4096))
    rejects(garbage, "paper.pdf", r"not a PDF file \(no %PDF header\)")
    rejects(b"\x89PNG\r\n\x1a\n" + garbage, "paper.pdf", "not a PDF file .*PNG image")
    rejects(b"%PDF-1.7\n" + garbage, "paper.pdf", "damaged or truncated")


def test_unsupported_extension_says_what_is_allowed():
    rejects(b"MZ\x90\x00", "setup.exe", r"unsupported file type \.exe; allowed: .*\.pdf")


def test_over_the_upload_limit():
    rejects(b"x" * int(30.2 * 1024 * 1024), "big.txt", r"^file is 30\.2 MB; the limit is 25 MB$")
    rejects(b"x" * 2048, "small.txt", r"file is 0\.0 MB; the limit is 0\.0 MB", max_bytes=1024)
    assert extract_bytes(b"x" * 1024, "ok.txt", max_bytes=1024).characters == 1024


def test_streamlit_upload_limit_matches():
    config = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert config["server"]["maxUploadSize"] == MAX_UPLOAD_MB
    assert MAX_UPLOAD_BYTES == MAX_UPLOAD_MB * 1024 * 1024  # Streamlit counts MiB


# --- bad input: PDFs ------------------------------------------------------------------------------


@pytest.mark.parametrize("fraction", [0.2, 0.5, 0.8, 0.97])
def test_truncated_pdf(fraction):
    data = make_pdf(PDF_TEXT)
    rejects(data[: int(len(data) * fraction)], "cut.pdf", "^this PDF is damaged or truncated and cannot be read")


def test_corrupt_xref_is_repaired_with_a_warning():
    data = re.sub(rb"startxref\n\d+", b"startxref\n99999", make_pdf(PDF_TEXT))
    doc = extract_bytes(data, "bad.pdf")
    assert "68213" in doc.text
    assert any("damaged" in w for w in doc.warnings), doc.warnings


def test_corrupt_xref_table_is_rejected():
    data = make_pdf(PDF_TEXT).replace(b"xref\n0", b"xrXf\n0")
    rejects(data, "bad.pdf", "damaged or truncated")


def test_encrypted_pdf_with_empty_password_is_opened_with_a_warning():
    doc = extract_bytes(encrypt_pdf(make_pdf(PDF_TEXT), ""), "locked.pdf")
    assert "68213" in doc.text and doc.pages == 2
    assert doc.warnings == ["the PDF is encrypted with an empty password; opened it without one"]


def test_encrypted_pdf_with_a_password_is_rejected():
    rejects(encrypt_pdf(make_pdf(PDF_TEXT), "s3cret"), "locked.pdf", "^this PDF is encrypted and needs a password")


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256"])
def test_aes_encrypted_pdf(algorithm):
    pytest.importorskip("cryptography")
    assert "68213" in extract_bytes(encrypt_pdf(make_pdf(PDF_TEXT), "", algorithm), "aes.pdf").text
    rejects(encrypt_pdf(make_pdf(PDF_TEXT), "pw", algorithm), "aes.pdf", "encrypted and needs a password")


def test_aes_without_cryptography_is_a_clear_error(monkeypatch):
    from pypdf.errors import DependencyError

    data = encrypt_pdf(make_pdf(PDF_TEXT), "")

    def no_crypto(self, password):
        raise DependencyError("cryptography>=3.1 is required for AES algorithm")

    monkeypatch.setattr(pypdf.PdfReader, "decrypt", no_crypto)
    rejects(data, "aes.pdf", "AES encryption; reading it needs the 'cryptography' package")


def test_scanned_pdf_has_no_text_layer():
    rejects(
        make_pdf(["", ""], image_pages=(0, 1)), "scan.pdf", r"^no text found: the PDF looks scanned \(no text layer\)"
    )
    rejects(make_pdf([""]), "blank.pdf", "^no text found: the PDF has no text layer$")


def test_partly_scanned_pdf_warns_which_pages():
    doc = extract_bytes(make_pdf(["typed page one", "", "typed page three"], image_pages=(1,)), "mixed.pdf")
    assert doc.text == "typed page one\n\ntyped page three" and doc.pages == 3
    assert doc.warnings == ["1 of 3 pages have no text (scanned?): 2"]


def test_pdf_repair_warnings_do_not_cross_threads():
    """pypdf logs repairs to one global logger; concurrent sessions must each see only their own."""
    broken = re.sub(rb"startxref\n\d+", b"startxref\n99999", make_pdf(PDF_TEXT))
    clean = make_pdf(PDF_TEXT)
    results: dict[str, list] = {"broken": [], "clean": []}
    start = threading.Barrier(4)

    def work(kind: str, data: bytes):
        start.wait(timeout=30)
        for _ in range(10):
            results[kind].append(extract_bytes(data, f"{kind}.pdf").warnings)

    threads = [threading.Thread(target=work, args=a) for a in [("broken", broken), ("clean", clean)] * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results["clean"]) == 20 and all(w == [] for w in results["clean"])
    assert len(results["broken"]) == 20 and all(any("damaged" in x for x in w) for w in results["broken"])


# --- bad input: docx ------------------------------------------------------------------------------


def test_docx_that_is_a_zip_of_something_else():
    rejects(
        make_zip({"photo.jpg": b"\xff\xd8\xff", "notes.txt": b"hi"}), "a.docx", r"^this \.docx is not a Word document"
    )
    excel = make_zip({"[Content_Types].xml": b"<Types/>", "xl/workbook.xml": b"<workbook/>"})
    rejects(excel, "sheet.docx", "not a Word document .*Excel workbook")


def test_docx_that_is_not_a_zip():
    rejects(b"just some text", "a.docx", r"not a Word document \(not a valid zip archive\)")
    rejects(make_docx()[:2000], "cut.docx", "not a Word document")
    rejects(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(512), "old.docx", "not a Word document .*old-format .doc")


def test_docx_with_a_broken_part():
    good = zipfile.ZipFile(io.BytesIO(make_docx()))
    parts = {n: (b"<w:document><unclosed" if n == "word/document.xml" else good.read(n)) for n in good.namelist()}
    rejects(make_zip(parts), "broken.docx", "not a Word document or it is damaged")


def test_empty_docx():
    out = io.BytesIO()
    docx.Document().save(out)
    rejects(out.getvalue(), "empty.docx", "^no text found: the Word document is empty$")


def test_docx_zip_bomb_is_rejected_before_parsing(monkeypatch):
    monkeypatch.setattr(documents, "MAX_UNZIPPED_BYTES", 10_000)
    data = make_zip({"[Content_Types].xml": b"<Types/>", "word/document.xml": b" " * 50_000})
    assert len(data) < 10_000
    rejects(data, "bomb.docx", r"expands to .* MB; the limit is")


# --- bad input: encodings -------------------------------------------------------------------------


def test_cp1252_fallback_says_which():
    doc = extract_bytes("Café “quoted” — naïve".encode("cp1252"), "win.txt")
    assert doc.text == "Café “quoted” — naïve"
    assert doc.encoding == "cp1252 (fallback)"
    assert len(doc.warnings) == 1 and "not valid UTF-8" in doc.warnings[0] and "cp1252" in doc.warnings[0]


def test_latin1_fallback_when_cp1252_cannot_decode():
    data = ("Résumé " * 20).encode("latin-1") + b"\x81"  # 0x81 is undefined in cp1252
    doc = extract_bytes(data, "old.txt")
    assert doc.encoding == "latin-1 (fallback)" and doc.text.startswith("Résumé")


@pytest.mark.parametrize(
    ("codec", "label"),
    [("utf-8-sig", "utf-8-sig"), ("utf-16", "utf-16"), ("utf-32", "utf-32"), ("utf-16-le", "utf-16-le (no BOM)")],
)
def test_unicode_encodings_are_detected(codec, label):
    text = "Grüße, Привет, 你好 and plain ASCII words to make the byte pattern clear."
    doc = extract_bytes(text.encode(codec), "u.txt")
    assert doc.text == text and doc.encoding == label and doc.warnings == []


def test_bad_bytes_after_a_bom():
    rejects(b"\xff\xfe\x00\xd8", "u.txt", "byte-order mark but is not valid utf-16")


# --- security: names are labels, nothing is written -----------------------------------------------


def test_file_names_are_never_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "secret.txt"
    target.write_text("on disk, must not be read")
    before = sorted(os.listdir(tmp_path))
    doc = extract_bytes(b"uploaded bytes", str(target))
    assert doc.text == "uploaded bytes" and doc.name == "secret.txt"
    assert extract_bytes(b"x", "..\\..\\windows\\evil\x00.txt").name == "evil.txt"
    assert extract_bytes(b"x", "").name == "document"
    long_name = extract_bytes(make_docx(), "r" * 500 + ".docx")
    assert long_name.kind == "docx" and long_name.name.endswith(".docx") and len(long_name.name) <= 200
    for data, name in [(make_pdf(PDF_TEXT), "../../a.pdf"), (make_docx(), "/tmp/../b.docx"), (b"<p>x</p>", "c.html")]:
        extract_bytes(data, name)
    assert sorted(os.listdir(tmp_path)) == before


# --- far longer than the context ------------------------------------------------------------------


class WordTokenizer:
    """A fast-tokenizer stand-in: one token per word (with its leading spaces), offsets included."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        spans = [m.span() for m in re.finditer(r"\s*\S+", text)]
        out = {"input_ids": list(range(len(spans)))}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out


class SlowWordTokenizer(WordTokenizer):
    """Like a transformers slow tokenizer: no offsets."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        if return_offsets_mapping:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return super().__call__(text)


LONG = "\n\n".join(
    " ".join(f"Sentence {p}.{s} has some words in it." for s in range(4)) for p in range(300)
)  # 300 paragraphs x 4 sentences x 7 words


@pytest.mark.parametrize("tok", [WordTokenizer(), SlowWordTokenizer()], ids=["fast", "slow"])
def test_fit_to_context_cuts_at_a_paragraph(tok):
    text, n, cut = fit_to_context(LONG, tok, 1000)
    assert cut and n <= 1000 and n > 750
    assert LONG.startswith(text) and LONG[len(text) : len(text) + 2] == "\n\n"
    assert n == len(tok(text)["input_ids"])


def test_fit_to_context_falls_back_to_sentence_and_word_boundaries():
    tok = WordTokenizer()
    one_paragraph = LONG.replace("\n\n", " ")
    text, n, cut = fit_to_context(one_paragraph, tok, 1000)
    assert cut and 500 < n <= 1000 and text.endswith("in it.")
    no_punctuation = " ".join(["word"] * 5000)
    text, n, cut = fit_to_context(no_punctuation, tok, 333)
    assert cut and n == 333 and text == " ".join(["word"] * 333)


def test_fit_to_context_leaves_short_text_alone():
    assert fit_to_context("a few words.", WordTokenizer(), 10) == ("a few words.", 3, False)
    assert fit_to_context("a few words.", WordTokenizer(), 3) == ("a few words.", 3, False)
    with pytest.raises(ValueError, match="positive"):
        fit_to_context("x", WordTokenizer(), 0)


@pytest.mark.model
def test_document_far_longer_than_the_models_context(lm):
    pdf = make_pdf([f"Page {i}. " + "The river runs past the old mill every single day. " * 8 for i in range(60)])
    doc = extract_bytes(pdf, "long.pdf")
    budget = lm.max_context // 4  # keep the test quick; the same code serves the full context
    text, n, cut = fit_to_context(doc.text * 6, lm.tokenizer, budget)
    assert cut and budget * 0.75 <= n <= budget
    assert n == len(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    assert text.endswith((".", "day."))
    whole, total, cut = fit_to_context(doc.text, lm.tokenizer, lm.max_context)
    assert not cut and whole == doc.text and total < lm.max_context


# --- CLI end to end -------------------------------------------------------------------------------


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "kvdemo", "extract", *argv], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_extract_text_and_json(tmp_path):
    path = tmp_path / "paper.pdf"
    path.write_bytes(encrypt_pdf(make_pdf(PDF_TEXT), ""))
    plain = run_cli(str(path))
    assert plain.returncode == 0, plain.stderr
    assert "68213" in plain.stdout and plain.stdout.index("68213") < plain.stdout.index("Page two")
    assert "warning: the PDF is encrypted with an empty password" in plain.stderr
    as_json = run_cli(str(path), "--json")
    assert as_json.returncode == 0, as_json.stderr
    out = json.loads(as_json.stdout)
    assert out["pages"] == 2 and out["kind"] == "pdf" and out["characters"] == len(out["text"])
    assert out["warnings"] and out["encoding"] is None


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("empty.txt", b"", "error: empty file"),
        ("garbage.pdf", bytes(range(256)) * 8, "error: this .pdf is not a PDF file"),
        ("locked.pdf", None, "error: this PDF is encrypted and needs a password"),
        ("zip.docx", make_zip({"a.txt": b"a"}), "error: this .docx is not a Word document"),
    ],
)
def test_cli_fails_cleanly_with_exit_code_2(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(encrypt_pdf(make_pdf(PDF_TEXT), "pw") if data is None else data)
    result = run_cli(str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().startswith(message) and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


def test_cli_missing_file_and_oversized_file(tmp_path):
    missing = run_cli(str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: file not found")
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: the size check happens before reading
        f.truncate(MAX_UPLOAD_BYTES + 5 * 1024 * 1024)
    result = run_cli(str(big))
    assert result.returncode == 2 and result.stderr.strip() == "error: file is 30 MB; the limit is 25 MB"


def test_document_dataclass_counts_characters():
    doc = Document(name="n", kind="txt", text="abc")
    assert doc.characters == 3 and doc.warnings == []


def test_held_document_counts_the_original_and_says_what_was_cut(monkeypatch):
    tok = WordTokenizer()
    whole = hold_document("short.txt", "one two three", tok, 100, "upload", [], "m")
    assert (whole["tokens"], whole["truncated"], whole["original_tokens"]) == (3, False, 3)
    assert truncation_note(whole, 2048) == ""
    cut = hold_document("long.txt", LONG, tok, 1000, "upload", ["scanned page 3"], "m")
    assert cut["truncated"] and cut["tokens"] <= 1000 < cut["original_tokens"] == count_tokens(LONG, tok)
    assert cut["original_tokens_exact"] and cut["warnings"] == ["scanned page 3"] and cut["original_chars"] == len(LONG)
    note = truncation_note(cut, 2024)
    assert f"kept its first {cut['tokens']:,} of {cut['original_tokens']:,} tokens" in note
    assert "2,024 tokens, 1,024 of them kept for the conversation" in note
    monkeypatch.setattr(documents, "EXACT_COUNT_CHARS", 10)  # beyond it the original is scaled from the kept part
    guessed = hold_document("long.txt", LONG, tok, 1000, "upload", [], "m")
    assert not guessed["original_tokens_exact"] and "of about " in truncation_note(guessed, 2024)
    assert guessed["original_tokens"] == round(guessed["tokens"] * len(LONG) / len(guessed["text"]))


def test_document_budget_keeps_room_for_the_conversation():
    assert document_budget(8192) == 8192 - documents.CHAT_RESERVE
    assert document_budget(512) == documents.MIN_BUDGET  # a short context still holds a document
