"""The trainer's shared-prefix forward against one padded row per datum (the plain forward).

Random groups of datums, some sharing a prompt and some not, random ignored targets, both
target alignments: the log-probs agree to 1e-5 (tests/invariance.py's LOGPROB_ATOL) and the
LoRA gradients of a random weighted sum of them to 1e-5 of their largest entry. Runs on a
randomly initialised tiny model with random (non-zero) LoRA weights on every module.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytrio.types import AdamParams, Datum, ModelInput, TensorData

from grpo.backends.datums import IGNORE_INDEX
from grpo.backends.local import LocalServiceClient, shared_prefix, tiny
from grpo.backends.local.model import LoraSpec, ModelHost
from grpo.backends.local.shared_prefix import group_by_prefix, pack_rows, row_cost
from tests.invariance import LOGPROB_ATOL

GRADIENT_RTOL = 1e-5  # of the largest gradient entry: float32 sums of ~100 terms of ~1


@pytest.fixture(scope="module")
def host() -> tuple[ModelHost, str]:
    model, tokenizer = tiny.init_tiny_model(0)
    host = ModelHost(tiny.TINY_MODEL_NAME, model, tokenizer)
    spec = LoraSpec(rank=8, seed=0, train_mlp=True, train_attn=True, train_unembed=True)
    adapter = host.add_adapter(spec)
    host.activate_training(adapter)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in host.adapter_parameters(adapter).values():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return host, adapter


@st.composite
def datum_groups(draw: st.DrawFn) -> tuple[list[list[int]], list[np.ndarray]]:
    """Inputs and targets: 1-3 groups of 1-4 datums, each a group prompt + its own completion
    (0-8 tokens); targets random, ignored at random positions (more often in the prompt)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    inputs: list[list[int]] = []
    targets: list[np.ndarray] = []
    for _group in range(draw(st.integers(1, 3))):
        prompt = rng.integers(1, 500, draw(st.integers(1, 24))).tolist()
        for _member in range(draw(st.integers(1, 4))):
            tokens = prompt + rng.integers(1, 500, draw(st.integers(0, 8))).tolist()
            if not tokens:
                continue
            target = rng.integers(0, 500, len(tokens))
            ignored = rng.random(len(tokens)) < np.where(
                np.arange(len(tokens)) < len(prompt), 0.7, 0.2
            )
            target[ignored] = IGNORE_INDEX
            inputs.append(tokens)
            targets.append(target)
    order = rng.permutation(len(inputs))  # the groups' datums need not be neighbours
    return [inputs[i] for i in order], [targets[i] for i in order]


def logprobs_and_gradients(
    host: ModelHost,
    adapter: str,
    inputs: Sequence[Sequence[int]],
    targets: Sequence[np.ndarray],
    *,
    shared: bool,
    auto_shift: bool,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The concatenated log-probs, and the LoRA gradients of their weighted sum: through the
    shared-prefix forward, or through `ModelHost.target_logprobs` (one row per datum)."""
    forward = shared_prefix.target_logprobs if shared else ModelHost.target_logprobs
    parameters = list(host.adapter_parameters(adapter).values())
    for parameter in parameters:
        parameter.grad = None
    with torch.enable_grad():
        logprobs = torch.cat(forward(host, inputs, targets, auto_shift=auto_shift))
        weights = torch.from_numpy(
            np.random.default_rng(len(logprobs)).normal(size=len(logprobs)).astype(np.float32)
        )
        (logprobs * weights).sum().backward()
    return logprobs.detach(), [parameter.grad.clone() for parameter in parameters]


@pytest.mark.parametrize("path", ["merged step", "peft forward", "sdpa attention"])
@settings(max_examples=15)
@given(batch=datum_groups(), auto_shift=st.booleans())
def test_shared_prefix_forward_matches_one_row_per_datum(
    host: tuple[ModelHost, str],
    path: str,
    batch: tuple[list[list[int]], list[np.ndarray]],
    auto_shift: bool,
) -> None:
    model_host, adapter = host
    inputs, targets = batch
    limits = shared_prefix.MERGED_STEP_MAX_PARAMETERS, shared_prefix.MATMUL_ATTENTION_SCORES
    if path == "peft forward":  # what a model above the merged step's size runs
        shared_prefix.MERGED_STEP_MAX_PARAMETERS = 0
    if path == "sdpa attention":  # what rows too long for the matmul attention take
        shared_prefix.MATMUL_ATTENTION_SCORES = 0
    try:
        shared, shared_gradients = logprobs_and_gradients(
            model_host, adapter, inputs, targets, shared=True, auto_shift=auto_shift
        )
    finally:
        shared_prefix.MERGED_STEP_MAX_PARAMETERS, shared_prefix.MATMUL_ATTENTION_SCORES = limits
    plain, plain_gradients = logprobs_and_gradients(
        model_host, adapter, inputs, targets, shared=False, auto_shift=auto_shift
    )
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared, plain, rtol=0.0, atol=LOGPROB_ATOL)
    scale = max(float(gradient.abs().max()) for gradient in plain_gradients)
    for got, expected in zip(shared_gradients, plain_gradients, strict=True):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=GRADIENT_RTOL * max(scale, 1.0))


@settings(max_examples=60)
@given(
    inputs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=8),
    weight=st.sampled_from([0.0, 1e-3, 0.1]),
)
def test_groups_partition_the_datums_and_never_cost_more(
    inputs: list[list[int]], weight: float
) -> None:
    groups = group_by_prefix(inputs, weight)
    members = sorted(member for group in groups for member in group.members)
    assert members == list(range(len(inputs)))
    for group in groups:
        prefix = inputs[group.members[0]][: group.prefix_length]
        for member in group.members:
            assert inputs[member][: group.prefix_length] == prefix
        if len(group.members) == 1:
            assert group.prefix_length == len(inputs[group.members[0]])
        else:
            assert group.prefix_length >= 1
    packed_cost = sum(
        row_cost(
            sum(len(inputs[m]) for m in group.members)
            - (len(group.members) - 1) * group.prefix_length,
            weight,
        )
        for group in groups
    )
    assert packed_cost <= sum(row_cost(len(tokens), weight) for tokens in inputs) + 1e-9


def test_a_grpo_group_is_one_row_with_its_prompt_once() -> None:
    prompt = list(range(10, 40))
    inputs = [prompt + [100 + member] * (member + 1) for member in range(8)]
    (group,) = group_by_prefix(inputs)
    assert sorted(group.members) == list(range(8)) and group.prefix_length == len(prompt)
    packed = pack_rows(inputs, [group])
    assert packed.input_ids_RL.shape == (1, len(prompt) + sum(range(1, 9)))
    # Member 2's last token sees the prompt and its own tokens, nothing of the others.
    column = int(packed.column_N[sum(len(tokens) for tokens in inputs[:3]) - 1])
    seen = packed.attends_RLL[0, 0, column].nonzero().flatten().tolist()
    own = [int(c) for c in packed.column_N[sum(map(len, inputs[:2])) : sum(map(len, inputs[:3]))]]
    assert seen == own
    assert packed.position_ids_RL[0, column] == len(inputs[2]) - 1


def grpo_group_datums(groups: int = 2, size: int = 4, seed: int = 0) -> list[Datum]:
    """GRPO datums: each group's members share a prompt (its targets ignored), then differ."""
    rng = np.random.default_rng(seed)
    datums = []
    for _group in range(groups):
        prompt = rng.integers(4, 90, 14).tolist()
        for _member in range(size):
            tokens = prompt + rng.integers(4, 90, int(rng.integers(3, 9))).tolist()
            targets = np.array(tokens[1:], dtype=np.int64)
            targets[: len(prompt) - 1] = IGNORE_INDEX
            advantages = np.where(targets == IGNORE_INDEX, 0.0, rng.choice([-1.0, 1.0]))
            datums.append(
                Datum(
                    model_input=ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": TensorData.from_numpy(targets),
                        "logprobs": TensorData.from_numpy(
                            np.where(advantages != 0, -4.0, 0.0).astype(np.float32)
                        ),
                        "advantages": TensorData.from_numpy(advantages.astype(np.float32)),
                    },
                )
            )
    return datums


def test_forward_backward_shares_the_prompts_and_trains_as_unshared(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tiny, "load_tiny_model", lambda *_: tiny.init_tiny_model(0))
    packed: list[int] = []
    pack = shared_prefix.pack_rows
    monkeypatch.setattr(
        shared_prefix,
        "pack_rows",
        lambda inputs, groups: packed.append(len(groups)) or pack(inputs, groups),
    )
    datums = grpo_group_datums()
    results = []
    for shared in (True, False):
        with LocalServiceClient(root=tmp_path / str(shared), seed=0) as service:
            client = service.create_lora_training_client(tiny.TINY_MODEL_NAME, rank=4, seed=3)
            client._host.shared_prefix_forward = shared
            for call in range(2):  # the second call runs on trained, non-zero LoRA B weights
                output = client.forward_backward(datums, "importance_sampling").result()
                if call == 0:
                    client.optim_step(AdamParams(learning_rate=1e-2)).result()
            grads = [parameter.grad.clone() for parameter in client._parameters]
            logprobs = torch.cat(
                [torch.tensor(out["logprobs"].data) for out in output.loss_fn_outputs]
            )
            results.append((output.metrics["loss_sum"], logprobs, grads))
    assert packed == [2, 2]  # the shared runs packed each group of 4 into one row
    (shared_loss, shared_lp, shared_grads), (plain_loss, plain_lp, plain_grads) = results
    torch.testing.assert_close(shared_lp, plain_lp, rtol=0.0, atol=LOGPROB_ATOL)
    assert shared_loss == pytest.approx(plain_loss, rel=1e-5, abs=LOGPROB_ATOL)
    scale = max(float(gradient.abs().max()) for gradient in plain_grads)
    assert scale > 0
    for got, expected in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=GRADIENT_RTOL * scale)
