"""A small PyTRIO program: a few GRPO steps on one question, then the trained weights saved.

It imports pytrio only (no grpo), as a program written for the PyTRIO service does, so it runs
unchanged against the real service or, offline, against `grpo serve`:

    grpo serve --port 8765 &
    export PYTRIO_BASE_URL=http://127.0.0.1:8765 PYTRIO_API_KEY=local
    python examples/pytrio_offline.py --steps 5 --save weights.txt
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.error
import urllib.request

import numpy as np
import pytrio as trio

QUESTION = "What is 7 plus 5? Provide a numerical answer without units, written inside \\boxed{}."
ANSWER = "\\boxed{12}"


def wait_for_service(url: str, timeout_s: float = 120.0) -> None:
    """Return once something answers HTTP at `url` (a server just started takes seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            return
        except urllib.error.HTTPError:
            return  # it answered, if only with an error status
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"nothing answers at {url}; is `grpo serve` running?") from None
            time.sleep(0.5)


def group_datums(prompt: list[int], sequences: list, rewards: list[float]) -> list[trio.Datum]:
    """One importance-sampling datum per completion, its advantage the reward minus the mean."""
    mean = sum(rewards) / len(rewards)
    datums = []
    for sequence, reward in zip(sequences, rewards, strict=True):
        tokens, observed = list(sequence.tokens), len(prompt) - 1
        inputs = {
            "target_tokens": np.asarray([0] * observed + tokens, dtype=np.int64),
            "logprobs": np.asarray([0.0] * observed + list(sequence.logprobs), dtype=np.float32),
            "advantages": np.asarray(
                [0.0] * observed + [reward - mean] * len(tokens), dtype=np.float32
            ),
        }
        datums.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(prompt + tokens[:-1]), loss_fn_inputs=inputs
            )
        )
    return datums


def main() -> None:
    """Train `--steps` GRPO steps of 8 completions on one question; print each step's reward."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-model", default="grpo/tiny-qwen3-bpe")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save", default=None, help="write the sampler weights' path here")
    args = parser.parse_args()
    if os.environ.get("PYTRIO_BASE_URL"):
        wait_for_service(os.environ["PYTRIO_BASE_URL"])

    trainer = trio.ServiceClient().create_lora_training_client(base_model=args.base_model, rank=8)
    tokenizer = trainer.get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    params = trio.SamplingParams(max_tokens=24, temperature=1.0)
    for step in range(args.steps):
        sampler = trainer.save_weights_and_get_sampling_client()
        sequences = (
            sampler.sample(
                prompt=trio.ModelInput.from_ints(prompt), num_samples=8, sampling_params=params
            )
            .result()
            .sequences
        )
        rewards = [1.0 if ANSWER in tokenizer.decode(s.tokens) else 0.0 for s in sequences]
        if len(set(rewards)) > 1:  # a group of equal rewards has no advantage to learn from
            datums = group_datums(prompt, sequences, rewards)
            trainer.forward_backward(datums, loss_fn="importance_sampling").result()
            trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
        print(f"step {step} | reward {sum(rewards) / len(rewards):.3f}", flush=True)
    path = trainer.save_weights_for_sampler(name="pytrio-offline").result().path
    print(f"sampler weights: {path}")
    if args.save:
        with open(args.save, "w") as out:
            out.write(path + "\n")


if __name__ == "__main__":
    main()
