"""Sampler–trainer mismatch on the local backend, and what measuring it costs.

`python -m benchmarks.mismatch [--quick]`

On the built-in tiny model (`grpo/tiny-qwen3-arith`, a fresh LoRA of rank 32, i.e. the
base model's distribution): 8 arithmetic training prompts x 8 samples of up to 24 new
tokens per setting, then one training `forward` of those completions. Table 1: the
mismatch (docs/FORMULAS.md, "Sampler–trainer mismatch": KL(sampler ‖ trainer) as k1 and
k3, max |log ρ|, share of tokens off by more than 2x) per sampler precision, temperature
and top-p. The local sampler's log-probs are those of the distribution it sampled
(softmax(logits / T), then top-p, renormalised); the trainer's are the temperature-1
softmax, so T ≠ 1 or top-p < 1 is a mismatch even in float32. Table 2: the cost of the
proximal `forward` a `--mismatch-correction` adds per step, against one `forward_backward`
of the same datums. --quick: 2 prompts x 4 samples, two settings, one timing.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence

from pytrio.types import ModelInput, SamplingParams

from benchmarks.common import argument_parser, markdown_table, measure, print_header
from grpo.backends.datums import batch_to_datums, forward_only, output_logprobs
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.core.alignment import align, pack
from grpo.core.metrics import mismatch_metrics
from grpo.tasks.data import load_problems
from grpo.tasks.prompts import build_prompt_tokens

NEW_TOKENS = 24
SETTINGS = [
    (dtype, temperature, top_p)
    for dtype in ("float32", "bfloat16")
    for temperature in (0.7, 1.0, 1.3)
    for top_p in (1.0, 0.9)
]
QUICK_SETTINGS = [("float32", 1.0, 1.0), ("bfloat16", 0.7, 0.9)]


def _batch(
    client: LocalServiceClient, prompts: int, samples: int, temperature: float, top_p: float
):
    trainer = client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=32, seed=0)
    tokenizer = trainer.get_tokenizer()
    sampler = trainer.save_weights_and_get_sampling_client()
    rows = load_problems("arithmetic", "train", limit=prompts)
    sequences = []
    for index, row in enumerate(rows):
        prompt = build_prompt_tokens(tokenizer, row["question"], fewshot=False)
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=temperature, top_p=top_p, seed=index
        )
        response = sampler.sample(
            ModelInput.from_ints(prompt), num_samples=samples, sampling_params=params
        )
        for sequence in response.result().sequences:
            sequences.append(align(prompt, sequence.tokens, sequence.logprobs, 1.0))
    return trainer, pack(sequences)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the mismatch table and the proximal forward's cost."""
    parser = argument_parser(__doc__ or "")
    args = parser.parse_args(argv)
    prompts, samples = (2, 4) if args.quick else (8, 8)
    print_header(
        "Sampler-trainer mismatch on the local backend (tiny model)",
        "python -m benchmarks.mismatch" + (" --quick" if args.quick else ""),
    )
    rows = []
    timing_rows = []
    for dtype, temperature, top_p in QUICK_SETTINGS if args.quick else SETTINGS:
        with tempfile.TemporaryDirectory() as root:
            client = LocalServiceClient(root=root, seed=0, sampler_dtype=dtype)
            trainer, batch = _batch(client, prompts, samples, temperature, top_p)
            datums = batch_to_datums(batch)
            output = trainer.forward(forward_only(datums), loss_fn="cross_entropy").result()
            found = mismatch_metrics(
                output_logprobs(output.loss_fn_outputs),
                batch.sampling_logprobs,
                batch.mask,
                batch.seq_lens,
            )
            rows.append(
                [
                    dtype,
                    f"{temperature:g}",
                    f"{top_p:g}",
                    f"{found['kl_k1']:.2e}",
                    f"{found['kl_k3']:.2e}",
                    f"{found['max_abs_log_ratio']:.3f}",
                    f"{found['frac_off_by_2x']:.2%}",
                    f"{found['seq_ratio_std']:.3f}",
                ]
            )
            if not timing_rows:
                repeats = 1 if args.quick else 5
                forward = measure(
                    lambda: trainer.forward(forward_only(datums), loss_fn="cross_entropy").result(),
                    repeats=repeats,
                )
                backward = measure(
                    lambda: trainer.forward_backward(
                        datums, loss_fn="importance_sampling"
                    ).result(),
                    repeats=repeats,
                )
                timing_rows.append(
                    [
                        f"{len(datums)} x {batch.num_tokens // len(datums)} positions",
                        f"{forward.best_ms:.0f} ms",
                        f"{backward.best_ms:.0f} ms",
                        f"{forward.best_s / backward.best_s:.2f}",
                    ]
                )
            client.close()
    print("\n### Mismatch per sampler setting (trainer: float32, temperature 1)\n")
    print(
        markdown_table(
            [
                "sampler dtype",
                "T",
                "top-p",
                "kl_k1",
                "kl_k3",
                "max abs log ratio",
                "frac off by 2x",
                "seq ratio std",
            ],
            rows,
        )
    )
    print("\n### Cost of the proximal forward (one per step under --mismatch-correction)\n")
    print(
        markdown_table(
            ["batch", "forward", "forward_backward", "forward / forward_backward"], timing_rows
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
