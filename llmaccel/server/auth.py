"""Who a request comes from, whether it may pass, and what its rate limits count against.

- API keys: any number (`--api-key` repeated, `--api-key-file`); each is compared in constant time,
  and every key is compared, so the time taken says nothing of which came close.
- Failed authentications are limited per client address (a token bucket of
  `--auth-failures-per-minute`): once it is empty, every attempt from that address gets 429 until it
  refills, the right key included, so keys cannot be guessed at full speed and a 429 says nothing of
  whether the guess was right.
- The client address is the peer's, or, when the peer is one of `--trusted-proxies`, the right-most
  address of X-Forwarded-For that is not itself a trusted proxy (the one the last trusted hop saw).
- Rate limits count against the key when keys are set (a client cannot mint new ones), else against
  the client address: a Bearer token the server does not check is not an identity.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path

from starlette.requests import Request

from llmaccel.safety.rate_limit import RateLimiter
from llmaccel.server.errors import APIError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """'10.0.0.0/8', '127.0.0.1', '::1' -> networks; a ValueError names an entry that is neither."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--trusted-proxies {entry!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path!r}: {exc.strerror}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"the API key file {path!r} holds no key (one per line)")
    return keys


class Gate:
    def __init__(self, api_keys: Iterable[str], trusted_proxies: Iterable[Network] = (),
                 auth_failures_per_minute: int = 10) -> None:
        self._keys = [key.encode() for key in api_keys]
        self.trusted_proxies = tuple(trusted_proxies)
        self.failures = RateLimiter(auth_failures_per_minute, None)

    @property
    def needs_key(self) -> bool:
        return bool(self._keys)

    def client_address(self, request: Request) -> str:
        peer = request.client.host if request.client else "unknown"
        if not self.trusted_proxies or not self._trusted(peer):
            return peer
        hops = [h.strip() for part in request.headers.getlist("x-forwarded-for") for h in part.split(",")]
        for hop in reversed(hops):
            if not _is_address(hop):
                break  # a malformed hop: nothing left of it can be believed
            if not self._trusted(hop):
                return hop
        return peer

    def check(self, request: Request) -> None:
        """Let the request pass, or raise 401 (no or a wrong key) / 429 (too many failures)."""
        if not self._keys:
            return
        address = self.client_address(request)
        locked = self.failures.blocked(address)
        if locked is not None:
            raise APIError(429, f"too many failed authentications from this address; retry in "
                           f"{locked.retry_after_header} s", "rate_limit_error", code="too_many_auth_failures",
                           headers={"Retry-After": locked.retry_after_header}, rejected="unauthorized")
        if not self._matches(bearer_token(request).encode()):
            self.failures.admit(address)
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'",
                           "invalid_request_error", code="invalid_api_key", rejected="unauthorized")

    def client_id(self, request: Request) -> str:
        """Whom rate limits count against: the key (hashed) when keys are set, else the client address."""
        if self._keys:
            return "key:" + hashlib.sha256(bearer_token(request).encode()).hexdigest()[:32]
        return "address:" + self.client_address(request)

    def _matches(self, token: bytes) -> bool:
        found = False
        for key in self._keys:  # no early exit: each key costs the same whatever the token
            found |= hmac.compare_digest(token, key)
        return found

    def _trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self.trusted_proxies)


def bearer_token(request: Request) -> str:
    """The key of 'Authorization: Bearer <key>', or "" without one."""
    header = request.headers.get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " else ""


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
