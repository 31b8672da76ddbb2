"""One HTTP exchange of `grpo serve` as its endpoints see it: the `Request`, the `Reply`, and
the body of an error reply."""

from __future__ import annotations

import json
from typing import Any, TypeVar

import attrs
import pydantic

from grpo.serve.limits import MAX_FIELD_CHARS, MAX_JSON_DEPTH, MAX_PAGE, check_name, json_depth
from grpo.serve.openai_wire import OPENAI_PREFIX, openai_error_body
from grpo.serve.wire import ServeError

Model = TypeVar("Model", bound=pydantic.BaseModel)
_JSON_KINDS = {
    type(None): "null",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    str: "a string",
    list: "an array",
}


@attrs.define
class Request:
    """A decoded request: method, path, the query (last value of each key), headers, body."""

    method: str
    path: str
    query: dict[str, str]
    headers: Any
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body as a JSON object at most `MAX_JSON_DEPTH` deep (400 if it is not one)."""
        too_deep = ServeError(
            400,
            "validation.invalid_request",
            f"body is JSON nested more than {MAX_JSON_DEPTH} levels deep",
        )
        try:
            data = json.loads(self.body or b"{}")
        except RecursionError:  # nested past the parser's stack
            raise too_deep from None
        except ValueError as error:
            raise ServeError(
                400, "validation.invalid_request", f"body is not JSON: {error}"
            ) from None
        if not isinstance(data, dict):
            raise ServeError(
                400,
                "validation.invalid_request",
                f"body must be a JSON object ({{...}}), got {_JSON_KINDS[type(data)]}",
            )
        if json_depth(data) > MAX_JSON_DEPTH:
            raise too_deep
        return data

    def model(self, model: type[Model]) -> Model:
        """The JSON body as pytrio's request `model`, its strings at most `MAX_FIELD_CHARS`;
        400 naming the first bad field."""
        try:
            parsed = model.model_validate(self.json())
        except pydantic.ValidationError as error:
            raise ServeError(400, "validation.invalid_request", field_errors(error)) from None
        for name, value in parsed:
            if isinstance(value, str):
                check_name(name, value)
        return parsed

    def text_param(self, name: str, default: str = "") -> str:
        """Query parameter `name`, at most `MAX_FIELD_CHARS` long."""
        return check_name(f"query {name}", self.query.get(name, default))

    def int_param(self, name: str, default: int) -> int:
        """Query parameter `name` as an int in [0, `MAX_PAGE`]."""
        raw = self.query.get(name, default)
        try:
            value = int(check_name(f"query {name}", str(raw)))
        except ValueError:
            raise ServeError(
                400, "validation.invalid_request", f"query {name} must be an int, got {raw!r:.40}"
            ) from None
        if not 0 <= value <= MAX_PAGE:
            raise ServeError(
                400,
                "validation.invalid_request",
                f"query {name} must be in [0, {MAX_PAGE}], got {value}",
            )
        return value


def field_errors(error: pydantic.ValidationError) -> str:
    """A pydantic error as one line naming each bad field (``data.0.tokens: ...``)."""
    parts = [
        f"{'.'.join(str(part) for part in item['loc']) or 'body'}: {item['msg']}"
        for item in error.errors(include_url=False)[:5]
    ]
    return "; ".join(parts)[: MAX_FIELD_CHARS // 4]


@attrs.define
class Reply:
    """A reply: its status and body, sent as msgpack when `msgpack` is set."""

    status: int
    body: Any = None  # dict -> JSON (or msgpack when `msgpack`), bytes -> as is, None -> empty
    msgpack: bool = False
    content_type: str | None = None  # of a bytes body (default application/octet-stream)


def error_body(code: str, message: str, path: str) -> dict[str, Any]:
    """The body of an error reply; the Actor API (``/actor/``) nests it under ``error`` too,
    and the OpenAI-compatible API (``/v1/``) answers OpenAI's error object."""
    if path.startswith(OPENAI_PREFIX):
        return openai_error_body(code, message)
    body: dict[str, Any] = {"code": code, "message": message}
    if path.startswith("/actor/"):
        body["error"] = {"code": code, "message": message}
    return body
