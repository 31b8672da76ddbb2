"""The embedded local backend's throughput: sampling and forward_backward tokens/s.

`python -m benchmarks.local [--quick]`

On the built-in tiny model (`grpo/tiny-qwen3-bpe`, LoRA rank 32): sampling 64
sequences of up to 32 new tokens (8 prompts x 8 samples, submitted together so the
worker batches them; tokens/s counts the tokens actually generated: a sequence stops at
its end-of-turn token) and forward_backward with `importance_sampling` on 64 datums of 121
positions. --quick: 16 sequences each. Under 1 torch thread and torch's default count:
the backend's worker thread keeps the thread count it started with, so every setting
gets a fresh service created under that setting.

Then, on one thread, the sampler against its compute limit: the model's FLOPs per
generated token (2 per weight of every matmul a decode step runs, plus attention over the
mean context), the machine's measured matmul throughput (the decode step's largest
matmul, and a 1024 x 1024 x 1024 one), and four samplers on the same 64 sequences: the
backend's merged step with its one-call decode (`sampler/decode.py`, the default), the
same step decoding span by span through the prefill's cache (`ModelHost.one_call_decode`
off: the decode before issue 39; the two alternated twice, best of each), the backend with
the Hugging Face forward (`_DecodeStep` off), and transformers' `generate` on the base
model (KV cache, no LoRA, top-k off).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pytrio.types import Datum, ModelInput, SamplingParams

from benchmarks.common import (
    Timing,
    argument_parser,
    markdown_table,
    measure,
    print_header,
    thread_settings,
    torch_threads,
)
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.sampler import merged as local_sampling
from grpo.backends.local.tiny import TINY_MODEL_NAME, load_tiny_model
from grpo.tasks.data import load_problems
from grpo.tasks.prompts import build_prompt_tokens

SAMPLES_PER_PROMPT = 8
NEW_TOKENS = 32
DATUM_POSITIONS = 121
TRAINED_POSITIONS = 24  # the completion part: the advantage is non-zero only there


def sampling_prompts(tokenizer: Any, count: int) -> list[ModelInput]:
    """The first `count` built-in arithmetic training prompts."""
    rows = load_problems("arithmetic", "train", limit=count)
    return [
        ModelInput.from_ints(build_prompt_tokens(tokenizer, row["question"], fewshot=False))
        for row in rows
    ]


def training_datums(count: int, vocab_size: int, seed: int = 0) -> list[Datum]:
    """`count` datums of DATUM_POSITIONS random tokens.

    The last TRAINED_POSITIONS carry an advantage of ±1.
    """
    rng = np.random.default_rng(seed)
    datums = []
    for _ in range(count):
        advantages = np.zeros(DATUM_POSITIONS, dtype=np.float32)
        advantages[-TRAINED_POSITIONS:] = rng.choice([-1.0, 1.0])
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(
                    rng.integers(0, vocab_size, DATUM_POSITIONS).tolist()
                ),
                loss_fn_inputs={
                    "target_tokens": rng.integers(0, vocab_size, DATUM_POSITIONS),
                    "logprobs": np.where(
                        advantages != 0, -rng.exponential(1.0, DATUM_POSITIONS), 0.0
                    ).astype(np.float32),
                    "advantages": advantages,
                },
            )
        )
    return datums


def time_backend(
    num_sequences: int, *, repeats: int, train: bool = True, one_call_decode: bool = True
) -> tuple[Timing, int, Timing | None, int]:
    """(sampling timing, tokens per call, forward_backward timing, positions per call).

    Each call gets a fresh service; without `train` only sampling is timed (forward_backward
    timing None). `one_call_decode` False decodes span by span, as before issue 39.
    """
    with (
        tempfile.TemporaryDirectory(prefix="grpo-bench-local-") as root,
        LocalServiceClient(root=root, seed=0) as service,
    ):
        training_client = service.create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=32, seed=0
        )
        training_client._host.one_call_decode = one_call_decode
        tokenizer = training_client.get_tokenizer()
        sampler = training_client.save_weights_and_get_sampling_client()
        prompts = sampling_prompts(tokenizer, num_sequences // SAMPLES_PER_PROMPT)
        generated: list[int] = []

        def sample_all() -> None:
            futures = [
                sampler.sample(
                    prompt=prompt,
                    num_samples=SAMPLES_PER_PROMPT,
                    sampling_params=SamplingParams(
                        max_tokens=NEW_TOKENS, temperature=1.0, seed=index
                    ),
                )
                for index, prompt in enumerate(prompts)
            ]
            responses = [future.result() for future in futures]
            generated.append(
                sum(
                    len(sequence.tokens)
                    for response in responses
                    for sequence in response.sequences
                )
            )

        sampling = measure(sample_all, repeats=repeats)
        if not train:
            return sampling, generated[-1], None, 0
        datums = training_datums(num_sequences, vocab_size=len(tokenizer))
        forward_backward = measure(
            lambda: training_client.forward_backward(
                datums, loss_fn="importance_sampling"
            ).result(),
            repeats=repeats,
        )
    # Every call samples with the same seeds, so every call generates the same tokens.
    return sampling, generated[-1], forward_backward, num_sequences * DATUM_POSITIONS


def flops_per_token(config: Any, context: float) -> float:
    """2 x (decoder matmul weights + unembedding) + 4 x layers x heads x head_dim x context."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention_weights = hidden * head_dim * (2 * heads + 2 * config.num_key_value_heads)
    layer_weights = attention_weights + 3 * hidden * config.intermediate_size
    matmul_weights = config.num_hidden_layers * layer_weights + hidden * config.vocab_size
    return 2 * matmul_weights + 4 * config.num_hidden_layers * heads * head_dim * context


def matmul_gflops(rows: int, inner: int, columns: int, *, repeats: int) -> float:
    """Measured GFLOP/s of one [rows, inner] x [inner, columns] float32 matmul (best call)."""
    left, right = torch.randn(rows, inner), torch.randn(columns, inner)
    timing = measure(lambda: torch.nn.functional.linear(left, right), repeats=repeats, warmup=3)
    return 2 * rows * inner * columns / timing.best_s / 1e9


def time_generate(prompts: Sequence[list[int]], *, repeats: int) -> tuple[Timing, int]:
    """transformers' generate on the shipped base model: 8 samples per prompt, left padded."""
    model, tokenizer = load_tiny_model()
    rows = [prompt for prompt in prompts for _ in range(SAMPLES_PER_PROMPT)]
    width = max(map(len, rows))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row in rows])
    attention_mask = (input_ids != tokenizer.pad_token_id).long()
    generated: list[int] = []

    def generate() -> None:
        with torch.no_grad():
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=NEW_TOKENS,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[:, width:].tolist()
        end = tokenizer.eos_token_id
        generated.append(sum(row.index(end) + 1 if end in row else len(row) for row in output))

    return measure(generate, repeats=repeats), generated[-1]


def limit_table(num_sequences: int, *, repeats: int, threads: int = 1) -> tuple[list[str], str]:
    """(lines stating the limit, the samplers' table) at `threads` torch threads.

    The limit is FLOPs per token against the measured matmul rate at the same thread count.
    """
    label = "1 thread" if threads == 1 else f"{threads} threads"
    with torch_threads(threads):
        # The one-call decode and the span-by-span one (before issue 39), alternated twice.
        runs = [
            time_backend(num_sequences, repeats=repeats, train=False, one_call_decode=one_call)
            for _ in range(2)
            for one_call in (True, False)
        ]
        fast, generated_fast, _, _ = min(runs[0::2], key=lambda run: run[0].best_s)
        span, generated_span, _, _ = min(runs[1::2], key=lambda run: run[0].best_s)
        build = local_sampling._DecodeStep.build
        hugging_face_only = classmethod(lambda cls, model: None)
        local_sampling._DecodeStep.build = hugging_face_only  # type: ignore[method-assign]
        try:
            slow, generated_slow, _, _ = time_backend(num_sequences, repeats=repeats, train=False)
        finally:
            local_sampling._DecodeStep.build = build  # type: ignore[method-assign]
        model, tokenizer = load_tiny_model()
        rows = load_problems("arithmetic", "train", limit=num_sequences // SAMPLES_PER_PROMPT)
        prompts = [build_prompt_tokens(tokenizer, row["question"], fewshot=False) for row in rows]
        generate, generated_by_generate = time_generate(prompts, repeats=repeats)
        config = model.config
        widest = 2 * config.intermediate_size
        decode_gflops = matmul_gflops(num_sequences, config.hidden_size, widest, repeats=20)
        peak_gflops = matmul_gflops(1024, 1024, 1024, repeats=3)
    context = float(np.mean([len(prompt) for prompt in prompts])) + NEW_TOKENS / 2
    flops = flops_per_token(config, context)
    lines = [
        f"FLOPs per generated token: {flops / 1e6:.2f} M (mean context {context:.0f} positions)",
        f"matmul throughput, {label}: {decode_gflops:.1f} GFLOP/s at {num_sequences} x "
        f"{config.hidden_size} x {2 * config.intermediate_size} (the decode step's largest), "
        f"{peak_gflops:.1f} GFLOP/s at 1024^3",
        f"limit at the decode-step matmul rate: {decode_gflops * 1e9 / flops:,.0f} tokens/s",
        f"one-call decode against span by span (before issue 39), same run: "
        f"{(generated_fast / fast.best_s) / (generated_span / span.best_s):.2f}x tokens/s",
    ]
    rows = []
    for sampler, timing, generated in (
        ("local sampler, merged step, one-call decode", fast, generated_fast),
        ("local sampler, merged step, span-by-span decode", span, generated_span),
        ("local sampler, Hugging Face forward", slow, generated_slow),
        ("transformers generate (base model)", generate, generated_by_generate),
    ):
        tokens_per_s = generated / timing.best_s
        rows.append(
            [
                sampler,
                f"{generated}",
                f"{tokens_per_s:,.0f}",
                f"{tokens_per_s * flops / 1e9:.2f}",
                f"{tokens_per_s * flops / (decode_gflops * 1e9):.1%}",
            ]
        )
    table = markdown_table(
        [label, "tokens generated", "tokens/s", "GFLOP/s", "fraction of the matmul rate"], rows
    )
    return lines, table


def main(argv: Sequence[str] | None = None) -> int:
    """Run the local-backend benchmark and print its table."""
    args = argument_parser(__doc__.splitlines()[0]).parse_args(argv)
    num_sequences, repeats = (16, 2) if args.quick else (64, 5)
    print_header(
        "Local backend throughput (tiny model, LoRA rank 32)",
        "python -m benchmarks.local" + (" --quick" if args.quick else ""),
    )
    print(f"timings: best of {repeats} calls after a warm-up\n")
    rows = []
    for label, threads in thread_settings(args.quick):
        with torch_threads(threads):
            sampling, generated, forward_backward, positions = time_backend(
                num_sequences, repeats=repeats
            )
        assert forward_backward is not None
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
            [
                "torch threads",
                "sample: sequences x max tokens",
                "sample ms",
                "sampled tokens/s",
                "forward_backward: datums x positions",
                "forward_backward ms",
                "positions/s",
            ],
            rows,
        )
    )
    print()
    for label, threads in thread_settings(args.quick):
        lines, table = limit_table(num_sequences, repeats=repeats, threads=threads)
        print(f"Sampler against its compute limit ({label}, same sequences)\n")
        print("\n".join(f"- {line}" for line in lines))
        print()
        print(table)
        print()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
