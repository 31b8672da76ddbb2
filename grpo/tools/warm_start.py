"""The supervised warm start of the built-in tiny model, and the sampler that measures it.

``scripts/make_tiny_model.py`` is the command line over this module (a developer tool, not a
run's). It lives outside ``grpo/backends/`` because it composes prompts (``grpo.tasks.prompts``)
and problems (``grpo.tasks.data``); the backend's ``tiny.py`` only receives the tokenizer corpus
it trains on.

The recipe: teacher-forced cross-entropy on reference completions (``a+b=c. \\boxed{c}``,
one equation per step for word problems) of the built-in arithmetic and word-problem
TRAIN problems, each given in two prompt styles: the project's own prompt (question +
suffix) and the few-shot style of the seed article (one worked exchange, then the
question + suffix). The worked exchange is drawn from a pool: the project's
``FEWSHOT_PREFIX``, letter-counting exchanges in several phrasings (with and without an
empty ``<think>`` block), and worked train problems. Adam(lr 2e-3, betas (0.9, 0.98)),
linear warm-up over 50 steps then a constant rate, gradient norm clipped to 1.0, batches
of 64 drawn in a seeded order. Stopping early leaves the model partly right, so GRPO has
something to improve.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Sequence

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.core.rewards import grade, gsm8k_gold
from grpo.tasks.data import load_problems
from grpo.tasks.prompts import FEWSHOT_PREFIX, QUESTION_SUFFIX

WARM_START_SEED = 0
WARM_START_STEPS = 400
BATCH_SIZE = 64
LEARNING_RATE = 2e-3
ADAM_BETAS = (0.9, 0.98)
WARMUP_STEPS = 50
MAX_GRAD_NORM = 1.0
MAX_NEW_TOKENS = 24
IGNORED_LABEL = -100
# A batch is cut into sub-batches of this many rows after sorting by length, so short
# prompts are not padded to the few-shot ones; gradients accumulate, the loss stays the
# mean over all completion tokens of the batch.
SUB_BATCH_ROWS = 16
DATASETS = ("arithmetic", "wordproblems")
EMPTY_THINK = "<think>\n\n</think>\n\n"

Message = dict[str, str]

# Letter-counting exchanges in the article's few-shot style (words and phrasings are ours).
LETTER_WORDS = (
    ("banana", "a"),
    ("balloon", "l"),
    ("committee", "t"),
    ("coffee", "e"),
    ("pepper", "p"),
    ("mississippi", "s"),
    ("bookkeeper", "o"),
    ("tomorrow", "o"),
    ("cherry", "r"),
    ("letter", "t"),
    ("parallel", "l"),
    ("assessment", "s"),
)
LETTER_QUESTIONS = (
    "How many times does the letter {letter} appear in {word}?",
    "How many {letter}'s are in {word}?",
    "Count the letter {letter} in the word {word}.",
)
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six")


def reference_completion(answer: str) -> str:
    """`a+b=c. \\boxed{c}` (one compact equation per answer line) from a built-in answer."""
    *lines, gold_line = answer.split("\n")
    if not lines or not gold_line.startswith("#### ") or any("=" not in line for line in lines):
        raise ValueError(
            f"answer {answer!r} is not a built-in answer (equation lines, then '#### N'); "
            "the warm start trains on load_problems('arithmetic' or 'wordproblems') rows only"
        )
    steps = " ".join(f"{line.replace(' ', '')}." for line in lines)
    return f"{steps} \\boxed{{{gold_line[len('#### ') :]}}}"


def letter_exchange(rng: random.Random) -> tuple[Message, Message]:
    """A worked letter-counting exchange: spell the word, list the positions, box the count."""
    word, letter = rng.choice(LETTER_WORDS)
    question = rng.choice(LETTER_QUESTIONS).format(letter=letter, word=word)
    positions = [str(index + 1) for index, char in enumerate(word) if char == letter]
    if rng.random() < 0.5:
        spelled = ", ".join(f"{char} ({index + 1})" for index, char in enumerate(word))
        opening = "Spelling the word one letter at a time: "
    else:
        spelled = " ".join(f"{index + 1}) {char}" for index, char in enumerate(word))
        opening = "Numbering every letter of the word: "
    listed = (
        ", ".join(positions[:-1]) + f" and {positions[-1]}" if len(positions) > 1 else positions[0]
    )
    reasoning = (
        f"{opening}{spelled}. The letter {letter} is at positions {listed}, "
        f"so it appears {NUMBER_WORDS[len(positions)]} times. \\boxed{{{len(positions)}}}"
    )
    think = EMPTY_THINK if rng.random() < 0.5 else ""
    return (
        {"role": "user", "content": question + QUESTION_SUFFIX},
        {"role": "assistant", "content": think + reasoning},
    )


def worked_exchange(rng: random.Random, problems: datasets.Dataset) -> tuple[Message, Message]:
    """A worked exchange on a random train problem: its question and reference completion."""
    row = problems[rng.randrange(len(problems))]
    think = EMPTY_THINK if rng.random() < 0.5 else ""
    return (
        {"role": "user", "content": row["question"] + QUESTION_SUFFIX},
        {"role": "assistant", "content": think + reference_completion(row["answer"])},
    )


def fewshot_prefix(rng: random.Random, problems: datasets.Dataset) -> list[Message]:
    """One worked exchange from the pool: FEWSHOT_PREFIX, a letter count or a train problem."""
    kind = rng.randrange(3)
    if kind == 0:
        return [dict(message) for message in FEWSHOT_PREFIX]
    if kind == 1:
        return list(letter_exchange(rng))
    return list(worked_exchange(rng, problems))


def warm_start_conversations(seed: int = WARM_START_SEED) -> list[tuple[list[Message], str]]:
    """(prompt messages, reference completion) for every train problem, in both prompt styles."""
    # The seed label keeps the module's old name: it fixes the conversations, not a location.
    rng = random.Random(f"grpo.warm_start/{seed}")
    conversations = []
    for source in DATASETS:
        problems = load_problems(source, "train")
        for question, answer in zip(problems["question"], problems["answer"]):
            user = {"role": "user", "content": question + QUESTION_SUFFIX}
            completion = reference_completion(answer)
            conversations.append(([user], completion))
            conversations.append(([*fewshot_prefix(rng, problems), user], completion))
    return conversations


def tokenizer_corpus(conversations: Sequence[tuple[list[Message], str]]) -> list[str]:
    """The texts the built-in BPE is trained on: each turn as the chat template lays it out."""
    texts = []
    for messages, completion in conversations:
        turns = [*messages, {"role": "assistant", "content": completion}]
        texts.extend(f"{turn['role']}\n{turn['content']}" for turn in turns)
    return texts


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """chat_template(messages, add_generation_prompt=True, enable_thinking=False), encoded."""
    text = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, conversations: Sequence[tuple[list[Message], str]]
) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, completion tokens ending in end-of-turn) for each conversation."""
    examples = []
    for messages, completion in conversations:
        completion_tokens = tokenizer.encode(completion, add_special_tokens=False)
        examples.append(
            (prompt_tokens(tokenizer, messages), [*completion_tokens, tokenizer.eos_token_id])
        )
    return examples


def collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids_BT, attention_mask_BT, labels_BT); labels: completion tokens only.

    Right padding keeps each sequence's positions at 0..len-1 without explicit position ids.
    """
    length = max(len(prompt) + len(completion) for prompt, completion in examples)
    input_ids_BT = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(examples), length), dtype=torch.long)
    labels_BT = torch.full((len(examples), length), IGNORED_LABEL, dtype=torch.long)
    for row, (prompt, completion) in enumerate(examples):
        total = len(prompt) + len(completion)
        input_ids_BT[row, :total] = torch.tensor(prompt + completion)
        attention_mask_BT[row, :total] = 1
        labels_BT[row, len(prompt) : total] = torch.tensor(completion)
    return input_ids_BT, attention_mask_BT, labels_BT


@contextlib.contextmanager
def deterministic_cpu() -> Iterator[None]:
    """One thread and deterministic kernels inside the block; the previous settings after it."""
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)


def batch_order(num_examples: int, *, steps: int, batch_size: int, seed: int) -> list[list[int]]:
    """Example indices for each step: seeded permutations laid end to end, cut into batches."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    stream: list[int] = []
    while len(stream) < needed:
        stream.extend(torch.randperm(num_examples, generator=generator).tolist())
    return [stream[step * batch_size : (step + 1) * batch_size] for step in range(steps)]


def sub_batches(
    examples: Sequence[tuple[list[int], list[int]]], rows: int = SUB_BATCH_ROWS
) -> list[list[tuple[list[int], list[int]]]]:
    """The examples sorted by total length (stable), cut into runs of `rows`."""
    ordered = sorted(examples, key=lambda example: len(example[0]) + len(example[1]))
    return [ordered[start : start + rows] for start in range(0, len(ordered), rows)]


def train_warm_start(
    model: PreTrainedModel,
    examples: Sequence[tuple[list[int], list[int]]],
    *,
    steps: int,
    pad_token_id: int,
    seed: int = WARM_START_SEED,
    batch_size: int = BATCH_SIZE,
    learning_rate: float = LEARNING_RATE,
    warmup_steps: int = WARMUP_STEPS,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Minimise the mean completion-token cross-entropy for `steps` Adam steps; the loss per step.

    The learning rate at step s (0-based) is learning_rate · min(1, (s + 1) / warmup_steps).
    The batch loss is Σ token losses / completion tokens over the whole batch, accumulated
    over its length-sorted sub-batches. Bit-for-bit reproducible for the same model,
    examples and seed.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be >= 1")
    if not examples:
        raise ValueError("examples is empty; pass encode_examples(tokenizer, conversations)")
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate, betas=ADAM_BETAS)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / max(1, warmup_steps))
    )
    losses = []
    model.train()
    with deterministic_cpu():
        for step, indices in enumerate(
            batch_order(len(examples), steps=steps, batch_size=batch_size, seed=seed)
        ):
            batch = [examples[index] for index in indices]
            completion_tokens = sum(len(completion) for _, completion in batch)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for part in sub_batches(batch):
                input_ids_BT, attention_mask_BT, labels_BT = collate(part, pad_token_id)
                logits_BTV = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits
                loss = (
                    torch.nn.functional.cross_entropy(
                        logits_BTV[:, :-1].flatten(0, 1),
                        labels_BT[:, 1:].flatten(),
                        ignore_index=IGNORED_LABEL,
                        reduction="sum",
                    )
                    / completion_tokens
                )
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            losses.append(total)
            if on_step is not None:
                on_step(step, losses[-1])
    model.eval()
    return losses


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[list[int]],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = 64,
) -> list[str]:
    """Decoded completions, each cut before its first end-of-turn; greedy when temperature == 0.

    Sampling draws from softmax(logits / temperature) over the full vocabulary (top-k and
    top-p off), from a torch RNG seeded with `seed` and restored afterwards.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    eos_token_id, pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    texts = []
    model.eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            width = max(len(prompt) for prompt in batch)
            padding_B = [width - len(prompt) for prompt in batch]
            # Left padding with a mask: generate derives position ids from the mask.
            input_ids_BT = torch.tensor(
                [[pad_token_id] * padding + prompt for padding, prompt in zip(padding_B, batch)]
            )
            attention_mask_BT = (
                torch.arange(width)[None, :] >= torch.tensor(padding_B)[:, None]
            ).long()
            generated_BT = model.generate(
                input_ids=input_ids_BT,
                attention_mask=attention_mask_BT,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
                **(sampling if temperature > 0 else {"do_sample": False}),
            )
            for completion in generated_BT[:, width:].tolist():
                # Finished rows continue as padding after their end-of-turn token.
                if eos_token_id in completion:
                    completion = completion[: completion.index(eos_token_id)]
                texts.append(tokenizer.decode(completion))
    return texts


def solve_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    problems: datasets.Dataset,
    *,
    temperature: float,
    prefix: Sequence[Message] = (),
    seed: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> float:
    """Mean grade of one completion per problem (1 when its last \\boxed{} equals the gold).

    Each prompt is `prefix` (a few-shot exchange, or none) then the question + suffix.
    """
    prompts = [
        prompt_tokens(tokenizer, [*prefix, {"role": "user", "content": question + QUESTION_SUFFIX}])
        for question in problems["question"]
    ]
    completions = sample_completions(
        model, tokenizer, prompts, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens
    )
    grades = [
        grade(completion, gsm8k_gold(answer))
        for completion, answer in zip(completions, problems["answer"])
    ]
    return sum(grades) / len(grades)
