"""Text from uploaded documents (txt, md, pdf, docx, html), parsed in memory, with clear errors.

Everything works on the uploaded bytes: nothing is written to disk, nothing is executed, and the
file name only picks the parser (its extension) and labels the result; it is never used as a path.
A problem the user can cause raises `DocumentError` (a `ValueError`) with a one-line message.

- text / markdown: BOM sniffing (UTF-8, UTF-16, UTF-32), UTF-16 without BOM by its zero bytes, then
  UTF-8, then cp1252 and latin-1 as fallbacks (with a warning saying which); binary data sent with a
  text name is rejected instead of being returned as mojibake.
- PDF (pypdf): encrypted files are opened with the empty password when that works (with a warning),
  otherwise rejected; damaged files are repaired by pypdf where it can (warning) or rejected; pages
  without a text layer are reported ("looks scanned").
- docx (python-docx): paragraphs and tables in document order; zip archives that are not Word
  documents, old binary .doc files and zip bombs are rejected before python-docx sees them.
- HTML: the stdlib `html.parser`; script/style/template and similar are dropped, blocks become lines.

`fit_to_context` cuts a long text at a paragraph or sentence boundary to a token budget, so the app
can show "truncated to N tokens" instead of overflowing the model's context.
References: PDF 1.7 (ISO 32000-1) section 7.5.2 (header) and 7.6 (encryption); ECMA-376 (docx);
the WHATWG encoding sniffing algorithm (BOM first, then declared charset).
"""

from __future__ import annotations

import codecs
import io
import logging
import re
import threading
import unicodedata
import zipfile
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import TypedDict

MAX_UPLOAD_MB = 25  # also `[server] maxUploadSize` in .streamlit/config.toml (Streamlit counts MiB)
MAX_UPLOAD_BYTES = MAX_UPLOAD_MB * 1024 * 1024
MAX_UNZIPPED_BYTES = 256 * 1024 * 1024  # a .docx that inflates beyond this is treated as a zip bomb
KINDS = ("txt", "md", "pdf", "docx", "html")
EXTENSIONS = {
    "txt": "txt",
    "text": "txt",
    "md": "md",
    "markdown": "md",
    "pdf": "pdf",
    "docx": "docx",
    "html": "html",
    "htm": "html",
}
CONTROL_RATIO = 0.01  # more control characters than this (and more than 2) in decoded "text": binary data

# Magic numbers of common binary formats, for "this .txt is really a PNG image" messages.
_MAGIC = (
    (b"%PDF-", "a PDF file"),
    (b"PK\x03\x04", "a zip archive"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old-format .doc/.xls or a password-protected Office file"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF8", "a GIF image"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"\x7fELF", "an executable (ELF)"),
    (b"MZ", "a Windows executable"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive"),
    (b"Rar!", "a RAR archive"),
)
_BOMS = (  # longest first: the UTF-32 LE BOM starts with the UTF-16 LE one
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


class DocumentError(ValueError):
    """A document that cannot be read; the message is one line a user understands."""


@dataclass
class Document:
    """Text extracted from one upload."""

    name: str  # display name (the upload's base name, cleaned), never used as a path
    kind: str  # one of KINDS
    text: str
    pages: int | None = None  # PDF pages; None for other kinds
    characters: int = 0
    encoding: str | None = None  # text files and HTML: how the bytes were decoded
    warnings: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.characters = len(self.text)

    def to_dict(self) -> dict:
        return asdict(self)


# --- entry point ----------------------------------------------------------------------------------


def extract_bytes(data: bytes, filename: str, max_bytes: int = MAX_UPLOAD_BYTES) -> Document:
    """Text of an uploaded file. `filename` picks the parser by its extension (content sniffing
    overrides it for PDF and zip data) and names the result. Raises DocumentError."""
    name = display_name(filename)
    size = len(data)
    if size > max_bytes:
        raise DocumentError(f"file is {_mb(size)} MB; the limit is {_mb(max_bytes)} MB")
    if size == 0:
        raise DocumentError("empty file")
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    if ext and ext not in EXTENSIONS:
        raise DocumentError(f"unsupported file type .{ext}; allowed: " + ", ".join(f".{e}" for e in EXTENSIONS))
    sniffed = _sniff_kind(data)
    kind = EXTENSIONS.get(ext) or sniffed
    notes: list[str] = []
    if kind in ("txt", "md", "html") and sniffed in ("pdf", "docx"):  # a mislabelled PDF / Word file
        notes.append(f"the file is named .{ext or '(none)'} but is a {sniffed.upper()}; read it as {sniffed}")
        kind = sniffed
    if kind == "pdf":
        doc = _pdf(data, name)
    elif kind == "docx":
        doc = _docx(data, name)
    elif kind == "html":
        doc = _html(data, name)
    else:
        doc = _plain(data, name, kind)
    doc.warnings[:0] = notes
    return doc


def display_name(filename: str) -> str:
    """The last path component of an upload's name, without control characters (for labels only)."""
    base = re.split(r"[\\/]", str(filename or ""))[-1]
    base = "".join(c for c in base if unicodedata.category(c)[0] != "C").strip()
    if len(base) > 200:  # shorten the stem, keep the extension (it picks the parser)
        stem, dot, ext = base.rpartition(".")
        base = stem[:190] + dot + ext[:9] if dot else base[:200]
    return base or "document"


def _mb(n: int) -> str:
    mb = n / (1024 * 1024)
    return f"{mb:.0f}" if mb == int(mb) else f"{mb:.1f}"


def _sniff_kind(data: bytes) -> str:
    """What the bytes look like: pdf, docx (a zip with a Word part), html or txt."""
    if b"%PDF-" in data[:1024]:  # PDF 7.5.2: the header may follow some junk bytes
        return "pdf"
    if data.startswith(b"PK\x03\x04") and b"word/" in data[:65536] + data[-65536:]:
        return "docx"
    head = data[:2048].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")):
        return "html"
    return "txt"


# --- plain text and markdown ----------------------------------------------------------------------


def decode_text(data: bytes) -> tuple[str, str, list[str]]:
    """Bytes of a text file -> (text, encoding label, warnings). Raises DocumentError on binary data."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec), codec, []
            except UnicodeDecodeError as err:
                raise DocumentError(f"the file starts with a {codec} byte-order mark but is not valid {codec}") from err
    utf16 = _utf16_without_bom(data)
    if utf16:
        try:
            return data.decode(utf16), f"{utf16} (no BOM)", []
        except UnicodeDecodeError:
            pass
    kind = _binary_kind(data)
    if kind:
        raise DocumentError(f"this is {kind}, not text")
    if b"\x00" in data:
        raise DocumentError("this looks like binary data, not text (it contains zero bytes)")
    try:
        return data.decode("utf-8"), "utf-8", []
    except UnicodeDecodeError as err:
        where = err.start
    for codec in ("cp1252", "latin-1"):
        try:
            text = data.decode(codec)
        except UnicodeDecodeError:
            continue
        label = f"{codec} (fallback)"
        return text, label, [f"not valid UTF-8 (first bad byte at offset {where}): decoded as {label}"]
    raise AssertionError("latin-1 decodes every byte")  # pragma: no cover


def _utf16_without_bom(data: bytes) -> str | None:
    """utf-16-le / utf-16-be when most odd (even) bytes of the start are zero, as in ASCII-range UTF-16."""
    head = data[:4096]
    if len(head) < 4 or len(head) % 2:
        return None
    even, odd = head[0::2], head[1::2]
    zero_even, zero_odd = even.count(0) / len(even), odd.count(0) / len(odd)
    if zero_odd > 0.3 and zero_even < 0.05:
        return "utf-16-le"
    if zero_even > 0.3 and zero_odd < 0.05:
        return "utf-16-be"
    return None


def _binary_kind(data: bytes) -> str | None:
    for magic, what in _MAGIC:
        if data.startswith(magic):
            return what
    return None


def _check_textual(text: str) -> None:
    """Reject decoded text with many control characters (binary data decoded as cp1252/latin-1)."""
    sample = text[:65536]
    bad = sum(1 for c in sample if c not in "\t\n\r\f\v" and unicodedata.category(c) == "Cc")
    bad += sample.count("\ufffd")
    if bad > 2 and bad > CONTROL_RATIO * len(sample):
        raise DocumentError(f"this looks like binary data, not text ({bad / len(sample):.0%} control characters)")


def _plain(data: bytes, name: str, kind: str) -> Document:
    text, encoding, notes = decode_text(data)
    _check_textual(text)
    text = normalize_whitespace(text, keep_indent=True)
    if not text:
        raise DocumentError("no text found: the file contains only whitespace")
    return Document(name=name, kind=kind, text=text, encoding=encoding, warnings=notes)


_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"))


def normalize_whitespace(text: str, keep_indent: bool = False) -> str:
    """Unix newlines, no control characters, no trailing spaces, at most one blank line between
    paragraphs. `keep_indent` keeps leading spaces and inner runs (plain text, code, aligned tables);
    otherwise every run of spaces becomes one space (PDF, HTML, docx)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n\n").replace("\v", "\n")
    text = text.translate(_ZERO_WIDTH)
    text = "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")
    text = re.sub(r"[\u00a0\u2000-\u200a\u202f\u205f\u3000]", " ", text)
    lines = []
    for line in text.split("\n"):
        line = line.rstrip()
        if not keep_indent:
            line = re.sub(r"[ \t]+", " ", line).strip()
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") if keep_indent else text.strip()


# --- PDF ------------------------------------------------------------------------------------------


class _Collect(logging.Handler):
    """Collects pypdf's log warnings (repairs of damaged files) raised by this thread while one
    document is read; other threads' documents (other sessions) are not mixed in."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.messages.append(record.getMessage())


def _pdf(data: bytes, name: str) -> Document:
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    if b"%PDF-" not in data[:1024]:
        what = _binary_kind(data)
        raise DocumentError("this .pdf is not a PDF file" + (f" (it is {what})" if what else " (no %PDF header)"))
    notes: list[str] = []
    handler = _Collect()
    log = logging.getLogger("pypdf")
    log.addHandler(handler)
    try:
        reader = PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")
            except DependencyError as err:
                raise DocumentError(
                    "this PDF uses AES encryption; reading it needs the 'cryptography' package"
                ) from err
            if not opened:
                raise DocumentError("this PDF is encrypted and needs a password; remove the password and retry")
            notes.append("the PDF is encrypted with an empty password; opened it without one")
        n_pages = len(reader.pages)
        if n_pages == 0:
            raise DocumentError("this PDF has no pages")
        texts, empty, scanned = [], [], []
        for i, page in enumerate(reader.pages):
            try:
                page_text = page.extract_text() or ""
            except MemoryError:
                raise
            except Exception as err:  # pypdf raises many types on damaged content streams
                notes.append(f"page {i + 1} could not be read ({_first_line(err)})")
                page_text = ""
            page_text = normalize_whitespace(page_text)
            if not page_text:
                empty.append(i + 1)
                if _has_images(page):
                    scanned.append(i + 1)
            texts.append(page_text)
    except (DocumentError, MemoryError):
        raise
    except Exception as err:  # PdfReadError, but also KeyError, struct.error, zlib.error, ... on bad bytes
        raise DocumentError(f"this PDF is damaged or truncated and cannot be read ({_first_line(err)})") from err
    finally:
        log.removeHandler(handler)
    repairs = handler.messages
    if repairs:
        notes.append(f"the PDF is damaged; pypdf repaired it ({_first_line(repairs[0])}); text may be incomplete")
    if len(empty) == n_pages:
        if scanned:
            raise DocumentError("no text found: the PDF looks scanned (no text layer); run OCR on it first")
        raise DocumentError("no text found: the PDF has no text layer")
    if empty:
        why = " (scanned?)" if scanned else ""
        notes.append(f"{len(empty)} of {n_pages} pages have no text{why}: {_page_list(empty)}")
    text = "\n\n".join(t for t in texts if t)
    return Document(name=name, kind="pdf", text=text, pages=n_pages, warnings=notes)


def _has_images(page) -> bool:
    """Whether a PDF page draws an image XObject (directly or in a form XObject)."""
    try:
        xobjects = page.get("/Resources", {}).get_object().get("/XObject", {}).get_object()
        for ref in xobjects.values():
            obj = ref.get_object()
            if obj.get("/Subtype") == "/Image":
                return True
            if obj.get("/Subtype") == "/Form" and "/XObject" in obj.get("/Resources", {}).get_object():
                return True
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return False


def _page_list(pages: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, pages[:limit]))
    return shown + (f" and {len(pages) - limit} more" if len(pages) > limit else "")


def _first_line(err: object) -> str:
    text = str(err).strip().splitlines()
    line = text[0] if text else type(err).__name__
    return line[:160]


# --- docx -----------------------------------------------------------------------------------------


def _docx(data: bytes, name: str) -> Document:
    import docx
    from docx.table import Table

    not_word = "this .docx is not a Word document"
    what = _binary_kind(data)
    if what and what != "a zip archive":
        raise DocumentError(f"{not_word} (it is {what})")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = set(archive.namelist())
        inflated = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise DocumentError(f"{not_word} (not a valid zip archive)") from err
    if inflated > MAX_UNZIPPED_BYTES:
        raise DocumentError(f"this .docx expands to {_mb(inflated)} MB; the limit is {_mb(MAX_UNZIPPED_BYTES)} MB")
    if "word/document.xml" not in names or "[Content_Types].xml" not in names:
        other = _office_kind(names)
        raise DocumentError(f"{not_word} ({other or 'the archive has no word/document.xml'})")
    try:
        document = docx.Document(io.BytesIO(data))
        blocks = []
        for block in document.iter_inner_content():
            blocks.append(_table_text(block) if isinstance(block, Table) else block.text)
    except MemoryError:
        raise
    except Exception as err:  # python-docx / lxml raise many types on malformed parts
        raise DocumentError(f"{not_word} or it is damaged ({_first_line(err)})") from err
    text = normalize_whitespace("\n\n".join(b for b in blocks if b and b.strip()))
    if not text:
        raise DocumentError("no text found: the Word document is empty")
    return Document(name=name, kind="docx", text=text)


def _office_kind(names: set[str]) -> str | None:
    prefixes = {
        "xl/": "it is an Excel workbook",
        "ppt/": "it is a PowerPoint file",
        "META-INF/": "it is a Java archive",
    }
    for prefix, what in prefixes.items():
        if any(n.startswith(prefix) for n in names):
            return what
    if "mimetype" in names:
        return "it is an OpenDocument file"
    return None


def _table_text(table) -> str:
    """One line per row, cells joined by ' | ' (merged cells once), nested tables inline."""
    from docx.table import Table

    rows = []
    for row in table.rows:
        cells, seen = [], set()
        for cell in row.cells:
            if id(cell._tc) in seen:
                continue
            seen.add(id(cell._tc))
            parts = [_table_text(b) if isinstance(b, Table) else b.text for b in cell.iter_inner_content()]
            cells.append(" ".join(p.strip() for p in parts if p.strip()))
        if any(cells):
            rows.append(" | ".join(cells))
    return "\n".join(rows)


# --- HTML -----------------------------------------------------------------------------------------


class _HTMLText(HTMLParser):
    """Visible text of an HTML page: blocks on their own lines, script/style/... dropped."""

    SKIP = {"script", "style", "template", "noscript", "svg", "math", "head", "iframe", "object", "canvas"}
    BLOCK = {
        "p", "div", "section", "article", "aside", "header", "footer", "nav", "main", "blockquote", "pre",
        "ul", "ol", "li", "dl", "dt", "dd", "table", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
        "figure", "figcaption", "form", "fieldset", "address", "details", "summary", "title", "body",
    }  # fmt: skip
    VOID = {"br", "hr", "img", "input", "meta", "link", "area", "base", "col", "embed", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0
        self.pre = 0
        self.title: list[str] = []
        self.in_title = False

    def handle_starttag(self, tag, attrs):
        if tag == "title":
            self.in_title = True
        elif tag in self.SKIP and tag not in self.VOID:
            self.skip += 1
        elif tag == "br":
            self.parts.append("\n")
        elif tag in ("td", "th"):
            self.parts.append(" | ")
        elif tag in self.BLOCK:
            self.parts.append("\n\n")
            self.pre += tag == "pre"

    def handle_startendtag(self, tag, attrs):
        if tag == "br":
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
        elif tag in self.SKIP:
            self.skip = max(self.skip - 1, 0)
        elif tag in self.BLOCK:
            self.parts.append("\n\n")
            if tag == "pre":
                self.pre = max(self.pre - 1, 0)

    def handle_data(self, data):
        if self.in_title:
            self.title.append(data)
        elif not self.skip:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        body = "".join(self.parts)
        body = re.sub(r"(^|\n) ?\| ", r"\1", body)  # a row's first cell needs no separator
        title = " ".join("".join(self.title).split())
        if title and not body.lstrip().startswith(title):
            body = title + "\n\n" + body
        return normalize_whitespace(body)


_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9_\-:.]+)""", re.IGNORECASE)


def _html(data: bytes, name: str) -> Document:
    notes: list[str] = []
    declared = _META_CHARSET.search(data[:4096])
    try:
        text, encoding, notes = decode_text(data)
    except DocumentError as err:
        raise DocumentError(str(err).replace("not text", "not an HTML page")) from err
    if encoding.endswith("(fallback)") and declared:  # not UTF-8: trust the page's own <meta charset>
        codec = declared.group(1).decode("ascii", "replace").lower()
        try:
            text, encoding, notes = data.decode(codec), f"{codec} (meta charset)", []
        except (LookupError, UnicodeDecodeError):
            notes.append(f"the page declares charset {codec!r}, which does not decode it")
    _check_textual(text)
    parser = _HTMLText()
    try:
        parser.feed(text)
        parser.close()
    except (AssertionError, ValueError) as err:  # html.parser is lenient; this is defensive
        raise DocumentError(f"this HTML page cannot be parsed ({_first_line(err)})") from err
    body = parser.text()
    if not body:
        raise DocumentError("no text found: the HTML page has no visible text")
    return Document(name=name, kind="html", text=body, encoding=encoding, warnings=notes)


# --- fitting a document into the model's context --------------------------------------------------

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE = re.compile(r"[.!?;:\u3002\uff01\uff1f][\"')\]\u201d\u2019]*(?=\s)|\n")


def token_ids(text: str, tokenizer) -> list[int]:
    """The token ids of `text` on its own: no special tokens, no chat template."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def count_tokens(text: str, tokenizer) -> int:
    return len(token_ids(text, tokenizer))


def fit_to_context(text: str, tokenizer, max_tokens: int) -> tuple[str, int, bool]:
    """(text cut to at most `max_tokens` tokens, its token count, whether it was cut).

    The cut falls at the last paragraph break inside the budget when that keeps at least 3/4 of
    it, else the last sentence end (at least 1/2), else the last space, else mid-word. The count is
    of the returned text, tokenized on its own without special tokens. Only a growing prefix of a
    long text is tokenized (a 1 MB document costs about as much as the budget, not the whole text).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be a positive number of tokens, got {max_tokens}")
    window = max_tokens * CHARS_PER_TOKEN_GUESS + 256
    while True:
        head = text[:window]
        ends = _token_starts(head, tokenizer, max_tokens)
        if len(ends) > max_tokens:  # the budget ends inside this prefix
            break
        if window >= len(text):
            return text, len(ends), False
        window *= 2
    end = ends[max_tokens]  # where token max_tokens (0-based) starts: the first max_tokens tokens end here
    while True:
        cut = _boundary_cut(text, end)
        n = count_tokens(cut, tokenizer)
        if n <= max_tokens or not cut:
            return cut, n, True
        end = max(len(cut) - max(1, (len(cut) * (n - max_tokens)) // n), 0)  # re-tokenized longer: shrink


CHARS_PER_TOKEN_GUESS = 6  # first prefix tried by fit_to_context; it doubles until the budget fits inside


def _token_starts(text: str, tokenizer, limit: int) -> list[int]:
    """Character offsets where the tokens of `text` start (only the first limit + 1 are exact for a
    slow tokenizer without offsets, found by bisection on characters)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(start) for start, _ in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError, ValueError):
        pass
    n = count_tokens(text, tokenizer)
    if n <= limit:
        return [0] * n  # only the count matters when the whole text fits
    lo, hi = 0, len(text)  # the longest prefix with at most `limit` tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count_tokens(text[:mid], tokenizer) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return [0] * limit + [lo]


def _boundary_cut(text: str, end: int) -> str:
    """text[:end] shortened to its last paragraph / sentence / word boundary (see fit_to_context)."""
    head = text[:end]
    paragraphs = [m.start() for m in _PARAGRAPH.finditer(head)]
    if paragraphs and paragraphs[-1] >= 0.75 * end:
        return head[: paragraphs[-1]].rstrip()
    sentences = [m.end() for m in _SENTENCE.finditer(head)]
    if sentences and sentences[-1] >= 0.5 * end:
        return head[: sentences[-1]].rstrip()
    if end < len(text) and not text[end].isspace():
        space = head.rfind(" ")
        if space > 0:
            return head[:space].rstrip()
    return head.rstrip()


# --- local files ----------------------------------------------------------------------------------


def extract_file(path: str | Path, max_bytes: int = MAX_UPLOAD_BYTES) -> Document:
    """Document from a local file (the CLI): size checked before the file is read."""
    p = Path(path)
    if not p.is_file():
        raise DocumentError(f"file not found: {path}")
    size = p.stat().st_size
    if size > max_bytes:
        raise DocumentError(f"file is {_mb(size)} MB; the limit is {_mb(max_bytes)} MB")
    return extract_bytes(p.read_bytes(), p.name, max_bytes)


# --- the document the app holds: fitted to the model's context ------------------------------------------
CHAT_RESERVE = 1024  # tokens of the context kept free for the conversation when a document is fitted
MIN_BUDGET = 256  # the fewest tokens of a document the app keeps, whatever the model's context
EXACT_COUNT_CHARS = 200_000  # a cut document's original tokens are counted up to this length, estimated beyond


class HeldDocument(TypedDict):
    """A document as the app holds it: its text fitted to `budget` tokens, with the size of the original."""

    name: str
    text: str  # the kept text (the whole document when it fits)
    tokens: int  # tokens of `text`
    truncated: bool  # whether the original was cut to fit
    budget: int  # the most tokens it could keep
    original_tokens: int  # tokens of the whole original (estimated beyond EXACT_COUNT_CHARS)
    original_tokens_exact: bool
    original_chars: int
    warnings: list[str]  # what extraction noticed (scanned pages, missing text, ...)
    source: str  # "sample" | "upload"
    model: str  # the model whose tokenizer counted it


def document_budget(max_context: int) -> int:
    """Tokens of a document the app keeps for a model: its context less what the conversation needs."""
    return max(max_context - CHAT_RESERVE, MIN_BUDGET)


def hold_document(
    name: str, text: str, tokenizer, budget: int, source: str, warnings: list[str], model: str
) -> HeldDocument:
    """`text` fitted to `budget` tokens (`fit_to_context`), with the original's size: counted exactly up to
    EXACT_COUNT_CHARS characters (counting a long text costs seconds on a CPU), scaled from the kept part
    beyond."""
    fitted, tokens, cut = fit_to_context(text, tokenizer, budget)
    original, exact = tokens, True
    if cut:
        exact = len(text) <= EXACT_COUNT_CHARS or not fitted
        original = count_tokens(text, tokenizer) if exact else round(tokens * len(text) / len(fitted))
    return HeldDocument(
        name=name,
        text=fitted,
        tokens=tokens,
        truncated=cut,
        budget=budget,
        original_tokens=original,
        original_tokens_exact=exact,
        original_chars=len(text),
        warnings=list(warnings),
        source=source,
        model=model,
    )


def truncation_note(doc: HeldDocument, max_context: int) -> str:
    """What a cut document lost, in one sentence (empty when nothing was cut)."""
    if not doc["truncated"]:
        return ""
    about = "" if doc["original_tokens_exact"] else "about "
    return (
        f"The document is longer than fits: kept its first {doc['tokens']:,} of {about}{doc['original_tokens']:,} "
        f"tokens ({len(doc['text']):,} of {doc['original_chars']:,} characters). The model's context is "
        f"{max_context:,} tokens, {max_context - doc['budget']:,} of them kept for the conversation."
    )
