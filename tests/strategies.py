"""Hypothesis strategies shared by the test suite (one place, per house style)."""

# --- records/rewards/advantages strategies ---
from decimal import Decimal  # noqa: E402
from functools import lru_cache  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from grpo.core.advantages import center  # noqa: E402
from grpo.core.records import Completion, ScoredGroup  # noqa: E402

VOCAB_SIZE = 50_000

# Strategy factories are cached: a composite that builds a fresh strategy on every draw
# pays hypothesis's validation each time, which dominated the run time.


@lru_cache(maxsize=None)
def token_arrays(min_size: int = 1, max_size: int = 12) -> st.SearchStrategy[np.ndarray]:
    """1-D int64 token ids."""
    return st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=min_size, max_size=max_size).map(
        lambda ids: np.array(ids, dtype=np.int64)
    )


@lru_cache(maxsize=None)
def logprob_arrays(size: int) -> st.SearchStrategy[np.ndarray]:
    """1-D float64 sampler log-probs (<= 0, finite) of the given length."""
    floats = st.floats(-30.0, 0.0, allow_nan=False)
    return st.lists(floats, min_size=size, max_size=size).map(
        lambda values: np.array(values, dtype=np.float64)
    )


@st.composite
def completions(draw: st.DrawFn, max_tokens: int = 12) -> Completion:
    """A valid Completion with 1..max_tokens tokens (log-probs from a drawn seed, for speed)."""
    tokens = draw(token_arrays(1, max_tokens))
    seed = draw(st.integers(0, 2**32 - 1))
    return Completion(
        tokens=tokens,
        logprobs=-np.random.default_rng(seed).exponential(2.0, size=tokens.size),
        text=draw(st.sampled_from(["", "so \\boxed{1}", "no answer"])),
        stop_reason=draw(st.sampled_from(["stop", "length"])),
    )


@lru_cache(maxsize=None)
def _binary_rewards(size: int) -> st.SearchStrategy[list[float]]:
    return st.lists(st.sampled_from([0.0, 1.0]), min_size=size, max_size=size)


@lru_cache(maxsize=None)
def _dyadic_rewards(size: int) -> st.SearchStrategy[list[float]]:
    # Multiples of 1/64 in [-8, 8]: shifts and power-of-two scalings stay exact.
    return st.lists(st.integers(-512, 512).map(lambda k: k / 64), min_size=size, max_size=size)


@lru_cache(maxsize=None)
def _near_constant_rewards(size: int) -> st.SearchStrategy[list[float]]:
    return st.tuples(
        st.floats(-1e3, 1e3, allow_nan=False),
        st.sampled_from([1e-15, 1e-12, 1e-9, 1e-6]),
        st.lists(st.integers(0, 3), min_size=size, max_size=size),
    ).map(lambda args: [args[0] + args[1] * k for k in args[2]])


@lru_cache(maxsize=None)
def group_rewards(size: int) -> st.SearchStrategy[list[float]]:
    """Rewards of one group: binary, dyadic, constant, near-constant, or general floats."""
    return st.one_of(
        _binary_rewards(size),
        _dyadic_rewards(size),
        st.floats(-10.0, 10.0, allow_nan=False).map(lambda value: [value] * size),
        _near_constant_rewards(size),
        st.lists(
            st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False),
            min_size=size,
            max_size=size,
        ),
    )


@st.composite
def reward_batches(
    draw: st.DrawFn, max_groups: int = 6, max_group_size: int = 8, rewards=group_rewards
) -> tuple[np.ndarray, np.ndarray]:
    """(rewards_N, group_sizes_B) of 1..max_groups ragged groups."""
    sizes = draw(st.lists(st.integers(1, max_group_size), min_size=1, max_size=max_groups))
    rewards = [reward for size in sizes for reward in draw(rewards(size))]
    return np.array(rewards, dtype=np.float64), np.array(sizes, dtype=np.int64)


@st.composite
def dyadic_reward_batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Like reward_batches, but every reward is a multiple of 1/64 (exact under shifts)."""
    return draw(reward_batches(rewards=_dyadic_rewards))


@st.composite
def scored_groups(draw: st.DrawFn, max_group_size: int = 5, max_prompt: int = 10) -> ScoredGroup:
    """A valid ScoredGroup: binary rewards (often degenerate) and centered advantages."""
    group_size = draw(st.integers(1, max_group_size))
    rewards = np.array(draw(_binary_rewards(group_size)))
    return ScoredGroup(
        prompt_tokens=draw(token_arrays(1, max_prompt)),
        completions=draw(_completion_lists(group_size)),
        rewards=rewards,
        advantages=center(rewards),
    )


@lru_cache(maxsize=None)
def _completion_lists(size: int) -> st.SearchStrategy[list[Completion]]:
    return st.lists(completions(), min_size=size, max_size=size)


@st.composite
def answer_numbers(draw: st.DrawFn) -> Decimal:
    """An exact decimal answer: small or large integers, up to 4 decimals, either sign."""
    integer_part = draw(st.one_of(st.integers(0, 20), st.integers(0, 10**12)))
    decimals = draw(st.integers(0, 4))
    fraction = draw(st.integers(0, 10**decimals - 1)) if decimals else 0
    magnitude = Decimal(integer_part) + Decimal(fraction).scaleb(-decimals)
    negative = magnitude != 0 and draw(st.booleans())
    return -magnitude if negative else magnitude


def _group_thousands(digits: str, separator: str) -> str:
    head = len(digits) % 3 or 3
    groups = [digits[:head]] + [digits[i : i + 3] for i in range(head, len(digits), 3)]
    return separator.join(groups)


@st.composite
def number_surface_forms(draw: st.DrawFn, value: Decimal) -> str:
    """One way a person or a model might write value: `$1,000.50`, ` −3 `, `5.`, `1{,}000` ..."""
    integer_digits, _, fraction_digits = format(abs(value), "f").partition(".")
    fraction_digits = fraction_digits.rstrip("0") + "0" * draw(st.integers(0, 3))
    if len(integer_digits) > 3:
        integer_digits = _group_thousands(
            integer_digits, draw(st.sampled_from(["", ",", "{,}", "\\,"]))
        )
    if integer_digits == "0" and fraction_digits and draw(st.booleans()):
        integer_digits = ""
    number = integer_digits + ("." + fraction_digits if fraction_digits else "")
    if value < 0:
        sign = draw(st.sampled_from(["-", "\u2212"]))
    else:
        sign = draw(st.sampled_from(["", "+"]))
    dollar = draw(st.sampled_from(["", "$", "\\$", "$ "]))
    form = draw(st.sampled_from([sign + dollar + number, dollar + sign + number]))
    if draw(st.booleans()):
        form += "."
    spaces = st.text(alphabet=" \t", max_size=2)
    return draw(spaces) + form + draw(spaces)


_PROSE = st.text(alphabet="abc xyz=+-*/().,:\n0123456789", max_size=20)


@st.composite
def boxed_responses(draw: st.DrawFn, answer: str) -> str:
    """A response whose last \\boxed{} holds answer, after prose and possibly earlier boxes."""
    earlier = draw(st.sampled_from(["", "\\boxed{7}", "\\boxed{\\frac{1}{2}} ", "{x{y}} "]))
    return draw(_PROSE) + earlier + draw(_PROSE) + "\\boxed{" + answer + "}" + draw(_PROSE)


# --- loss kernel strategies ---
import attrs  # noqa: E402
import pytrio  # noqa: E402
import torch  # noqa: E402

# Token values come from a numpy generator seeded by hypothesis: hypothesis draws the
# structure (lengths, mask rate, advantages, seed), so an example costs a few draws
# instead of four per token, and a failure still replays from its seed.


def _trained_log_ratios(rng: np.random.Generator, size: int) -> np.ndarray:
    """lp - lp_old on training tokens: exactly 0, inside GSPO's 1e-4-wide band, inside
    PPO's bounds, or large enough that r is huge or tiny (exp(±30))."""
    choices = np.stack(
        [
            np.zeros(size),
            rng.uniform(-1e-3, 1e-3, size),
            rng.uniform(-0.5, 0.5, size),
            rng.uniform(-30.0, 30.0, size),
        ]
    )
    return choices[rng.integers(0, len(choices), size), np.arange(size)]


def _masked_log_ratios(rng: np.random.Generator, size: int) -> np.ndarray:
    """Anything finite, including log-ratios whose exp overflows float32 and float64."""
    overflowing = rng.choice([-1000.0, -800.0, -100.0, 100.0, 800.0, 1000.0], size)
    return np.where(rng.random(size) < 0.5, overflowing, rng.uniform(-30.0, 30.0, size))


def _masked_advantages(rng: np.random.Generator, size: int) -> np.ndarray:
    extremes = rng.choice([-1e6, 0.0, 1e6], size)
    return np.where(rng.random(size) < 0.3, extremes, rng.uniform(-1e6, 1e6, size))


# Subnormal advantages halve to 0 in autograd's tie-splitting; real ones never are.
_SEQUENCE_ADVANTAGES = st.one_of(st.just(0.0), st.floats(-3.0, 3.0, allow_subnormal=False))
_MASK_RATES = st.sampled_from([0.0, 0.3, 0.7, 1.0])
_SEEDS = st.integers(0, 2**32 - 1)


@attrs.frozen
class PackedLossBatch:
    """Flat float64 kernel inputs over ragged packed sequences, with a bool mask."""

    logprobs: np.ndarray
    sampling_logprobs: np.ndarray
    advantages: np.ndarray
    mask: np.ndarray
    seq_lens: tuple[int, ...]

    def tensors(
        self, dtype: torch.dtype = torch.float64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs leaf with requires_grad, sampling_logprobs, advantages, mask)."""
        logprobs = torch.tensor(self.logprobs, dtype=dtype, requires_grad=True)
        return (
            logprobs,
            torch.tensor(self.sampling_logprobs, dtype=dtype),
            torch.tensor(self.advantages, dtype=dtype),
            torch.tensor(self.mask, dtype=torch.bool),
        )

    def sequence_slices(self) -> list[slice]:
        """The positions of each packed sequence."""
        ends = np.cumsum(self.seq_lens)
        return [
            slice(int(end - length), int(end))
            for end, length in zip(ends, self.seq_lens, strict=True)
        ]


@st.composite
def packed_loss_batches(
    draw: st.DrawFn,
    max_sequences: int = 5,
    max_len: int = 8,
    advantages: st.SearchStrategy[float] = _SEQUENCE_ADVANTAGES,
) -> PackedLossBatch:
    """Ragged sequences (empty ones allowed), random masks, one advantage per sequence.

    Masked positions hold wild finite values (log-ratios that overflow exp, huge
    advantages) that a correct kernel ignores.
    """
    seq_lens = draw(st.lists(st.integers(0, max_len), min_size=1, max_size=max_sequences))
    sequence_advantages = [draw(advantages) for _ in seq_lens]
    mask_rate = draw(_MASK_RATES)
    rng = np.random.default_rng(draw(_SEEDS))
    size = sum(seq_lens)
    mask = rng.random(size) < mask_rate
    logprobs = rng.uniform(-20.0, 0.0, size)
    log_ratios = np.where(mask, _trained_log_ratios(rng, size), _masked_log_ratios(rng, size))
    advantages_N = np.where(
        mask, np.repeat(sequence_advantages, seq_lens), _masked_advantages(rng, size)
    )
    return PackedLossBatch(
        logprobs=logprobs,
        sampling_logprobs=logprobs - log_ratios,
        advantages=advantages_N,
        mask=mask,
        seq_lens=tuple(seq_lens),
    )


@st.composite
def masked_perturbations(draw: st.DrawFn, batch: PackedLossBatch) -> PackedLossBatch:
    """batch with every masked position's logprob, log-ratio and advantage redrawn wildly."""
    rng = np.random.default_rng(draw(_SEEDS))
    size = batch.logprobs.size
    logprobs = np.where(rng.random(size) < 0.2, -1e4, rng.uniform(-1e4, 0.0, size))
    keep = batch.mask
    new_logprobs = np.where(keep, batch.logprobs, logprobs)
    return attrs.evolve(
        batch,
        logprobs=new_logprobs,
        sampling_logprobs=np.where(
            keep, batch.sampling_logprobs, new_logprobs - _masked_log_ratios(rng, size)
        ),
        advantages=np.where(keep, batch.advantages, _masked_advantages(rng, size)),
    )


def _ordered_bounds(
    low: st.SearchStrategy[float], high: st.SearchStrategy[float]
) -> st.SearchStrategy[dict[str, float]]:
    return st.tuples(low, high).map(
        lambda bounds: {"clip_low_threshold": bounds[0], "clip_high_threshold": bounds[1]}
    )


_DUAL_CLIPS = st.one_of(st.none(), st.floats(1.5, 10.0))

# Both bounds on one side of 1: every r = 1 (all masked units hold it) is then clipped,
# which the kernels' masked-unit corrections must not count.
_OFF_CENTER_BOUNDS = st.one_of(
    _ordered_bounds(st.floats(0.1, 0.5), st.floats(0.55, 0.95)),
    _ordered_bounds(st.floats(1.05, 2.0), st.floats(2.05, 3.0)),
)

LOSS_CONFIGS: dict[str, st.SearchStrategy[dict[str, float | None]]] = {
    "importance_sampling": st.just({}),
    "ppo": st.one_of(
        st.just({}),
        st.tuples(_ordered_bounds(st.floats(0.0, 0.95), st.floats(1.05, 3.0)), _DUAL_CLIPS).map(
            lambda config: {**config[0], "dual_clip": config[1]}
        ),
        _OFF_CENTER_BOUNDS,
    ),
    "cispo": st.one_of(
        st.just({}),
        _ordered_bounds(st.floats(0.0, 0.95), st.floats(1.05, 6.0)),
        _OFF_CENTER_BOUNDS,
    ),
    "dro": st.one_of(st.just({}), st.floats(0.0, 1.0).map(lambda beta: {"beta": beta})),
    "gspo": st.one_of(
        st.just({}),
        _ordered_bounds(
            st.floats(1e-4, 0.5).map(lambda gap: 1.0 - gap),
            st.floats(1e-4, 0.5).map(lambda gap: 1.0 + gap),
        ),
        _OFF_CENTER_BOUNDS,
    ),
    "cross_entropy": st.just({}),
}
"""Valid loss_fn_config for each kernel: its defaults, or thresholds away from ties at r = 1."""


@st.composite
def policy_datums(
    draw: st.DrawFn, max_datums: int = 4, max_prompt: int = 5, max_completion: int = 6
) -> tuple[list[pytrio.Datum], list[np.ndarray]]:
    """Full policy Datums laid out as docs/FORMULAS.md's token alignment, and the current
    policy's log-probs for each (what the trainer's forward would return).

    Each datum has target_tokens, logprobs (0 on prompt positions) and advantages
    (0 on prompt positions, one value on the completion).
    """
    prompt_lens = draw(st.lists(st.integers(1, max_prompt), min_size=1, max_size=max_datums))
    completion_lens = [draw(st.integers(1, max_completion)) for _ in prompt_lens]
    sequence_advantages = [draw(_SEQUENCE_ADVANTAGES) for _ in prompt_lens]
    rng = np.random.default_rng(draw(_SEEDS))
    datums, current_logprobs = [], []
    for prompt_len, completion_len, advantage in zip(
        prompt_lens, completion_lens, sequence_advantages, strict=True
    ):
        prompt_pad = prompt_len - 1
        completion = rng.integers(0, VOCAB_SIZE, completion_len)
        sampled = rng.uniform(-20.0, 0.0, completion_len)
        datums.append(
            pytrio.Datum(
                model_input=pytrio.ModelInput.from_ints(
                    rng.integers(0, VOCAB_SIZE, prompt_len).tolist() + completion[:-1].tolist()
                ),
                loss_fn_inputs={
                    "target_tokens": np.concatenate(
                        [np.zeros(prompt_pad, dtype=np.int64), completion]
                    ),
                    "logprobs": np.concatenate([np.zeros(prompt_pad), sampled]).astype(np.float32),
                    "advantages": np.concatenate(
                        [np.zeros(prompt_pad), np.full(completion_len, advantage)]
                    ).astype(np.float32),
                },
            )
        )
        current = np.concatenate(
            [
                rng.uniform(-20.0, 0.0, prompt_pad),
                sampled + _trained_log_ratios(rng, completion_len),
            ]
        )
        current_logprobs.append(current.astype(np.float32))
    return datums, current_logprobs


# --- on-policy distillation (tests/core/test_distill.py) ---


@st.composite
def distill_batches(draw: st.DrawFn, max_sequences: int = 5, max_len: int = 9) -> dict:
    """A packed batch for distillation: prompt and completion runs per sequence, s, q, Â."""
    count = draw(st.integers(1, max_sequences))
    prompt_lens = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    completion_lens = draw(st.lists(st.integers(1, max_len), min_size=count, max_size=count))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mask = np.concatenate(
        [np.r_[np.zeros(p), np.ones(c)] for p, c in zip(prompt_lens, completion_lens, strict=True)]
    )
    size = mask.size
    return {
        "seq_lens": np.array(prompt_lens) + np.array(completion_lens),
        "mask": mask,
        "student": rng.uniform(-8.0, 0.0, size) * mask,
        "teacher": rng.uniform(-8.0, 0.0, size) * mask,
        "task": np.repeat(rng.normal(size=count), np.array(prompt_lens) + completion_lens) * mask,
    }


# --- evaluation (tests/core/test_evaluation.py) ---

from grpo.core.evaluation import EvalSamples  # noqa: E402


@st.composite
def eval_samples(draw: st.DrawFn, max_problems: int = 6, max_samples: int = 9) -> EvalSamples:
    """Graded samples of P problems x n samples: answers from a small alphabet (so votes tie
    and repeat), correctness, truncation, lengths and rewards; episodes' turns half the time."""
    problems = draw(st.integers(1, max_problems))
    n = draw(st.integers(1, max_samples))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    answers = [
        [None if rng.random() < 0.25 else "abc"[rng.integers(0, 3)] for _ in range(n)]
        for _ in range(problems)
    ]
    episodes = draw(st.booleans())
    return EvalSamples(
        correct_PG=rng.random((problems, n)) < draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
        answers_PG=answers,
        truncated_PG=rng.random((problems, n)) < 0.2,
        tokens_PG=rng.integers(0, 50, (problems, n)),
        reward_PG=rng.normal(size=(problems, n)),
        turns_PG=rng.integers(1, 5, (problems, n)) if episodes else None,
        tool_calls_PG=rng.integers(0, 3, (problems, n)) if episodes else None,
    )
