"""Client for sglang-router's worker API (0.3.x: POST/GET /workers, DELETE /workers/{id}).

A worker added with POST is pending until the router has read its /health, /server_info and
/model_info; only then is it listed and routed to. Deleting takes the worker id, not its url.

PD mode (`launch_router --pd-disaggregation` with no --prefill/--decode), as measured on the
installed 0.3.2 wheel: it starts with no workers; `POST /workers {"url", "worker_type": "prefill",
"bootstrap_port": P}` or `{"url", "worker_type": "decode"}` adds one (202-style "accepted"), and
`GET /workers` lists each with its `worker_type` (and `bootstrap_port`) plus counts under
`stats.prefill_count/decode_count`; DELETE /workers/{id} removes either kind. A /generate goes to
one prefill and one decode worker at once, both bodies carrying `bootstrap_host` (the prefill
worker's host), `bootstrap_port` and a random `bootstrap_room` (lists of them for a batch); the
answer is the decode worker's, with the prefill's `meta_info.input_token_logprobs` put in front
of the decode's when `return_logprob` is set. The caller's Authorization header is forwarded to
both (a worker's own api_key is not, unlike regular mode). A prefill worker that cannot be reached
gives 502 `prefill_server_error` ("... for url (http://HOST:PORT/generate) ..."), a decode one 502
`decode_server_error`; a decode worker's own 5xx is passed through."""

from __future__ import annotations

import time

import requests

_LISTED_POLL_S = 0.1  # between two looks at the router's worker list


class RouterError(RuntimeError):
    pass


class RouterClient:
    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        """timeout_s bounds one call."""
        self.url = url.rstrip("/")
        self.session = requests.Session()
        if api_key:
            self.session.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        try:
            response = self.session.request(method, self.url + path, timeout=self.timeout_s, **kwargs)
        except requests.RequestException as err:
            raise RouterError(f"router {self.url} did not answer {method} {path}: {err}") from None
        if response.status_code >= 400:
            raise RouterError(f"router {self.url}: {method} {path} -> {response.status_code} {response.text[:200]}")
        return response

    def alive(self) -> bool:
        try:
            return self.session.get(self.url + "/liveness", timeout=self.timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def workers(self) -> dict[str, str]:
        """url -> worker id, for every worker the router routes to."""
        return {w["url"]: w["id"] for w in self._call("GET", "/workers").json()["workers"]}

    def add_worker(self, url: str, api_key: str | None = None, worker_type: str = "regular",
                   bootstrap_port: int | None = None) -> str:
        """worker_type prefill/decode: a PD-mode router's worker (a prefill one with its bootstrap_port)."""
        body: dict[str, str | int] = {"url": url, **({"api_key": api_key} if api_key else {})}
        if worker_type != "regular":
            body["worker_type"] = worker_type
        if bootstrap_port is not None:
            body["bootstrap_port"] = bootstrap_port
        return self._call("POST", "/workers", json=body).json()["worker_id"]

    def remove_worker(self, url: str) -> bool:
        """Remove by url (the router wants the id). False if the router does not list it."""
        worker_id = self.workers().get(url)
        if worker_id is None:
            return False
        self._call("DELETE", f"/workers/{worker_id}")
        return True

    def wait_listed(self, url: str, timeout_s: float, listed: bool = True) -> None:
        """Wait until the router lists (or no longer lists) `url`."""
        deadline = time.monotonic() + timeout_s
        while (url in self.workers()) != listed:
            if time.monotonic() > deadline:
                state = "listed" if listed else "removed"
                raise RouterError(f"router {self.url} did not have {url} {state} within {timeout_s:.0f} s")
            time.sleep(_LISTED_POLL_S)
