"""Suggested questions about the bundled sample (Pride and Prejudice, kvdemo/texts.py) that the embedded model
(SmolLM2-135M-Instruct) answers right at full precision with the Chat page's defaults (its system prompt,
greedy decoding, the sample's first 1,024 tokens): a first question whose full-precision answer can be trusted,
so what quantization changes in it is quantization's doing.

Each was found by running the model (tests/test_chat_compare.py asks every one at full precision and checks
the answer). Their answers are short and literal in the text: a name, a number, a day.
"""

from __future__ import annotations

from dataclasses import dataclass

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"  # the model the questions were checked on (a prefix of its name)


@dataclass(frozen=True)
class SuggestedQuestion:
    question: str
    expected: str  # words the right answer holds (matched by `needle.answer_matches`)
    quote: str  # the sample's words that answer it: offered only while the sample holds them
    note: str = ""  # what low-bit caches did with it when it was picked


SAMPLE_QUESTIONS: tuple[SuggestedQuestion, ...] = (
    SuggestedQuestion(
        "How many daughters does Mrs. Bennet have?",
        "five",
        "When a woman has five grown-up daughters",
        "When it was picked, int4 said four and int2 said five.",
    ),
    SuggestedQuestion(
        "What is the name of the young man who has taken Netherfield?",
        "Bingley",
        '"What is his name?"\n\n"Bingley."',
        "When it was picked, int4 answered it right and int2 did not.",
    ),
    SuggestedQuestion(
        "On what day did Mr. Bingley come down to see Netherfield?",
        "Monday",
        "he came down on Monday",
        "When it was picked, int4 said Monday and int2 did not.",
    ),
)


def suggested_questions(model_name: str, document: str) -> list[SuggestedQuestion]:
    """The questions to offer for `document` (the bundled sample at the length the user chose) when the loaded
    model is the one they were checked on; none otherwise."""
    if not model_name.startswith(EMBEDDED_MODEL):
        return []
    return [q for q in SAMPLE_QUESTIONS if q.quote in document]
