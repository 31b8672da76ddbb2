"""The one chat-message check: known roles, text content, errors naming where, index and fix."""

from __future__ import annotations

import pytest

from grpo.core.messages import ROLES, check_messages


def test_every_role_is_accepted_and_entries_come_back_as_plain_dicts():
    messages = [{"role": role, "content": role, "extra": 1} for role in ROLES]
    assert check_messages(messages, "x") == tuple({"role": role, "content": role} for role in ROLES)
    assert ROLES == ("system", "user", "assistant", "tool")


@pytest.mark.parametrize(
    "message", [{"role": "robot", "content": "x"}, {"role": "user"}, "user: hi", None]
)
def test_a_bad_message_raises_the_callers_error_naming_where_and_index(message):
    class Mine(Exception):
        pass

    with pytest.raises(Mine, match=r"^here, message 1 is .*; each message is \{\"role\": one of"):
        check_messages([{"role": "user", "content": "ok"}, message], "here", Mine)


def test_a_long_bad_message_is_shortened_in_the_error():
    with pytest.raises(ValueError) as error:
        check_messages([{"role": "bot", "content": "x" * 500}], "here")
    assert "x" * 100 not in str(error.value) and "..." in str(error.value)
