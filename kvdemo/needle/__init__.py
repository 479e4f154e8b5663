"""Needle in a haystack: full precision and quantized KV caches, side by side, on the same tokens.

A fact (the needle) is hidden at a chosen depth of a long text (the haystack) and the model is asked for it.
Each cell (prompt length x depth) is prefilled once and read by every precision from the question on; a grid
runs every cell, `repeats` times with new needles.

- `kvdemo.needle.prompts`: tasks (passkey, RULER multikey, custom), haystacks, sentence boundaries, and the
  prompt of a cell at a length and depth.
- `kvdemo.needle.run`: one cell at every precision (`run_cell`) and a grid (`run_grid`).
- `kvdemo.results.needle`: what a grid returns (`NeedleGrid` of `NeedleRow`s), its found rates, intervals and
  paired differences, and its files.

The names below are the package's front door (`from kvdemo.needle import run_grid`).
"""

from .prompts import (
    FILLER,
    INSTRUCTIONS,
    KINDS,
    MULTIKEY_INSTRUCTION,
    MULTIKEY_LEAD_IN,
    MULTIKEY_NEEDLE,
    MULTIKEY_QUESTION,
    NUM_KEYS,
    PASSKEY_NEEDLE,
    NeedleError,
    NeedlePrompt,
    NeedleTask,
    answer_matches,
    build_prompt,
    cell_rng,
    choose_haystack,
    default_haystack,
    insert_at,
    lead_in,
    make_task,
    nearest_boundary,
    normalize,
    sentence_starts,
    split_answer,
    token_offsets,
)
from .run import (
    LLAMACPP_FAILED,
    LLAMACPP_INSTALL,
    MAX_REPEATS,
    check_grid,
    check_length,
    contender_labels,
    flush_points,
    forward_as_decoding,
    llamacpp_choices,
    parse_numbers,
    run_cell,
    run_grid,
    score_and_answer,
    specs_with_full,
    transplant,
    work_tokens,
)

__all__ = [
    "FILLER",
    "INSTRUCTIONS",
    "KINDS",
    "LLAMACPP_FAILED",
    "LLAMACPP_INSTALL",
    "MAX_REPEATS",
    "MULTIKEY_INSTRUCTION",
    "MULTIKEY_LEAD_IN",
    "MULTIKEY_NEEDLE",
    "MULTIKEY_QUESTION",
    "NUM_KEYS",
    "PASSKEY_NEEDLE",
    "NeedleError",
    "NeedlePrompt",
    "NeedleTask",
    "answer_matches",
    "build_prompt",
    "cell_rng",
    "check_grid",
    "check_length",
    "choose_haystack",
    "contender_labels",
    "default_haystack",
    "flush_points",
    "forward_as_decoding",
    "insert_at",
    "lead_in",
    "llamacpp_choices",
    "make_task",
    "nearest_boundary",
    "normalize",
    "parse_numbers",
    "run_cell",
    "run_grid",
    "score_and_answer",
    "sentence_starts",
    "specs_with_full",
    "split_answer",
    "token_offsets",
    "transplant",
    "work_tokens",
]
