"""Small local stand-ins for what slime's agentic examples call out to, for
tests/rollout/test_slime_examples.py, each an HTTP server on 127.0.0.1 in a thread of the test
(stopped by the test):

- ScriptedEngine: SGLang's /generate (reference/sglang-http.md: text or input_ids in, text,
  output_ids, meta_info with finish_reason, output_token_logprobs and weight_version out) whose
  replies a script picks from the prompt, in the tiny model's tokens: the model's decisions an
  agent example reacts to (search, call a tool, answer), which a random tiny model never makes.
- RetrievalServer: Search-R1's local retrieval server (/retrieve: queries, topk -> result).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LOG_PROB = -0.5  # every scripted token's log-prob
Script = Callable[[str], str]  # the prompt's text -> the reply


class _Server:
    def __init__(self, handle: Callable[[str, dict[str, Any]], dict[str, Any]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                reply = json.dumps(handle(self.path, body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                """Quiet: the test reads what the server recorded."""

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.port = self.httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def serving(server: _Server) -> Iterator[Any]:
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join()


class ScriptedEngine(_Server):
    def __init__(self, tokenizer: Any, script: Script) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.prompts: list[str] = []
        super().__init__(self._generate)

    def _generate(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/generate", path
        text = body["text"] if "text" in body else self.tokenizer.decode(body["input_ids"])
        self.prompts.append(text)
        ids = self.tokenizer(self.script(text), add_special_tokens=False)["input_ids"]
        limit = body.get("sampling_params", {}).get("max_new_tokens", len(ids))
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        meta: dict[str, Any] = {"finish_reason": {"type": finish}, "weight_version": "0",
                                "prompt_tokens": len(self.tokenizer(text)["input_ids"]), "completion_tokens": len(ids)}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[LOG_PROB, t, None] for t in ids]
        return {"text": self.tokenizer.decode(ids), "output_ids": ids, "meta_info": meta}


class RetrievalServer(_Server):
    def __init__(self, documents: dict[str, str]) -> None:
        """documents: a query word -> the passage ('"Title"\\ntext') returned for a query holding it."""
        self.documents = documents
        self.queries: list[str] = []
        super().__init__(self._retrieve)

    def _retrieve(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "/retrieve", path
        self.queries += body["queries"]
        found = [{"contents": text} for word, text in self.documents.items() if word in body["queries"][0]]
        return {"result": [found[:body["topk"]]]}
