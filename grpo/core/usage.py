"""Token usage and its cost: what a run sends to the sampler, samples, trains and forwards.

Six kinds of tokens (docs/FORMULAS.md, "Usage and cost"), each with where it comes from:

- ``prompt_tokens``: tokens sent to a sampler. For ``sample`` calls the service's own count
  (``SampleResponse.input_tokens``); the client's count (the prompt's length) where the
  response reports 0, and for ``compute_logprobs`` (reference log-probs), which reports none.
- ``completion_tokens``: tokens sampled, ``SampleResponse.output_tokens`` (the client's
  count, the completions' lengths, where the response reports 0).
- ``trained_tokens``: counted by the client: the positions of every datum of every
  ``forward_backward`` (prompt positions included), once per pass (epoch).
- ``forward_tokens``: counted by the client: forward-only positions, i.e. the extra forward
  PyTRIO's SDK runs before a custom loss, and the one-minibatch forward that checks the
  weights before each checkpoint.
- ``judge_prompt_tokens``, ``judge_completion_tokens``: what a judge reward
  (`grpo.rewards:judge`, `judge_rank`) sent to its judge and got back: the sampler's counts
  for a judge on the run's backend, an endpoint's reported ``usage`` (docs/FORMULAS.md,
  "Judge rewards"); priced at the prompt and completion prices.

Cost = Σ_kind tokens_kind × price_kind / 10^6, with prices per million tokens that the
user supplies (no price is built in).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from grpo.core.records import ScoredGroup, TokenBatch

__all__ = [
    "USAGE_KINDS",
    "Prices",
    "TokenUsage",
    "cost",
    "planned_episode_tokens",
    "planned_teacher_tokens",
    "planned_usage",
    "reference_usage",
    "sample_usage",
    "training_usage",
    "usage_from_row",
    "usage_metrics",
]

USAGE_KINDS = (
    "prompt_tokens",
    "completion_tokens",
    "trained_tokens",
    "forward_tokens",
    "judge_prompt_tokens",
    "judge_completion_tokens",
)
PER_MILLION = 1_000_000


def _count(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"TokenUsage.{attribute.name} must be an integer >= 0, got {value!r}")


@attrs.frozen
class TokenUsage:
    """Token counts of the six kinds (see the module docstring for each one's source)."""

    prompt_tokens: int = attrs.field(default=0, validator=_count)
    completion_tokens: int = attrs.field(default=0, validator=_count)
    trained_tokens: int = attrs.field(default=0, validator=_count)
    forward_tokens: int = attrs.field(default=0, validator=_count)
    judge_prompt_tokens: int = attrs.field(default=0, validator=_count)
    judge_completion_tokens: int = attrs.field(default=0, validator=_count)

    def __add__(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(*(getattr(self, kind) + getattr(other, kind) for kind in USAGE_KINDS))

    @property
    def total(self) -> int:
        """All six kinds together."""
        return sum(getattr(self, kind) for kind in USAGE_KINDS)


def _price(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"price {attribute.name} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"price {attribute.name} must be finite and >= 0, got {value!r}")


@attrs.frozen
class Prices:
    """Prices per million tokens of each kind, in `currency`, and where they come from."""

    currency: str
    prompt: float = attrs.field(validator=_price)
    completion: float = attrs.field(validator=_price)
    train: float = attrs.field(validator=_price)
    forward: float = attrs.field(validator=_price)
    source: str = ""
    """Who supplied them (a price file, flags): shown next to every cost."""

    def per_kind(self) -> dict[str, float]:
        """The price of each usage kind, per million tokens (a judge's at prompt/completion)."""
        rates = (
            self.prompt,
            self.completion,
            self.train,
            self.forward,
            self.prompt,
            self.completion,
        )
        return dict(zip(USAGE_KINDS, rates, strict=True))


def cost(usage: TokenUsage, prices: Prices) -> float:
    """Σ_kind tokens_kind × price_kind / 10^6 (prices per million tokens)."""
    rates = prices.per_kind()
    return sum(getattr(usage, kind) * rates[kind] for kind in USAGE_KINDS) / PER_MILLION


def sample_usage(
    input_tokens: int, output_tokens: int, prompt_len: int, completion_lens: Iterable[int]
) -> TokenUsage:
    """One ``sample`` call: the service's counts, the client's where the service reports 0."""
    sampled = sum(completion_lens)
    return TokenUsage(
        prompt_tokens=input_tokens if input_tokens > 0 else prompt_len,
        completion_tokens=output_tokens if output_tokens > 0 else sampled,
    )


def reference_usage(groups: Sequence[ScoredGroup]) -> TokenUsage:
    """Reference log-probs: one ``compute_logprobs`` of prompt + completion per completion."""
    return TokenUsage(
        prompt_tokens=sum(
            group.prompt_tokens.size + completion.tokens.size
            for group in groups
            for completion in group.completions
        )
    )


def training_usage(parts: Sequence[TokenBatch], *, passes: int, extra_forward: bool) -> TokenUsage:
    """``passes`` × Σ positions of the minibatches (as many forward-only with extra_forward)."""
    positions = passes * sum(part.num_tokens for part in parts)
    return TokenUsage(trained_tokens=positions, forward_tokens=positions if extra_forward else 0)


def usage_metrics(
    step: TokenUsage, cumulative: TokenUsage, prices: Prices | None
) -> dict[str, float]:
    """``usage/<kind>`` of the step, ``usage/cum_<kind>`` so far, ``cost/step`` and ``cost/cum``."""
    metrics = {f"usage/{kind}": float(getattr(step, kind)) for kind in USAGE_KINDS}
    metrics.update({f"usage/cum_{kind}": float(getattr(cumulative, kind)) for kind in USAGE_KINDS})
    metrics["usage/cum_tokens"] = float(cumulative.total)
    if prices is not None:
        metrics["cost/step"] = cost(step, prices)
        metrics["cost/cum"] = cost(cumulative, prices)
    return metrics


def planned_teacher_tokens(
    teacher_prompt_lens: Sequence[int], group_size: int, max_tokens: int
) -> int:
    """The bound on one step's teacher tokens: G·Σ_b (p_T,b + max_tokens)."""
    return group_size * sum(p + max_tokens for p in teacher_prompt_lens)


def usage_from_row(row: Mapping[str, object]) -> TokenUsage:
    """The cumulative usage a metrics row records (zero for a row without usage keys)."""
    return TokenUsage(*(int(row.get(f"usage/cum_{kind}", 0) or 0) for kind in USAGE_KINDS))


def planned_usage(
    prompt_lens_by_step: Sequence[Sequence[int]],
    eval_prompt_lens: Sequence[int],
    *,
    group_size: int,
    max_tokens: int,
    epochs: int,
    num_evals: int,
    num_checkpoints: int,
    with_reference: bool,
    extra_forward: bool,
    proximal_forward: bool = False,
    teacher_prompt_lens_by_step: Sequence[Sequence[int]] | None = None,
    extra_prompt_lens_by_step: Sequence[Sequence[int]] | None = None,
) -> TokenUsage:
    """An upper bound on a run's usage, exact in the prompts it sends for sampling.

    Every group trains (none degenerate) and every completion is ``max_tokens`` long, so a
    completion of prompt length p has at most p + max_tokens − 1 positions. Per step with
    prompts p_b: prompts Σ p_b (one request per prompt), completions ≤ B·G·max_tokens,
    trained ≤ epochs·G·Σ (p_b + max_tokens − 1), reference log-probs ≤ G·Σ (p_b + max_tokens);
    each evaluation sends its prompts once and samples ≤ max_tokens per problem; each
    checkpoint check forwards at most one step's batch; with proximal_forward (a mismatch
    correction) every step forwards its batch once more; with teacher prompt lengths
    (distillation) every step sends the teacher ≤ G·Σ (p_T,b + max_tokens) prompt tokens.
    With extra prompt lengths (dynamic sampling: every extra round's prompts of a step, as
    if every round ran) those are sampled too, and the B trained groups are bounded by the
    B longest prompts of all the step's rounds (docs/FORMULAS.md, "Dry-run bound").
    """
    total = TokenUsage()
    largest_batch = 0
    extra_by_step = extra_prompt_lens_by_step or [()] * len(prompt_lens_by_step)
    for prompt_lens, extra_lens in zip(prompt_lens_by_step, extra_by_step, strict=True):
        sampled = [*prompt_lens, *extra_lens]
        trained = sorted(sampled, reverse=True)[: len(prompt_lens)]
        positions = group_size * sum(p + max_tokens - 1 for p in trained)
        largest_batch = max(largest_batch, positions)
        total += TokenUsage(
            prompt_tokens=sum(sampled)
            + (group_size * sum(p + max_tokens for p in trained) if with_reference else 0),
            completion_tokens=len(sampled) * group_size * max_tokens,
            trained_tokens=epochs * positions,
            forward_tokens=(epochs * positions if extra_forward else 0)
            + (positions if proximal_forward else 0),
        )
    for teacher_lens in teacher_prompt_lens_by_step or ():
        total += TokenUsage(
            prompt_tokens=planned_teacher_tokens(teacher_lens, group_size, max_tokens)
        )
    evaluation = TokenUsage(
        prompt_tokens=sum(eval_prompt_lens), completion_tokens=len(eval_prompt_lens) * max_tokens
    )
    for _ in range(num_evals):
        total += evaluation
    return total + TokenUsage(forward_tokens=num_checkpoints * largest_batch)


def planned_episode_tokens(
    episodes_by_step: Sequence[int],
    num_eval_episodes: int,
    *,
    max_turns: int,
    max_tokens: int,
    num_evals: int,
    max_rounds: int = 1,
) -> int:
    """An upper bound on the tokens an --env run samples: T·M per episode.

    An episode samples at most T = ``max_turns`` turns of at most M = ``max_tokens`` tokens;
    a step plays E_s episodes (B·G) in each of at most ``max_rounds`` rounds (dynamic
    sampling), each evaluation ``num_eval_episodes``: Σ_s R·E_s·T·M + num_evals·n_test·T·M.
    """
    per_episode = max_turns * max_tokens
    trained = sum(max_rounds * episodes for episodes in episodes_by_step)
    return per_episode * (trained + num_evals * num_eval_episodes)
