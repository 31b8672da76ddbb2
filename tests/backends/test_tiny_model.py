"""The built-in tiny model: tokenizer, chat template, context, shipped files, warm start."""

import ast
import hashlib
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytrio.types import ModelInput, SamplingParams
from safetensors.torch import load_file
from tokenizers import Tokenizer

from grpo.backends.local.sampler.validation import validate_sample_request
from grpo.backends.local.tiny import (
    MAX_POSITIONS,
    TINY_MODEL_DIR,
    VOCAB_SIZE,
    build_tokenizer,
    init_tiny_model,
    load_tiny_model,
    train_tokenizer,
)
from grpo.tasks.data import load_problems
from grpo.tasks.prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX, build_prompt_tokens
from grpo.tools import warm_start

WEIGHTS = TINY_MODEL_DIR / "model.safetensors"
BACKENDS = Path(warm_start.__file__).parents[1] / "backends"

# A long GSM8K-style question (ours), about the length of GSM8K's longest.
LONG_QUESTION = (
    "A school is planning a trip for its 3 classes. The first class has 24 students, the second "
    "class has 6 fewer students than the first, and the third class has twice as many students "
    "as the second. Each bus holds 20 students and costs $150 to rent for the day, and every "
    "student also pays $4 for lunch. Teachers ride for free, but the school must bring 1 "
    "teacher for every 10 students, rounded up, and each teacher needs a seat. How many buses "
    "must the school rent, and how much does the whole trip cost the school if it pays for the "
    "buses while the students pay for their own lunches?"
)

# Arbitrary text plus the characters a character tokenizer lost: newline runs, tabs, |, ~,
# backticks, emoji, CJK.
TRICKY = st.sampled_from(
    ["\n", "\n\n", "\n\n\n", "\t", "\r\n", " ", "  ", "|", "~", "`", "😀", "中文", "é"]
    + [" .", " ,", " ?", " !", " n't", " 's", " 're"]  # what decoding's space clean-up rewrites
)
TEXTS = st.lists(st.one_of(st.text(max_size=12), TRICKY), max_size=12).map("".join)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def problems():
    rows = [
        load_problems(source, split)
        for source in warm_start.DATASETS
        for split in ("train", "test")
    ]
    return [q for r in rows for q in r["question"]], [a for r in rows for a in r["answer"]]


@pytest.fixture(scope="module")
def shipped():
    return load_tiny_model()


@settings(max_examples=300, deadline=None)
@given(text=TEXTS)
def test_every_utf8_string_round_trips_through_encode_and_decode(tokenizer, text):
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(tokens, skip_special_tokens=False) == text
    assert tokenizer.decode(tokens, skip_special_tokens=True) == text


def test_newline_runs_and_think_blocks_survive_decoding_without_special_tokens(tokenizer):
    text = "<think>\n\n</think>\n\na\n\n\tb |~` 😀 中文"
    assert (
        tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
        == text
    )


def test_problems_and_completions_round_trip_in_fewer_tokens_than_characters(tokenizer, problems):
    questions, answers = problems
    texts = [*questions, *answers, *map(warm_start.reference_completion, answers)]
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert [tokenizer.decode(tokens) for tokens in encoded] == texts
    assert sum(map(len, encoded)) < 0.7 * sum(map(len, texts))  # characters: 1.0


def test_vocabulary_is_small_with_the_specials_first(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    ]
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.padding_side) == (
        0,
        2,
        "left",
    )


def test_tokenizer_training_is_deterministic_and_reproduces_the_shipped_tokenizer():
    corpus = warm_start.tokenizer_corpus(warm_start.warm_start_conversations())
    first = train_tokenizer(corpus).backend_tokenizer.to_str()
    assert train_tokenizer(corpus).backend_tokenizer.to_str() == first
    shipped = Tokenizer.from_file(str(TINY_MODEL_DIR / "tokenizer.json")).to_str()
    assert first == shipped


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


def test_builtin_prompts_are_a_few_dozen_tokens(tokenizer, problems):
    lengths = [len(build_prompt_tokens(tokenizer, q, fewshot=False)) for q in problems[0]]
    assert 25 <= min(lengths) and max(lengths) <= 100


def test_articles_fewshot_prompt_with_a_long_question_and_512_new_tokens_fits(tokenizer, shipped):
    # The article's style: a worked exchange whose answer opens with an empty think block.
    prefix = [
        FEWSHOT_PREFIX[0],
        {**FEWSHOT_PREFIX[1], "content": warm_start.EMPTY_THINK + FEWSHOT_PREFIX[1]["content"]},
    ]
    messages = [*prefix, {"role": "user", "content": LONG_QUESTION + QUESTION_SUFFIX}]
    prompt = warm_start.prompt_tokens(tokenizer, messages)
    assert (
        150 <= len(prompt)
        and len(prompt) + 512 <= MAX_POSITIONS <= shipped[0].config.max_position_embeddings
    )
    validate_sample_request(
        ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=SamplingParams(max_tokens=512),
        include_prompt_logprobs=False,
        topk_prompt_logprobs=0,
        return_text=True,
        vocab_size=len(tokenizer),
        max_positions=shipped[0].config.max_position_embeddings,
        draw_seed=lambda: 0,
    )


def test_shipped_files_load_offline_in_fp32_eval_mode(shipped, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_tiny_model()
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert (
        model.config.vocab_size == len(tokenizer)
        and model.config.max_position_embeddings == MAX_POSITIONS
    )
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert sum(p.numel() for p in model.parameters()) < 1_200_000
    state = model.state_dict()
    for name, tensor in load_file(WEIGHTS).items():
        assert torch.equal(state[name], tensor), name


def test_shipped_sha256s_match_the_manifest():
    manifest = (TINY_MODEL_DIR / "MANIFEST.md").read_text()
    for name in ("model.safetensors", "tokenizer.json"):
        recorded = re.search(rf"{re.escape(name)} sha256: `([0-9a-f]{{64}})`", manifest).group(1)
        assert hashlib.sha256((TINY_MODEL_DIR / name).read_bytes()).hexdigest() == recorded, name


def test_shipped_model_greedy_accuracy_is_in_the_warm_start_band(shipped):
    model, tokenizer = shipped
    test = load_problems("arithmetic", "test", limit=50)
    assert 0.15 <= warm_start.solve_rate(model, tokenizer, test, temperature=0.0) <= 0.8


def test_backends_import_neither_prompts_nor_data():
    for path in BACKENDS.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        imported |= {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        }
        assert not imported & {
            "grpo.tasks.prompts",
            "grpo.tasks.data",
            "grpo.tools.warm_start",
        }, path.name


def test_warm_start_is_bit_for_bit_reproducible_and_changes_the_weights(tokenizer):
    examples = warm_start.encode_examples(tokenizer, warm_start.warm_start_conversations()[:8])

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


def test_sub_batches_give_the_whole_batch_mean_loss_and_gradient(tokenizer):
    examples = warm_start.encode_examples(tokenizer, warm_start.warm_start_conversations()[:6])
    model, _ = init_tiny_model(seed=0)
    input_ids_BT, attention_mask_BT, labels_BT = warm_start.collate(
        examples, tokenizer.pad_token_id
    )
    whole = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=labels_BT).loss
    whole.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    parts = warm_start.sub_batches(examples, rows=4)
    assert [len(part) for part in parts] == [4, 2]
    tokens = sum(len(completion) for _, completion in examples)
    total = 0.0
    for part in parts:
        ids, mask, labels = warm_start.collate(part, tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = (
            torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
            )
            / tokens
        )
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(whole.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-7)


def test_warm_start_restores_thread_and_determinism_settings(tokenizer):
    examples = warm_start.encode_examples(tokenizer, warm_start.warm_start_conversations()[:2])
    model, _ = init_tiny_model(seed=1)
    before = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    warm_start.train_warm_start(model, examples, steps=1, pad_token_id=0, batch_size=2)
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == before


def test_reference_completion_is_one_compact_equation_per_step_then_the_boxed_result():
    assert warm_start.reference_completion("4 + 18 = 22\n#### 22") == "4+18=22. \\boxed{22}"
    assert (
        warm_start.reference_completion("9 - 5 = 4\n4 + 3 = 7\n#### 7")
        == "9-5=4. 4+3=7. \\boxed{7}"
    )
    with pytest.raises(ValueError, match="not a built-in answer"):
        warm_start.reference_completion("Natalia sold 48 clips.\n#### 72")


def test_warm_start_covers_both_datasets_in_both_prompt_styles():
    conversations = warm_start.warm_start_conversations()
    sizes = sum(len(load_problems(source, "train")) for source in warm_start.DATASETS)
    assert len(conversations) == 2 * sizes
    plain = [messages for messages, _ in conversations if len(messages) == 1]
    fewshot = [messages for messages, _ in conversations if len(messages) == 3]
    assert len(plain) == len(fewshot) == sizes
    assert all(m[-1]["content"].endswith(QUESTION_SUFFIX) for m in plain + fewshot)
    assert [m["role"] for m in fewshot[0]] == ["user", "assistant", "user"]
    openings = {m[1]["content"].startswith(warm_start.EMPTY_THINK) for m in fewshot}
    assert openings == {True, False}
    assert any(m[:2] == list(FEWSHOT_PREFIX) for m in fewshot)


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
