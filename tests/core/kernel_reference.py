"""The loss kernels' per-token reference, written from docs/FORMULAS.md, and the helpers
that run a kernel against it (shared by the kernel, packing and reduction tests)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from grpo.core import losses
from tests.strategies import PackedLossBatch

KERNELS = sorted(losses.LOSSES)
POLICY_KERNELS = [name for name in KERNELS if name != "cross_entropy"]
NORM_LENGTH = 7.0
# Each law holds on both paths: the eager kernel and the single-pass fused form. The tests
# run the fused form uncompiled (the `uncompiled_fused_forms` fixture of conftest.py);
# tests/core/test_fused_losses.py checks the compiled form against the eager kernel.
PATHS = pytest.mark.parametrize("fused", [False, True], ids=["eager", "fused"])


def norm_length_for(reduction: str) -> float | None:
    """The test's norm_length L for ``seq_mean_token_sum_norm``, None for other reductions."""
    return NORM_LENGTH if reduction == "seq_mean_token_sum_norm" else None


# --- the reference: one token at a time, Python floats, docs/FORMULAS.md verbatim ------


def _clip(value: float, low: float, high: float) -> float:
    return min(max(value, low), high)


def _clipped_surrogate(
    ratio: float, advantage: float, low: float, high: float, dual_clip: float | None
) -> tuple[float, float]:
    """(o, do/dr) of min(r·A, clip(r, lo, hi)·A), dual-clipped at c·A for A < 0."""
    objective = min(ratio * advantage, _clip(ratio, low, high) * advantage)
    clipped_side = (advantage > 0 and ratio > high) or (advantage < 0 and ratio < low)
    slope = 0.0 if clipped_side else advantage
    if dual_clip is not None and advantage < 0 and dual_clip * advantage > objective:
        objective, slope = dual_clip * advantage, 0.0
    return objective, slope


def _token_objective(
    name: str, config: dict, logprob: float, sampling_logprob: float, advantage: float
) -> tuple[float, float]:
    """(o_t, do_t/dlp_t) for one masked-in token."""
    log_ratio = logprob - sampling_logprob
    if name == "cross_entropy":
        return advantage * logprob, advantage
    if name == "dro":
        beta = config["beta"]
        return logprob * advantage - beta / 2 * log_ratio**2, advantage - beta * log_ratio
    ratio = math.exp(log_ratio)
    if name == "importance_sampling":
        return ratio * advantage, ratio * advantage
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    if name == "cispo":
        weight = _clip(ratio, low, high) * advantage
        return weight * logprob, weight
    assert name == "ppo"
    objective, slope = _clipped_surrogate(ratio, advantage, low, high, config["dual_clip"])
    return objective, slope * ratio


def reference(
    name: str,
    config: dict,
    batch: PackedLossBatch,
    reduction: str,
    norm_length: float | None = None,
) -> tuple[float, np.ndarray, dict[str, float]]:
    """(loss, d loss/d lp, metrics) straight from docs/FORMULAS.md, token by token."""
    config = losses.resolve_config(name, config)
    gradient = np.zeros(batch.logprobs.size)
    sequences = [
        [t for t in range(piece.start, piece.stop) if batch.mask[t]]
        for piece in batch.sequence_slices()
    ]
    trained_sequences = [tokens for tokens in sequences if tokens]
    num_sequences = len(trained_sequences)
    num_tokens = sum(len(tokens) for tokens in sequences)
    ratios, advantages = [], []
    loss = 0.0
    if name == "gspo":
        # Every sequence is one unit carrying ℓ_i; token sum -> ℓ_i and n_i -> 1.
        weight = {
            "sum": 1.0,
            "token_mean": 1 / max(num_sequences, 1),
            "seq_mean_token_mean": 1 / max(num_sequences, 1),
            "seq_mean_token_sum": 1 / max(num_sequences, 1),
            "seq_mean_token_sum_norm": 1 / max(num_sequences, 1) / (norm_length or 1),
        }[reduction]
        for tokens in trained_sequences:
            mean_log_ratio = sum(
                batch.logprobs[t] - batch.sampling_logprobs[t] for t in tokens
            ) / len(tokens)
            sequence_ratio = math.exp(mean_log_ratio)
            advantage = sum(batch.advantages[t] for t in tokens) / len(tokens)
            objective, slope = _clipped_surrogate(
                sequence_ratio,
                advantage,
                config["clip_low_threshold"],
                config["clip_high_threshold"],
                None,
            )
            loss -= weight * objective
            for t in tokens:
                gradient[t] = -weight * slope * sequence_ratio / len(tokens)
            ratios.append(sequence_ratio)
            advantages.append(advantage)
    else:
        for tokens in sequences:
            for t in tokens:
                weight = {
                    "sum": 1.0,
                    "token_mean": 1 / num_tokens,
                    "seq_mean_token_mean": 1 / (num_sequences * len(tokens)),
                    "seq_mean_token_sum": 1 / num_sequences,
                    "seq_mean_token_sum_norm": 1 / (num_sequences * (norm_length or 1)),
                }[reduction]
                objective, slope = _token_objective(
                    name,
                    config,
                    batch.logprobs[t],
                    batch.sampling_logprobs[t],
                    batch.advantages[t],
                )
                loss -= weight * objective
                gradient[t] = -weight * slope
                ratios.append(math.exp(batch.logprobs[t] - batch.sampling_logprobs[t]))
                advantages.append(batch.advantages[t])
    return loss, gradient, _reference_metrics(name, config, loss, num_tokens, ratios, advantages)


def _reference_metrics(
    name: str, config: dict, loss: float, num_tokens: int, ratios: list, advantages: list
) -> dict[str, float]:
    metrics = {"loss": loss, "train_tokens": float(num_tokens)}
    count = max(len(ratios), 1)
    metrics["ratio_mean"] = sum(ratios) / count
    metrics["ratio_min"] = min(ratios, default=0.0)
    metrics["ratio_max"] = max(ratios, default=0.0)
    low = config.get("clip_low_threshold", 0.0)
    high = config.get("clip_high_threshold", math.inf)
    dual_clip = config.get("dual_clip")
    below = [r < low for r in ratios]
    above = [r > high for r in ratios]
    if name in ("ppo", "gspo"):
        clipped = [
            (a > 0 and r > high)
            or (a < 0 and (r < low or (dual_clip is not None and r > dual_clip)))
            for r, a in zip(ratios, advantages, strict=True)
        ]
    elif name == "cispo":
        clipped = [b or h for b, h in zip(below, above, strict=True)]
        metrics["clipped_ratio_mean"] = sum(_clip(r, low, high) for r in ratios) / count
    else:
        clipped = below = above = []
    metrics["clip_fraction"] = sum(clipped) / count
    metrics["clip_low_fraction"] = sum(below) / count
    metrics["clip_high_fraction"] = sum(above) / count
    return metrics


def run_kernel(
    name: str,
    batch: PackedLossBatch,
    reduction: str = "sum",
    dtype: torch.dtype = torch.float64,
    *,
    fused: bool = False,
    scale: float = 1.0,
    **config: float | None,
) -> tuple[torch.Tensor, np.ndarray, dict[str, float]]:
    """(loss, d(scale·loss)/d lp as numpy, metrics) of the kernel on batch (eager or fused)."""
    logprobs, sampling_logprobs, advantages, mask = batch.tensors(dtype)
    loss, metrics = losses.LOSSES[name](
        logprobs,
        sampling_logprobs,
        advantages,
        mask=mask,
        seq_lens=batch.seq_lens,
        reduction=reduction,
        norm_length=norm_length_for(reduction),
        fused=fused and losses.LOSSES[name].fused_form is not None,
        **config,
    )
    (loss if scale == 1.0 else scale * loss).backward()
    assert logprobs.grad is not None
    return loss.detach(), logprobs.grad.numpy(), metrics


def term_scale(batch: PackedLossBatch) -> float:
    """Size of the largest per-token term: float64 sums are exact to ~1e-16 of it."""
    log_ratios = np.where(batch.mask, batch.logprobs - batch.sampling_logprobs, 0.0)
    trained = np.where(batch.mask, np.abs(batch.advantages) + 1, 1.0)
    return float(np.max(np.exp(np.abs(log_ratios)) * trained * 40, initial=1.0))


def assert_metrics_close(actual: dict[str, float], expected: dict[str, float]) -> None:
    """The same metric keys, each value equal to rel/abs 1e-9."""
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert math.isclose(
            actual[key], value, rel_tol=1e-9, abs_tol=1e-9 * max(1.0, abs(value))
        ), (
            key,
            actual[key],
            value,
        )
