"""The seed article's GRPO step, as its demo scripts run it, on the built-in model.

Few-shot prompt through the chat template (thinking off), a group of samples per question
with end-of-turn stop strings, boxed-answer grading, reward - group mean as advantage,
datums built by hand, forward_backward with the built-in importance-sampling loss, then
an Adam step: groups must not all be degenerate and the loss must be finite.
"""

import math

import numpy as np
import pytest
from pytrio.types import AdamParams, Datum, ModelInput, SamplingParams

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.core.rewards import grade, gsm8k_gold
from grpo.tasks.data import load_problems
from grpo.tasks.prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX
from grpo.tools.warm_start import EMPTY_THINK

GROUP_SIZE = 8
QUESTIONS = 6

# The article's prefix style: its worked answer opens with an empty think block.
ARTICLE_STYLE_PREFIX = [
    FEWSHOT_PREFIX[0],
    {**FEWSHOT_PREFIX[1], "content": EMPTY_THINK + FEWSHOT_PREFIX[1]["content"]},
]


def build_prompt(tokenizer, question: str) -> list[int]:
    messages = [*ARTICLE_STYLE_PREFIX, {"role": "user", "content": question + QUESTION_SUFFIX}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def build_datum(
    prompt: list[int], tokens: list[int], logprobs: list[float], advantage: float
) -> Datum:
    observed = len(prompt) - 1
    return Datum(
        model_input=ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray([0] * observed + tokens, dtype=np.int64),
            "logprobs": np.asarray([0.0] * observed + logprobs, dtype=np.float32),
            "advantages": np.asarray(
                [0.0] * observed + [advantage] * len(tokens), dtype=np.float32
            ),
        },
    )


@pytest.mark.slow
@pytest.mark.parametrize("source", ["wordproblems", "arithmetic"])
def test_article_step_has_non_degenerate_groups_and_a_finite_loss(tmp_path, source):
    with LocalServiceClient(root=tmp_path, seed=0) as service:
        assert service.get_supported_models()[0] == TINY_MODEL_NAME
        trainer = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=32, seed=0)
        tokenizer = trainer.get_tokenizer()
        params = SamplingParams(
            max_tokens=512,
            temperature=1.0,
            top_p=1.0,
            stop=[tokenizer.eos_token, "<|im_end|>"],
            seed=0,
        )
        sampler = trainer.save_weights_and_get_sampling_client()
        datums, degenerate = [], 0
        for row in load_problems(source, "train", limit=QUESTIONS):
            prompt = build_prompt(tokenizer, row["question"])
            result = sampler.sample(
                prompt=ModelInput.from_ints(prompt),
                num_samples=GROUP_SIZE,
                sampling_params=params,
                return_text=True,
            ).result()
            rewards = [
                grade(sequence.text, gsm8k_gold(row["answer"])) for sequence in result.sequences
            ]
            mean = sum(rewards) / len(rewards)
            if all(reward == mean for reward in rewards):
                degenerate += 1
                continue
            for sequence, reward in zip(result.sequences, rewards, strict=True):
                assert sequence.stop_reason == "stop"  # every completion ends its turn
                datums.append(
                    build_datum(prompt, sequence.tokens, sequence.logprobs, reward - mean)
                )
        assert degenerate < QUESTIONS and datums
        output = trainer.forward_backward(datums, loss_fn="importance_sampling").result()
        trainer.optim_step(AdamParams(learning_rate=4e-5, beta1=0.9, beta2=0.95)).result()
        assert math.isfinite(output.metrics["loss_sum"])
        assert all(np.isfinite(out["logprobs"].data).all() for out in output.loss_fn_outputs)
