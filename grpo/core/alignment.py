"""Token alignment: a prompt and its completion as next-token training arrays, and packing.

For prompt P (length p >= 1), completion C (length c >= 1), sampler log-probs lp(C) and
the completion's advantage A (docs/FORMULAS.md "Token alignment"), all of length p + c − 1:
- input_tokens      = P + C[:-1]
- target_tokens     = [pad]·(p − 1) + C
- sampling_logprobs = [0]·(p − 1) + lp(C)
- advantages        = [0]·(p − 1) + [A]·c
- mask              = [0]·(p − 1) + [1]·c
Position k of the input predicts target k: the last prompt token predicts C[0].

- `align`: one completion -> `AlignedSequence`.
- `pack`: aligned sequences -> one `TokenBatch` (one concatenate per array).
- `pack_groups`: scored groups -> `TokenBatch` directly, equal to `pack` of `align` of every
  completion, without building per-completion records (the datum builder's fast path).
- `truncated_sequences`, `mask_sequences`: DAPO's overlong filtering (--mask-truncated):
  the sequences of completions cut at the token limit get mask 0 and advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from grpo.core.arrays import as_1d, require_finite, require_kind
from grpo.core.records import AlignedSequence, ScoredGroup, TokenBatch

__all__ = [
    "PAD_TOKEN_ID",
    "align",
    "mask_sequences",
    "minibatches",
    "pack",
    "pack_groups",
    "truncated_sequences",
]

# The target at prompt positions is never trained (mask 0); PyTRIO's article pads with 0.
PAD_TOKEN_ID = 0


def _token_ids(value: npt.ArrayLike, field_name: str) -> npt.NDArray[np.int64]:
    array = as_1d(value, field_name, of=" of token ids")
    require_kind(array, field_name, "iu", "integer token ids", "; pass the tokenizer's ids")
    return array.astype(np.int64, copy=False)


def align(
    prompt_tokens: npt.ArrayLike,
    completion_tokens: npt.ArrayLike,
    completion_logprobs: npt.ArrayLike,
    advantage: float,
) -> AlignedSequence:
    """Next-token arrays of length p + c − 1: input P + C[:-1], target pad·(p−1) + C.

    Sampling log-probs are 0·(p−1) + lp(C), advantages 0·(p−1) + A·c, mask 0·(p−1) + 1·c.
    """
    prompt = _token_ids(prompt_tokens, "prompt_tokens")
    completion = _token_ids(completion_tokens, "completion_tokens")
    logprobs = np.asarray(completion_logprobs, dtype=np.float64)
    if prompt.size == 0:
        raise ValueError(
            "prompt_tokens is empty: the first completion token needs a prompt token to be "
            "predicted from; encode the prompt (with its chat template) before aligning"
        )
    if completion.size == 0:
        raise ValueError(
            "completion_tokens is empty: the sampler returned no tokens; drop the completion "
            "or raise max_tokens"
        )
    if logprobs.shape != completion.shape:
        raise ValueError(
            f"completion_logprobs has {logprobs.size} entries but completion_tokens has "
            f"{completion.size}; pass the sampler's log-prob of every completion token"
        )
    require_finite(
        logprobs,
        "completion_logprobs",
        "the sampler's log-probs must be finite (check temperature and top-k/top-p masking)",
    )
    advantage = float(advantage)
    if not np.isfinite(advantage):
        raise ValueError(
            f"advantage = {advantage!r} is not finite; compute advantages from finite rewards "
            "with grpo.core.advantages"
        )
    prompt_pad = prompt.size - 1
    return AlignedSequence(
        input_tokens=np.concatenate((prompt, completion[:-1])),
        target_tokens=np.concatenate((np.full(prompt_pad, PAD_TOKEN_ID), completion)),
        sampling_logprobs=np.concatenate((np.zeros(prompt_pad), logprobs)),
        advantages=np.concatenate((np.zeros(prompt_pad), np.full(completion.size, advantage))),
        mask=np.concatenate((np.zeros(prompt_pad), np.ones(completion.size))),
    )


def _frozen(array: np.ndarray) -> np.ndarray:
    """Mark a freshly built array read-only so the record adopts it without a copy."""
    array.setflags(write=False)
    return array


def _empty_batch() -> TokenBatch:
    return TokenBatch(
        input_tokens=np.zeros(0, dtype=np.int64),
        target_tokens=np.zeros(0, dtype=np.int64),
        sampling_logprobs=np.zeros(0),
        advantages=np.zeros(0),
        mask=np.zeros(0),
        seq_lens=np.zeros(0, dtype=np.int64),
    )


def pack(sequences: Sequence[AlignedSequence]) -> TokenBatch:
    """Concatenate aligned sequences end to end; seq_lens lists their lengths."""
    if not sequences:
        return _empty_batch()
    return TokenBatch(
        input_tokens=_frozen(np.concatenate([s.input_tokens for s in sequences])),
        target_tokens=_frozen(np.concatenate([s.target_tokens for s in sequences])),
        sampling_logprobs=_frozen(np.concatenate([s.sampling_logprobs for s in sequences])),
        advantages=_frozen(np.concatenate([s.advantages for s in sequences])),
        mask=_frozen(np.concatenate([s.mask for s in sequences])),
        seq_lens=_frozen(np.array([len(s) for s in sequences], dtype=np.int64)),
    )


def _interleave(first_S: np.ndarray, second_S: np.ndarray) -> np.ndarray:
    """[first_0, second_0, first_1, second_1, ...]."""
    return np.stack((first_S, second_S), axis=1).ravel()


def pack_groups(groups: Sequence[ScoredGroup], *, drop_degenerate: bool = True) -> TokenBatch:
    """`pack([align(...) for every completion])` of the groups, with no per-token Python work.

    Token arrays are one `np.concatenate` of per-completion slices (prompt, C[:-1]) and
    (pad, C); advantages and mask are one `np.repeat` of two values per sequence over its
    two runs (p − 1 prompt positions, c completion positions). Degenerate groups (no
    learning signal) are skipped when drop_degenerate is true.
    """
    kept = [group for group in groups if not (drop_degenerate and group.is_degenerate)]
    input_pieces: list[np.ndarray] = []
    target_pieces: list[np.ndarray] = []
    logprob_pieces: list[np.ndarray] = []
    prompt_lens_S: list[int] = []
    completion_lens_S: list[int] = []
    for group in kept:
        prompt_pad = group.prompt_tokens.size - 1
        pad_tokens = np.full(prompt_pad, PAD_TOKEN_ID, dtype=np.int64)
        pad_logprobs = np.zeros(prompt_pad)
        for completion in group.completions:
            input_pieces += (group.prompt_tokens, completion.tokens[:-1])
            target_pieces += (pad_tokens, completion.tokens)
            logprob_pieces += (pad_logprobs, completion.logprobs)
            prompt_lens_S.append(group.prompt_tokens.size)
            completion_lens_S.append(completion.tokens.size)
    if not completion_lens_S:
        return _empty_batch()
    num_sequences = len(completion_lens_S)
    prompt_lens = np.array(prompt_lens_S, dtype=np.int64)
    completion_lens = np.array(completion_lens_S, dtype=np.int64)
    advantages_S = np.concatenate([group.advantages for group in kept])
    runs = _interleave(prompt_lens - 1, completion_lens)
    return TokenBatch(
        input_tokens=_frozen(np.concatenate(input_pieces)),
        target_tokens=_frozen(np.concatenate(target_pieces)),
        sampling_logprobs=_frozen(np.concatenate(logprob_pieces)),
        advantages=_frozen(np.repeat(_interleave(np.zeros(num_sequences), advantages_S), runs)),
        mask=_frozen(np.repeat(np.tile([0.0, 1.0], num_sequences), runs)),
        seq_lens=_frozen(prompt_lens + completion_lens - 1),
    )


def minibatches(batch: TokenBatch, num_minibatches: int) -> list[TokenBatch]:
    """``batch`` cut into ``num_minibatches`` contiguous runs of sequences, sizes differing by at
    most one (earlier runs larger); empty runs are dropped, so a short batch gives fewer."""
    if num_minibatches < 1:
        raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
    base, extra = divmod(batch.num_sequences, num_minibatches)
    sizes = [base + (index < extra) for index in range(num_minibatches)]
    bounds = np.cumsum([0, *sizes])
    return [
        batch.sequence_range(int(start), int(stop))
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True)
        if stop > start
    ]


def truncated_sequences(groups: Sequence[ScoredGroup]) -> npt.NDArray[np.bool_]:
    """One flag per completion, in packing order: True when it stopped at the token limit."""
    return np.array(
        [completion.is_truncated for group in groups for completion in group.completions],
        dtype=bool,
    )


def mask_sequences(batch: TokenBatch, masked_S: npt.ArrayLike) -> TokenBatch:
    """The batch with m = 0 and A = 0 at every position of the sequences flagged in masked_S.

    Tokens, log-probs and sequence lengths are unchanged, and so is every unflagged sequence.
    """
    masked = np.asarray(masked_S, dtype=bool)
    if masked.shape != (batch.num_sequences,):
        raise ValueError(
            f"masked_S has shape {masked.shape} but the batch has {batch.num_sequences} "
            "sequences; pass one flag per packed sequence"
        )
    keep_N = np.repeat(~masked, batch.seq_lens)
    return TokenBatch(
        input_tokens=batch.input_tokens,
        target_tokens=batch.target_tokens,
        sampling_logprobs=batch.sampling_logprobs,
        advantages=_frozen(np.where(keep_N, batch.advantages, 0.0)),
        mask=_frozen(np.where(keep_N, batch.mask, 0.0)),
        seq_lens=batch.seq_lens,
    )
