"""Talking to a running `sluice serve` over its REST API (standard library only).

SUMMARY
    client = ApiClient.from_config(config)        # api.listen, first token
    client.request("GET", "/suspensions") -> parsed JSON
    explain(config, qid) -> explanations from the running server, or None

DESCRIPTION
    The CLI's side of the API (`sluice suspend`, `sluice condition`,
    `sluice policy-audit`), and what `sluice why` asks first: a running
    server knows why an entry in its memory waits (counters, suspensions,
    slow start); the store alone only knows its state.

    The address is ``api.listen`` (a wildcard address is reached on
    loopback); the token is --token, else $SLUICE_API_TOKEN, else the
    first of ``api.tokens``.

    Errors are two exceptions: ApiUnavailable (nobody answers: the server
    is not running or the API is off) and ApiRequestError (the server
    refused: status, error and detail, as the API sends them).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from sluice.config import Config

__all__ = ["ENV_TOKEN", "ApiClient", "ApiRequestError", "ApiUnavailable", "base_url",
           "default_token", "explain"]

ENV_TOKEN = "SLUICE_API_TOKEN"


class ApiUnavailable(Exception):
    """No API server answers at the address."""


class ApiRequestError(Exception):
    """The server answered with an error."""

    def __init__(self, status: int, error: str, detail: Any) -> None:
        self.status = status
        self.error = error
        self.detail = detail
        super().__init__(self.describe())

    def describe(self) -> str:
        """The error as one line: the error, its status and its details."""
        if isinstance(self.detail, list):
            parts = [f"{p.get('path', '')}: {p.get('message', '')}" if isinstance(p, dict)
                     else str(p) for p in self.detail]
            detail = "; ".join(parts)
        else:
            detail = "" if self.detail is None else str(self.detail)
        return f"{self.error} ({self.status})" + (f": {detail}" if detail else "")


def base_url(config: Config) -> str:
    """http://host:port of api.listen; a wildcard address becomes loopback."""
    text = config.api.listen.strip()
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if host == "0.0.0.0":
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def default_token(config: Config) -> str | None:
    """The token a command uses: $SLUICE_API_TOKEN, else the first of api.tokens."""
    env = os.environ.get(ENV_TOKEN)
    if env:
        return env
    named = config.api.named_tokens
    return named[0][1] if named else None


class ApiClient:
    """A few lines around urllib: JSON in, JSON out, errors as exceptions."""

    def __init__(self, url: str, token: str | None, timeout: float = 15.0) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = timeout

    @classmethod
    def from_config(cls, config: Config, *, url: str | None = None, token: str | None = None,
                    timeout: float = 15.0) -> ApiClient:
        """A client for the API a configuration describes; ``url`` and ``token`` override it."""
        return cls(url or base_url(config), token or default_token(config), timeout)

    def request(self, method: str, path: str, *, query: Mapping[str, Any] | None = None,
                body: Any = None) -> Any:
        """Call /api/v1<path>; returns the parsed JSON answer."""
        url = f"{self.url}/api/v1{path}"
        if query:
            pairs = [(k, v) for k, v in query.items() if v is not None]
            url += "?" + urllib.parse.urlencode(pairs, doseq=True)
        data = None
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            try:
                payload = json.loads(exc.read() or b"{}")
            except ValueError:
                payload = {}
            if not isinstance(payload, dict):
                payload = {}
            raise ApiRequestError(exc.code, str(payload.get("error") or exc.reason),
                                  payload.get("detail")) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiUnavailable(f"no Sluice API answers at {self.url} ({reason})") from None


def explain(config: Config, qid: str, *, timeout: float = 3.0) -> list[dict[str, Any]] | None:
    """Why ``qid`` (SPID-N or a SPID) waits, from the running server.

    Returns the explanations (each with ``lines``: the sentences `sluice
    why` prints), [] when the server has no such entry, or None when no
    server can be asked (API off, no token, not running) -- then explain
    from the store instead.
    """
    if not config.api.enabled or default_token(config) is None:
        return None
    client = ApiClient.from_config(config, timeout=timeout)
    try:
        answer = client.request("GET", f"/queue/entries/{urllib.parse.quote(qid.strip())}/why")
    except ApiUnavailable:
        return None
    except ApiRequestError as exc:
        if exc.status == 404:
            return []
        if exc.status == 401:
            return None
        raise
    explanations: list[dict[str, Any]] = answer["explanations"]
    return explanations
