"""Readable names for the machine keys of result rows: one mapping, used by every page table that shows rows
keyed for files (the CSV and JSON downloads keep the machine keys, which reports and tests read)."""

from __future__ import annotations

COLUMN_LABELS = {
    "accuracy": "found",
    "found_low": "found, 95% low",
    "found_high": "found, 95% high",
    "mean_answer_logprob": "mean log p(answer)",
    "agree_with_full": "agrees with full",
    "full_missed": "full precision missed",
    "mean_logprob_change": "log p change vs full",
    "answer_logprob": "log p(answer)",
    "depth_actual": "depth (actual)",
    "prompt_tokens": "prompt tokens",
    "delta_vs_full": "delta vs full",
    "logit_kl": "logit KL",
    "bits_per_element": "bits/element",
    "ratio_vs_fp16": "x smaller than 16-bit",
    "live_bytes": "live bytes",
    "stored_tokens": "stored tokens",
    "tokens_per_s": "tokens/s",
}


def label(column: str) -> str:
    """The readable name of `column` (itself when it reads already, e.g. "precision")."""
    return COLUMN_LABELS.get(column, column.replace("_", " "))


def readable(rows: list[dict]) -> list[dict]:
    """`rows` with their keys renamed by `label`, values and order unchanged: what a page table shows."""
    return [{label(k): v for k, v in r.items()} for r in rows]
