"""Frozen records that flow through a training step.

- `Completion`: one sampled completion (tokens, sampler log-probs, text, stop reason).
- `ScoredGroup`: one prompt, its completions, their rewards and advantages.
- `GroupAdvantages`: advantages of a batch of ragged groups, flat, with degenerate flags.
- `AlignedSequence`: one completion as next-token arrays (input, target, log-prob, advantage, mask).
- `TokenBatch`: aligned sequences packed end to end, with `seq_lens`.

Every record converts its arrays to a fixed dtype at construction, keeps them read-only,
and validates them, so an invalid record cannot exist (`attrs.evolve` re-validates too).
An input array that is already read-only all the way down its base chain is kept as is
(no copy), so records can share frozen arrays and `TokenBatch.sequences()` returns views.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

from grpo.core.arrays import as_1d, require_kind

__all__ = [
    "LOGPROB_POSITIVE_TOLERANCE",
    "AlignedSequence",
    "Completion",
    "GroupAdvantages",
    "ScoredGroup",
    "TokenBatch",
]

# A sampled token's log-prob is <= 0 mathematically, but `x - logsumexp(x)` in float32
# rounds at the scale of the logits (ulp(32) ~ 4e-6), so tiny positive values are real
# sampler output. 1e-4 leaves margin for logits up to ~1e3; larger positives are bugs
# (e.g. logits passed instead of log-probs). Values are stored unchanged.
LOGPROB_POSITIVE_TOLERANCE = 1e-4


def _is_frozen(array: np.ndarray) -> bool:
    """True when neither the array nor any array it views can be written through."""
    current: Any = array
    while isinstance(current, np.ndarray):
        if current.flags.writeable:
            return False
        current = current.base
    return current is None


def _freeze(array: np.ndarray, dtype: type) -> npt.NDArray[Any]:
    if array.dtype == dtype and _is_frozen(array):
        return array
    frozen = np.array(array, dtype=dtype, copy=True)
    frozen.setflags(write=False)
    return frozen


def _typed(dtype: type, kinds: str, holds: str, fix: str) -> Any:
    """A field converter: a 1-D array of one of dtype ``kinds``, frozen as ``dtype``."""

    def convert(value: object, field: attrs.Attribute) -> npt.NDArray[Any]:
        array = as_1d(value, field.name, fix="; pass one flat sequence")
        require_kind(array, field.name, kinds, holds, fix)
        return _freeze(array, dtype)

    return convert


_to_int64 = _typed(np.int64, "iu", "integers", "; pass integer ids, not floats or bools")
_to_float64 = _typed(np.float64, "iuf", "real numbers", "; pass floats")
_to_bool = _typed(np.bool_, "b", "booleans", "; pass True/False flags")


def _arrays_equal(left: np.ndarray, right: np.ndarray) -> bool:
    return left.shape == right.shape and bool(np.array_equal(left, right))


def _array_field(to_array: Any) -> Any:
    """An attrs field converted by to_array(value, field) and compared by array values."""
    return attrs.field(
        converter=attrs.Converter(to_array, takes_field=True),
        eq=attrs.cmp_using(eq=_arrays_equal),
    )


def _first_bad(values: np.ndarray, bad: np.ndarray) -> str:
    """Describe the first offending entry and how many there are, for error messages."""
    bad_indices = np.flatnonzero(bad)
    first = int(bad_indices[0])
    return (
        f"{values[first].item()!r} at index {first} ({bad_indices.size} of {values.size} entries)"
    )


def _require_nonempty(field_name: str, values: np.ndarray, fix: str) -> None:
    if values.size == 0:
        raise ValueError(f"{field_name} is empty: {fix}")


def _require_finite(field_name: str, values: np.ndarray, fix: str) -> None:
    # min and max propagate NaN and expose ±inf without a temporary the size of the array.
    if values.size == 0 or (np.isfinite(values.min()) and np.isfinite(values.max())):
        return
    raise ValueError(
        f"{field_name} has a non-finite value {_first_bad(values, ~np.isfinite(values))}; {fix}"
    )


def _require_token_ids(field_name: str, values: np.ndarray) -> None:
    if values.size == 0 or values.min() >= 0:
        return
    raise ValueError(
        f"{field_name} has a negative token id {_first_bad(values, values < 0)}; "
        "token ids are vocabulary indices >= 0"
    )


def _require_same_length(
    reference_name: str, reference: np.ndarray, others: dict[str, np.ndarray]
) -> None:
    for name, values in others.items():
        if values.size != reference.size:
            raise ValueError(
                f"{name} has {values.size} entries but {reference_name} has {reference.size}; "
                "every array of the record needs one entry per position"
            )


def _require_binary_mask(values: np.ndarray) -> None:
    bad = (values != 0.0) & (values != 1.0)
    if bad.any():
        raise ValueError(
            f"mask must hold only 0.0 and 1.0, got {_first_bad(values, bad)}; "
            "use 1 for completion tokens that train and 0 elsewhere"
        )


def _require_sampled(
    tokens: tuple[str, np.ndarray], logprobs: tuple[str, np.ndarray], when_empty: str
) -> None:
    """What one sampling returned, as (name, array): at least one token id, and one finite
    log-prob at most LOGPROB_POSITIVE_TOLERANCE per token; ``when_empty`` says why not empty."""
    (tokens_name, token_ids), (logprobs_name, values) = tokens, logprobs
    if token_ids.size == 0:
        raise ValueError(when_empty)
    _require_token_ids(tokens_name, token_ids)
    if values.size != token_ids.size:
        raise ValueError(
            f"{logprobs_name} has {values.size} entries but {tokens_name} has {token_ids.size}; "
            "ask the sampler for the log-prob of every sampled token"
        )
    _require_finite(
        logprobs_name,
        values,
        "the sampler's log-probs must be finite (check temperature and top-k/top-p masking)",
    )
    too_high = values > LOGPROB_POSITIVE_TOLERANCE
    if too_high.any():
        raise ValueError(
            f"{logprobs_name} has a positive value {_first_bad(values, too_high)} above the "
            f"rounding tolerance {LOGPROB_POSITIVE_TOLERANCE}; pass log-probabilities "
            "(log-softmax of the logits), not logits or probabilities"
        )


@attrs.frozen
class Completion:
    """One sampled completion: token ids, the sampler's log-prob of each, text, stop reason."""

    tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    logprobs: npt.NDArray[np.float64] = _array_field(_to_float64)
    text: str = attrs.field(validator=attrs.validators.instance_of(str))
    stop_reason: str = attrs.field(validator=attrs.validators.instance_of(str))

    def __attrs_post_init__(self) -> None:
        _require_sampled(
            ("tokens", self.tokens),
            ("logprobs", self.logprobs),
            "completion is empty (tokens has 0 entries): the sampler returned no tokens; "
            "drop it or raise max_tokens",
        )

    @property
    def is_truncated(self) -> bool:
        """True when the sampler stopped at its token limit (`stop_reason == "length"`)."""
        return self.stop_reason == "length"


def _to_completions(value: object) -> tuple[Completion, ...]:
    return tuple(value)  # type: ignore[arg-type]


def _check_completions(
    instance: object, attribute: attrs.Attribute, value: tuple[Any, ...]
) -> None:
    for index, completion in enumerate(value):
        if not isinstance(completion, Completion):
            raise TypeError(
                f"completions[{index}] is a {type(completion).__name__}, not a Completion; "
                "build each completion with grpo.core.records.Completion"
            )


@attrs.frozen
class ScoredGroup:
    """One prompt, its G completions, their rewards R_G and their advantages A_G."""

    prompt_tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    completions: tuple[Completion, ...] = attrs.field(
        converter=_to_completions, validator=_check_completions
    )
    rewards: npt.NDArray[np.float64] = _array_field(_to_float64)
    advantages: npt.NDArray[np.float64] = _array_field(_to_float64)
    gold: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(str))
    )

    def __attrs_post_init__(self) -> None:
        _require_nonempty(
            "prompt_tokens",
            self.prompt_tokens,
            "a completion must follow at least one prompt token; encode the prompt first",
        )
        _require_token_ids("prompt_tokens", self.prompt_tokens)
        if not self.completions:
            raise ValueError("completions is empty: a group needs at least one sampled completion")
        group_size = len(self.completions)
        for name, values in (("rewards", self.rewards), ("advantages", self.advantages)):
            if values.size != group_size:
                raise ValueError(
                    f"{name} has {values.size} entries but the group has {group_size} completions; "
                    f"pass one {name[:-1]} per completion"
                )
            _require_finite(name, values, f"every completion needs a finite {name[:-1]}")

    @property
    def group_size(self) -> int:
        """G, the number of completions of the prompt."""
        return len(self.completions)

    @property
    def is_degenerate(self) -> bool:
        """True when all rewards are equal: the group has no learning signal."""
        return bool(np.all(self.rewards == self.rewards[0]))


@attrs.frozen
class GroupAdvantages:
    """Advantages of a batch of ragged groups: flat values, group sizes, degenerate flags."""

    advantages: npt.NDArray[np.float64] = _array_field(_to_float64)
    group_sizes: npt.NDArray[np.int64] = _array_field(_to_int64)
    degenerate: npt.NDArray[np.bool_] = _array_field(_to_bool)

    def __attrs_post_init__(self) -> None:
        _require_finite("advantages", self.advantages, "advantages must be finite")
        if self.degenerate.size != self.group_sizes.size:
            raise ValueError(
                f"degenerate has {self.degenerate.size} entries but group_sizes has "
                f"{self.group_sizes.size}; pass one flag per group"
            )
        if (self.group_sizes < 1).any():
            raise ValueError(f"group_sizes must all be >= 1, got {self.group_sizes.tolist()}")
        if int(self.group_sizes.sum()) != self.advantages.size:
            raise ValueError(
                f"group_sizes sum to {int(self.group_sizes.sum())} but advantages has "
                f"{self.advantages.size} entries; the sizes must cover the flat array exactly"
            )

    def split(self) -> list[npt.NDArray[np.float64]]:
        """Per-group views of `advantages` (np.split at the group offsets)."""
        if self.group_sizes.size == 0:
            return []
        return np.split(self.advantages, np.cumsum(self.group_sizes)[:-1])


def _validate_token_arrays(arrays: _NextTokenArrays) -> None:
    input_tokens, target_tokens = arrays.input_tokens, arrays.target_tokens
    sampling_logprobs, advantages, mask = arrays.sampling_logprobs, arrays.advantages, arrays.mask
    _require_same_length(
        "input_tokens",
        input_tokens,
        {
            "target_tokens": target_tokens,
            "sampling_logprobs": sampling_logprobs,
            "advantages": advantages,
            "mask": mask,
        },
    )
    _require_token_ids("input_tokens", input_tokens)
    _require_token_ids("target_tokens", target_tokens)
    _require_finite(
        "sampling_logprobs",
        sampling_logprobs,
        "use 0 at masked positions and the sampler's log-prob elsewhere",
    )
    _require_finite(
        "advantages",
        advantages,
        "use 0 at masked positions and the completion's advantage elsewhere",
    )
    _require_binary_mask(mask)


@attrs.frozen
class _NextTokenArrays:
    """The next-token arrays an aligned sequence and a packed batch both hold: input k
    predicts target k, with the sampler's log-prob, the advantage and the mask of k."""

    input_tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    target_tokens: npt.NDArray[np.int64] = _array_field(_to_int64)
    sampling_logprobs: npt.NDArray[np.float64] = _array_field(_to_float64)
    advantages: npt.NDArray[np.float64] = _array_field(_to_float64)
    mask: npt.NDArray[np.float64] = _array_field(_to_float64)


@attrs.frozen
class AlignedSequence(_NextTokenArrays):
    """One completion as next-token arrays of length p + c − 1: input k predicts target k."""

    def __attrs_post_init__(self) -> None:
        _require_nonempty(
            "input_tokens",
            self.input_tokens,
            "an aligned sequence has p + c − 1 >= 1 positions; build it with "
            "grpo.core.alignment.align",
        )
        _validate_token_arrays(self)

    def __len__(self) -> int:
        return int(self.input_tokens.size)


@attrs.frozen
class TokenBatch(_NextTokenArrays):
    """Aligned sequences packed end to end: flat arrays of N positions, `seq_lens` summing to N."""

    seq_lens: npt.NDArray[np.int64] = _array_field(_to_int64)

    def __attrs_post_init__(self) -> None:
        _validate_token_arrays(self)
        short = self.seq_lens < 1
        if short.any():
            raise ValueError(
                f"seq_lens has a length < 1: {_first_bad(self.seq_lens, short)}; "
                "every packed sequence has at least one position"
            )
        total = int(self.seq_lens.sum())
        if total != self.input_tokens.size:
            raise ValueError(
                f"seq_lens sum to {total} but the packed arrays have {self.input_tokens.size} "
                "positions; seq_lens must list the length of every packed sequence"
            )

    @property
    def num_sequences(self) -> int:
        """Number of packed sequences (datums)."""
        return int(self.seq_lens.size)

    @property
    def num_tokens(self) -> int:
        """N, the number of packed positions."""
        return int(self.input_tokens.size)

    @property
    def num_train_tokens(self) -> int:
        """Σ mask: the positions that train."""
        return int(self.mask.sum())

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Start of each sequence in the flat arrays, then N (num_sequences + 1 entries)."""
        return np.concatenate(([0], np.cumsum(self.seq_lens)))

    def sequence_range(self, start: int, stop: int) -> TokenBatch:
        """The batch of sequences ``start..stop-1``; arrays sliced, not copied."""
        if not 0 <= start < stop <= self.num_sequences:
            raise ValueError(
                f"sequence_range({start}, {stop}) is not a non-empty run of this batch's "
                f"{self.num_sequences} sequences"
            )
        offsets = self.offsets
        lo, hi = int(offsets[start]), int(offsets[stop])
        return TokenBatch(
            input_tokens=self.input_tokens[lo:hi],
            target_tokens=self.target_tokens[lo:hi],
            sampling_logprobs=self.sampling_logprobs[lo:hi],
            advantages=self.advantages[lo:hi],
            mask=self.mask[lo:hi],
            seq_lens=self.seq_lens[start:stop],
        )

    def sequences(self) -> tuple[AlignedSequence, ...]:
        """The packed sequences as `AlignedSequence` records holding read-only views (no copies)."""
        if self.num_sequences == 0:
            return ()
        cuts = np.cumsum(self.seq_lens)[:-1]
        columns = [
            np.split(array, cuts)
            for array in (
                self.input_tokens,
                self.target_tokens,
                self.sampling_logprobs,
                self.advantages,
                self.mask,
            )
        ]
        return tuple(AlignedSequence(*fields) for fields in zip(*columns))
