"""A fake OpenAI-compatible chat-completions server on loopback, for the probe's tests (no model).

It answers a needle prompt by rule: it reads the pass key (or the asked multikey value) from the prompt and
answers it while the prompt is at most `recall_tokens` long, and beyond that only when the needle sits in the
first half of the prompt ("I don't know." otherwise); prompts over `context_tokens` get a 400 with a
"maximum context length" message, as vLLM and OpenAI send. Tokens are counted with the probe's own
`WordPieces`, so usage.prompt_tokens is exact here; log-probs come back when asked for and `logprobs` is True ("reject": the request is refused with a 400 naming them).

The legacy completions API (``/v1/completions``) answers `echo` requests as llama.cpp's server does: the prompt's
word pieces echoed with their log-probs (the first None), then one completion token. The answer's pieces (the
prompt's last characters after "is ") get -0.1 each where the rule above would find the needle, -2.0 where not;
every other piece -0.5. `echo` scripts the endpoint: True answers, "reject" a 400 "echo is not supported",
"nofields" a 200 without log-probs, "shifted" drops the completion's token (as llama-cpp-python does when it
misplaces the echoed log-probs), "garbled" drops the prompt's last piece; False has no completions API (404).

`plan` scripts misbehaviour, one entry per request in order ("ok" once it runs out): "500", "429" (with
Retry-After: 0), "badjson", "nofields", "slow" (answers after `slow_s`), "drop" (closes the connection).
A wrong or missing key gets a 401 whose message echoes the key sent (as some servers do); another model name
a 404 "model ... does not exist".
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvdemo.probe.prompts import WordPieces

_COUNT = WordPieces().count


class FakeServer:
    def __init__(
        self,
        model: str = "fake-model",
        key: str = "",
        context_tokens: int = 100_000,
        recall_tokens: int = 100_000,
        plan: list[str] | None = None,
        slow_s: float = 1.0,
        logprobs: bool | str = True,  # False: never returned; "reject": a 400 when asked for
        echo: bool | str = True,  # the completions API: see the module's docstring
    ):
        self.model, self.key, self.context_tokens, self.recall_tokens = model, key, context_tokens, recall_tokens
        self.plan, self.slow_s, self.logprobs, self.echo = list(plan or []), slow_s, logprobs, echo
        self.requests: list[dict] = []  # every request body, with "authorization" added
        self.in_flight = self.most_in_flight = 0  # requests being answered now, and the most at once
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def answer(self, prompt: str) -> str:
        """The rule: the needle's value when the prompt is short enough or the needle early enough."""
        key = re.search(r"special magic number for ([\w-]+) mentioned", prompt)
        pattern = rf"magic numbers for {re.escape(key.group(1))} is: (\d+)" if key else r"The pass key is (\d+)"
        m = re.search(pattern, prompt)
        if not m:
            return "I don't know."
        if _COUNT(prompt) <= self.recall_tokens or m.start() < len(prompt) / 2:
            return f"The answer is {m.group(1)}."
        return "I don't know."

    def echoed(self, body: dict) -> tuple[int, dict]:
        """(status, answer) of a completions request with echo, as `echo` scripts it."""
        prompt = body["prompt"]
        if self.echo == "reject":
            return 400, {"error": {"message": "echo is not supported with logprobs for this model"}}
        completion = "."
        choice = {"index": 0, "text": prompt + completion, "logprobs": None, "finish_reason": "length"}
        if self.echo != "nofields":
            pieces = [prompt[a:b] for a, b in WordPieces()(prompt, return_offsets_mapping=True)["offset_mapping"]]
            at = prompt.rindex("is ") + len("is ")
            found = self.answer(prompt[:at]) != "I don't know."
            values, pos = [], 0
            for p in pieces:
                values.append((-0.1 if found else -2.0) if pos + len(p) > at else -0.5)
                pos += len(p)
            tokens = pieces + [completion]
            values = [None, *values[1:], -1.0]
            if self.echo == "shifted":
                tokens, values = tokens[:-1], values[:-1]
            if self.echo == "garbled":
                del tokens[-2], values[-2]
            offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": values, "text_offset": offsets,
                                  "top_logprobs": None}  # fmt: skip
        usage = {"prompt_tokens": _COUNT(prompt), "completion_tokens": 1, "total_tokens": _COUNT(prompt) + 1}
        return 200, {"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body, headers: dict | None = None) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                auth = self.headers.get("Authorization", "")
                with server._lock:
                    server.requests.append(body | {"authorization": auth})
                    step = server.plan.pop(0) if server.plan else "ok"
                completions = self.path == "/v1/completions" and server.echo is not False
                if self.path != "/v1/chat/completions" and not completions:
                    return self._send(404, {"error": {"message": "Not found"}})
                if server.key and auth != f"Bearer {server.key}":
                    sent = auth.removeprefix("Bearer ")
                    return self._send(401, {"error": {"message": f"Incorrect API key provided: {sent}"}})
                if body.get("model") != server.model:
                    return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist"}})
                if body.get("logprobs") and server.logprobs == "reject":
                    return self._send(400, {"error": {"message": "logprobs is not supported by this server"}})
                if completions:
                    return self._send(*server.echoed(body))
                if step == "500":
                    return self._send(500, {"error": {"message": "internal error"}})
                if step == "429":
                    return self._send(429, {"error": {"message": "slow down"}}, {"Retry-After": "0"})
                if step == "badjson":
                    return self._send(200, b"<html>gateway</html>")
                if step == "nofields":
                    return self._send(200, {"id": "x", "choices": []})
                if step == "drop":
                    self.close_connection = True
                    return
                if step == "slow":
                    with server._lock:
                        server.in_flight += 1
                        server.most_in_flight = max(server.most_in_flight, server.in_flight)
                    time.sleep(server.slow_s)
                    with server._lock:
                        server.in_flight -= 1
                prompt = "".join(m["content"] for m in body["messages"])
                tokens = _COUNT(prompt)
                if tokens > server.context_tokens:
                    message = (
                        f"This model's maximum context length is {server.context_tokens} tokens. However, you "
                        f"requested {tokens} tokens. Please reduce the length of the messages."
                    )
                    return self._send(400, {"error": {"message": message, "type": "invalid_request_error"}})
                text = server.answer(prompt)
                pieces = re.findall(r"\S+|\s+", text)
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if server.logprobs is True and body.get("logprobs"):
                    lp = -0.01 if "answer" in text else -1.5
                    choice["logprobs"] = {"content": [{"token": p, "logprob": lp} for p in pieces]}
                usage = {
                    "prompt_tokens": tokens,
                    "completion_tokens": len(pieces),
                    "total_tokens": tokens + len(pieces),
                }
                return self._send(200, {"id": "chatcmpl-1", "object": "chat.completion", "choices": [choice],
                                        "usage": usage})  # fmt: skip

        return Handler
