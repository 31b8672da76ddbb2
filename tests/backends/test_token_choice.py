"""The sampler's token choice (``grpo/backends/local/sampler/choice.py``) on hand-made logits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.backends.local.sampler.choice import _inverse_cdf, choose_tokens


def test_a_draw_rounded_past_the_last_token_lands_on_the_last_positive_one() -> None:
    # u·total at the very top of the CDF: searchsorted points past every token; the tail
    # holds tokens of weight 0 (filtered out), so the draw must move back to the last
    # token of positive weight, with a finite log-prob.
    # The third row's tail weight underflows to 0 (exp(-1000)) with a finite log-weight.
    log_weights = torch.tensor(
        [[0.0, 0.0, -math.inf, -math.inf], [0.0, math.log(3), 0.0, 0.0], [0.0, 0.0, 0.0, -1e3]],
        dtype=torch.float64,
    )
    index, logprob = _inverse_cdf(log_weights, torch.ones(3, dtype=torch.float64))
    assert index.tolist() == [1, 3, 2]
    expected = torch.tensor([math.log(0.5), math.log(1 / 6), math.log(1 / 3)]).double()
    assert torch.allclose(logprob, expected)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(2, 40),
    st.lists(st.sampled_from([0.0, 0.7, 1.0, 1.3]), min_size=6, max_size=6),
    st.lists(st.sampled_from([0, 1, 3]), min_size=6, max_size=6),
    st.lists(st.sampled_from([1.0, 0.9, 0.5]), min_size=6, max_size=6),
    st.integers(0, 2**31),
)
def test_each_row_chooses_as_it_would_alone(
    rows: int,
    vocab: int,
    temperatures: list[float],
    top_ks: list[int],
    top_ps: list[float],
    seed: int,
) -> None:
    """Rows never influence each other: a batch (mixed temperatures, top-k, top-p, greedy)
    chooses for every row what that row alone chooses, bit for bit; the log-prob of a
    sampled token is that of the filtered, renormalised distribution it was drawn from."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator) * 3
    uniforms = torch.rand(rows, generator=generator, dtype=torch.float64)
    temperature = torch.tensor(temperatures[:rows], dtype=torch.float64)
    top_k = torch.tensor([k if k > 0 else vocab for k in top_ks[:rows]])
    top_p = torch.tensor(top_ps[:rows], dtype=torch.float64)
    tokens, logprobs = choose_tokens(logits, temperature, top_k, top_p, uniforms)
    for row in range(rows):
        alone = choose_tokens(
            logits[row : row + 1],
            temperature[row : row + 1],
            top_k[row : row + 1],
            top_p[row : row + 1],
            uniforms[row : row + 1],
        )
        assert (tokens[row].item(), logprobs[row].item()) == (alone[0].item(), alone[1].item())
        if temperature[row] == 0:
            assert tokens[row] == logits[row].argmax() and logprobs[row] == 0
            continue
        distribution = torch.log_softmax(logits[row].double() / temperature[row], dim=-1)
        assert distribution[tokens[row]] <= logprobs[row] + 1e-12  # renormalised: never lower
        if top_k[row] >= vocab and top_p[row] == 1:
            expected = distribution[tokens[row]].item()
            assert math.isclose(logprobs[row].item(), expected, abs_tol=1e-9)
