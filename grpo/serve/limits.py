"""The bounds `grpo serve` holds every request to, before the local backend allocates for it.

- the body: at most ``--max-request-bytes`` (`MAX_REQUEST_BYTES`), told by a valid
  ``Content-Length`` (411 without one on a POST/PATCH, 413 above the limit, never read);
- JSON bodies: at most `MAX_JSON_DEPTH` levels of nesting;
- strings a request names things with (models, checkpoint URIs, ids, query values): at most
  `MAX_FIELD_CHARS` characters (a longer one is no name, and would reach the file system);
- one forward / forward_backward event: at most `MAX_EVENT_DATUMS` datums and
  `MAX_EVENT_TOKENS` tokens in all;
- connections: at most ``--max-connections`` (`MAX_CONNECTIONS`) served at once, each
  thread's socket reads time out after ``--request-timeout`` (`REQUEST_TIMEOUT_S`) s; past
  the cap a connection gets 503 with ``Retry-After`` (pytrio retries it); from a request's
  first byte its headers must arrive within `HEADER_TIMEOUT_S` s, else the connection is
  dropped (a client trickling its headers cannot keep a slot).

Every refusal is a 4xx (or a failed event) naming the field; none is a 5xx, which pytrio
would retry for 15 minutes.
"""

from __future__ import annotations

from typing import Any

from grpo.serve.wire import ServeError

MAX_REQUEST_BYTES = 64 * 2**20
MAX_CONNECTIONS = 128
REQUEST_TIMEOUT_S = 60.0
HEADER_TIMEOUT_S = 10.0
MAX_JSON_DEPTH = 32
MAX_FIELD_CHARS = 4096
MAX_EVENT_DATUMS = 4096
MAX_EVENT_TOKENS = 2**22
MAX_PAGE = 10_000


def body_length(method: str, headers: Any, limit: int) -> int:
    """The body's length from the headers, checked before a byte of it is read."""
    if headers.get("Transfer-Encoding"):
        raise ServeError(
            411,
            "validation.length_required",
            "chunked bodies are not accepted; send Content-Length",
        )
    declared = headers.get_all("Content-Length") or []
    if not declared:
        if method in ("POST", "PATCH"):
            raise ServeError(
                411, "validation.length_required", f"a {method} needs a Content-Length header"
            )
        return 0
    if len(set(declared)) != 1 or not declared[0].strip().isdigit():
        raise ServeError(
            400,
            "validation.invalid_request",
            f"Content-Length must be one non-negative integer, got {declared!r:.80}",
        )
    length = int(declared[0])
    if length > limit:
        raise ServeError(
            413,
            "validation.request_too_large",
            f"the body is {length} bytes; this server takes at most {limit} "
            "(grpo serve --max-request-bytes)",
        )
    return length


def json_depth(value: Any) -> int:
    """The nesting depth of a decoded JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item)
    return deepest


def check_name(field: str, value: str) -> str:
    """`value` when it is short enough to name something (400 naming `field` if not)."""
    if len(value) > MAX_FIELD_CHARS:
        raise ServeError(
            400,
            "validation.invalid_request",
            f"{field} is {len(value)} characters long; at most {MAX_FIELD_CHARS}",
        )
    return value


def check_event_size(datums: int, tokens: int) -> None:
    """Refuse a forward event over `MAX_EVENT_DATUMS` datums or `MAX_EVENT_TOKENS` tokens."""
    if datums > MAX_EVENT_DATUMS:
        raise ServeError(
            400,
            "validation.invalid_request",
            f"payload.data holds {datums} datums; at most {MAX_EVENT_DATUMS} per call",
        )
    if tokens > MAX_EVENT_TOKENS:
        raise ServeError(
            400,
            "validation.invalid_request",
            f"payload.data holds {tokens} tokens; at most {MAX_EVENT_TOKENS} per call",
        )
