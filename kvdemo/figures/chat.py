"""The Chat page's per-token comparison as HTML: an answer's tokens coloured by how much the quantized cache
disagrees with full precision there (KL(full || quantized) of the next-token distributions, in the bands of
`results.chat.KL_LEVELS`), each token's hover text giving both log-probabilities, and the first divergence
underlined. Plain HTML, no plotly: it sits under the answer text like the text itself.
"""

from __future__ import annotations

import html

from ..results.chat import LEVEL_NAMES, TokenScores, legend

COLOURS = ("#e8f5e9", "#fff59d", "#ffb74d", "#e57373")  # one per band of LEVEL_NAMES: agree .. strong


def _token_html(scores: TokenScores, i: int) -> str:
    piece = scores.pieces[i] or "⏎"  # the end-of-turn token has no text
    shown = html.escape(piece).replace("\n", "↵")
    level = scores.levels()[i]
    hover = (
        f"token #{i} {piece!r}: log p {scores.logprob_own[i]:.2f} under {scores.answer_of}, "
        f"{scores.logprob_other[i]:.2f} under {scores.scored_under}; KL {scores.kl[i]:.3f} nats ({LEVEL_NAMES[level]})"
    )
    style = f"background:{COLOURS[level]};border-radius:2px;padding:0 1px"
    if i == scores.divergence:
        hover += f"; first divergence: {scores.scored_under} would have said {scores.divergence_piece!r}"
        style += ";border-bottom:3px solid #b71c1c"
    return f'<span class="kv-tok" style="{style}" title="{html.escape(hover, quote=True)}">{shown}</span>'


def strip_html(scores: TokenScores) -> str:
    """The answer's tokens, each coloured by its KL band, with hover text (one `<div>`)."""
    tokens = "".join(_token_html(scores, i) for i in range(len(scores.tokens)))
    return f'<div class="kv-strip" style="line-height:1.9;font-size:0.9em">{tokens}</div>'


def legend_html() -> str:
    """The colour bands and what they mean, one line."""
    items = [
        f'<span style="background:{c};padding:0 4px;border-radius:2px">{name}: KL {rng} nats</span>'
        for c, (name, rng) in zip(COLOURS, legend(), strict=True)
    ]
    return (
        '<div style="font-size:0.8em">' + " ".join(items) + " · underlined: the first token the other cache "
        "would not have chosen; hover a token for its log-probabilities</div>"
    )
