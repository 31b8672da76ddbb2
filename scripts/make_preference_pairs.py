"""Preference pairs from the built-in task: a correct worked answer preferred over a wrong one.

The built-in model (the warm start) samples --samples completions at temperature 1 for each
of the first --problems problems of the arithmetic *train* split (the test split is never
read); each is graded by `grpo train`'s reward (the last \\boxed{} against the gold answer);
a problem with at least one correct and one wrong completion gives one pair: its first
correct completion (chosen) and its first wrong one (rejected), the prompt the chat messages
`grpo train` samples from. Offline, seeded, a few seconds on one core:

    python scripts/make_preference_pairs.py --out examples/dpo_arithmetic.jsonl

Then `grpo dpo --data examples/dpo_arithmetic.jsonl` (README, "Preference training").
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pytrio.types import SamplingParams

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_DIR
from grpo.tasks.data import load_run_problems
from grpo.tasks.prompts import build_messages
from grpo.training.rollouts.evaluation import correctness
from grpo.training.rollouts.grading import grade_rollouts
from grpo.training.rollouts.problems import run_problems, tokenizer_max_len
from grpo.training.rollouts.sampling import Sampling
from grpo.training.run.inputs import read_paths, refuse_overlap
from grpo.training.run.seeds import Purpose, sampling_seed
from grpo.training.settings.config import TrainConfig


def make_pairs(problems: int, samples: int, seed: int) -> tuple[list[dict], int]:
    """The pairs (prompt messages, chosen, rejected) and how many problems were sampled."""
    config = TrainConfig(seed=seed)
    rows = load_run_problems(config, "train", limit=problems)
    with LocalServiceClient(seed=seed, threads=1) as service:
        sampler = service.create_sampling_client(base_model=config.base_model)
        tokenizer = sampler.get_tokenizer()
        built = run_problems(tokenizer, rows, config, "train", max_len=tokenizer_max_len(tokenizer))

        def params(index: int) -> SamplingParams:
            return SamplingParams(
                max_tokens=config.max_tokens,
                temperature=1.0,
                seed=sampling_seed(seed, 0, index, purpose=Purpose.EVAL),
            )

        with ThreadPoolExecutor(max_workers=8) as pool:
            job = Sampling(pool, tokenizer, 2, print).submit(
                sampler, built, params, num_samples=samples
            )
            completions_P = job.result()
    scores = grade_rollouts(built, completions_P, config, config.max_tokens).scores
    correct_PG = correctness(scores, config.reward_fns[0].name)
    pairs = []
    for problem, completions, correct in zip(built, completions_P, correct_PG):
        right = [c.text for c, ok in zip(completions, correct) if ok]
        wrong = [c.text for c, ok in zip(completions, correct) if not ok]
        if right and wrong:
            prompt = build_messages(
                problem.question, fewshot=config.use_fewshot, template=config.prompt_template
            )
            pairs.append({"prompt": prompt, "chosen": right[0], "rejected": wrong[0]})
    return pairs, len(built)


def main() -> None:
    """Write the pairs as JSONL and say how many problems gave one."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("examples/dpo_arithmetic.jsonl"))
    parser.add_argument("--problems", type=int, default=400, help="train problems sampled")
    parser.add_argument("--samples", type=int, default=8, help="completions per problem")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # Before any sampling: --out never is, lies in or holds the model it samples from.
    try:
        refuse_overlap(args.out, "--out", read_paths("the built-in model", TINY_MODEL_DIR))
    except ValueError as error:
        parser.error(str(error))  # exit 2, one line, no traceback
    pairs, sampled = make_pairs(args.problems, args.samples, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as out:
        for pair in pairs:
            out.write(json.dumps(pair) + "\n")
    print(f"{len(pairs)} pairs from {sampled} train problems -> {args.out}")


if __name__ == "__main__":
    main()
