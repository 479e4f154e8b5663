"""A fact planted in the user's own document and asked for, at full precision and at the chosen precision: the
needle test (kvdemo/needle/) at the document's length, in the Chat page's own setting (its system prompt, its
prefill mode, its decoding), with the per-token comparison of the two answers.

It runs in a chat session of its own, so the user's conversation, caches and document are left as they are.
"""

from __future__ import annotations

from ..models import LoadedModel, WaitCallback
from ..needle.prompts import answer_matches, cell_rng, insert_at, make_task, nearest_boundary, token_offsets
from ..precision import PrecisionSpec
from ..progress import ProgressFn, StopFn
from ..results.chat import PlantedCheck
from .lane import TokenCallback
from .session import ChatError, ChatSession

PLANTED_DEPTH = 0.5  # where the fact goes, as a fraction of the document (at the nearest sentence start)
PLANTED_NEW_TOKENS = 32  # a pass key is 5 digits; room for a sentence around it


def plant_and_ask(
    lm: LoadedModel,
    spec: PrecisionSpec | str,
    document: str,
    name: str = "document",
    seed: int = 0,
    depth: float = PLANTED_DEPTH,
    prefill_mode: str = "chunked",
    max_new_tokens: int = PLANTED_NEW_TOKENS,
    on_token: TokenCallback | None = None,
    on_progress: ProgressFn | None = None,
    should_stop: StopFn | None = None,
    on_wait: WaitCallback | None = None,
) -> PlantedCheck:
    """Plant a pass key (5 random digits, `seed`) at `depth` of `document`, ask for it at full precision and at
    `spec`, and say whether each answer holds it. Raises `ChatError` as a chat turn does (context full, out of
    memory) and `progress.Cancelled` when stopped while waiting for the model; a turn stopped later comes back
    with the partial answers, unscored."""
    text = document.strip()
    if not text:
        raise ChatError("load a document first: the fact is planted in it")
    task = make_task("passkey", cell_rng(seed, len(text), depth))
    at = nearest_boundary(text, token_offsets(lm.tokenizer, text), depth)
    planted, _ = insert_at(text, at, task.needle)
    session = ChatSession(lm, spec, planted, prefill_mode=prefill_mode)
    turn = session.ask(
        task.question,
        max_new_tokens,
        on_token=on_token,
        on_progress=on_progress,
        should_stop=should_stop,
        on_wait=on_wait,
    )
    answers = {a.precision: a.text.strip() for a in turn.answers}
    return PlantedCheck(
        document=name,
        document_tokens=turn.answers[0].prompt_tokens,
        needle=task.needle,
        question=task.question,
        expected=task.answer,
        depth=at / max(len(text), 1),
        answers=answers,
        found={p: answer_matches(task.answer, a) for p, a in answers.items()},
        comparison=turn.comparison,
    )
