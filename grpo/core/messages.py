"""The one check of chat messages: a list of ``{"role", "content"}`` with a known role.

Environments (`grpo/envs/base.py`), SFT data (`grpo/training/recipes/sft/data.py`) and few-shot
files (`grpo/tasks/prompts.py`) all check their messages here; each keeps its own exception type
and its own extra rules (SFT needs an assistant turn, a few-shot file a non-empty list).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

__all__ = ["ROLES", "check_messages"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have (a prompt template with a tool message is legitimate)."""

_SHOWN = 80  # characters of a bad message the error repeats


def check_messages(
    messages: Sequence[object],
    where: str,
    error: Callable[[str], Exception] = ValueError,
) -> tuple[dict[str, str], ...]:
    """``messages`` as {"role", "content"} dicts; ``error`` naming ``where``, index and fix."""
    checked = []
    for index, message in enumerate(messages):
        if (
            not isinstance(message, Mapping)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            shown = repr(message)
            if len(shown) > _SHOWN:
                shown = shown[: _SHOWN - 3] + "..."
            raise error(
                f"{where}, message {index} is {shown}; each message is "
                f'{{"role": one of {", ".join(ROLES)}, "content": text}}'
            )
        checked.append({"role": str(message["role"]), "content": str(message["content"])})
    return tuple(checked)
