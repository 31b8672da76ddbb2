"""The built-in tiny model: tokenizer, chat template, shipped weights, reproducible warm start."""

import hashlib
import re

import pytest
import torch
from safetensors.torch import load_file

from grpo.backends import warm_start
from grpo.backends.tiny import TINY_MODEL_DIR, build_tokenizer, init_tiny_model, load_tiny_model
from grpo.data import load_problems
from grpo.prompts import build_prompt_tokens

WEIGHTS = TINY_MODEL_DIR / "model.safetensors"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def problems():
    train, test = load_problems("arithmetic", "train"), load_problems("arithmetic", "test")
    return [*train["question"], *test["question"]], [*train["answer"], *test["answer"]]


@pytest.fixture(scope="module")
def shipped():
    return load_tiny_model()


def test_tokenizer_round_trips_every_problem_and_completion_without_unknown_tokens(tokenizer, problems):
    questions, answers = problems
    texts = questions + answers + [warm_start.reference_completion(answer) for answer in answers]
    for text in texts:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.unk_token_id not in tokens, text
        assert len(tokens) == len(text)
        assert tokenizer.decode(tokens) == text


def test_chat_template_renders_qwen_style_turns(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "\\boxed{2}"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n\\boxed{2}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_builtin_prompts_stay_short(tokenizer, problems):
    lengths = [len(build_prompt_tokens(tokenizer, q, fewshot=False)) for q in problems[0]]
    assert 95 <= min(lengths) and max(lengths) <= 125


def test_shipped_weights_load_offline_in_fp32_eval_mode(shipped, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_tiny_model()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    state = model.state_dict()
    for name, tensor in load_file(WEIGHTS).items():
        assert torch.equal(state[name], tensor), name


def test_shipped_sha256_matches_the_manifest():
    manifest = (TINY_MODEL_DIR / "MANIFEST.md").read_text()
    recorded = re.search(r"model\.safetensors sha256: `([0-9a-f]{64})`", manifest).group(1)
    assert hashlib.sha256(WEIGHTS.read_bytes()).hexdigest() == recorded


def test_shipped_model_greedy_accuracy_is_in_the_warm_start_band(shipped):
    model, tokenizer = shipped
    test = load_problems("arithmetic", "test", limit=50)
    assert 0.15 <= warm_start.solve_rate(model, tokenizer, test, temperature=0.0) <= 0.7


def test_warm_start_is_bit_for_bit_reproducible_and_changes_the_weights(tokenizer, problems):
    examples = warm_start.encode_examples(tokenizer, load_problems("arithmetic", "train", limit=8))

    def three_steps():
        model, _ = init_tiny_model(seed=0)
        losses = warm_start.train_warm_start(
            model, examples, steps=3, pad_token_id=tokenizer.pad_token_id, batch_size=4
        )
        return losses, model.state_dict()

    initial = init_tiny_model(seed=0)[0].state_dict()
    losses, state = three_steps()
    losses_again, state_again = three_steps()
    assert losses == losses_again
    assert all(torch.equal(state[name], state_again[name]) for name in state)
    assert not torch.equal(state["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])


def test_warm_start_restores_thread_and_determinism_settings(tokenizer):
    examples = warm_start.encode_examples(tokenizer, load_problems("arithmetic", "train", limit=2))
    model, _ = init_tiny_model(seed=1)
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    warm_start.train_warm_start(model, examples, steps=1, pad_token_id=0, batch_size=2)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_reference_completion_is_the_compact_equation_then_the_boxed_result():
    assert warm_start.reference_completion("4 + 18 = 22\n#### 22") == "4+18=22. \\boxed{22}"
    assert warm_start.reference_completion("9 - 5 = 4\n#### 4") == "9-5=4. \\boxed{4}"
    with pytest.raises(ValueError, match="not a built-in arithmetic answer"):
        warm_start.reference_completion("Natalia sold 48 clips.\n#### 72")


def test_collate_supervises_exactly_the_completion_tokens():
    input_ids_BT, attention_mask_BT, labels_BT = warm_start.collate(
        [([5, 6, 7], [8, 2]), ([5], [9, 9, 2])], pad_token_id=0
    )
    assert input_ids_BT.tolist() == [[5, 6, 7, 8, 2], [5, 9, 9, 2, 0]]
    assert attention_mask_BT.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert labels_BT.tolist() == [[-100, -100, -100, 8, 2], [-100, 9, 9, 2, -100]]


def test_batch_order_visits_every_example_once_per_epoch_and_is_seeded():
    order = warm_start.batch_order(10, steps=5, batch_size=4, seed=0)
    stream = [index for batch in order for index in batch]
    assert [len(batch) for batch in order] == [4] * 5
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert order == warm_start.batch_order(10, steps=5, batch_size=4, seed=0)
    assert order != warm_start.batch_order(10, steps=5, batch_size=4, seed=1)
    assert warm_start.batch_order(10, steps=3, batch_size=4, seed=0) == order[:3]


def test_sampled_completions_stop_before_the_end_of_turn_follow_the_seed_and_the_format(shipped):
    model, tokenizer = shipped
    prompts = [build_prompt_tokens(tokenizer, "What is 3 plus 4?", fewshot=False)] * 4
    first = warm_start.sample_completions(model, tokenizer, prompts, temperature=1.0, seed=7)
    again = warm_start.sample_completions(model, tokenizer, prompts, temperature=1.0, seed=7)
    greedy = warm_start.sample_completions(model, tokenizer, prompts[:1], temperature=0.0, seed=0)
    assert first == again
    assert all("<|im_end|>" not in text and "<|endoftext|>" not in text for text in first)
    assert re.fullmatch(r"3\+4=\d+\. \\boxed\{\d+\}", greedy[0])
    with pytest.raises(ValueError, match="temperature=-1"):
        warm_start.sample_completions(model, tokenizer, prompts, temperature=-1, seed=0)
