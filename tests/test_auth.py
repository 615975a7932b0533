"""Auth and limits that hold: rate limits follow the client, not a token it makes up; failed
authentications are limited per address; several keys; protected metrics and docs."""

from __future__ import annotations

import httpx
import pytest

from llmaccel.cli import build_parser
from llmaccel.config import ServerConfig
from llmaccel.server.launch import server_config
from tests.live_server import live_server

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}


def bearer(key: str, forwarded_for: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return headers


def post(server, key: str = "", forwarded_for: str | None = None) -> httpx.Response:
    return httpx.post(server.url + CHAT, json=BODY, headers=bearer(key, forwarded_for), timeout=60)


def test_without_keys_rate_limits_count_per_address_whatever_token_is_sent(llama_dir):
    with live_server(llama_dir, rate_limit_requests=2) as server:
        assert [post(server, f"token-{i}").status_code for i in range(3)] == [200, 200, 429]
        refused = post(server, "yet-another-token")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(refused.headers["retry-after"]) >= 1


def test_with_keys_rate_limits_count_per_key(llama_dir):
    with live_server(llama_dir, rate_limit_requests=1, api_keys=("alice", "bob")) as server:
        assert [post(server, "alice").status_code, post(server, "alice").status_code] == [200, 429]
        assert post(server, "bob").status_code == 200


def test_key_guessing_is_limited_per_address_and_the_right_key_waits_too(llama_dir):
    with live_server(llama_dir, api_keys=("right-key",), auth_failures_per_minute=3) as server:
        assert post(server, "right-key").status_code == 200
        assert [post(server, f"guess-{i}").status_code for i in range(3)] == [401, 401, 401]
        locked = post(server, "guess-4")
        assert locked.status_code == 429 and locked.json()["error"]["code"] == "too_many_auth_failures"
        assert int(locked.headers["retry-after"]) >= 1
        assert post(server, "right-key").status_code == 429  # a 429 says nothing of whether a guess was right
        assert httpx.get(server.url + "/health").status_code == 200


def test_trusted_proxies_attribute_requests_to_the_forwarded_client(llama_dir):
    proxies = ("127.0.0.0/8",)
    with live_server(llama_dir, api_keys=("k",), auth_failures_per_minute=2, trusted_proxies=proxies) as server:
        assert [post(server, "bad", "10.0.0.1").status_code for _ in range(3)] == [401, 401, 429]
        assert post(server, "bad", "10.0.0.2").status_code == 401  # another client behind the same proxy
        assert post(server, "bad", "10.0.0.3, 127.0.0.5").status_code == 401  # a trusted hop is skipped
        assert post(server, "k", "10.0.0.3, 127.0.0.5").status_code == 200
        # the right-most untrusted hop counts: a client cannot pick its address by prepending one
        assert post(server, "bad", "10.0.0.9, 10.0.0.1").status_code == 429


def test_forwarded_for_is_ignored_without_trusted_proxies(llama_dir):
    with live_server(llama_dir, api_keys=("k",), auth_failures_per_minute=2) as server:
        assert [post(server, "bad", f"10.0.0.{i}").status_code for i in range(3)] == [401, 401, 429]


def test_several_keys_from_flags_a_file_and_the_environment(llama_dir, tmp_path, monkeypatch):
    key_file = tmp_path / "keys.txt"
    key_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n")
    monkeypatch.setenv("LLMACCEL_API_KEY", "env-key")
    args = build_parser().parse_args(["serve", "--api-key", "flag-a", "--api-key", "flag-b",
                                      "--api-key-file", str(key_file)])
    config = server_config(args)
    assert config.api_keys == ("flag-a", "flag-b", "file-key-1", "file-key-2", "env-key")
    with live_server(llama_dir, api_keys=config.api_keys) as server:
        assert {post(server, key).status_code for key in config.api_keys} == {200}
        assert post(server, "flag-c").status_code == 401


def test_tokenize_and_detokenize_need_the_key(llama_dir):
    with live_server(llama_dir, api_keys=("k",)) as server:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            assert httpx.post(server.url + path, json=body).status_code == 401
            assert httpx.post(server.url + path, json=body, headers=bearer("k")).status_code == 200


def test_an_empty_key_file_is_refused(tmp_path):
    empty = tmp_path / "keys.txt"
    empty.write_text("# nothing yet\n")
    with pytest.raises(ValueError, match="holds no key"):
        server_config(build_parser().parse_args(["serve", "--api-key-file", str(empty)]))


@pytest.mark.parametrize("path", ["/metrics", "/docs", "/openapi.json", "/version"])
def test_protect_metrics_puts_metrics_and_docs_behind_the_key(llama_dir, path):
    with live_server(llama_dir, api_keys=("k",), protect_metrics=True) as server:
        assert httpx.get(server.url + path).status_code == 401
        assert httpx.get(server.url + path, headers=bearer("k")).status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200


def test_without_protect_metrics_metrics_and_docs_stay_open(llama_dir):
    with live_server(llama_dir, api_keys=("k",)) as server:
        assert {httpx.get(server.url + path).status_code for path in ("/metrics", "/openapi.json", "/docs")} == {200}


def test_protect_metrics_needs_a_key():
    with pytest.raises(ValueError, match="--protect-metrics needs --api-key"):
        ServerConfig(protect_metrics=True)
