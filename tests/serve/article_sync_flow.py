"""The seed article's synchronous GRPO flow (its ``01-demo-sync.py``), written afresh for a
pytrio client of any version against `grpo serve` (run as a script).

``python article_sync_flow.py URL KEY MODEL``: log in (the client's own `ensure_login`),
create a LoRA training client, then per step: save weights and get a sampler, sample a
group per question through the chat template with end-of-turn stops, grade the boxed
answer, advantage = reward - group mean, skip degenerate groups, build the datums (prompt
positions target 0, advantage 0), forward_backward with ``importance_sampling``, an Adam
step; at the end save the weights for a sampler and close the client (pytrio 0.2.0/0.2.1
have ``close``; the article's scripts end with it). The last line is ``# all done``.
Imports pytrio and numpy only.
"""

from __future__ import annotations

import re
import sys

QUESTIONS = [("What is 2 + 3?", "5"), ("What is 7 - 4?", "3")]
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
STEPS, GROUP, MAX_TOKENS = 2, 4, 16


def reward(text: str, tokens: list[int], answer: str) -> float:
    """1 for the right boxed answer; the built-in tiny model rarely boxes one, so a small
    tie-breaker (the share of distinct tokens) keeps its groups from being degenerate."""
    boxed = re.findall(r"\\boxed\{([^}]+)\}", text)
    correct = 1.0 if boxed and boxed[-1].strip() == answer else 0.0
    return correct + 0.01 * len(set(tokens)) / max(len(tokens), 1)


def main(url: str, key: str, model: str) -> None:
    import numpy as np
    import pytrio as trio
    from pytrio.auth.flow import ensure_login

    ensure_login(api_key=key, base_url=url, save=True)
    print("Creating PyTRIO clients...", flush=True)
    service = trio.ServiceClient()
    training_client = service.create_lora_training_client(base_model=model, rank=8)
    tokenizer = training_client.get_tokenizer()
    stops = list(dict.fromkeys(t for t in (tokenizer.eos_token, "<|im_end|>") if t))
    params = trio.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=1.0, stop=stops)
    adam = trio.AdamParams(learning_rate=4e-5, beta1=0.9, beta2=0.95)
    trained = 0
    try:
        for step in range(STEPS):
            sampler = training_client.save_weights_and_get_sampling_client()
            datums = []
            for question, answer in QUESTIONS:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": question + SUFFIX}],
                    tokenize=False,
                    add_generation_prompt=True,
                    enable_thinking=False,
                )
                prompt = tokenizer.encode(text, add_special_tokens=False)
                result = sampler.sample(
                    prompt=trio.ModelInput.from_ints(prompt),
                    num_samples=GROUP,
                    sampling_params=params,
                ).result()
                group = []
                for sequence in result.sequences:
                    tokens = list(sequence.tokens)
                    completion = tokenizer.decode(tokens, skip_special_tokens=True)
                    value = reward(completion, tokens, answer)
                    group.append((tokens, list(sequence.logprobs), value))
                mean = sum(item[2] for item in group) / len(group)
                if all(item[2] == mean for item in group):
                    continue
                observed = len(prompt) - 1
                for tokens, logprobs, value in group:
                    datums.append(
                        trio.Datum(
                            model_input=trio.ModelInput.from_ints(prompt + tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": np.asarray(
                                    [0] * observed + tokens, dtype=np.int64
                                ),
                                "logprobs": np.asarray(
                                    [0.0] * observed + logprobs, dtype=np.float32
                                ),
                                "advantages": np.asarray(
                                    [0.0] * observed + [value - mean] * len(tokens),
                                    dtype=np.float32,
                                ),
                            },
                        )
                    )
            loss_mean = "n/a"
            if datums:
                backward = training_client.forward_backward(datums, loss_fn="importance_sampling")
                optim = training_client.optim_step(adam)
                loss_mean = f"{backward.result().metrics['loss_mean']:.4f}"
                optim.result()
                trained += 1
            print(f"Step {step} | datums: {len(datums)} | loss_mean: {loss_mean}", flush=True)
        final = training_client.save_weights_for_sampler(name="article-sync-final").result()
        print(f"Saved weights path: {final.path} | trained steps: {trained}", flush=True)
    finally:
        if hasattr(training_client, "close"):
            training_client.close()
    print("# all done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
