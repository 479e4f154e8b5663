"""API probe: the needle grid asked of OpenAI-compatible endpoints through chat completions, side by side.

- `kvdemo.probe.client`: the HTTP client (standard library): timeouts, retries with backoff, one-line messages
  for each kind of failure, the key read from an environment variable and never written anywhere.
- `kvdemo.probe.prompts`: the needle prompts sized by a word-piece estimate of the endpoint's tokens.
- `kvdemo.probe.echo`: the answer's teacher-forced log-prob through the completions API with echo (the prompt
  rendered by a template, the answer's tokens found by characters in the echoed ones).
- `kvdemo.probe.run`: the grid over endpoints (`run_probe`), a few requests at a time per endpoint.
- `kvdemo.results.probe`: what a probe returns (`ProbeReport` of `ProbeCell`s), found rates with intervals,
  endpoint differences, files.
"""

from .client import ENDPOINT_FAILURES, Client, Endpoint, ProbeError, Reply, key_status, parse_endpoint, parse_endpoints
from .echo import ECHO_TEMPLATES, LOGPROB_LABELS, LOGPROB_PATHS, resolve_template
from .prompts import ESTIMATOR, Question, WordPieces, answer_logprob
from .run import DEFAULT_MAX_TOKENS, MAX_CONCURRENCY, questions, run_probe, work_tokens

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "ECHO_TEMPLATES",
    "ENDPOINT_FAILURES",
    "ESTIMATOR",
    "LOGPROB_LABELS",
    "LOGPROB_PATHS",
    "MAX_CONCURRENCY",
    "Client",
    "Endpoint",
    "ProbeError",
    "Question",
    "Reply",
    "WordPieces",
    "answer_logprob",
    "key_status",
    "parse_endpoint",
    "parse_endpoints",
    "questions",
    "resolve_template",
    "run_probe",
    "work_tokens",
]
