"""`python -m kvdemo calibrate`: fit the model's nuq codebooks (kvdemo.calibration) and save them where nuq
caches look first; progress on stderr, the file's path, tensor count, size and seconds on stdout."""

from __future__ import annotations

import sys


def load(args):
    """The model of `--model`: anything `load_model` takes, or "random" / "random:<config>" (random weights,
    the shapes of kvdemo.measured.SCALE_MODEL or of a reference config)."""
    from ..models import load_model, pick_device, random_model

    source = (args.model or "").strip()
    if source == "random" or source.startswith("random:"):
        from ..measured import SCALE_MODEL

        shape = SCALE_MODEL if source == "random" else source.removeprefix("random:")
        return random_model(shape, pick_device(args.device), args.dtype)
    return load_model(source, device=args.device, dtype=args.dtype)


def run_cli(args) -> dict:
    from ..calibration import calibrate_to_file
    from ..progress import Progress

    def progress(p: Progress) -> None:
        print(f"[{p.fraction:4.0%}] {p.text()}", file=sys.stderr, flush=True)

    lm = load(args)
    return calibrate_to_file(
        lm, tokens=args.tokens, out=args.out or None, on_progress=progress, text=args.calibration_text
    )


def format_text(out: dict) -> str:
    return (
        f"codebooks of {out['model']} ({out['layers']} layers, {out['tokens']:,} calibration tokens)\n"
        f"text: {out['text']}\n"
        f"path: {out['path']}\n"
        f"tensors: {out['tensors']}\n"
        f"size: {out['bytes']:,} bytes\n"
        f"seconds: {out['seconds']:.1f}"
    )
