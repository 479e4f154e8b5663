"""The answer's log-prob through the legacy completions API with echo: log p(true answer | prompt), teacher-forced.

Where an endpoint offers ``POST /v1/completions`` with ``echo: true`` and ``logprobs``, the probe sends the needle
prompt followed by the answer's lead-in and the expected answer (`echo_prompt`), asks for one token
(``max_tokens: 1``: llama-cpp-python reads 0 as "no limit"), and reads the log-probs the endpoint gives the
echoed prompt tokens (`answer_logprob_from_echo`). Summed over the tokens that spell the answer they are the
teacher-forced log-probability of the true answer after the prompt: the quantity the needle page's rows report,
for a miss as for a hit, where chat log-probs cover only what the model sampled.

The prompt: the completions API takes text, not messages, so the chat template is applied here, by a template
with ``{prompt}`` where the needle's user message goes (`ECHO_TEMPLATES`: ``plain``, kvdemo's own rendering for
a model without a chat template, and ``chatml``; or the caller's own text). The endpoint's tokenizer is not at
hand, so the answer is found by characters: the echoed tokens' strings laid end to end spell the prompt and then
the completion the endpoint wrote; the answer is the prompt's last characters, so its tokens are those covering
the span that ends where the completion begins. ``text_offset`` is not used: llama-cpp-python counts it on the
text without special tokens, so it is not an offset into the prompt sent.
"""

from __future__ import annotations

import math

from .prompts import Question

LOGPROB_PATHS = ("chat", "echo", "off")  # where the probe reads the answer's log-prob; "off": nowhere
LOGPROB_LABELS = {
    "chat": "chat: the reply's tokens (found answers only)",
    "echo": "echo: the true answer teacher-forced (completions API)",
    "off": "off",
}
PLACEHOLDER = "{prompt}"
ECHO_TEMPLATES = {
    "plain": "user: {prompt}\n\nassistant:",  # kvdemo's rendering of a prompt for a model without a chat template
    "chatml": "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n",  # SmolLM2, Qwen and others
}
ECHO_MAX_TOKENS = 1  # the completion the request asks for (its text marks where the echoed prompt ends)


class EchoUnsupported(ValueError):
    """The endpoint answered an echo request without the fields echo scoring reads: it will not for any cell."""


def resolve_template(text: str) -> str:
    """A template by its name in `ECHO_TEMPLATES`, or the caller's own text with ``{prompt}`` once (``\\n`` written
    out is a newline: a command line or a one-line field can hold the template); ValueError saying what is allowed
    otherwise."""
    template = ECHO_TEMPLATES.get(text.strip(), text.replace("\\n", "\n"))
    if template.count(PLACEHOLDER) != 1:
        raise ValueError(
            f"echo template {text!r}: give {' or '.join(ECHO_TEMPLATES)}, or a template with {PLACEHOLDER} once where "
            "the needle's user message goes (e.g. the model's chat template up to the assistant's turn)"
        )
    return template


def echo_prompt(template: str, q: Question) -> str:
    """The text sent for echo scoring: the template around the needle's user message, the answer's lead-in ("The
    pass key is"; none for a custom needle whose answer opens it) and the expected answer, a space between
    words, as `needle.split_answer` joins them for kvdemo's own rows."""
    head = resolve_template(template).replace(PLACEHOLDER, q.prompt.text)
    tail = " ".join(s for s in (q.task.answer_prefix.strip(), q.task.answer.strip()) if s)
    return head + ("" if not head or head[-1].isspace() else " ") + tail


def echo_body(model: str, prompt: str) -> dict:
    """The completions request: the prompt echoed with its tokens' log-probs, one token written, temperature 0."""
    return {"model": model, "prompt": prompt, "max_tokens": ECHO_MAX_TOKENS, "temperature": 0, "echo": True,
            "logprobs": 1}  # fmt: skip


def answer_logprob_from_echo(parsed: dict, sent: str, answer: str) -> float:
    """The summed log-prob of the echoed prompt tokens that spell `answer`, the last characters of `sent` (the
    token that holds the space before it included, as kvdemo's rows score it where the tokenizer joins them).

    EchoUnsupported when the answer lacks ``choices[0].text``, ``logprobs.tokens`` or ``logprobs.token_logprobs``;
    ValueError (a one-line reason) when the echoed tokens cannot be placed on the prompt: they do not end with the
    completion the endpoint wrote (llama-cpp-python 0.3.36 shifts them by one when the prompt does not begin with
    the model's BOS token, and then drops the completion's token), or they do not spell the answer where it is."""
    try:
        choice = parsed["choices"][0]
        text, logprobs = choice["text"], choice["logprobs"]
        tokens, values = logprobs["tokens"], logprobs["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise EchoUnsupported("the answer has no choices[0].text with logprobs.tokens and token_logprobs") from None
    if not isinstance(text, str) or not isinstance(tokens, list) or not isinstance(values, list) or not tokens:
        raise EchoUnsupported("the answer has no echoed tokens with log-probs (logprobs.tokens is empty)")
    if len(tokens) != len(values):
        raise ValueError("the echoed tokens and their log-probs differ in number")
    if not text.startswith(sent):
        raise EchoUnsupported("the answer's text does not begin with the prompt sent: the endpoint did not echo it")
    completion = text[len(sent) :]
    spelled = "".join(str(t) for t in tokens)
    if not spelled.endswith(completion):
        raise ValueError(
            "the echoed tokens do not end with the completion the endpoint wrote: their log-probs "
            "cannot be placed on the prompt (llama-cpp-python's server shifts them when the prompt does not begin "
            "with the model's BOS token: try a template that does)"
        )
    end = len(spelled) - len(completion)  # where the prompt's last character ends, in the tokens' own text
    start = end - len(answer)
    if start < 0 or spelled[start:end] != answer:
        raise ValueError("the echoed tokens do not spell the answer at the end of the prompt")
    total, pos, used = 0.0, 0, 0
    for token, value in zip(tokens, values, strict=True):
        a, b = pos, pos + len(str(token))
        pos = b
        if b <= start or a >= end or a == b:
            continue
        if value is None or not math.isfinite(float(value)):
            raise ValueError("a token of the answer came back without a log-prob")
        total += float(value)
        used += 1
    if not used:
        raise ValueError("no echoed token spells the answer")
    return round(total, 4)
