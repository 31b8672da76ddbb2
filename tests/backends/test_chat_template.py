"""The built-in chat template follows Qwen3's for turns and tools (docs/FORMULAS.md, "Chat
template"), and renders plain conversations exactly as the template the shipped models were
trained with."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from grpo.backends.local.tiny import build_tokenizer

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}

# Qwen3's rendering (its tokenizer_config.json chat_template, e.g. Qwen/Qwen3-8B), written out
# by hand: the system turn with the tool signatures, one JSON object a line.
QWEN3_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "{tools}"
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def qwen3_system(system: str | None, tools: list[dict]) -> str:
    """Qwen3's first turn when tools are given."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    head = f"{system}\n\n" if system is not None else ""
    return "<|im_start|>system\n" + head + QWEN3_TOOLS_HEADER.replace("{tools}", lines)


def qwen3_call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


TOKENIZER = build_tokenizer()


@pytest.fixture
def tokenizer():
    return TOKENIZER


def render(tokenizer, messages, tools=None, **kwargs) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )


def test_a_multi_turn_tool_episode_renders_as_qwen3_does(tokenizer):
    """system + tools, a call answered by the tool, a second call with text before it, two
    answers in one user turn, then the generation prompt (the episode's shape)."""
    messages = [
        {"role": "system", "content": "Put the final answer in \\boxed{}."},
        {"role": "user", "content": "Tom has 9 apples and buys 4. How many?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "calculator", "arguments": {"expression": "9 + 4"}},
                }
            ],
        },
        {"role": "tool", "content": "13"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"function": {"name": "calculator", "arguments": '{"expression": "13 - 0"}'}},
                {"name": "lookup", "arguments": {"key": "tom"}},
            ],
        },
        {"role": "tool", "content": "13"},
        {"role": "tool", "content": "error: unknown key"},
    ]
    expected = (
        qwen3_system("Put the final answer in \\boxed{}.", [CALCULATOR, LOOKUP])
        + "<|im_start|>user\nTom has 9 apples and buys 4. How many?<|im_end|>\n"
        + "<|im_start|>assistant\n"
        + qwen3_call("calculator", '{"expression": "9 + 4"}')
        + "<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n13\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\nChecking.\n"
        + qwen3_call("calculator", '{"expression": "13 - 0"}')
        + "\n"
        + qwen3_call("lookup", '{"key": "tom"}')
        + "<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n13\n</tool_response>\n"
        + "<tool_response>\nerror: unknown key\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, [CALCULATOR, LOOKUP]) == expected
    # enable_thinking is accepted either way (the built-in models have no thinking mode)
    assert render(tokenizer, messages, [CALCULATOR, LOOKUP], enable_thinking=False) == expected
    assert render(tokenizer, messages, [CALCULATOR, LOOKUP], enable_thinking=True) == expected


def test_tools_without_a_system_message_open_their_own_system_turn(tokenizer):
    messages = [{"role": "user", "content": "2 + 2?"}]
    assert render(tokenizer, messages, [CALCULATOR]) == (
        qwen3_system(None, [CALCULATOR])
        + "<|im_start|>user\n2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_tool_message_is_a_user_turn_even_without_tools(tokenizer):
    messages = [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
        {"role": "tool", "content": "4"},
    ]
    assert render(tokenizer, messages) == (
        "<|im_start|>user\n2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>{}</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_the_assistant_mask_covers_content_tool_calls_and_end_of_turn(tokenizer):
    messages = [
        {"role": "user", "content": "2 + 2?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "calculator", "arguments": {"expression": "2 + 2"}}],
        },
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "\\boxed{4}"},
    ]
    out = tokenizer.apply_chat_template(
        messages,
        tools=[CALCULATOR],
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    trained = [token for token, keep in zip(out["input_ids"], out["assistant_masks"]) if keep]
    assert tokenizer.decode(trained) == (
        qwen3_call("calculator", '{"expression": "2 + 2"}') + "<|im_end|>\\boxed{4}<|im_end|>"
    )


# The template the shipped models were trained with, before tools (PLAIN must not change).
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TEXT = st.text(st.sampled_from("ab 1+\n{}<>|\\'\"_é"), max_size=12)


@given(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": _TEXT}
        ),
        min_size=1,
        max_size=5,
    ),
    st.booleans(),
)
def test_plain_conversations_render_as_the_shipped_models_were_trained(messages, generation):
    tokenizer = TOKENIZER
    kwargs = dict(tokenize=False, add_generation_prompt=generation, enable_thinking=False)
    assert tokenizer.apply_chat_template(messages, **kwargs) == tokenizer.apply_chat_template(
        messages, chat_template=PLAIN_TEMPLATE, **kwargs
    )
