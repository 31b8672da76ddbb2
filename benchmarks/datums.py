"""Rollout records to PyTRIO Datums: tokens/s of each path through pytrio's types.

`python -m benchmarks.datums [--quick]`

Input: scored groups of a GSM8K-sized step (prompts of ~150 tokens, completions of ~350,
groups of 8), about 1M packed positions (--quick: 64k). Paths, slowest first:

1. per-token lists: input, target, log-prob and advantage lists built token by token,
   then `Datum(model_input=ModelInput.from_ints(...), loss_fn_inputs={...lists})` with
   pydantic's full validation (what a straightforward port of the article does);
2. `align` per completion + `pack`, then validated `Datum`s from the numpy arrays;
3. `pack_groups` (no per-completion records), then validated `Datum`s from numpy arrays;
4. `pack_groups` + `batch_to_datums` (the loop's path: `model_construct`, no re-validation
   of arrays the core records already validated).

Every path's datums are checked equal (`model_dump`) to path 1's before timing. The work
is numpy and pydantic only: torch's thread setting does not apply.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
from pytrio.types import Datum, ModelInput

from benchmarks.common import argument_parser, markdown_table, measure, print_header
from grpo.backends.datums import IGNORE_INDEX, batch_to_datums
from grpo.core.alignment import align, pack, pack_groups
from grpo.core.records import Completion, ScoredGroup, TokenBatch

FULL_TOKENS = 1_000_000
QUICK_TOKENS = 65_536
GROUP_SIZE = 8
VOCAB_SIZE = 150_000


def make_groups(num_tokens: int, seed: int = 0) -> list[ScoredGroup]:
    """Scored groups (prompt ~U(100, 200), completions ~U(100, 600) tokens) up to num_tokens."""
    rng = np.random.default_rng(seed)
    groups: list[ScoredGroup] = []
    total = 0
    while total < num_tokens:
        prompt = rng.integers(0, VOCAB_SIZE, int(rng.integers(100, 200)))
        completions = []
        for _ in range(GROUP_SIZE):
            length = int(rng.integers(100, 600))
            completions.append(
                Completion(
                    tokens=rng.integers(0, VOCAB_SIZE, length),
                    logprobs=-rng.exponential(1.0, length),
                    text="",
                    stop_reason="stop",
                )
            )
            total += prompt.size + length - 1
        rewards = rng.integers(0, 2, GROUP_SIZE).astype(np.float64)
        rewards[0] = 1.0 - rewards[1]  # never degenerate: every group trains
        groups.append(
            ScoredGroup(
                prompt_tokens=prompt,
                completions=tuple(completions),
                rewards=rewards,
                advantages=rewards - rewards.mean(),
            )
        )
    return groups


def per_token_lists(groups: Sequence[ScoredGroup]) -> list[Datum]:
    """Path 1: Python lists built one token at a time, then fully validated Datums."""
    datums = []
    for group in groups:
        prompt = group.prompt_tokens.tolist()
        for completion, advantage in zip(group.completions, group.advantages.tolist(), strict=True):
            tokens = completion.tokens.tolist()
            logprobs = completion.logprobs.tolist()
            input_tokens: list[int] = []
            target_tokens: list[int] = []
            sampling_logprobs: list[float] = []
            advantages: list[float] = []
            for token in prompt:
                input_tokens.append(token)
            for token in tokens[:-1]:
                input_tokens.append(token)
            for _ in range(len(prompt) - 1):
                target_tokens.append(IGNORE_INDEX)  # masked out: what the loop's datums hold
                sampling_logprobs.append(0.0)
                advantages.append(0.0)
            for token, logprob in zip(tokens, logprobs, strict=True):
                target_tokens.append(token)
                sampling_logprobs.append(logprob)
                advantages.append(advantage)
            datums.append(
                Datum(
                    model_input=ModelInput.from_ints(input_tokens),
                    loss_fn_inputs={
                        "target_tokens": target_tokens,
                        "logprobs": sampling_logprobs,
                        "advantages": advantages,
                    },
                )
            )
    return datums


def validated_datums(batch: TokenBatch) -> list[Datum]:
    """Datums from a packed batch through pydantic's validated constructors (numpy inputs)."""
    datums = []
    for sequence in batch.sequences():
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(sequence.input_tokens.tolist()),
                loss_fn_inputs={
                    "target_tokens": np.where(
                        sequence.mask != 0, sequence.target_tokens, IGNORE_INDEX
                    ),
                    "logprobs": sequence.sampling_logprobs.astype(np.float32),
                    "advantages": sequence.advantages.astype(np.float32),
                },
            )
        )
    return datums


def align_then_validate(groups: Sequence[ScoredGroup]) -> list[Datum]:
    """Path 2: one AlignedSequence record per completion, packed, then validated Datums."""
    return validated_datums(
        pack(
            [
                align(group.prompt_tokens, completion.tokens, completion.logprobs, advantage)
                for group in groups
                for completion, advantage in zip(group.completions, group.advantages, strict=True)
            ]
        )
    )


def pack_groups_then_validate(groups: Sequence[ScoredGroup]) -> list[Datum]:
    """Path 3: pack_groups, then validated Datums."""
    return validated_datums(pack_groups(groups))


def fast_path(groups: Sequence[ScoredGroup]) -> list[Datum]:
    """Path 4: pack_groups + batch_to_datums, as the training loop builds its datums."""
    return batch_to_datums(pack_groups(groups))


PATHS: dict[str, Callable[[Sequence[ScoredGroup]], list[Datum]]] = {
    "per-token lists + Datum(...) validated": per_token_lists,
    "align + pack + Datum(...) validated": align_then_validate,
    "pack_groups + Datum(...) validated": pack_groups_then_validate,
    "pack_groups + batch_to_datums (loop)": fast_path,
}


def check_equal(reference: Sequence[Datum], candidate: Sequence[Datum], name: str) -> None:
    """Raise unless both lists of datums dump to the same data."""
    if len(reference) != len(candidate):
        raise AssertionError(f"{name}: {len(candidate)} datums, expected {len(reference)}")
    for index, (expected, actual) in enumerate(zip(reference, candidate, strict=True)):
        if expected.model_dump() != actual.model_dump():
            raise AssertionError(
                f"{name}: datum {index} differs from the validated per-token construction"
            )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the datum-building benchmark and print its table."""
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    num_tokens = QUICK_TOKENS if args.quick else FULL_TOKENS
    repeats, budget_s = (2, 2.0) if args.quick else (5, 30.0)
    print_header(
        "Rollout records to PyTRIO Datums",
        "python -m benchmarks.datums" + (" --quick" if args.quick else ""),
    )
    groups = make_groups(num_tokens)
    positions = pack_groups(groups).num_tokens
    reference = per_token_lists(groups)
    for name, build in PATHS.items():
        check_equal(reference, build(groups), name)
    print(f"{len(groups)} groups x {GROUP_SIZE} = {len(reference)} datums, {positions} positions")
    print("every path's datums checked equal to the validated per-token construction (model_dump)")
    print(f"timings: best of up to {repeats} calls after a warm-up\n")
    timings = {
        name: measure(lambda build=build: build(groups), repeats=repeats, budget_s=budget_s)
        for name, build in PATHS.items()
    }
    slowest = timings[next(iter(PATHS))]
    rows = [
        [
            name,
            f"{timing.best_s * 1e3:.4g}",
            f"{positions / timing.best_s / 1e6:.3g}",
            f"{slowest.best_s / timing.best_s:.3g}x",
        ]
        for name, timing in timings.items()
    ]
    print(markdown_table(["path", "ms", "M positions/s", "speed-up vs per-token lists"], rows))
    print()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
