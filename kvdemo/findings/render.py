"""The findings report as files: a standalone HTML (plotly.js embedded: opens offline, makes no network
request), a PDF printed from it by headless Chromium (one or more pages per claim), and PNG figures. Both
carry what the Findings page shows: the chosen config, the decision box, the claims with the pick's
production settings, KVQuant's methods, keys vs values and the glossary; no plotly toolbar.

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
from ..figures.ppl import ablation_frontier_figure
from ..results.ablation import claim_rows as ablation_claim_rows
from ..results.ablation import cost_rows, load_ablation
from ..results.findings import DEFAULT_CONFIG, Findings, production_rows, save
from ..results.kv_split import load_kv_split
from . import decision
from .glossary import glossary_rows
from .verdicts import caption, judged

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking")
FIGURE_WIDTH = 1000  # px: figures have a fixed width so the PDF pages lay out the same on every machine
VERDICT_COLORS = {True: "#1b7f3b", False: "#b3261e", None: "#6b6b6b"}
FIGURE_CONFIG = {"displaylogo": False, "displayModeBar": False}  # no toolbar over the titles in a file or print

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
.config { font-size: 17px; font-weight: 600; }
.decision { border: 2px solid #0b5cad; padding: 8px 14px; margin: 14px 0; }
.modebar, .modebar-container { display: none !important; }
@media print { body { margin: 0 auto; } .modebar, .modebar-container { display: none !important; } }
"""


def chromium() -> str | None:
    """Path of a Chromium binary (KVDEMO_CHROMIUM, then `chromium` / `chromium-browser` on PATH)."""
    for name in (os.environ.get("KVDEMO_CHROMIUM", ""), "chromium", "chromium-browser"):
        if name and (shutil.which(name) or Path(name).is_file()):
            return shutil.which(name) or name
    return None


def _figure_html(fig, first: bool) -> str:
    fig = fig.update_layout(width=FIGURE_WIDTH)
    return fig.to_html(full_html=False, include_plotlyjs=True if first else False, config=FIGURE_CONFIG)


def verdict_rows(found: Findings) -> list[dict]:
    """One row per claim: title, verdict word, verdict text (what docs/findings.md and the page tabulate)."""
    return [{"claim": c.title, "verdict": c.verdict.word, "numbers": c.verdict.text} for c in found.claims]


def config_line(found: Findings, budget: float | None = None) -> str:
    """The chosen capacity config and quality budget the claims were judged for, e.g. "Capacity and the
    recommendation for llama-3.1-70b on 2 x h100-80gb, 32,768 tokens per sequence; quality budget 0.01
    nats/token"."""
    cap = found.claim("capacity")
    c = cap.data["capacity"]["config"] if cap is not None else DEFAULT_CONFIG
    trade = found.claim("tradeoff")
    budget = trade.data["tradeoff"]["budget"] if budget is None and trade is not None else budget
    budget = found.thresholds["budget_nll_nats"] if budget is None else budget
    return (
        f"Capacity and the recommendation for {c['model_config']} on {c['gpus']} x {c['gpu']}, "
        f"{int(c['context']):,} tokens per sequence; quality budget {budget:g} nats/token"
    )


def _table(rows: list[dict]) -> str:
    """Rows of dicts (same keys) as an HTML table; None shows as blank."""
    if not rows:
        return ""
    esc = html.escape
    head = "".join(f"<th>{esc(str(k))}</th>" for k in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{'' if v is None else esc(str(v))}</td>" for v in r.values()) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _decision_html(found: Findings) -> str:
    """The decision box: one word per format and its evidence (`kvdemo.findings.decision`)."""
    esc = html.escape
    decisions = decision.decide(found, found.claim("capacity").data["capacity"]["config"] if found.claims else None)
    if not decisions:
        return ""
    rows = "".join(
        f"<tr><td>{esc(d.precision)}</td><td style='color:{decision.COLORS[d.word]};font-weight:600'>{d.word}</td>"
        f"<td>{esc(d.why)}</td><td>{esc(d.evidence())}</td></tr>"
        for d in decisions
    )
    return (
        "<div class='decision'><h2>Should I turn it on? For long-context serving of this model</h2>"
        f"<p>{esc(decision.summary(decisions))}</p>"
        f"<table><tr><th>format</th><th>verdict</th><th>why</th><th>evidence</th></tr>{rows}</table>"
        f"<p class='method'><b>The rule.</b> {esc(decision.RULE)}</p></div>"
    )


def _extra_sections(found: Findings, figures: bool) -> list[str]:
    """What the page shows below the claims: KVQuant's methods (the shipped ablation) and keys vs values (the
    shipped split), then the glossary. `figures`: whether plotly.js is already on the page."""
    esc = html.escape
    parts = []
    ablation = load_ablation()
    if ablation is not None:
        parts += [
            "<section id='methods'><h2>KVQuant's methods at 4, 3 and 2 bits</h2>",
            _figure_html(ablation_frontier_figure(ablation), not figures),
            _table(ablation_claim_rows(ablation)),
            "<p>What the formats cost: the live cache at 4,096 tokens and decode speed, one run.</p>",
            _table(cost_rows(ablation)),
            f"<p class='method'>Measured with <code>{esc(ablation.ppl.command)}</code> on {esc(ablation.ppl.date)} "
            "(assets/reports/ablation.json), CPU, fp32.</p></section>",
        ]
    split = load_kv_split()
    if split is not None:
        parts += ["<section id='kv_split'><h2>Keys or values: where the loss sits</h2>"]
        parts += [f"<p>{esc(line)}</p>" for line in split.lines()]
        parts += [
            _table(split.rows()),
            f"<p class='method'>Measured with <code>{esc(split.ppl.command)}</code> on {esc(split.ppl.date)} "
            "(assets/reports/ppl_kv_split.json), CPU, fp32.</p></section>",
        ]
    parts += ["<section id='glossary'><h2>Glossary</h2>", _table(glossary_rows()), "</section>"]
    return parts


def render_html(found: Findings, config: dict | None = None, budget: float | None = None) -> str:
    """The whole report as one HTML document (plotly.js inline once), as the page shows it: the chosen config,
    the decision box, the verdict table, each claim (with the pick's production settings), KVQuant's methods,
    keys vs values and the glossary; the claims judged again for `config` and `budget` when given (or when
    the report has none)."""
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
        f"<p class='config'>{esc(config_line(found, budget))}</p>",
        f"<p class='caption'>{esc(caption(found))}</p>",
    ]
    if found.weights_note:
        parts.append(f"<p class='caption'>{esc(found.weights_note)}</p>")
    parts.append(_decision_html(found))
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
        production = c.data.get("tradeoff", {}).get("production") if c.id == "tradeoff" else None
        if production:
            parts += ["<h3>Production settings of the pick</h3>", _table(production_rows(production))]
        parts.append(f"<p class='method'><b>How it was measured.</b> {esc(c.method)}</p></section>")
    parts += _extra_sections(found, figures=not first)
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


def shipped_pdf_fits(view: Findings, shipped: Findings | None) -> bool:
    """Whether the shipped findings.pdf is what the page shows: `view` is the shipped report judged for the
    shipped config and budget (the same claims, word for word). Otherwise the PDF is printed for `view`."""
    if shipped is None or view.created != shipped.created or view.model != shipped.model:
        return False
    return [c.verdict for c in view.claims] == [c.verdict for c in shipped.claims] and config_line(view) == config_line(
        shipped
    )


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
            "<html><body style='margin:0'>"
            + fig.to_html(full_html=False, include_plotlyjs=True, config=FIGURE_CONFIG)
            + "</body></html>",
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
