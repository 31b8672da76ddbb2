"""Preference optimization (DPO and its variants), the pure parts (docs/FORMULAS.md,
"Preference optimization").

- `PreferencePair`: a prompt with a chosen and a rejected completion, each an `SftExample`
  (tokens and the mask of the completion's tokens);
- `sequence_logprobs`: log π(y|x) = Σ_t m_t · lp_t of each sequence of a packed batch;
- `dpo_loss`: the loss of P pairs from their sequence log-probs under the policy and the
  reference, vectorized over pairs, for `--dpo-loss` sigmoid (with label smoothing:
  conservative DPO), ipo or hinge, plus the optional SFT term on the chosen completions
  (RPO), and the metrics (implicit rewards, margin, accuracy);
- `pair_batches`: the pairs of every step, seeded passes laid end to end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.core.sft import SftExample

DPO_LOSSES = ("sigmoid", "ipo", "hinge")
METRICS = (
    "loss",
    "accuracy",
    "margin",
    "chosen_reward",
    "rejected_reward",
    "chosen_logprob",
    "rejected_logprob",
)


@attrs.frozen
class PreferencePair:
    """One prompt x with completions y_w (chosen) and y_l (rejected), encoded as SFT rows."""

    chosen: SftExample
    rejected: SftExample

    @property
    def num_positions(self) -> int:
        """Positions of its two datums."""
        return self.chosen.num_positions + self.rejected.num_positions

    @property
    def num_tokens(self) -> int:
        """Tokens of its two sequences (what the reference's compute_logprobs reads)."""
        return int(self.chosen.tokens_T.size + self.rejected.tokens_T.size)

    @property
    def is_degenerate(self) -> bool:
        """Chosen and rejected encode to the same tokens and mask: their margin is 0 under
        any weights, so the pair teaches no preference (its loss stays log 2)."""
        chosen, rejected = self.chosen, self.rejected
        return np.array_equal(chosen.tokens_T, rejected.tokens_T) and np.array_equal(
            chosen.mask_T, rejected.mask_T
        )


@attrs.frozen
class DpoSettings:
    """β, the per-pair loss, label smoothing ε (sigmoid only) and the SFT weight α."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    sft_weight: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"beta must be a finite number > 0, got {self.beta}")
        if self.loss not in DPO_LOSSES:
            raise ValueError(f"loss must be one of {', '.join(DPO_LOSSES)}, got {self.loss!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing > 0 and self.loss != "sigmoid":
            raise ValueError(
                f"label smoothing applies to the sigmoid loss only, not {self.loss!r}; "
                "drop --label-smoothing or use --dpo-loss sigmoid"
            )
        if not (math.isfinite(self.sft_weight) and self.sft_weight >= 0):
            raise ValueError(f"sft_weight must be a finite number >= 0, got {self.sft_weight}")


def sequence_logprobs(logprobs_N: Tensor, mask_N: Tensor, seq_lens_B: Sequence[int]) -> Tensor:
    """log π(y|x) of each packed sequence: Σ_t m_t · lp_t over its positions (B values)."""
    if logprobs_N.shape != mask_N.shape or logprobs_N.dim() != 1:
        raise ValueError(
            f"logprobs_N {tuple(logprobs_N.shape)} and mask_N {tuple(mask_N.shape)} must be "
            "1-D and of one shape"
        )
    lengths = torch.as_tensor(list(seq_lens_B), dtype=torch.long)
    if int(lengths.sum()) != logprobs_N.numel():
        raise ValueError(
            f"seq_lens sum to {int(lengths.sum())} but there are {logprobs_N.numel()} positions"
        )
    segment_N = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    # Masked positions may hold any finite value: zero them before they are summed.
    masked = torch.where(mask_N.bool(), logprobs_N, torch.zeros_like(logprobs_N))
    return torch.zeros(lengths.numel(), dtype=logprobs_N.dtype).index_add(0, segment_N, masked)


def pair_loss(h_P: Tensor, delta_P: Tensor, settings: DpoSettings) -> Tensor:
    """ℓ_p of `settings.loss` from h = β·Δ (sigmoid, hinge) or Δ (ipo)."""
    if settings.loss == "sigmoid":
        eps = settings.label_smoothing
        # logsigmoid is exact for any finite h (softplus turns linear above 20: 1e-9 off).
        return -(1 - eps) * F.logsigmoid(h_P) - eps * F.logsigmoid(-h_P)
    if settings.loss == "ipo":
        return (delta_P - 1 / (2 * settings.beta)) ** 2
    return torch.relu(1 - h_P)


def dpo_loss(
    policy_chosen_P: Tensor,
    policy_rejected_P: Tensor,
    ref_chosen_P: Tensor,
    ref_rejected_P: Tensor,
    settings: DpoSettings,
    chosen_tokens_P: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """L = mean_p ℓ_p + α·L_sft and the metrics, from per-pair sequence log-probs.

    ρ = log π − sg(log π_ref) per completion, Δ = ρ_w − ρ_l, h = β·Δ; L_sft =
    −Σ_p log π(y_w,p) / Σ_p n_w,p needs ``chosen_tokens_P`` (n_w) when α > 0. Metrics:
    the implicit rewards β·ρ, their margin and accuracy (r_w > r_l), the mean log-probs.
    """
    shapes = {tuple(t.shape) for t in (policy_chosen_P, policy_rejected_P, ref_chosen_P)}
    if len(shapes | {tuple(ref_rejected_P.shape)}) != 1 or policy_chosen_P.dim() != 1:
        raise ValueError("the four sequence log-prob tensors must be 1-D and of one shape (P,)")
    if policy_chosen_P.numel() == 0:
        raise ValueError("dpo_loss needs at least one pair")
    rho_chosen_P = policy_chosen_P - ref_chosen_P.detach()
    rho_rejected_P = policy_rejected_P - ref_rejected_P.detach()
    delta_P = rho_chosen_P - rho_rejected_P
    h_P = settings.beta * delta_P
    loss = pair_loss(h_P, delta_P, settings).mean()
    metrics: dict[str, float] = {}
    if settings.sft_weight > 0:
        if chosen_tokens_P is None:
            raise ValueError("the SFT term needs chosen_tokens_P (completion tokens per pair)")
        sft = -policy_chosen_P.sum() / chosen_tokens_P.to(policy_chosen_P.dtype).sum()
        loss = loss + settings.sft_weight * sft
        metrics["sft_loss"] = float(sft.detach())
    with torch.no_grad():
        chosen_reward_P = settings.beta * rho_chosen_P
        rejected_reward_P = settings.beta * rho_rejected_P
        metrics.update(
            {
                "loss": float(loss.detach()),
                "accuracy": float((chosen_reward_P > rejected_reward_P).double().mean()),
                "margin": float((chosen_reward_P - rejected_reward_P).mean()),
                "chosen_reward": float(chosen_reward_P.mean()),
                "rejected_reward": float(rejected_reward_P.mean()),
                "chosen_logprob": float(policy_chosen_P.detach().mean()),
                "rejected_logprob": float(policy_rejected_P.detach().mean()),
            }
        )
    return loss, metrics


def pair_batches(num_pairs: int, *, batch_size: int, steps: int, seed: int) -> list[np.ndarray]:
    """Pair indices of each of ``steps`` steps: permutations seeded by (seed, pass) laid end
    to end, cut into consecutive windows of ``batch_size`` (min(batch_size, num_pairs))."""
    if num_pairs < 1 or batch_size < 1 or steps < 1:
        raise ValueError(
            f"need pairs, batch size and steps >= 1, got {num_pairs}, {batch_size}, {steps}"
        )
    size = min(batch_size, num_pairs)
    passes = math.ceil(steps * size / num_pairs)
    order = np.concatenate(
        [np.random.default_rng([seed, 2, e]).permutation(num_pairs) for e in range(passes)]
    )
    return [order[step * size : (step + 1) * size] for step in range(steps)]


def steps_of_one_pass(num_pairs: int, batch_size: int) -> int:
    """Steps of one pass over the pairs (`--steps 0`): ceil(pairs / batch size)."""
    return math.ceil(num_pairs / max(1, min(batch_size, num_pairs)))
