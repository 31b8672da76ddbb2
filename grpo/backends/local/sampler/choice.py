"""Choosing tokens: each sequence's own uniform stream and the filtered inverse-CDF draw.

Sample ``i`` of a request seeded ``s`` draws its uniforms from
``numpy.random.default_rng([s, i])``; ``choose_tokens`` picks each row's token by inverse
CDF of softmax(logits / T) filtered by top-k then top-p, rows never influencing each other.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def choose_tokens(
    logits_RV: Tensor, temperature_R: Tensor, top_k_R: Tensor, top_p_R: Tensor, uniform_R: Tensor
) -> tuple[Tensor, Tensor]:
    """Tokens by inverse CDF of u under softmax(logits/T) filtered by top-k then top-p.

    Returns the tokens and their log-probs under that filtered, renormalised distribution
    (0 for greedy rows, temperature 0). Rows never influence each other.
    """
    logits = logits_RV.to(torch.float64)
    greedy = temperature_R == 0
    if bool((temperature_R == 1).all()):
        scaled = logits  # x / 1 = x exactly: one pass over the logits saved
    else:
        scaled = logits / torch.where(greedy, 1.0, temperature_R).unsqueeze(-1)
    vocab = logits.shape[-1]
    filtered = (top_k_R < vocab) | (top_p_R < 1)
    plain = (~greedy & ~filtered).nonzero().squeeze(-1)
    if plain.numel() == len(logits):  # the usual batch: every row samples the full softmax
        return _inverse_cdf(scaled, uniform_R)

    tokens = torch.empty(len(logits), dtype=torch.long)
    chosen = torch.zeros(len(logits), dtype=torch.float64)
    if plain.numel():
        picked, picked_logprobs = _inverse_cdf(scaled[plain], uniform_R[plain])
        tokens[plain], chosen[plain] = picked, picked_logprobs

    nucleus = (~greedy & filtered).nonzero().squeeze(-1)
    if nucleus.numel():
        logprobs = torch.log_softmax(scaled[nucleus], dim=-1)
        sorted_logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab)
        keep = rank < top_k_R[nucleus].unsqueeze(-1)
        after_top_k = torch.where(keep, sorted_logprobs, -math.inf).log_softmax(dim=-1)
        probs = after_top_k.exp()
        keep &= (probs.cumsum(-1) - probs) < top_p_R[nucleus].unsqueeze(-1)
        position, picked_logprobs = _inverse_cdf(
            torch.where(keep, sorted_logprobs, -math.inf), uniform_R[nucleus]
        )
        tokens[nucleus] = order.gather(-1, position.unsqueeze(-1)).squeeze(-1)
        chosen[nucleus] = picked_logprobs

    greedy_rows = greedy.nonzero().squeeze(-1)
    if greedy_rows.numel():
        tokens[greedy_rows] = logits[greedy_rows].argmax(dim=-1)  # log-prob stays 0
    return tokens, chosen


def _inverse_cdf(log_weights: Tensor, uniform: Tensor) -> tuple[Tensor, Tensor]:
    """Index of the first cumulative weight above u·total, and its normalised log-prob.

    `log_weights` are unnormalised log-probabilities (-inf for excluded tokens); one
    `exp` serves both the draw and the log-prob: log p_i = (w_i - max w) - log Σ e^(w - max w).
    """
    shifted = log_weights - log_weights.amax(dim=-1, keepdim=True)
    weights = shifted.exp()
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1]
    index = torch.searchsorted(cdf, (uniform * total).unsqueeze(-1), right=True)
    index = index.clamp_(max=weights.shape[-1] - 1)
    # Rounding can put u·total at the very top, past the last token of positive weight: the
    # first cumulative weight above u·total always has a positive weight of its own, so a
    # picked weight of 0 (excluded, or exp underflowed) is that case; move it back to the
    # last token of positive weight.
    if bool((weights.gather(-1, index) == 0).any()):
        last_positive = weights.shape[-1] - 1 - (weights > 0).flip(-1).to(torch.int8).argmax(dim=-1)
        index = torch.minimum(index.squeeze(-1), last_positive).unsqueeze(-1)
    return index.squeeze(-1), shifted.gather(-1, index).squeeze(-1) - total.log()


def _uniforms(seed: int, sample_index: int, count: int) -> np.ndarray:
    """The uniform draws of sample `sample_index` of a request seeded `seed` (its own stream)."""
    return np.random.default_rng([seed % (1 << 64), sample_index]).random(count)
