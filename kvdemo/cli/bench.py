"""`python -m kvdemo bench`: kvdemo vs transformers' QuantizedCache and llama.cpp's cache types
(kvdemo.contest.run.run_bench), the report files (bench.json, bench.md, bench.html) and its text."""

from __future__ import annotations

import json
from pathlib import Path

from ..contest.run import run_bench
from ..results.bench import REPORT_FILES, SIZES, BenchReport, markdown_table
from .progress import printer


def run_cli(args) -> BenchReport:
    """`python -m kvdemo bench [--quick | --sizes full|1k|quick] [--only NAMES] [--precision LIST] [--out reports]
    [--json]`: progress on stderr, the report files written into --out, the report returned."""
    from ..models import load_model

    name = "quick" if args.quick else getattr(args, "sizes", "full")
    only = [n.strip() for n in getattr(args, "only", "").split(",") if n.strip()] or None
    precisions = getattr(args, "precision", "").strip() or None
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    report = run_bench(
        lm, quick=name == "quick", sizes=SIZES[name], only=only, on_progress=printer(), precisions=precisions
    )
    if args.out:
        report.files = write_report(report, args.out)
    return report


def write_report(report: BenchReport, out_dir: str | Path) -> dict[str, str]:
    """Write bench.json, bench.md and bench.html (the table and the figures) into `out_dir`; return their paths."""
    import plotly.io as pio

    from ..figures.bench import bench_figures

    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name.split(".")[1]: str(folder / name) for name in REPORT_FILES}
    Path(paths["json"]).write_text(json.dumps(report.to_json() | {"files": paths}, indent=2) + "\n")
    Path(paths["md"]).write_text(f"# kvdemo bench: {report.model}\n\n" + markdown_table(report))
    figs = [pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0)) for i, fig in enumerate(bench_figures(report))]
    title = f"kvdemo bench: {report.model}"
    table = markdown_table(report).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    Path(paths["html"]).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<h1>{title}</h1><pre>{table}</pre>" + "\n".join(figs) + "</body></html>\n"
    )
    return paths


def format_text(report: BenchReport) -> str:
    lines = [f"model: {report.model}{'  (quick sizes)' if report.quick else ''}", "", markdown_table(report)]
    if report.files:
        lines.append("written: " + ", ".join(report.files.values()))
    return "\n".join(lines)
