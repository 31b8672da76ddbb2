"""Drive `grpo serve` with whichever pytrio client is first on ``sys.path`` (run as a script).

``python client_driver.py URL KEY MODEL [--tokenizer-only]``: log in with the client's own
`ensure_login` (pytrio before 0.2.9 reads no environment variables), then create, sample,
forward_backward, a custom loss, optim_step, save_state, save_weights_for_sampler, a
sampler on the saved weights, the RestClient's archive of them, load_state into a new
client and create_training_client_from_state (with and without the optimizer), whose
forwards must equal the trained one's, and close (where the client has it).
Prints one ``STEP name json`` line per call and ``DONE`` at the end;
tests/serve/test_client_versions.py reads them. Imports pytrio, numpy and torch only:
never grpo.
"""

from __future__ import annotations

import json
import math
import sys
import urllib.request


def step(name: str, value: object = None) -> None:
    """One progress line the test reads."""
    print(f"STEP {name} {json.dumps(value)}", flush=True)


def main(url: str, key: str, model: str, tokenizer_only: bool) -> None:
    import numpy as np
    import pytrio as trio
    from pytrio._version import __version__
    from pytrio.auth.flow import ensure_login

    step("client", {"version": __version__, "file": trio.__file__})
    ensure_login(api_key=key, base_url=url, save=True)
    service = trio.ServiceClient()
    trainer = service.create_lora_training_client(base_model=model, rank=4)
    tokenizer = trainer.get_tokenizer()
    prompt = tokenizer.encode("What is 2 + 3?", add_special_tokens=False)
    step("tokenizer", {"prompt_tokens": len(prompt)})
    if tokenizer_only:
        print("DONE", flush=True)
        return
    sampler = trainer.save_weights_and_get_sampling_client()
    params = trio.SamplingParams(max_tokens=6, temperature=1.0, seed=0)
    result = sampler.sample(
        prompt=trio.ModelInput.from_ints(prompt), num_samples=2, sampling_params=params
    ).result()
    step("sample", [len(sequence.tokens) for sequence in result.sequences])
    datums = []
    for sequence, advantage in zip(result.sequences, (1.0, -1.0), strict=True):
        tokens, observed = list(sequence.tokens), len(prompt) - 1
        datums.append(
            trio.Datum(
                model_input=trio.ModelInput.from_ints(prompt + tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray([0] * observed + tokens, dtype=np.int64),
                    "logprobs": np.asarray(
                        [0.0] * observed + list(sequence.logprobs), dtype=np.float32
                    ),
                    "advantages": np.asarray(
                        [0.0] * observed + [advantage] * len(tokens), dtype=np.float32
                    ),
                },
            )
        )
    metrics = trainer.forward_backward(datums, loss_fn="importance_sampling").result().metrics
    assert math.isfinite(metrics["loss_sum"]), metrics
    step("forward_backward", dict(metrics))

    def custom_loss(data, logprobs_list):
        loss = -sum(logprobs.sum() for logprobs in logprobs_list) / len(logprobs_list)
        return loss, {"custom/calls": 1.0}

    stripped = [
        trio.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]},
        )
        for datum in datums
    ]
    metrics = trainer.forward_backward_custom(stripped, custom_loss).result().metrics
    assert metrics["custom/calls"] == 1.0, metrics
    step("forward_backward_custom", dict(metrics))
    trainer.optim_step(trio.AdamParams(learning_rate=1e-3)).result()
    step("optim_step")
    state = trainer.save_state(name="driver-state").result()
    weights = trainer.save_weights_for_sampler(name="driver-weights").result()
    step("saved", {"state": state.path, "weights": weights.path})
    saved_sampler = trainer.create_sampling_client(weights.path)
    again = saved_sampler.sample(
        prompt=trio.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
    ).result()
    step("sample_saved", len(again.sequences))
    rest = service.create_rest_client()
    listed = rest.list_user_checkpoints().result().checkpoints
    ids = [
        c.checkpoint_id
        for c in listed
        if weights.path in (getattr(c, "path", None), getattr(c, "tinker_path", None))
    ]
    url = rest.get_checkpoint_archive_url(ids[0]).result().url  # 0.2.0-0.2.3: .../archive
    with urllib.request.urlopen(url, timeout=30) as response:
        step("archive", {"bytes": len(response.read())})
    trained = trainer.forward(datums, loss_fn="importance_sampling").result().metrics
    restored = service.create_lora_training_client(base_model=model, rank=4)
    restored.load_state(state.path).result()
    loaded = restored.forward(datums, loss_fn="importance_sampling").result().metrics
    step("load_state", {"trained": trained["loss_sum"], "loaded": loaded["loss_sum"]})
    resumed = {
        "weights": service.create_training_client_from_state(state.path),
        "optimizer": service.create_training_client_from_state_with_optimizer(state.path),
    }
    step(
        "from_state",
        {
            "trained": trained["loss_sum"],
            **{
                kind: client.forward(datums, loss_fn="importance_sampling")
                .result()
                .metrics["loss_sum"]
                for kind, client in resumed.items()
            },
        },
    )
    if hasattr(trainer, "close"):  # 0.2.0 and 0.2.1 (removed in 0.2.2)
        for client in (trainer, restored, *resumed.values()):
            client.close()
        step("close")
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], "--tokenizer-only" in sys.argv[4:])
