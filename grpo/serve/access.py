"""Who may call `grpo serve`: the API key check and the per-checkpoint download tokens.

Secrets are compared with `hmac.compare_digest` (constant time), so a caller learns nothing
from how long a wrong key takes to refuse. A download URL carries a token that opens one
checkpoint's archive until the ``expires_at`` the URL states (`DOWNLOAD_LIFETIME`); pytrio
asks for a fresh URL on a 403 or shortly before that time.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from datetime import UTC, datetime, timedelta

from grpo.serve.wire import ServeError

DOWNLOAD_LIFETIME = timedelta(minutes=15)
_DOWNLOAD_TOKENS_KEPT = 1024  # live tokens kept, oldest dropped first


def checked_api_key(key: str | None) -> str | None:
    """`key` itself, or None for none given; an empty or whitespace key is a ValueError.

    ``--api-key "$KEY"`` with KEY unset gives an empty key: that must not turn the check off.
    """
    if key is None:
        return None
    if not key.strip():
        raise ValueError(
            "--api-key is empty or whitespace (an unset $VARIABLE?); give a real key, or "
            "leave --api-key out to accept any key on loopback"
        )
    return key


def same_secret(given: str | None, expected: str) -> bool:
    """Whether `given` equals `expected`, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class DownloadTokens:
    """Download tokens, each opening one checkpoint until its expiry (thread-safe)."""

    def __init__(self, lifetime: timedelta = DOWNLOAD_LIFETIME) -> None:
        self.lifetime = lifetime
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, datetime]] = {}  # token -> (checkpoint, expires)

    def issue(self, checkpoint: str) -> tuple[str, datetime]:
        """A new unguessable token for `checkpoint` and the time it expires."""
        token, now = secrets.token_urlsafe(32), datetime.now(UTC)
        with self._lock:
            for old in [t for t, (_c, expires) in self._tokens.items() if expires <= now]:
                del self._tokens[old]
            while len(self._tokens) >= _DOWNLOAD_TOKENS_KEPT:
                del self._tokens[next(iter(self._tokens))]
            self._tokens[token] = (checkpoint, now + self.lifetime)
            return token, now + self.lifetime

    def check(self, checkpoint: str, token: str | None) -> None:
        """Nothing if `token` opens `checkpoint` now; else a 403 saying why."""
        with self._lock:
            live = [(t, c, e) for t, (c, e) in self._tokens.items() if c == checkpoint]
        found = [expires for t, _c, expires in live if same_secret(token, t)]
        if not found:
            raise ServeError(
                403,
                "forbidden",
                f"the download token is missing, wrong, or not for checkpoint {checkpoint!r}; "
                "ask for a download URL of this checkpoint (get_checkpoint_download_url)",
            )
        if found[0] <= datetime.now(UTC):
            raise ServeError(
                403,
                "download.url_expired",
                f"this download URL expired at {found[0].isoformat()}; "
                "ask for a new one (get_checkpoint_download_url)",
            )
