"""An OpenAI-compatible chat-completions client on the standard library (urllib), bounded and polite.

One `Client` per endpoint: `chat(messages, max_tokens)` POSTs to ``{base_url}/chat/completions`` (and
`complete(body)` to the legacy ``{base_url}/completions``, for the answer's log-prob by echo) with a
per-request timeout, retries 429, 5xx, timeouts and dropped connections with exponential backoff (a 429's or
503's ``Retry-After`` is honoured, capped), and turns every failure into a `ProbeError` whose `kind` and one-line
message say what went wrong: the endpoint is unreachable, refused the key, does not serve the model, found the
prompt longer than its context, or answered without the fields expected.

The key is read from the environment variable the endpoint names (`Endpoint.key_env`) when a request is made;
it is never stored in a result, and every message built from a response body has it masked (some servers echo
a bad key back).

No dependency beyond the standard library: the probe's needs (JSON over HTTP, a timeout, a few headers) are
what urllib does, and the package stays importable wherever kvdemo is.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass

MAX_RETRY_AFTER_S = 60.0  # the longest wait a Retry-After header may ask for before a retry
BODY_CHARS = 200  # how much of an error body a message quotes

# what a failure is; `ProbeError.kind`
UNREACHABLE, AUTH, MODEL, CONTEXT, MALFORMED, TIMEOUT, RATE_LIMITED, SERVER, REQUEST, NO_KEY = (
    "unreachable",
    "wrong key",
    "unknown model",
    "context too long",
    "malformed response",
    "timeout",
    "rate limited",
    "server error",
    "bad request",
    "no key",
)
# failures that say something about the endpoint as a whole: its other cells are not sent
ENDPOINT_FAILURES = (UNREACHABLE, AUTH, MODEL, NO_KEY)
_CONTEXT_WORDS = re.compile(
    r"context.{0,20}(length|window|size|limit)|maximum.{0,20}(context|tokens|length)|too (long|many tokens)|"
    r"exceed|n_ctx|prompt is too|reduce the length",
    re.IGNORECASE,
)
_MODEL_WORDS = re.compile(r"model.{0,80}(not (found|exist|served|available|loaded)|does not exist|unknown)|"
                          r"(unknown|invalid|no such) model", re.IGNORECASE)  # fmt: skip


class ProbeError(ValueError):
    """A request that failed for good; `kind` (one of the constants above), a one-line message, and the HTTP
    status of the answer that ended it (None: no answer, or a 200 without the fields expected)."""

    def __init__(self, kind: str, message: str, attempts: int = 1, status: int | None = None):
        super().__init__(message)
        self.kind, self.attempts, self.status = kind, attempts, status


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: a name for the report, its base URL (``http://host:port/v1``), the model
    name it serves, and the name of the environment variable holding its key ("" when it needs none)."""

    name: str
    base_url: str
    model: str
    key_env: str = ""

    def __post_init__(self) -> None:
        if not self.name or not re.fullmatch(r"[\w.\-]+", self.name):
            raise ValueError(f"endpoint name {self.name!r}: use letters, digits, '.', '-' or '_'")
        if not re.match(r"https?://[^/\s]+", self.base_url):
            raise ValueError(f"endpoint {self.name}: base URL {self.base_url!r} must start with http:// or https://")
        if not self.model.strip():
            raise ValueError(f"endpoint {self.name}: give the model name the endpoint serves")
        if self.key_env and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.key_env):
            raise ValueError(f"endpoint {self.name}: {self.key_env!r} is not an environment variable name")

    def key(self) -> str:
        """The key from the environment ("" when the endpoint names no variable); a `ProbeError` when the
        variable it names is unset or empty."""
        if not self.key_env:
            return ""
        value = os.environ.get(self.key_env, "").strip()  # a key read from a file often ends in a newline
        if not value:
            raise ProbeError(NO_KEY, f"{self.name}: the environment variable {self.key_env} is not set")
        if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
            # an HTTP header cannot carry it, and the error http.client would raise quotes the header
            raise ProbeError(NO_KEY, f"{self.name}: the variable {self.key_env} holds characters a key cannot have")
        return value

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Endpoint:
        return cls(**d)


def parse_endpoint(text: str) -> Endpoint:
    """``NAME=BASE_URL,MODEL[,KEY_ENV]`` (the CLI's and the page's grammar) as an `Endpoint`."""
    name, eq, rest = text.strip().partition("=")
    parts = [p.strip() for p in rest.split(",")]
    if not eq or len(parts) not in (2, 3):
        raise ValueError(f"endpoint {text!r}: write NAME=BASE_URL,MODEL[,KEY_ENV], e.g. local=http://127.0.0.1:8080/v1,"
                         "llama,LOCAL_KEY (the variable's name, never the key)")  # fmt: skip
    return Endpoint(name.strip(), parts[0].rstrip("/"), parts[1], parts[2] if len(parts) == 3 else "")


def parse_endpoints(text: str) -> list[Endpoint]:
    """One endpoint per line (`parse_endpoint`'s grammar; blank lines and lines starting with # skipped); a
    ValueError naming the line that does not parse."""
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if line.strip() and not line.strip().startswith("#"):
            try:
                out.append(parse_endpoint(line))
            except ValueError as err:
                raise ValueError(f"line {i}: {err}") from None
    return out


def key_status(endpoint: Endpoint) -> str:
    """Whether the endpoint's key variable is set, in words (never the key)."""
    if not endpoint.key_env:
        return "no key sent"
    return f"{endpoint.key_env} is set" if os.environ.get(endpoint.key_env) else f"{endpoint.key_env} is NOT set"


@dataclass
class Reply:
    """One chat completion: the answer text, `usage`'s token counts, the answer tokens' log-probs when the
    endpoint returned them (None when not), the seconds the successful request took and the attempts made."""

    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    token_logprobs: list[tuple[str, float]] | None
    latency_s: float
    attempts: int


class Client:
    """Requests to one endpoint. `chat` is safe to call from several threads (the caller bounds how many)."""

    def __init__(
        self,
        endpoint: Endpoint,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError("timeout must be > 0 s, retries >= 0 and backoff >= 0 s")
        self.endpoint, self.timeout_s, self.retries, self.backoff_s, self.sleep = (
            endpoint,
            timeout_s,
            retries,
            backoff_s,
            sleep,
        )
        self.logprobs = True  # asked for until the endpoint refuses them
        self._lock = threading.Lock()

    # --- one request ------------------------------------------------------------------------------------

    def _mask(self, text: str, key: str) -> str:
        return text.replace(key, "***") if key else text

    def _post(self, body: dict, key: str, path: str = "/chat/completions") -> tuple[int, dict | None, str, dict]:
        """(HTTP status, parsed JSON or None, body text, headers) of one POST to `path` under the base URL;
        URLError/timeouts propagate."""
        data = json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.endpoint.base_url + path, data, headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, raw, head = resp.status, resp.read(), dict(resp.headers)
        except urllib.error.HTTPError as err:
            status, raw, head = err.code, err.read() or b"", dict(err.headers or {})
        text = raw.decode("utf-8", errors="replace")
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        return status, parsed if isinstance(parsed, dict) else None, text, head

    def _failure(
        self, status: int, parsed: dict | None, text: str, key: str, path: str = "/chat/completions"
    ) -> tuple[str, str]:
        """(kind, message) of an HTTP error answer to a POST to `path`."""
        name, ep = self.endpoint.name, self.endpoint
        detail = (parsed or {}).get("error", parsed) if parsed else text
        if isinstance(detail, dict):
            detail = detail.get("message") or json.dumps(detail)
        detail = self._mask(" ".join(str(detail).split()), key)[:BODY_CHARS]  # masked before a cut could split the key
        if status in (401, 403):
            hint = f"check the variable {ep.key_env}" if ep.key_env else "it needs a key: add ,KEY_ENV to the endpoint"
            return AUTH, f"{name}: the endpoint refused the key (HTTP {status}): {hint}"
        if status == 413 or (status == 400 and _CONTEXT_WORDS.search(detail)):
            return (
                CONTEXT,
                f"{name}: the prompt is longer than the context the endpoint accepts (HTTP {status}: {detail})",
            )
        if status == 404 or (status == 400 and _MODEL_WORDS.search(detail)):
            if _MODEL_WORDS.search(detail) or "model" in detail.lower():
                return MODEL, f"{name}: the endpoint does not serve the model {ep.model!r} (HTTP {status}: {detail})"
            return UNREACHABLE, (
                f"{name}: no {path.strip('/').replace('/', ' ')} at {ep.base_url}{path} (HTTP 404): "
                "check the base URL (it usually ends in /v1)"
            )
        if status == 429:
            return RATE_LIMITED, f"{name}: rate limited (HTTP 429) after every retry: lower --concurrency"
        if status >= 500:
            return SERVER, f"{name}: server error (HTTP {status}) after every retry: {detail}"
        return REQUEST, f"{name}: the endpoint refused the request (HTTP {status}): {detail}"

    def _reply(self, parsed: dict | None, text: str, latency: float, attempts: int, key: str) -> Reply:
        """The answer, usage and log-probs of a 200 answer; `ProbeError(MALFORMED)` when a field is missing."""
        name = self.endpoint.name
        if parsed is None:
            snippet = self._mask(" ".join(text.split()), key)[:80]
            raise ProbeError(MALFORMED, f"{name}: the answer is not JSON ({snippet!r})", attempts)
        try:
            choice = parsed["choices"][0]
            content = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ProbeError(MALFORMED, f"{name}: the answer has no choices[0].message.content", attempts) from None
        if content is None:  # null: nothing written (a reasoning model can spend max_tokens before answering)
            content = ""
        if not isinstance(content, str):
            raise ProbeError(MALFORMED, f"{name}: choices[0].message.content is not text", attempts)
        usage = parsed.get("usage") if isinstance(parsed.get("usage"), dict) else {}
        entries = ((choice.get("logprobs") or {}) if isinstance(choice, dict) else {}).get("content")
        token_logprobs = None
        if isinstance(entries, list) and entries:
            try:
                token_logprobs = [(str(e["token"]), float(e["logprob"])) for e in entries]
            except (KeyError, TypeError, ValueError):
                token_logprobs = None
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        return Reply(
            text=content,
            prompt_tokens=prompt if isinstance(prompt, int) else None,
            completion_tokens=completion if isinstance(completion, int) else None,
            token_logprobs=token_logprobs,
            latency_s=round(latency, 3),
            attempts=attempts,
        )

    def _wait(self, attempt: int, headers: dict) -> None:
        """Back off before retry `attempt` (1, 2, ...): Retry-After when the server sent one, else
        backoff x 2^(attempt - 1)."""
        after = next((v for k, v in headers.items() if k.lower() == "retry-after"), None)
        try:
            seconds = min(float(after), MAX_RETRY_AFTER_S) if after is not None else None
        except ValueError:
            seconds = None
        self.sleep(seconds if seconds is not None else self.backoff_s * 2 ** (attempt - 1))

    def _request(
        self,
        path: str,
        body: Callable[[], dict],
        stop: Callable[[], bool] | None,
        relax: Callable[[str], bool] | None = None,
    ) -> tuple[dict | None, str, float, int, str]:
        """POST `body()` to `path`, retried on 429, 5xx, timeouts and dropped connections: (parsed JSON or None,
        body text, seconds, attempts, key) of the 200 answer; `ProbeError` when it fails for good. `relax(text)`,
        given a 400's body, may drop a field the endpoint refused and say so (True): the request is sent again at
        once, not counted as a retry. `stop`: polled before each retry (a cancelled run sends no more)."""
        key = self.endpoint.key()
        name = self.endpoint.name
        attempt = 0
        while True:
            attempt += 1
            t0 = time.perf_counter()
            headers: dict = {}
            retryable = True  # timeouts, dropped or refused connections, 429 and 5xx are tried again
            status = None
            try:
                status, parsed, text, headers = self._post(body(), key, path)
            except TimeoutError:
                kind, message = TIMEOUT, f"{name}: no answer within {self.timeout_s:g} s"
            except urllib.error.URLError as err:
                if isinstance(err.reason, TimeoutError):
                    kind, message = TIMEOUT, f"{name}: no answer within {self.timeout_s:g} s"
                else:
                    reason = self._mask(str(err.reason), key)
                    kind, message = UNREACHABLE, f"{name}: cannot reach {self.endpoint.base_url} ({reason})"
            except OSError as err:  # a connection dropped mid-answer
                kind, message = UNREACHABLE, f"{name}: cannot reach {self.endpoint.base_url} ({type(err).__name__})"
            except Exception as err:  # anything else urllib raises: one line, the key masked, not retried
                detail = self._mask(f"{type(err).__name__}: {err}", key)
                raise ProbeError(REQUEST, f"{name}: the request failed ({detail})", attempt) from None
            else:
                if status == 200:
                    return parsed, text, time.perf_counter() - t0, attempt, key
                if status == 400 and relax is not None and relax(text):
                    attempt -= 1
                    continue
                kind, message = self._failure(status, parsed, text, key, path)
                retryable = status == 429 or status >= 500
            if not retryable or attempt > self.retries or (stop is not None and stop()):
                suffix = f" ({attempt} attempts)" if attempt > 1 else ""
                raise ProbeError(kind, message + suffix, attempt, status)
            self._wait(attempt, headers)

    def chat(self, messages: list[dict], max_tokens: int, stop: Callable[[], bool] | None = None) -> Reply:
        """One chat completion (temperature 0), retried on 429, 5xx, timeouts and dropped connections;
        `ProbeError` when it fails for good. `stop`: polled before each retry (a cancelled run sends no more).
        Chat log-probs are asked for while `self.logprobs` holds; an endpoint that refuses the field (a 400 naming
        it) is asked again without it, and is not asked for it again."""

        def body() -> dict:
            out = {"model": self.endpoint.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            if self.logprobs:  # top_logprobs 0: the sampled tokens' log-probs only (llama.cpp's server needs it)
                out |= {"logprobs": True, "top_logprobs": 0}
            return out

        def relax(text: str) -> bool:
            if not (self.logprobs and "logprob" in text.lower()):
                return False
            with self._lock:
                self.logprobs = False  # the endpoint does not take the field: ask without it
            return True

        parsed, text, latency, attempts, key = self._request("/chat/completions", body, stop, relax)
        return self._reply(parsed, text, latency, attempts, key)

    def complete(self, body: dict, stop: Callable[[], bool] | None = None) -> dict:
        """One legacy completion (``POST {base_url}/completions``) of `body` (the model is set here), retried as
        `chat` is; its parsed JSON, or `ProbeError` (MALFORMED for an answer that is not JSON)."""
        parsed, text, _, attempts, key = self._request(
            "/completions", lambda: body | {"model": self.endpoint.model}, stop
        )
        if parsed is None:
            snippet = self._mask(" ".join(text.split()), key)[:80]
            raise ProbeError(MALFORMED, f"{self.endpoint.name}: the answer is not JSON ({snippet!r})", attempts, 200)
        return parsed
