"""The words the findings use, in plain language: one list for the page, the HTML/PDF report and docs/findings.md
(tests/test_findings.py checks that the doc carries each entry)."""

from __future__ import annotations

GLOSSARY = {
    "NLL": "negative log-likelihood: how surprised the model is by the actual next token, averaged over the text. "
    "Lower is better; the findings give the change against full precision on the same tokens.",
    "nats": "the unit of NLL and KL (natural logarithm). A change of 0.01 nats/token is a perplexity about 1% "
    "higher; 0.1 nats/token about 10% higher.",
    "KL": "Kullback-Leibler divergence, KL(full || quantized): how far the quantized cache moves the model's whole "
    "next-token distribution away from full precision's, in nats. 0 means the same predictions.",
    "JS": "Jensen-Shannon divergence: a symmetric, bounded (at most ln 2 nats) cousin of KL, used for attention "
    "weights: how far a head's attention over past tokens moved.",
    "needle": "a fact hidden in long text (a key and its number); the model is asked for it after the whole text. "
    "Found means the right answer came out; log p is how sure the model was of it.",
    "headroom": "how many sequences (or how long a context) fit in the GPU memory left after the weights and a "
    "reserve: what a smaller KV cache buys.",
    "16-bit basis": 'every "x smaller" compares with a 16-bit (fp16/bf16) cache of the same tokens, the way a GPU '
    "serves it, whatever dtype the model runs in here.",
}


def glossary_rows() -> list[dict]:
    """The glossary as table rows: term, meaning."""
    return [{"term": term, "meaning": text} for term, text in GLOSSARY.items()]
