"""What a request passes before any of its body is read: the API key and the body's size.

A pure ASGI middleware, outermost but for CORS: an unauthenticated client costs the server
its headers only (no body read, no JSON parsed), and no body past `max_body` bytes is read
whole, whether it declares its length or streams it in chunks. The key is compared as bytes,
so an `Authorization` header of any bytes is a 401, never an error in the comparison.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from mtpkit.core.errors import MtpkitError
from mtpkit.serve.schemas import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# Routes open without a key.
OPEN_PATHS = frozenset({"/health"})
BAD_KEY = "invalid or missing API key (send Authorization: Bearer KEY)"


class BadApiKey(MtpkitError):
    """An --api-key the server cannot compare or that no client could send."""


def checked_api_key(key: str | None) -> str | None:
    """`key` when it can authenticate a client: not empty, not only spaces, printable ASCII
    (what an HTTP header carries); None for no key. Raises `BadApiKey` otherwise, so that a
    mistyped key never turns authentication off or makes every request fail."""
    if key is None:
        return None
    if not key.strip():
        raise BadApiKey(
            "--api-key (or MTPKIT_API_KEY) is empty: pass a key, or leave both unset to serve "
            "without one"
        )
    if not key.isascii() or not key.isprintable() or key != key.strip():
        raise BadApiKey(
            "--api-key must be printable ASCII without leading or trailing spaces (an HTTP "
            "header carries nothing else)"
        )
    return key


class Guard:
    """The API key (on every route but OPEN_PATHS) and the body-size limit, both checked
    before the route reads the body."""

    def __init__(self, app: App, *, api_key: str | None, max_body: int) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("ascii") if api_key else None
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope.get("method") != "OPTIONS" and not self._authorized(scope, headers):
            await _refuse(send, 401, BAD_KEY, "invalid_api_key")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            await _refuse(send, 413, self._too_large(), "request_too_large")
            return
        await self.app(scope, self._bounded(receive, send), send)

    def _authorized(self, scope: Scope, headers: dict[bytes, bytes]) -> bool:
        if self.expected is None or scope.get("path") in OPEN_PATHS:
            return True
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        given = b"Bearer " + token.strip() if scheme.lower() == b"bearer" else b""
        return secrets.compare_digest(given, self.expected)

    def _too_large(self) -> str:
        return f"the request body is larger than {self.max_body:,} bytes"

    def _bounded(self, receive: Receive, send: Send) -> Receive:
        """`receive`, ending the request with a 413 once its body passes `max_body`."""
        seen = 0

        async def read() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    # FastAPI passes an HTTPException from reading the body on as it is.
                    raise HTTPException(413, self._too_large())
            return message

        return read


async def _refuse(send: Send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
