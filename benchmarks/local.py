"""The embedded local backend's throughput: sampling and forward_backward tokens/s.

`python -m benchmarks.local [--quick]`

On the built-in tiny model (`grpo/tiny-qwen3-arith`, LoRA rank 32): sampling 64
sequences of up to 32 new tokens (8 prompts x 8 samples, submitted together so the
worker batches them; tokens/s counts the tokens actually generated: a sequence stops at
its end-of-turn token) and forward_backward with `importance_sampling` on 64 datums of 121
positions. --quick: 16 sequences each. Under 1 torch thread and torch's default count:
the backend's worker thread keeps the thread count it started with, so every setting
gets a fresh service created under that setting.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
from pytrio.types import Datum, ModelInput, SamplingParams

from benchmarks.common import Timing, argument_parser, markdown_table, measure, print_header, thread_settings, torch_threads
from grpo.backends.local import LocalServiceClient
from grpo.backends.tiny import TINY_MODEL_NAME
from grpo.data import load_problems
from grpo.prompts import build_prompt_tokens

SAMPLES_PER_PROMPT = 8
NEW_TOKENS = 32
DATUM_POSITIONS = 121
TRAINED_POSITIONS = 24  # the completion part: the advantage is non-zero only there


def sampling_prompts(tokenizer: Any, count: int) -> list[ModelInput]:
    """The first `count` built-in arithmetic training prompts."""
    rows = load_problems("arithmetic", "train", limit=count)
    return [ModelInput.from_ints(build_prompt_tokens(tokenizer, row["question"], fewshot=False)) for row in rows]


def training_datums(count: int, vocab_size: int, seed: int = 0) -> list[Datum]:
    """`count` datums of DATUM_POSITIONS random tokens; the last TRAINED_POSITIONS carry an advantage of ±1."""
    rng = np.random.default_rng(seed)
    datums = []
    for _ in range(count):
        advantages = np.zeros(DATUM_POSITIONS, dtype=np.float32)
        advantages[-TRAINED_POSITIONS:] = rng.choice([-1.0, 1.0])
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(rng.integers(0, vocab_size, DATUM_POSITIONS).tolist()),
                loss_fn_inputs={
                    "target_tokens": rng.integers(0, vocab_size, DATUM_POSITIONS),
                    "logprobs": np.where(advantages != 0, -rng.exponential(1.0, DATUM_POSITIONS), 0.0).astype(np.float32),
                    "advantages": advantages,
                },
            )
        )
    return datums


def time_backend(num_sequences: int, *, repeats: int) -> tuple[Timing, int, Timing, int]:
    """(sampling timing, tokens generated per call, forward_backward timing, positions per call) on a fresh service."""
    with tempfile.TemporaryDirectory(prefix="grpo-bench-local-") as root, LocalServiceClient(root=root, seed=0) as service:
        training_client = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=32, seed=0)
        tokenizer = training_client.get_tokenizer()
        sampler = training_client.save_weights_and_get_sampling_client()
        prompts = sampling_prompts(tokenizer, num_sequences // SAMPLES_PER_PROMPT)
        generated: list[int] = []

        def sample_all() -> None:
            futures = [
                sampler.sample(
                    prompt=prompt,
                    num_samples=SAMPLES_PER_PROMPT,
                    sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=index),
                )
                for index, prompt in enumerate(prompts)
            ]
            responses = [future.result() for future in futures]
            generated.append(sum(len(sequence.tokens) for response in responses for sequence in response.sequences))

        sampling = measure(sample_all, repeats=repeats)
        datums = training_datums(num_sequences, vocab_size=len(tokenizer))
        forward_backward = measure(
            lambda: training_client.forward_backward(datums, loss_fn="importance_sampling").result(), repeats=repeats
        )
    # Every call samples with the same seeds, so every call generates the same tokens.
    return sampling, generated[-1], forward_backward, num_sequences * DATUM_POSITIONS


def main(argv: Sequence[str] | None = None) -> int:
    """Run the local-backend benchmark and print its table."""
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    num_sequences, repeats = (16, 2) if args.quick else (64, 5)
    print_header("Local backend throughput (tiny model, LoRA rank 32)", "python -m benchmarks.local" + (" --quick" if args.quick else ""))
    print(f"timings: best of {repeats} calls after a warm-up\n")
    rows = []
    for label, threads in thread_settings(args.quick):
        with torch_threads(threads):
            sampling, generated, forward_backward, positions = time_backend(num_sequences, repeats=repeats)
        rows.append(
            [
                label,
                f"{num_sequences} x {NEW_TOKENS} ({generated} generated)",
                f"{sampling.best_s * 1e3:.0f}",
                f"{generated / sampling.best_s:.0f}",
                f"{num_sequences} x {DATUM_POSITIONS}",
                f"{forward_backward.best_s * 1e3:.0f}",
                f"{positions / forward_backward.best_s:.0f}",
            ]
        )
    print(
        markdown_table(
            ["torch threads", "sample: sequences x max tokens", "sample ms", "sampled tokens/s", "forward_backward: datums x positions", "forward_backward ms", "positions/s"],
            rows,
        )
    )
    print()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
