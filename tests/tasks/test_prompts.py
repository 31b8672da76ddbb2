"""Prompt construction: the article's format, rendered by the tokenizer's chat template."""

import json

import pytest

from grpo.backends.local.tiny import build_tokenizer
from grpo.tasks.prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX, build_messages, build_prompt_tokens


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
    assert text.endswith(
        "What is 3 plus 4?" + QUESTION_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n"
    )


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


# --- templates and columns ------------------------------------------------------------------

from grpo.tasks.prompts import DEFAULT_TEMPLATE, PromptTemplate, read_fewshot_file  # noqa: E402
from grpo.training.rollouts.problems import build_problems  # noqa: E402
from grpo.training.settings.config import ConfigError, TrainConfig, check_user_inputs  # noqa: E402


def test_default_config_template_gives_the_articles_tokens(tokenizer):
    template = TrainConfig().prompt_template
    assert template == DEFAULT_TEMPLATE
    for fewshot in (False, True):
        assert build_prompt_tokens(
            tokenizer, "What is 3 plus 4?", fewshot=fewshot, template=template
        ) == build_prompt_tokens(tokenizer, "What is 3 plus 4?", fewshot=fewshot)


def test_system_prompt_and_suffix_change_exactly_their_part_of_the_prompt(tokenizer):
    config = TrainConfig(system_prompt="Be brief.", question_suffix=" Answer in \\boxed{}.")
    text = tokenizer.decode(
        build_prompt_tokens(
            tokenizer, "What is 3 plus 4?", fewshot=False, template=config.prompt_template
        )
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 3 plus 4? Answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_fewshot_file_replaces_the_example_and_turns_fewshot_on(tokenizer, tmp_path):
    path = tmp_path / "shots.json"
    path.write_text(
        json.dumps(
            [
                {"role": "user", "content": "2 plus 2?"},
                {"role": "assistant", "content": "\\boxed{4}"},
            ]
        )
    )
    config = TrainConfig(fewshot_file=str(path))
    assert config.use_fewshot and not TrainConfig(fewshot_file=str(path), fewshot=False).use_fewshot
    text = tokenizer.decode(
        build_prompt_tokens(
            tokenizer,
            "What is 3 plus 4?",
            fewshot=config.use_fewshot,
            template=config.prompt_template,
        )
    )
    assert text.startswith(
        "<|im_start|>user\n2 plus 2?<|im_end|>\n<|im_start|>assistant\n\\boxed{4}"
    )
    assert "strawberry" not in text and text.endswith(
        "What is 3 plus 4?" + QUESTION_SUFFIX + "<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "not found"),
        ("{", "line 1 is not valid JSON"),
        ("[]", "non-empty list"),
        ('[{"role": "robot", "content": "x"}]', "message 0 is"),
    ],
)
def test_bad_fewshot_files_are_config_errors_of_the_user_inputs_check(tmp_path, content, message):
    path = tmp_path / "shots.json"
    if content is not None:
        path.write_text(content)
    config = TrainConfig(fewshot_file=str(path))  # building one reads no file
    with pytest.raises(ConfigError, match=f"--fewshot-file .*{message}"):
        check_user_inputs(config)


def test_a_fewshot_file_may_hold_a_tool_message(tmp_path):
    path = tmp_path / "shots.json"
    path.write_text('[{"role": "user", "content": "2+2?"}, {"role": "tool", "content": "4"}]')
    assert read_fewshot_file(path) == (("user", "2+2?"), ("tool", "4"))


def test_prompt_and_answer_columns_and_gold_rule_pick_the_fields(tokenizer):
    rows = [{"problem": "What is 3 plus 4?", "solution": "it is 7", "question": "ignored"}]
    (problem,) = build_problems(
        tokenizer,
        rows,
        fewshot=False,
        max_tokens=8,
        max_len=None,
        split="train",
        columns=("problem", "solution", r"regex:is (\d+)"),
    )
    assert problem.gold == "7" and problem.row == rows[0] and problem.index == 0
    assert list(problem.prompt_tokens) == build_prompt_tokens(
        tokenizer, "What is 3 plus 4?", fewshot=False
    )
    assert PromptTemplate().question_suffix == QUESTION_SUFFIX
