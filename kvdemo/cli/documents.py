"""`python -m kvdemo extract FILE`: a document's text as the app reads it (kvdemo.documents)."""

from __future__ import annotations

import sys

from ..documents import extract_file


def run_cli(args) -> dict | str:
    """`python -m kvdemo extract FILE [--json]`: the dict with --json, else the text (warnings on stderr)."""
    doc = extract_file(args.file)
    if getattr(args, "json", False):
        return doc.to_dict()
    for note in doc.warnings:
        print(f"warning: {note}", file=sys.stderr)
    return doc.text
