"""Loss kernels: forward and forward+backward throughput against a per-datum loop and the roofline.

`python -m benchmarks.losses [--quick] [--no-compile] [--checks-only]`

For every kernel in `grpo.core.losses.LOSSES` (registry defaults, reduction "sum"), on
float32 CPU batches of ragged sequences (mean length 1024, ~30% of positions masked as
prompt), at 16k, 256k, 2M and 8M tokens (--quick: 16k and 256k), under 1 torch thread and
under torch's default thread count, it times:

- the kernel on flat packed tensors, forward only (no_grad) and forward+backward, both
  eager (`fused=False`) and through its compiled single-pass form (`fused=True`); "default"
  is what a plain call runs (the compiled form from `FUSED_MIN_TOKENS` on CPU);
- (a) a straightforward per-datum implementation: a Python loop over per-datum leaf
  tensors, as the seed article's CISPO custom loss; compared with the kernel on packed
  tensors (loop/kernel) and with the kernel fed the same per-datum leaves (`torch.cat`,
  then the kernel: what `as_custom_loss` does; loop/(cat+kernel)), which adds autograd's
  per-leaf gradient bookkeeping that any per-datum-leaf API pays (the loop pays it too);
- (b) the memory roofline: one `torch.add(a, b, out=c)` over float32 buffers sized to the
  bytes the kernel must touch (forward reads lp, lp_old, A as float32 and the bool mask:
  13 bytes a token, 9 without lp_old; backward also writes the float32 gradient: +4);
- (c) `torch.compile`: the fused column is the kernel's compiled form (`fused_losses`,
  compiled afresh under each thread setting; its build time is printed), or "n/a (reason)";
  `--quick` compiles only the first kernel's form, `--no-compile` none;
- (d) the input checks (finite masked-in values, binary mask): forward+backward at 256k and
  2M tokens (--quick: 256k and the first kernel only), 1 thread, eager and fused, with the
  checks and without them (the same code with `pack_finite` plain `pack` and no probe in
  the fused forms' total), the two timed alternately in the same run; `--checks-only` runs
  this part alone.

Targets (issue 5): forward+backward at least 20x faster than the loop at 256 sequences x
1024 tokens; within 4x of the roofline at 2M tokens and above. `--keep-freed-memory` makes
glibc keep freed blocks, to show what page faults on fresh temporaries cost; run with
`THP_MEM_ALLOC_ENABLE=1` in the environment to have PyTorch back large tensors with
transparent huge pages (512x fewer page faults on a fresh gradient).
"""

from __future__ import annotations

import importlib.util
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import attrs
import numpy as np
import torch
from torch import Tensor

import grpo.core.losses as losses_module
from benchmarks.common import (
    Timing,
    argument_parser,
    keep_freed_memory,
    markdown_table,
    measure,
    millis,
    print_header,
    thread_settings,
    torch_threads,
)
from grpo.core import compiled_losses, fused_losses, packing
from grpo.core.losses import FUSED_MIN_TOKENS, LOSSES, LossKernel

SIZES = (16_384, 262_144, 2_097_152, 8_388_608)
QUICK_SIZES = (16_384, 262_144)
MEAN_SEQUENCE_LENGTH = 1024
LOOP_TARGET_TOKENS = 262_144  # 256 sequences x 1024 tokens
LOOP_TARGET_SPEEDUP = 20.0
ROOFLINE_TARGET_TOKENS = 2_097_152
ROOFLINE_TARGET_RATIO = 4.0
# The loop's cost is linear in the datums (~1 ms each); above this it is not timed, to keep
# the full run within minutes on a busy two-core machine.
LOOP_MAX_TOKENS = 2_097_152
FLOAT_BYTES = 4
MASK_BYTES = 1


@attrs.frozen
class PackedBatch:
    """A packed policy-loss batch (flat tensors) and the same data split per datum."""

    logprobs_N: Tensor
    sampling_logprobs_N: Tensor
    advantages_N: Tensor
    mask_N: Tensor
    seq_lens_B: Tensor
    logprobs_D: list[Tensor]
    sampling_logprobs_D: list[Tensor]
    advantages_D: list[Tensor]
    mask_D: list[Tensor]

    @property
    def num_tokens(self) -> int:
        """N, the packed positions."""
        return int(self.logprobs_N.numel())


def ragged_lengths(num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """num_tokens / 1024 sequence lengths, uniform in [256, 1792], scaled to sum to num_tokens."""
    num_sequences = max(1, round(num_tokens / MEAN_SEQUENCE_LENGTH))
    raw = rng.uniform(0.25, 1.75, num_sequences)
    lengths = np.maximum(np.floor(raw / raw.sum() * num_tokens).astype(np.int64), 2)
    # Hand out the rounding remainder one token at a time, longest sequences first.
    shortfall = num_tokens - int(lengths.sum())
    order = np.argsort(-lengths)
    lengths[order[: abs(shortfall)]] += int(np.sign(shortfall))
    assert int(lengths.sum()) == num_tokens
    return lengths


def make_batch(num_tokens: int, seed: int = 0) -> PackedBatch:
    """Ragged sequences whose first 15-45% positions (prompt) are masked, as alignment does.

    Completion positions: lp = −Exp(1), lp_old = lp + N(0, 0.1²) (ratios near 1, a few
    percent clipped at 0.8/1.2), one N(0, 1) advantage per sequence. Prompt positions:
    lp_old = 0 and A = 0, mask 0.
    """
    rng = np.random.default_rng(seed)
    lengths = ragged_lengths(num_tokens, rng)
    prompt_fraction = rng.uniform(0.15, 0.45, lengths.size)
    prompt_lens = np.minimum(np.round(prompt_fraction * lengths).astype(np.int64), lengths - 1)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    position = np.arange(num_tokens) - np.repeat(starts, lengths)
    mask = position >= np.repeat(prompt_lens, lengths)
    logprobs = -rng.exponential(1.0, num_tokens)
    sampling = np.where(mask, logprobs + rng.normal(0.0, 0.1, num_tokens), 0.0)
    advantages = np.where(mask, np.repeat(rng.normal(0.0, 1.0, lengths.size), lengths), 0.0)
    logprobs_N = torch.from_numpy(logprobs.astype(np.float32))
    sampling_N = torch.from_numpy(sampling.astype(np.float32))
    advantages_N = torch.from_numpy(advantages.astype(np.float32))
    mask_N = torch.from_numpy(mask)
    split = lengths.tolist()
    return PackedBatch(
        logprobs_N=logprobs_N,
        sampling_logprobs_N=sampling_N,
        advantages_N=advantages_N,
        mask_N=mask_N,
        seq_lens_B=torch.from_numpy(lengths),
        logprobs_D=[piece.clone() for piece in logprobs_N.split(split)],
        sampling_logprobs_D=[piece.clone() for piece in sampling_N.split(split)],
        advantages_D=[piece.clone() for piece in advantages_N.split(split)],
        mask_D=[piece.float() for piece in mask_N.split(split)],
    )


# --- (a) the straightforward per-datum loop ------------------------------------------------


def _loop_objective(
    name: str, config: dict[str, float | None]
) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """Σ over one datum's masked-in positions of kernel `name`'s objective, the obvious way."""
    low, high = config.get("clip_low_threshold"), config.get("clip_high_threshold")

    def importance_sampling(lp: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        return (torch.exp(lp - lp_old) * advantages * mask).sum()

    def ppo(lp: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        ratio = torch.exp(lp - lp_old)
        objective = torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
        return (objective * mask).sum()

    def cispo(lp: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        clipped_ratio = torch.clamp(torch.exp(lp - lp_old), low, high)
        return (clipped_ratio.detach() * lp * advantages * mask).sum()

    def dro(lp: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        beta = config["beta"]
        return ((lp * advantages - beta / 2 * (lp - lp_old) ** 2) * mask).sum()

    def gspo(lp: Tensor, lp_old: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        count = mask.sum()
        sequence_ratio = torch.exp(((lp - lp_old) * mask).sum() / count)
        advantage = (advantages * mask).sum() / count
        return torch.minimum(
            sequence_ratio * advantage, torch.clamp(sequence_ratio, low, high) * advantage
        )

    def cross_entropy(lp: Tensor, lp_old: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
        return (weights * lp * mask).sum()

    objectives = {
        "importance_sampling": importance_sampling,
        "ppo": ppo,
        "cispo": cispo,
        "dro": dro,
        "gspo": gspo,
        "cross_entropy": cross_entropy,
    }
    if config.get("dual_clip") is not None:
        raise ValueError("the per-datum loop implements the registry defaults only (dual_clip off)")
    return objectives[name]


def loop_loss(kernel: LossKernel, logprobs_D: Sequence[Tensor], batch: PackedBatch) -> Tensor:
    """−Σ over datums of the datum's objective: one Python iteration per datum.

    As the article's CISPO.
    """
    objective = _loop_objective(kernel.name, dict(kernel.defaults))
    datum_losses = [
        -objective(lp, lp_old, advantages, mask)
        for lp, lp_old, advantages, mask in zip(
            logprobs_D, batch.sampling_logprobs_D, batch.advantages_D, batch.mask_D, strict=True
        )
    ]
    return torch.stack(datum_losses).sum()


# --- the kernel ---------------------------------------------------------------------------


def kernel_loss(
    kernel: LossKernel, logprobs_N: Tensor, batch: PackedBatch, fused: bool | None = None
) -> Tensor:
    """The registry kernel on the packed batch (sum reduction, registry defaults).

    Its metrics are computed too.

    `fused`: None is what a user gets (the compiled form from FUSED_MIN_TOKENS on CPU),
    False the eager kernel, True the compiled single-pass form.
    """
    sampling = batch.sampling_logprobs_N if kernel.needs_sampling_logprobs else None
    loss, _metrics = kernel(
        logprobs_N,
        sampling,
        batch.advantages_N,
        mask=batch.mask_N,
        seq_lens=batch.seq_lens_B,
        fused=fused,
    )
    return loss


def check_kernel_matches_loop(kernel: LossKernel, batch: PackedBatch) -> None:
    """The loop is the same loss: value and gradient agree with the kernel's (float32 rounding)."""
    leaves = [piece.clone().requires_grad_(True) for piece in batch.logprobs_D]
    loop_value = loop_loss(kernel, leaves, batch)
    loop_value.backward()
    flat = batch.logprobs_N.clone().requires_grad_(True)
    value = kernel_loss(kernel, flat, batch)
    value.backward()
    loop_gradient = torch.cat([leaf.grad for leaf in leaves])  # type: ignore[misc]
    scale = float(batch.advantages_N.abs().sum()) + 1.0
    if not math.isclose(value.item(), loop_value.item(), rel_tol=1e-3, abs_tol=1e-4 * scale):
        raise AssertionError(
            f"{kernel.name}: kernel loss {value.item()} != loop loss {loop_value.item()}"
        )
    assert flat.grad is not None
    torch.testing.assert_close(
        flat.grad, loop_gradient, rtol=1e-4, atol=1e-5, msg=f"{kernel.name} gradient"
    )


# --- (b) the roofline -----------------------------------------------------------------------


def kernel_bytes(kernel: LossKernel, num_tokens: int, *, backward: bool) -> int:
    """Bytes the kernel must move.

    Read lp, (lp_old), A as float32 and the bool mask; write the gradient.
    """
    floats_read = 3 if kernel.needs_sampling_logprobs else 2
    per_token = floats_read * FLOAT_BYTES + MASK_BYTES + (FLOAT_BYTES if backward else 0)
    return per_token * num_tokens


def roofline(num_bytes: int, *, repeats: int, budget_s: float) -> Timing:
    """One fused elementwise op moving num_bytes: torch.add(a, b, out=c), float32.

    8 bytes read + 4 written an element.
    """
    elements = math.ceil(num_bytes / (3 * FLOAT_BYTES))
    first, second, out = torch.ones(elements), torch.ones(elements), torch.empty(elements)
    out.fill_(0.0)  # fault the output's pages in before timing, as the inputs' are
    return measure(
        lambda: torch.add(first, second, out=out), repeats=repeats * 3, budget_s=budget_s
    )


# --- (c) torch.compile ----------------------------------------------------------------------


@attrs.frozen
class Compiled:
    """How long the kernel's compiled form took to build, or why it is not timed."""

    available: bool
    compile_s: float
    reason: str


def compile_fused(kernel: LossKernel, batch: PackedBatch) -> Compiled:
    """Build the compiled single-pass form (forward, forward+backward) under the current threads.

    Inductor fixes a kernel's thread count when it generates it, so every thread setting
    starts from an empty compile cache.
    """
    if kernel.fused_form is None:
        return Compiled(
            available=False, compile_s=0.0, reason="n/a (no fused form: sequence-level)"
        )
    torch._dynamo.reset()
    compiled_losses._compiled_form.cache_clear()
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error", RuntimeWarning
        )  # a fallback to eager is not a compiled timing
        try:
            flat = batch.logprobs_N.clone().requires_grad_(True)
            kernel_loss(kernel, flat, batch, fused=True).backward()
            with torch.no_grad():
                kernel_loss(kernel, batch.logprobs_N, batch, fused=True)
        except RuntimeWarning as error:
            first_line = (str(error).strip().splitlines() or [""])[0][:160]
            return Compiled(available=False, compile_s=0.0, reason=f"n/a ({first_line})")
    return Compiled(available=True, compile_s=time.perf_counter() - started, reason="")


# --- (d) the input checks --------------------------------------------------------------------

CHECK_SIZES = (262_144, 2_097_152)
CHECK_ROUNDS = 12  # alternate checked and unchecked timings this often (a few calls each)
CHECK_REPEATS = 3


def _finish_unprobed(
    objective: Tensor,
    slope: Tensor,
    derivative: Tensor,
    mask: Tensor,
    want_gradient: bool,
    probe: Tensor,
) -> tuple[Tensor, Tensor | None]:
    """`fused_losses._finish` without the finiteness probe."""
    total = torch.where(mask, objective * derivative, 0.0).sum()
    return total, torch.where(mask, slope * -derivative, 0.0) if want_gradient else None


def unchecked_kernel(kernel: LossKernel) -> LossKernel:
    """`kernel` whose fused form adds no finiteness probe to its total (from a second copy of
    the module, so that both forms compile side by side)."""
    if kernel.fused_form is None:
        return kernel
    name = "benchmarks._unchecked_fused_losses"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, fused_losses.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # torch.compile finds a function's module by name
        spec.loader.exec_module(module)
        module._finish = _finish_unprobed  # type: ignore[attr-defined]
    return attrs.evolve(kernel, fused_form=getattr(module, kernel.fused_form.__name__))


@contextmanager
def eager_checks_off() -> Iterator[None]:
    """The eager kernel without its finiteness check (`pack_finite` is plain `pack`).

    Patched in `grpo.core.losses`, where the kernel looks the name up.
    """
    checked = losses_module.pack_finite
    losses_module.pack_finite = packing.pack
    try:
        yield
    finally:
        losses_module.pack_finite = checked


@attrs.frozen
class CheckRow:
    """Forward+backward of one kernel at one size on one path, with and without the input checks."""

    kernel: str
    num_tokens: int
    path: str
    checked: Timing
    unchecked: Timing


def time_checks(
    batch: PackedBatch, kernels: Sequence[LossKernel], *, rounds: int, budget_s: float
) -> list[CheckRow]:
    """Every kernel's forward+backward with the input checks and without, alternately (1 thread).

    Each round times a few calls of each; a row's best is the best call of all rounds, its
    median the median of the rounds' bests (load spikes on a shared machine hit single rounds).
    """
    flat = batch.logprobs_N.clone().requires_grad_(True)

    def clear() -> None:
        flat.grad = None

    rows = []
    for kernel in kernels:
        paths = [("eager", False)] + ([("fused", True)] if kernel.fused_form is not None else [])
        for path, fused in paths:
            unchecked = unchecked_kernel(kernel)

            def checked_call(kernel: LossKernel = kernel, fused: bool = fused) -> None:
                kernel_loss(kernel, flat, batch, fused=fused).backward()

            def unchecked_call(kernel: LossKernel = unchecked, fused: bool = fused) -> None:
                with eager_checks_off():
                    kernel_loss(kernel, flat, batch, fused=fused).backward()

            with warnings.catch_warnings():
                # A fallback to eager would be no fused timing.
                warnings.simplefilter("error", RuntimeWarning)
                checked_call()
                unchecked_call()  # compiles the unchecked copy of the form
            timings: dict[str, list[float]] = {"checked": [], "unchecked": []}
            for _ in range(rounds):
                for label, call in (("checked", checked_call), ("unchecked", unchecked_call)):
                    timing = measure(call, repeats=CHECK_REPEATS, budget_s=budget_s, setup=clear)
                    timings[label].append(timing.best_s)
            summary = {
                label: Timing(min(found), statistics.median(found), len(found))
                for label, found in timings.items()
            }
            checked, unchecked = summary["checked"], summary["unchecked"]
            rows.append(CheckRow(kernel.name, batch.num_tokens, path, checked, unchecked))
    return rows


def check_table(rows: Sequence[CheckRow]) -> str:
    """Checked vs unchecked forward+backward, and the checks' share."""
    cells = [
        [
            row.kernel,
            size_label(row.num_tokens),
            row.path,
            millis(row.unchecked.best_s),
            millis(row.checked.best_s),
            f"{(row.checked.best_s / row.unchecked.best_s - 1) * 100:+.1f}%",
            f"{(row.checked.median_s / row.unchecked.median_s - 1) * 100:+.1f}%",
        ]
        for row in rows
    ]
    header = [
        "kernel",
        "tokens",
        "path",
        "unchecked ms",
        "checked ms",
        "overhead (best)",
        "overhead (median)",
    ]
    return markdown_table(header, cells)


def run_checks(
    batches: dict[int, PackedBatch], sizes: Sequence[int], *, quick: bool, budget_s: float
) -> None:
    """Print (d): the cost of the input checks at `sizes`, 1 thread (--quick: the first kernel)."""
    rows: list[CheckRow] = []
    kernels = list(LOSSES.values())[:1] if quick else list(LOSSES.values())
    rounds = 2 if quick else CHECK_ROUNDS
    with torch_threads(1):
        for num_tokens in sizes:
            rows += time_checks(batches[num_tokens], kernels, rounds=rounds, budget_s=budget_s)
    print(
        "### input checks (forward+backward, torch 1 thread, "
        "finite masked-in values + binary mask)\n"
    )
    print(
        f"checked and unchecked timed alternately, {rounds} rounds of {CHECK_REPEATS} calls each; "
        "best: the best call; median: the median of the rounds' bests; bool mask (a float mask "
        "adds one comparison pass)\n"
    )
    print(check_table(rows))
    print()
    sys.stdout.flush()


# --- the run --------------------------------------------------------------------------------


@attrs.frozen
class Row:
    """All timings of one kernel at one size under one thread setting."""

    kernel: str
    num_tokens: int
    eager_forward: Timing
    eager_forward_backward: Timing
    fused_forward: Timing | None
    fused_forward_backward: Timing | None
    fused_note: str
    packed_forward: Timing
    packed_forward_backward: Timing
    loop_forward: Timing | None
    loop_forward_backward: Timing | None
    roofline_forward: Timing
    roofline_forward_backward: Timing

    @property
    def default_is_fused(self) -> bool:
        """Whether a plain call (fused=None) runs the compiled form at this size."""
        return self.fused_forward_backward is not None and self.num_tokens >= FUSED_MIN_TOKENS

    @property
    def forward(self) -> Timing:
        """The forward a plain call runs."""
        return (
            self.fused_forward
            if self.default_is_fused and self.fused_forward
            else self.eager_forward
        )

    @property
    def forward_backward(self) -> Timing:
        """The forward+backward a plain call runs."""
        if self.default_is_fused and self.fused_forward_backward is not None:
            return self.fused_forward_backward
        return self.eager_forward_backward


def time_kernel(
    kernel: LossKernel,
    batch: PackedBatch,
    compiled: Compiled,
    rooflines: dict[int, Timing],
    *,
    repeats: int,
    budget_s: float,
) -> Row:
    """Every timing of `kernel` on `batch` (the current torch thread setting)."""
    flat = batch.logprobs_N.clone().requires_grad_(True)
    leaves = [piece.clone().requires_grad_(True) for piece in batch.logprobs_D]

    def clear_flat() -> None:
        flat.grad = None

    def clear_leaves() -> None:
        for leaf in leaves:
            leaf.grad = None

    def forward(fused: bool) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                kernel_loss(kernel, batch.logprobs_N, batch, fused=fused)

        return run

    def forward_backward(fused: bool) -> Callable[[], None]:
        def run() -> None:
            kernel_loss(kernel, flat, batch, fused=fused).backward()

        return run

    def packed_forward() -> None:
        with torch.no_grad():
            kernel_loss(kernel, torch.cat(batch.logprobs_D), batch)

    def packed_forward_backward() -> None:
        kernel_loss(kernel, torch.cat(leaves), batch).backward()

    def loop_forward() -> None:
        with torch.no_grad():
            loop_loss(kernel, batch.logprobs_D, batch)

    def loop_forward_backward() -> None:
        loop_loss(kernel, leaves, batch).backward()

    def timed(call: Callable[[], None], setup: Callable[[], None] | None = None) -> Timing:
        return measure(call, repeats=repeats, budget_s=budget_s, setup=setup)

    forward_bytes = kernel_bytes(kernel, batch.num_tokens, backward=False)
    backward_bytes = kernel_bytes(kernel, batch.num_tokens, backward=True)
    for num_bytes in (forward_bytes, backward_bytes):
        if num_bytes not in rooflines:
            rooflines[num_bytes] = roofline(num_bytes, repeats=repeats, budget_s=budget_s)
    loop_timed = batch.num_tokens <= LOOP_MAX_TOKENS
    return Row(
        kernel=kernel.name,
        num_tokens=batch.num_tokens,
        eager_forward=timed(forward(False)),
        eager_forward_backward=timed(forward_backward(False), clear_flat),
        fused_forward=timed(forward(True)) if compiled.available else None,
        fused_forward_backward=timed(forward_backward(True), clear_flat)
        if compiled.available
        else None,
        fused_note=f"compiled in {compiled.compile_s:.1f} s"
        if compiled.available
        else compiled.reason,
        packed_forward=timed(packed_forward),
        packed_forward_backward=timed(packed_forward_backward, clear_leaves),
        loop_forward=timed(loop_forward) if loop_timed else None,
        loop_forward_backward=timed(loop_forward_backward, clear_leaves) if loop_timed else None,
        roofline_forward=rooflines[forward_bytes],
        roofline_forward_backward=rooflines[backward_bytes],
    )


def tokens_per_second(num_tokens: int, timing: Timing) -> str:
    """Millions of tokens a second at the best timing."""
    return f"{num_tokens / timing.best_s / 1e6:.3g}"


def size_label(num_tokens: int) -> str:
    """16k, 256k, 2M, 8M."""
    if num_tokens >= 1 << 20:
        return f"{num_tokens / (1 << 20):g}M"
    return f"{num_tokens / (1 << 10):g}k"


def ratio(numerator: Timing | None, denominator: Timing | None) -> str:
    """numerator/denominator of the best timings, or "-" when either is missing."""
    if numerator is None or denominator is None:
        return "-"
    return f"{numerator.best_s / denominator.best_s:.3g}x"


def loop_cells(loop: Timing | None, kernel: Timing, packed: Timing) -> list[str]:
    """The loop's time and its ratios to the kernel and to cat+kernel.

    "not timed" above LOOP_MAX_TOKENS.
    """
    if loop is None:
        return [f"not timed (> {size_label(LOOP_MAX_TOKENS)})", "-", "-"]
    return [millis(loop.best_s), ratio(loop, kernel), ratio(loop, packed)]


def _table(rows: Sequence[Row], *, backward: bool) -> str:
    cells = []
    for row in rows:
        eager = row.eager_forward_backward if backward else row.eager_forward
        fused = row.fused_forward_backward if backward else row.fused_forward
        default = row.forward_backward if backward else row.forward
        roof = row.roofline_forward_backward if backward else row.roofline_forward
        packed = row.packed_forward_backward if backward else row.packed_forward
        loop = row.loop_forward_backward if backward else row.loop_forward
        cells.append(
            [
                row.kernel,
                size_label(row.num_tokens),
                millis(eager.best_s),
                millis(fused.best_s) if fused is not None else row.fused_note,
                "fused" if row.default_is_fused else "eager",
                tokens_per_second(row.num_tokens, default),
                millis(roof.best_s),
                ratio(eager, roof),
                ratio(fused, roof),
                millis(packed.best_s),
                *loop_cells(loop, default, packed),
            ]
        )
    header = [
        "kernel",
        "tokens",
        "eager ms",
        "fused ms",
        "default",
        "default Mtok/s",
        "roofline ms",
        "eager/roofline",
        "fused/roofline",
        "cat+default ms",
        "loop ms",
        "loop/default",
        "loop/(cat+default)",
    ]
    return markdown_table(header, cells)


def tables(rows: Sequence[Row]) -> str:
    """Forward and forward+backward tables of one thread setting."""
    notes = sorted({f"{row.kernel}: {row.fused_note}" for row in rows})
    return "\n\n".join(
        [
            "forward (no_grad; loss and metrics)",
            _table(rows, backward=False),
            "forward+backward",
            _table(rows, backward=True),
            "fused forms: " + "; ".join(notes),
        ]
    )


def _verdict(value: float, met: bool) -> str:
    return f"{value:.3g}x: {'met' if met else 'missed'}"


def target_lines(rows: Sequence[Row], quick: bool) -> list[list[str]]:
    """Per kernel: loop speed-up at 256 x 1024 and worst roofline ratio at >= 2M, met or missed."""
    not_measured = "not measured" + (" (--quick)" if quick else "")
    lines = []
    for name in LOSSES:
        mine = [row for row in rows if row.kernel == name]
        at_target = [
            row
            for row in mine
            if row.num_tokens == LOOP_TARGET_TOKENS and row.loop_forward_backward
        ]
        large = [row for row in mine if row.num_tokens >= ROOFLINE_TARGET_TOKENS]
        line = [name]
        if at_target:
            row = at_target[0]
            loop = row.loop_forward_backward
            assert loop is not None
            for kernel_timing in (
                row.forward_backward,
                row.fused_forward_backward,
                row.packed_forward_backward,
            ):
                if kernel_timing is None:
                    line.append("n/a")
                else:
                    speedup = loop.best_s / kernel_timing.best_s
                    line.append(_verdict(speedup, speedup >= LOOP_TARGET_SPEEDUP))
        else:
            line += [not_measured] * 3
        for pick in (lambda row: row.forward_backward, lambda row: row.fused_forward_backward):
            ratios = [
                pick(row).best_s / row.roofline_forward_backward.best_s
                for row in large
                if pick(row) is not None
            ]
            line.append(
                _verdict(max(ratios), max(ratios) <= ROOFLINE_TARGET_RATIO)
                if ratios
                else "n/a"
                if large
                else not_measured
            )
        forward_ratios = [row.forward.best_s / row.roofline_forward.best_s for row in large]
        line.append(f"{max(forward_ratios):.3g}x" if forward_ratios else not_measured)
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the loss-kernel benchmark and print its tables."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="skip the compiled forms (they take seconds a kernel to build)",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory (mallopt) so temporaries reuse pages"
        " instead of faulting them in",
    )
    parser.add_argument(
        "--checks-only",
        action="store_true",
        help="time only the input checks (d), at 256k and 2M tokens",
    )
    args = parser.parse_args(argv)
    if args.keep_freed_memory and not keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc's mallopt")
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats, budget_s = (3, 0.5) if args.quick else (7, 4.0)
    check_sizes = [size for size in CHECK_SIZES if size in sizes or args.checks_only]
    check_sizes = check_sizes[:1] if args.quick else check_sizes
    flags = [
        flag
        for flag, on in (
            ("--quick", args.quick),
            ("--no-compile", args.no_compile),
            ("--keep-freed-memory", args.keep_freed_memory),
            ("--checks-only", args.checks_only),
        )
        if on
    ]
    # PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation: it
    # can only come from the environment, so the command shows it when set.
    environment = (
        ["THP_MEM_ALLOC_ENABLE=1"] if os.environ.get("THP_MEM_ALLOC_ENABLE") == "1" else []
    )
    command = " ".join([*environment, "python -m benchmarks.losses", *flags])
    print_header("Loss kernels (float32, CPU, reduction sum, registry defaults)", command)
    print(
        "default: what a plain call runs (fused=None): the compiled form on CPU"
        f" from {FUSED_MIN_TOKENS:,} tokens"
    )
    if args.checks_only:
        if args.no_compile:
            parser.error("--checks-only times the fused forms too; drop --no-compile")
        batches = {size: make_batch(size, seed=index) for index, size in enumerate(check_sizes)}
        run_checks(batches, check_sizes, quick=args.quick, budget_s=budget_s)
        return 0
    batches = {
        num_tokens: make_batch(num_tokens, seed=index) for index, num_tokens in enumerate(sizes)
    }
    for kernel in LOSSES.values():
        check_kernel_matches_loop(kernel, batches[sizes[0]])
    print(
        "per-datum loop checked equal to every kernel (loss and gradient)"
        f" at {size_label(sizes[0])} tokens"
    )
    print(
        f"timings: best of up to {repeats} calls after a warm-up"
        f" (each measurement capped at ~{budget_s:g} s)\n"
    )
    # --quick compiles one form only: building all of them takes about a minute.
    to_compile = (
        [] if args.no_compile else [name for name, kernel in LOSSES.items() if kernel.fused_form]
    )
    to_compile = to_compile[:1] if args.quick else to_compile
    for label, threads in thread_settings(args.quick):
        rows: list[Row] = []
        rooflines: dict[int, Timing] = {}
        with torch_threads(threads):
            for kernel in LOSSES.values():
                compiled = (
                    compile_fused(kernel, batches[sizes[0]])
                    if kernel.name in to_compile
                    else Compiled(
                        available=False, compile_s=0.0, reason="n/a (not compiled in this run)"
                    )
                )
                for num_tokens in sizes:
                    rows.append(
                        time_kernel(
                            kernel,
                            batches[num_tokens],
                            compiled,
                            rooflines,
                            repeats=repeats,
                            budget_s=budget_s,
                        )
                    )
        print(f"### torch {label}\n")
        print(tables(rows))
        print(
            "\ntargets (fwd+bwd: the loop >= 20x slower than the kernel at 256 x 1024;"
            " kernel <= 4x roofline at >= 2M)\n"
        )
        print(
            markdown_table(
                [
                    "kernel",
                    "loop/default fwd+bwd @256k",
                    "loop/fused fwd+bwd @256k",
                    "loop/(cat+default) fwd+bwd @256k",
                    "worst default fwd+bwd/roofline @>=2M",
                    "worst fused fwd+bwd/roofline @>=2M",
                    "worst default fwd/roofline @>=2M",
                ],
                target_lines(rows, args.quick),
            )
        )
        print()
        sys.stdout.flush()
    if not args.no_compile:
        run_checks(batches, check_sizes, quick=args.quick, budget_s=budget_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
