"""Single requests that once stopped the engine or leaked internals: each gets a 4xx naming the field
(or a 200 where the value is legal), /health stays 200, and the next normal request is answered,
on the same keep-alive connection."""

from __future__ import annotations

import http.client
import json
import logging
from urllib.parse import urlparse

import httpx
import pytest

from tests.live_server import live_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


class KeepAlive:
    """One HTTP/1.1 connection; `same_socket` says whether the server kept it open between requests."""

    def __init__(self, url: str) -> None:
        parts = urlparse(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self.sockets: list[object] = []

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        self.sockets.append(self.conn.sock)
        response = self.conn.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())

    @property
    def same_socket(self) -> bool:
        return all(s is self.sockets[0] for s in self.sockets)


def assert_still_serving(server, conn: KeepAlive) -> None:
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    status, _, body = conn.post(COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


# (path, body, status, param the error names, words in its message); status 200: the value is legal
REPRODUCTIONS = [
    (CHAT, {"messages": HI, "temperature": 1, "seed": 1180591620717411303424, "max_tokens": 3}, 200, None, None),
    (CHAT, {"messages": HI, "temperature": 1, "seed": -(2**80), "max_tokens": 3, "n": 2}, 200, None, None),
    (COMPLETIONS, {"prompt": "hi", "top_k": 9223372036854775808, "max_tokens": 3, "temperature": 1}, 200, None, None),
    (COMPLETIONS, {"prompt": "hi", "top_k": 10**40, "max_tokens": 3}, 200, None, None),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 2, "stop_token_ids": [-723073], "max_tokens": 3}, 400,
     "stop_token_ids", "stop_token_ids.0: Input should be greater than or equal to 0 (got -723073)"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 2, "stop_token_ids": [5, 10**6]}, 400, "stop_token_ids",
     "stop_token_ids[1]: token id 1000000 is outside the vocabulary [0, 400)"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt", "prompt[0]: token id -1 is outside the vocabulary [0, 400)"),
    (COMPLETIONS, {"prompt": [9223372036854775808]}, 400, "prompt",
     "prompt[0]: token id 9223372036854775808 is outside the vocabulary"),
    (COMPLETIONS, {"prompt": [[5, 6], [7, -3]]}, 400, "prompt", "prompt[1][1]: token id -3 is outside"),
    (COMPLETIONS, {"prompt": None}, 400, "prompt", "must be a string, a list of strings"),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages", "content is required and must not be null"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400, "messages", "content is required"),
    (CHAT, {"messages": HI, "temperature": 1e308}, 400, "temperature", "must be in [0, 2]"),
    (CHAT, {"messages": HI, "n": 10**30}, 400, "n", "must be in [1, 128]"),
    (CHAT, {"messages": HI, "max_tokens": 10**30}, 400, "messages", "maximum context length is 1024 tokens"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 2**63}, 400, "logprobs", "must be in [0, 20]"),
]


@pytest.mark.parametrize("path,body,status,param,words", REPRODUCTIONS)
def test_each_reproduction_is_answered_and_the_server_keeps_serving(server, path, body, status, param, words):
    conn = KeepAlive(server.url)
    got, headers, answer = conn.post(path, body)
    assert got == status, answer
    if status == 200:
        assert answer["choices"] and answer["usage"]["completion_tokens"] >= 1
    else:
        assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["param"] == param and words in answer["error"]["message"]
        assert "Error(" not in answer["error"]["message"]  # no exception reprs
    assert headers["x-request-id"].startswith("req-")
    assert_still_serving(server, conn)
    assert conn.same_socket
    server.wait_idle()


@pytest.mark.parametrize("raw", [b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
                                 b'{"prompt": "hi", "min_p": -Infinity}'])
def test_non_finite_numbers_are_refused(server, raw):
    conn = KeepAlive(server.url)
    status, _, answer = conn.post(COMPLETIONS, raw)
    assert status == 400 and "must be a finite number" in answer["error"]["message"]
    assert_still_serving(server, conn)
    assert conn.same_socket


def test_a_bug_in_a_handler_is_a_500_naming_the_request_id_and_the_connection_lives_on(server, monkeypatch, caplog):
    def broken_submit(request, model, owner=""):
        raise RuntimeError("secret internals: /home/llmaccel/weights")

    monkeypatch.setattr(server.state.serving, "submit", broken_submit)
    conn = KeepAlive(server.url)
    with caplog.at_level(logging.ERROR, logger="llmaccel"):
        status, headers, answer = conn.post(COMPLETIONS, {"prompt": "hi"})
    monkeypatch.undo()
    request_id = headers["x-request-id"]
    assert status == 500 and answer["error"]["type"] == "internal_error" and answer["error"]["code"] == "internal_error"
    assert request_id in answer["error"]["message"] and "secret" not in answer["error"]["message"]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert len(logged) == 1 and "secret internals" in logged[0].exc_text  # the traceback, once, under the id
    assert_still_serving(server, conn)
    assert conn.same_socket


def test_unknown_field_names_are_logged_escaped_and_clipped(server, caplog):
    forged = "x\nINFO 00:00:00 llmaccel: forged line " + "y" * 100
    with caplog.at_level(logging.WARNING, logger="llmaccel"):
        response = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, forged: 1})
    assert response.status_code == 200
    line = next(r.getMessage() for r in caplog.records if "ignoring unknown request field" in r.getMessage())
    assert "\n" not in line and "\\n" in line and "y" * 100 not in line


def test_a_bug_mid_stream_ends_the_stream_with_an_error_event_naming_the_response(server, monkeypatch, caplog):
    def broken_filter(filters, index, choice):
        raise KeyError("secret internals")

    monkeypatch.setattr(server.state.serving, "_filter_delta", broken_filter)
    with caplog.at_level(logging.ERROR, logger="llmaccel"):
        with httpx.stream("POST", server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 8, "stream": True},
                          timeout=30) as stream:
            events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    monkeypatch.undo()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "internal_error" and "secret" not in error["message"]
    response_id = error["message"].split("streaming ")[1].split(";")[0]
    assert any(response_id in r.getMessage() and "secret internals" in (r.exc_text or "") for r in caplog.records)
    server.wait_idle()  # the request was aborted and its blocks freed
    assert httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
