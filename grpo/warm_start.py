"""The supervised warm start of the built-in tiny model, and the sampler that measures it.

``scripts/make_tiny_model.py`` is the command line over this module. The recipe (measured
in LOCAL_MODEL_NOTES.md): teacher-forced cross-entropy on the reference completion
``a+b=c. \\boxed{c}<|im_end|>`` of built-in arithmetic TRAIN problems, given the exact
prompt GRPO uses; Adam(lr 2e-3, betas (0.9, 0.98)), linear warm-up over 50 steps then a
constant rate, gradient norm clipped to 1.0, batches of 64 drawn in a seeded order. Stopping
early leaves the model partly right, so GRPO has something to improve.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import datasets
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.core.rewards import grade, gsm8k_gold
from grpo.prompts import build_prompt_tokens

WARM_START_SEED = 0
WARM_START_STEPS = 400
BATCH_SIZE = 64
LEARNING_RATE = 2e-3
ADAM_BETAS = (0.9, 0.98)
WARMUP_STEPS = 50
MAX_GRAD_NORM = 1.0
MAX_NEW_TOKENS = 24
IGNORED_LABEL = -100


def reference_completion(answer: str) -> str:
    """`a+b=c. \\boxed{c}` from a built-in arithmetic answer `a + b = c\\n#### c`."""
    equation, _, gold = answer.partition("\n#### ")
    if not gold or "=" not in equation:
        raise ValueError(
            f"answer {answer!r} is not a built-in arithmetic answer 'a + b = c\\n#### c'; "
            "the warm start trains on load_problems('arithmetic', 'train') rows only"
        )
    return f"{equation.replace(' ', '')}. \\boxed{{{gold}}}"


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, problems: datasets.Dataset
) -> list[tuple[list[int], list[int]]]:
    """(prompt tokens, completion tokens ending in end-of-turn) for each problem row."""
    examples = []
    for question, answer in zip(problems["question"], problems["answer"]):
        prompt_tokens = build_prompt_tokens(tokenizer, question, fewshot=False)
        completion_tokens = tokenizer.encode(reference_completion(answer), add_special_tokens=False)
        examples.append((prompt_tokens, [*completion_tokens, tokenizer.eos_token_id]))
    return examples


def collate(
    examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids_BT, attention_mask_BT, labels_BT); labels keep completion tokens only.

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
    Training is bit-for-bit reproducible for the same model, examples and seed.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError(f"steps={steps} and batch_size={batch_size} must both be >= 1")
    if not examples:
        raise ValueError("examples is empty; pass encode_examples(tokenizer, train problems)")
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
            input_ids_BT, attention_mask_BT, labels_BT = collate(
                [examples[index] for index in indices], pad_token_id
            )
            loss = model(
                input_ids=input_ids_BT, attention_mask=attention_mask_BT, labels=labels_BT
            ).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
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
            attention_mask_BT = (torch.arange(width)[None, :] >= torch.tensor(padding_B)[:, None]).long()
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
    seed: int = 0,
) -> float:
    """Mean grade of one completion per problem (1 when its last \\boxed{} equals the gold)."""
    prompts = [build_prompt_tokens(tokenizer, q, fewshot=False) for q in problems["question"]]
    completions = sample_completions(model, tokenizer, prompts, temperature=temperature, seed=seed)
    grades = [
        grade(completion, gsm8k_gold(answer))
        for completion, answer in zip(completions, problems["answer"])
    ]
    return sum(grades) / len(grades)
