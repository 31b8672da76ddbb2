"""Prompt construction: the article's format, rendered by the tokenizer's chat template."""

import pytest

from grpo.backends.tiny import build_tokenizer
from grpo.prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX, build_messages, build_prompt_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def test_question_suffix_is_the_articles_instruction():
    assert QUESTION_SUFFIX == " Provide a numerical answer without units, written inside \\boxed{}."


def test_fewshot_prefix_is_one_user_assistant_exchange_ending_in_a_boxed_answer():
    assert [message["role"] for message in FEWSHOT_PREFIX] == ["user", "assistant"]
    assert FEWSHOT_PREFIX[0]["content"].endswith(QUESTION_SUFFIX)
    assert "strawberry" in FEWSHOT_PREFIX[0]["content"]
    assert FEWSHOT_PREFIX[1]["content"].endswith("\\boxed{3}")


def test_prompt_without_fewshot_is_the_user_turn_then_the_assistant_header(tokenizer):
    tokens = build_prompt_tokens(tokenizer, "What is 3 plus 4?", fewshot=False)
    assert tokenizer.decode(tokens) == (
        "<|im_start|>user\nWhat is 3 plus 4?" + QUESTION_SUFFIX + "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_prompt_with_fewshot_puts_the_example_exchange_before_the_question(tokenizer):
    text = tokenizer.decode(build_prompt_tokens(tokenizer, "What is 3 plus 4?", fewshot=True))
    example_answer = FEWSHOT_PREFIX[1]["content"]
    assert text.startswith("<|im_start|>user\nHow many times does the letter r appear")
    assert text.index(example_answer) < text.index("What is 3 plus 4?")
    assert text.endswith("What is 3 plus 4?" + QUESTION_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n")


def test_prompt_is_encoded_without_added_special_tokens(tokenizer):
    question = "Take 6 away from 11."
    text = tokenizer.apply_chat_template(
        build_messages(question, fewshot=False),
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    assert build_prompt_tokens(tokenizer, question, fewshot=False) == tokenizer.encode(
        text, add_special_tokens=False
    )


def test_build_messages_does_not_share_the_fewshot_dicts():
    messages = build_messages("What is 1 plus 1?", fewshot=True)
    messages[0]["content"] = "changed"
    assert FEWSHOT_PREFIX[0]["content"] != "changed"


@pytest.mark.parametrize("question", ["", "   \n"])
def test_empty_question_is_rejected_with_the_field_name(tokenizer, question):
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        build_prompt_tokens(tokenizer, question, fewshot=False)


def test_a_template_that_renders_nothing_is_rejected():
    class EmptyTemplateTokenizer:
        def apply_chat_template(self, messages, **kwargs):
            return ""

        def encode(self, text, add_special_tokens):
            return []

    with pytest.raises(ValueError, match="encoded to zero tokens"):
        build_prompt_tokens(EmptyTemplateTokenizer(), "What is 1 plus 1?", fewshot=False)
