"""One HTTP exchange of `grpo serve` as its endpoints see it: the `Request`, the `Reply`, and
the body of an error reply."""

from __future__ import annotations

import json
from typing import Any

import attrs

from grpo.serve.wire import ServeError


@attrs.define
class Request:
    """A decoded request: method, path, the query (last value of each key), headers, body."""

    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body as a JSON object (400 if it is not one)."""
        try:
            data = json.loads(self.body or b"{}")
        except ValueError as error:
            raise ServeError(
                400, "validation.invalid_request", f"body is not JSON: {error}"
            ) from None
        if not isinstance(data, dict):
            raise ServeError(400, "validation.invalid_request", "body must be a JSON object")
        return data

    def int_param(self, name: str, default: int) -> int:
        """Query parameter `name` as an int."""
        try:
            return int(self.query.get(name, default))
        except ValueError:
            raise ServeError(
                400, "validation.invalid_request", f"query {name} must be an int"
            ) from None


@attrs.define
class Reply:
    """A reply: its status and body, sent as msgpack when `msgpack` is set."""

    status: int
    body: Any = None  # dict -> JSON (or msgpack when `msgpack`), bytes -> as is, None -> empty
    msgpack: bool = False


def error_body(code: str, message: str, path: str) -> dict[str, Any]:
    """The body of an error reply; the Actor API (``/actor/``) nests it under ``error`` too."""
    body: dict[str, Any] = {"code": code, "message": message}
    if path.startswith("/actor/"):
        body["error"] = {"code": code, "message": message}
    return body
