"""README is the door and docs/ holds the depth (STYLE.md, habit 7): README stays short, and every relative link in
README and docs/*.md reaches a file, and a heading where it names one. Reads files only."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a `[x](y)` in code is not a link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _slug(heading: str, seen: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: inline code and link markup dropped, lower case, punctuation removed,
    spaces to hyphens, and a -N suffix for a repeat."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    return slug if n == 0 else f"{slug}-{n}"


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    return {_slug(h, seen) for h in re.findall(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def _links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path.read_text())) if not re.match(r"[a-z]+:", t)]


def test_readme_is_the_door():
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; depth belongs in docs/ (STYLE.md, habit 7)"
    linked = {t.split("#")[0] for t in _links(README) if t.startswith("docs/")}
    assert linked >= {f"docs/{p.name}" for p in PAGES}, "README's index should link every docs page"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path):
    for target in _links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.is_file(), f"{path.name}: {target} is not a file"
        if anchor:
            assert dest.suffix == ".md" and anchor in _anchors(dest), (
                f"{path.name}: no heading for #{anchor} in {dest.name}"
            )


def test_slugs_follow_github():
    seen: dict[str, int] = {}
    assert _slug("Is the calibration the limit? No.", seen) == "is-the-calibration-the-limit-no"
    assert _slug("What `make test` runs", seen) == "what-make-test-runs"
    assert (
        _slug("Decode speed on CPU (measured, and its limits)", seen) == "decode-speed-on-cpu-measured-and-its-limits"
    )
    assert _slug("KVQuant's methods, rotation, 3-bit and NVFP4", seen) == "kvquants-methods-rotation-3-bit-and-nvfp4"
    assert _slug("compiled for sm_90", seen) == "compiled-for-sm_90"
    assert _slug("What `make test` runs", seen) == "what-make-test-runs-1"
