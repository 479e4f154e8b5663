"""The findings report as files: a standalone HTML (plotly.js embedded: opens offline, makes no network
request), a PDF printed from it by headless Chromium (one or more pages per claim), and PNG figures.

`write_report(found, out_dir)` writes findings.json, findings.html and, where Chromium is installed,
findings.pdf and the figures docs/findings.md shows (`DOC_FIGURES`). Chromium runs as
`chromium --headless --no-sandbox --disable-gpu --disable-background-networking`.
"""

from __future__ import annotations

import html
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..figures.findings import findings_figures
from ..results.findings import Findings, save
from .verdicts import caption, judged

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking")
FIGURE_WIDTH = 1000  # px: figures have a fixed width so the PDF pages lay out the same on every machine
VERDICT_COLORS = {True: "#1b7f3b", False: "#b3261e", None: "#6b6b6b"}

CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1040px;
       color: #1d1d1d; font-size: 17px; line-height: 1.45; }
h1 { font-size: 30px; margin-bottom: 4px; }
h2 { font-size: 25px; margin: 0 0 6px 0; }
.meta, .caption, .method { color: #555; font-size: 15px; }
.claim { font-size: 19px; font-style: italic; margin: 6px 0; }
.verdict { font-size: 20px; font-weight: 600; padding: 8px 12px; border-left: 6px solid; margin: 10px 0; }
table { border-collapse: collapse; font-size: 15px; margin: 12px 0; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; vertical-align: top; }
section { page-break-before: always; break-before: page; padding-top: 8px; }
@media print { body { margin: 0 auto; } }
"""


def chromium() -> str | None:
    """Path of a Chromium binary (KVDEMO_CHROMIUM, then `chromium` / `chromium-browser` on PATH)."""
    for name in (os.environ.get("KVDEMO_CHROMIUM", ""), "chromium", "chromium-browser"):
        if name and (shutil.which(name) or Path(name).is_file()):
            return shutil.which(name) or name
    return None


def _figure_html(fig, first: bool) -> str:
    fig = fig.update_layout(width=FIGURE_WIDTH)
    return fig.to_html(full_html=False, include_plotlyjs=True if first else False, config={"displaylogo": False})


def verdict_rows(found: Findings) -> list[dict]:
    """One row per claim: title, verdict word, verdict text (what docs/findings.md and the page tabulate)."""
    return [{"claim": c.title, "verdict": c.verdict.word, "numbers": c.verdict.text} for c in found.claims]


def render_html(found: Findings, config: dict | None = None, budget: float | None = None) -> str:
    """The whole report as one HTML document (plotly.js inline once); the claims judged again for `config`
    and `budget` when given (or when the report has none)."""
    if config is not None or budget is not None or not found.claims:
        found = judged(found, config, budget)
    esc = html.escape
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>kvdemo findings: {esc(found.model)}</title><style>{CSS}</style></head><body>",
        "<h1>KV-cache quantization: findings</h1>",
        f"<p class='meta'>{esc(found.model)}; {esc(found.created)}; "
        f"{'quick sizes; ' if found.quick else ''}measured in {found.seconds:.0f} s "
        f"({esc(found.stopped)}); code {esc(found.version)}</p>",
        f"<p class='caption'>{esc(caption(found))}</p>",
    ]
    if found.weights_note:
        parts.append(f"<p class='caption'>{esc(found.weights_note)}</p>")
    parts.append("<table><tr><th>claim</th><th>verdict on this model</th><th>numbers</th></tr>")
    for row, c in zip(verdict_rows(found), found.claims, strict=True):
        color = VERDICT_COLORS[c.verdict.holds]
        parts.append(
            f"<tr><td>{esc(row['claim'])}</td><td style='color:{color};font-weight:600'>{esc(row['verdict'])}</td>"
            f"<td>{esc(row['numbers'])}</td></tr>"
        )
    parts.append("</table>")
    first = True
    for c in found.claims:
        color = VERDICT_COLORS[c.verdict.holds]
        parts += [
            f"<section id='{esc(c.id)}'><h2>{esc(c.title)}</h2>",
            f"<p class='claim'>{esc(c.claim)}</p>",
            f"<div class='verdict' style='border-color:{color};color:{color}'>{esc(c.verdict.word.capitalize())}: "
            f"{esc(c.verdict.text)}</div>",
        ]
        for fig in findings_figures(found, c.id):
            parts.append(_figure_html(fig, first))
            first = False
        parts.append(f"<p class='method'><b>How it was measured.</b> {esc(c.method)}</p></section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def print_pdf(html_path: str | Path, pdf_path: str | Path, timeout: float = 180) -> Path | None:
    """Print `html_path` to `pdf_path` with headless Chromium; None when Chromium is not installed."""
    exe = chromium()
    if exe is None:
        return None
    pdf_path = Path(pdf_path)
    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            "--no-pdf-header-footer",
            "--virtual-time-budget=10000",  # let plotly draw before printing
            f"--print-to-pdf={pdf_path}",
            Path(html_path).resolve().as_uri(),
        ]
        subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    return pdf_path if pdf_path.is_file() else None


def pdf_bytes(found: Findings) -> bytes | None:
    """The report (claims as judged in `found`) printed to PDF; None when Chromium is not installed."""
    with tempfile.TemporaryDirectory() as d:
        html_path = Path(d) / "findings.html"
        html_path.write_text(render_html(found), encoding="utf-8")
        pdf = print_pdf(html_path, Path(d) / "findings.pdf")
        return None if pdf is None else pdf.read_bytes()


def figure_png(
    fig, png_path: str | Path, width: int = FIGURE_WIDTH, height: int = 480, timeout: float = 120
) -> Path | None:
    """A PNG of one figure: a standalone HTML page screenshotted by headless Chromium (None without it)."""
    exe = chromium()
    if exe is None:
        return None
    png_path = Path(png_path)
    fig = fig.update_layout(width=width, height=height, margin={"l": 70, "r": 30})
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "figure.html"
        page.write_text(
            "<html><body style='margin:0'>" + fig.to_html(full_html=False, include_plotlyjs=True) + "</body></html>",
            encoding="utf-8",
        )
        cmd = [
            exe,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={Path(tmp) / 'profile'}",
            "--hide-scrollbars",
            "--virtual-time-budget=10000",
            f"--window-size={width},{height}",
            f"--screenshot={png_path.resolve()}",
            page.as_uri(),
        ]
        subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    return png_path if png_path.is_file() else None


# the figures docs/findings.md shows, as PNGs beside the report: file -> (claim, index of the claim's figure)
DOC_FIGURES = {"tradeoff.png": ("tradeoff", 0), "long_range.png": ("long_range", 0)}


def write_report(found: Findings, out_dir: str | Path, pdf: bool = True) -> dict:
    """findings.json, findings.html and (with Chromium, `pdf`) findings.pdf and docs/findings.md's two
    figures as PNGs (`DOC_FIGURES`) in `out_dir`; their paths. A report without claims (one written while
    its run goes on) is judged first."""
    out_dir = Path(out_dir)
    found = found if found.claims else judged(found)
    files = {"json": str(save(found, out_dir))}
    html_path = out_dir / "findings.html"
    html_path.write_text(render_html(found), encoding="utf-8")
    files["html"] = str(html_path)
    if pdf:
        printed = print_pdf(html_path, out_dir / "findings.pdf")
        if printed is not None:
            files["pdf"] = str(printed)
        for name, (claim_id, index) in DOC_FIGURES.items():
            png = figure_png(findings_figures(found, claim_id)[index], out_dir / name)
            if png is not None:
                files[name] = str(png)
    return files
