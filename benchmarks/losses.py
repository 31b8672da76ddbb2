"""Loss kernels: forward and forward+backward throughput against a per-datum loop and the roofline.

`python -m benchmarks.losses [--quick] [--no-compile]`

For every kernel in `grpo.core.losses.LOSSES` (registry defaults, reduction "sum"), on
float32 CPU batches of ragged sequences (mean length 1024, ~30% of positions masked as
prompt), at 16k, 256k, 2M and 8M tokens (--quick: 16k and 256k), under 1 torch thread and
under torch's default thread count, it times:

- the kernel on flat packed tensors, forward only (no_grad) and forward+backward;
- (a) a straightforward per-datum implementation: a Python loop over per-datum leaf
  tensors, as the seed article's CISPO custom loss; compared with the kernel on packed
  tensors (loop/kernel) and with the kernel fed the same per-datum leaves (`torch.cat`,
  then the kernel: what `as_custom_loss` does; loop/(cat+kernel)), which adds autograd's
  per-leaf gradient bookkeeping that any per-datum-leaf API pays (the loop pays it too);
- (b) the memory roofline: one `torch.add(a, b, out=c)` over float32 buffers sized to the
  bytes the kernel must touch (forward reads lp, lp_old, A as float32 and the bool mask:
  13 bytes a token, 9 without lp_old; backward also writes the float32 gradient: +4);
- (c) the kernel under `torch.compile` (forward+backward), or "n/a (reason)".

Targets (issue 5): forward+backward at least 20x faster than the loop at 256 sequences x
1024 tokens; within 4x of the roofline at 2M tokens and above. `--keep-freed-memory` makes
glibc keep freed blocks, to show what page faults on fresh temporaries cost.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np
import torch
from torch import Tensor

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
from grpo.core.losses import LOSSES, LossKernel

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
    """num_tokens / 1024 sequence lengths drawn uniformly in [256, 1792] and scaled to sum to num_tokens."""
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
    """Ragged sequences whose first 15-45% positions (prompt) are masked, as alignment lays them out.

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


def _loop_objective(name: str, config: dict[str, float | None]) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """Σ over one datum's masked-in positions of kernel `name`'s objective, written the obvious way."""
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
        return torch.minimum(sequence_ratio * advantage, torch.clamp(sequence_ratio, low, high) * advantage)

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
    """−Σ over datums of the datum's objective: one Python iteration per datum, as the article's CISPO."""
    objective = _loop_objective(kernel.name, dict(kernel.defaults))
    datum_losses = [
        -objective(lp, lp_old, advantages, mask)
        for lp, lp_old, advantages, mask in zip(
            logprobs_D, batch.sampling_logprobs_D, batch.advantages_D, batch.mask_D, strict=True
        )
    ]
    return torch.stack(datum_losses).sum()


# --- the kernel ---------------------------------------------------------------------------


def kernel_loss(kernel: LossKernel, logprobs_N: Tensor, batch: PackedBatch) -> Tensor:
    """The registry kernel on the packed batch (sum reduction, registry defaults); its metrics are computed too."""
    sampling = batch.sampling_logprobs_N if kernel.needs_sampling_logprobs else None
    loss, _metrics = kernel(logprobs_N, sampling, batch.advantages_N, mask=batch.mask_N, seq_lens=batch.seq_lens_B)
    return loss


def check_kernel_matches_loop(kernel: LossKernel, batch: PackedBatch) -> None:
    """The loop is the same loss: its value and gradient agree with the kernel's (float32 rounding)."""
    leaves = [piece.clone().requires_grad_(True) for piece in batch.logprobs_D]
    loop_value = loop_loss(kernel, leaves, batch)
    loop_value.backward()
    flat = batch.logprobs_N.clone().requires_grad_(True)
    value = kernel_loss(kernel, flat, batch)
    value.backward()
    loop_gradient = torch.cat([leaf.grad for leaf in leaves])  # type: ignore[misc]
    scale = float(batch.advantages_N.abs().sum()) + 1.0
    if not math.isclose(value.item(), loop_value.item(), rel_tol=1e-3, abs_tol=1e-4 * scale):
        raise AssertionError(f"{kernel.name}: kernel loss {value.item()} != loop loss {loop_value.item()}")
    assert flat.grad is not None
    torch.testing.assert_close(flat.grad, loop_gradient, rtol=1e-4, atol=1e-5, msg=f"{kernel.name} gradient")


# --- (b) the roofline -----------------------------------------------------------------------


def kernel_bytes(kernel: LossKernel, num_tokens: int, *, backward: bool) -> int:
    """Bytes the kernel must move: read lp, (lp_old), A as float32 and the bool mask; write the gradient."""
    floats_read = 3 if kernel.needs_sampling_logprobs else 2
    per_token = floats_read * FLOAT_BYTES + MASK_BYTES + (FLOAT_BYTES if backward else 0)
    return per_token * num_tokens


def roofline(num_bytes: int, *, repeats: int, budget_s: float) -> Timing:
    """One fused elementwise op moving num_bytes: torch.add(a, b, out=c), float32, 8 bytes read + 4 written an element."""
    elements = math.ceil(num_bytes / (3 * FLOAT_BYTES))
    first, second, out = torch.ones(elements), torch.ones(elements), torch.empty(elements)
    out.fill_(0.0)  # fault the output's pages in before timing, as the inputs' are
    return measure(lambda: torch.add(first, second, out=out), repeats=repeats * 3, budget_s=budget_s)


# --- (c) torch.compile ----------------------------------------------------------------------


@attrs.frozen
class Compiled:
    """A compiled kernel and its compile time, or why it is not available."""

    call: Callable[..., tuple[Tensor, dict[str, float]]] | None
    compile_s: float
    reason: str


def compile_kernel(kernel: LossKernel, batch: PackedBatch) -> Compiled:
    """torch.compile(kernel) with dynamic shapes, compiled by a first forward+backward; n/a on any error."""
    try:
        import torch._dynamo

        torch._dynamo.reset()
        compiled = torch.compile(kernel, dynamic=True)
        started = time.perf_counter()
        flat = batch.logprobs_N.clone().requires_grad_(True)
        sampling = batch.sampling_logprobs_N if kernel.needs_sampling_logprobs else None
        loss, _ = compiled(flat, sampling, batch.advantages_N, mask=batch.mask_N, seq_lens=batch.seq_lens_B)
        loss.backward()
        return Compiled(call=compiled, compile_s=time.perf_counter() - started, reason="")
    except Exception as error:  # noqa: BLE001 - any compiler failure is reported, not raised
        first_line = (str(error).strip().splitlines() or [""])[0][:120]
        return Compiled(call=None, compile_s=0.0, reason=f"n/a ({type(error).__name__}: {first_line})")


# --- the run --------------------------------------------------------------------------------


@attrs.frozen
class Row:
    """All timings of one kernel at one size under one thread setting."""

    kernel: str
    num_tokens: int
    forward: Timing
    forward_backward: Timing
    packed_forward: Timing
    packed_forward_backward: Timing
    loop_forward: Timing | None
    loop_forward_backward: Timing | None
    roofline_forward: Timing
    roofline_forward_backward: Timing
    compiled_forward_backward: Timing | None
    compiled_note: str


def time_kernel(
    kernel: LossKernel,
    batch: PackedBatch,
    compiled: Compiled | None,
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

    def forward() -> None:
        with torch.no_grad():
            kernel_loss(kernel, batch.logprobs_N, batch)

    def forward_backward() -> None:
        kernel_loss(kernel, flat, batch).backward()

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

    compiled_timing: Timing | None = None
    compiled_note = compiled.reason if compiled is not None else "n/a (--quick or --no-compile: not compiled)"
    if compiled is not None and compiled.call is not None:
        call = compiled.call
        sampling = batch.sampling_logprobs_N if kernel.needs_sampling_logprobs else None

        def compiled_forward_backward() -> None:
            loss, _ = call(flat, sampling, batch.advantages_N, mask=batch.mask_N, seq_lens=batch.seq_lens_B)
            loss.backward()

        compiled_timing = timed(compiled_forward_backward, clear_flat)
        compiled_note = f"compiled in {compiled.compile_s:.1f} s"

    forward_bytes = kernel_bytes(kernel, batch.num_tokens, backward=False)
    backward_bytes = kernel_bytes(kernel, batch.num_tokens, backward=True)
    for num_bytes in (forward_bytes, backward_bytes):
        if num_bytes not in rooflines:
            rooflines[num_bytes] = roofline(num_bytes, repeats=repeats, budget_s=budget_s)
    return Row(
        kernel=kernel.name,
        num_tokens=batch.num_tokens,
        forward=timed(forward),
        forward_backward=timed(forward_backward, clear_flat),
        packed_forward=timed(packed_forward),
        packed_forward_backward=timed(packed_forward_backward, clear_leaves),
        loop_forward=timed(loop_forward) if batch.num_tokens <= LOOP_MAX_TOKENS else None,
        loop_forward_backward=(
            timed(loop_forward_backward, clear_leaves) if batch.num_tokens <= LOOP_MAX_TOKENS else None
        ),
        roofline_forward=rooflines[forward_bytes],
        roofline_forward_backward=rooflines[backward_bytes],
        compiled_forward_backward=compiled_timing,
        compiled_note=compiled_note,
    )


def tokens_per_second(num_tokens: int, timing: Timing) -> str:
    """Millions of tokens a second at the best timing."""
    return f"{num_tokens / timing.best_s / 1e6:.3g}"


def size_label(num_tokens: int) -> str:
    """16k, 256k, 2M, 8M."""
    if num_tokens >= 1 << 20:
        return f"{num_tokens / (1 << 20):g}M"
    return f"{num_tokens / (1 << 10):g}k"


def loop_cells(loop: Timing | None, kernel: Timing, packed: Timing) -> list[str]:
    """The loop's time and its ratios to the kernel and to cat+kernel ("not timed" above LOOP_MAX_TOKENS)."""
    if loop is None:
        return [f"not timed (> {size_label(LOOP_MAX_TOKENS)})", "-", "-"]
    return [millis(loop.best_s), f"{loop.best_s / kernel.best_s:.3g}x", f"{loop.best_s / packed.best_s:.3g}x"]


def tables(rows: Sequence[Row]) -> str:
    """Forward and forward+backward tables of one thread setting."""
    forward_rows = [
        [
            row.kernel,
            size_label(row.num_tokens),
            millis(row.forward.best_s),
            tokens_per_second(row.num_tokens, row.forward),
            millis(row.roofline_forward.best_s),
            f"{row.forward.best_s / row.roofline_forward.best_s:.3g}x",
            millis(row.packed_forward.best_s),
            *loop_cells(row.loop_forward, row.forward, row.packed_forward),
        ]
        for row in rows
    ]
    backward_rows = [
        [
            row.kernel,
            size_label(row.num_tokens),
            millis(row.forward_backward.best_s),
            tokens_per_second(row.num_tokens, row.forward_backward),
            millis(row.roofline_forward_backward.best_s),
            f"{row.forward_backward.best_s / row.roofline_forward_backward.best_s:.3g}x",
            millis(row.packed_forward_backward.best_s),
            *loop_cells(row.loop_forward_backward, row.forward_backward, row.packed_forward_backward),
            (
                f"{millis(row.compiled_forward_backward.best_s)} ({row.compiled_forward_backward.best_s / row.roofline_forward_backward.best_s:.3g}x roofline; {row.compiled_note})"
                if row.compiled_forward_backward is not None
                else row.compiled_note
            ),
        ]
        for row in rows
    ]
    common = ["kernel", "tokens"]
    return "\n\n".join(
        [
            "forward (no_grad; loss and metrics)",
            markdown_table(
                [*common, "kernel ms", "Mtok/s", "roofline ms", "kernel/roofline", "cat+kernel ms", "loop ms", "loop/kernel", "loop/(cat+kernel)"],
                forward_rows,
            ),
            "forward+backward",
            markdown_table(
                [
                    *common,
                    "kernel ms",
                    "Mtok/s",
                    "roofline ms",
                    "kernel/roofline",
                    "cat+kernel ms",
                    "loop ms",
                    "loop/kernel",
                    "loop/(cat+kernel)",
                    "torch.compile(kernel) ms",
                ],
                backward_rows,
            ),
        ]
    )


def target_lines(rows: Sequence[Row], quick: bool) -> list[list[str]]:
    """Per kernel: the loop speed-up at 256 x 1024 and the worst roofline ratio at >= 2M, met or missed."""
    lines = []
    for name in LOSSES:
        mine = [row for row in rows if row.kernel == name]
        at_target = [row for row in mine if row.num_tokens == LOOP_TARGET_TOKENS]
        loop_timing = at_target[0].loop_forward_backward if at_target else None
        speedup = loop_timing.best_s / at_target[0].forward_backward.best_s if loop_timing is not None else math.nan
        packed_speedup = (
            loop_timing.best_s / at_target[0].packed_forward_backward.best_s if loop_timing is not None else math.nan
        )
        large = [row for row in mine if row.num_tokens >= ROOFLINE_TARGET_TOKENS]
        worst_backward = max(
            (row.forward_backward.best_s / row.roofline_forward_backward.best_s for row in large), default=math.nan
        )
        worst_forward = max((row.forward.best_s / row.roofline_forward.best_s for row in large), default=math.nan)
        compiled = [
            row.compiled_forward_backward.best_s / row.roofline_forward_backward.best_s
            for row in large
            if row.compiled_forward_backward is not None
        ]
        lines.append(
            [
                name,
                f"{speedup:.3g}x: {'met' if speedup >= LOOP_TARGET_SPEEDUP else 'missed'}" if at_target else "not measured",
                f"{packed_speedup:.3g}x: {'met' if packed_speedup >= LOOP_TARGET_SPEEDUP else 'missed'}" if at_target else "not measured",
                (
                    f"{worst_backward:.3g}x: {'met' if worst_backward <= ROOFLINE_TARGET_RATIO else 'missed'}"
                    if large
                    else "not measured" + (" (--quick)" if quick else "")
                ),
                f"{worst_forward:.3g}x" if large else "not measured",
                f"{max(compiled):.3g}x" if compiled else "n/a",
            ]
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the loss-kernel benchmark and print its tables."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes tens of seconds a kernel)")
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="glibc keeps freed memory (mallopt) so temporaries reuse pages instead of faulting them in",
    )
    args = parser.parse_args(argv)
    if args.keep_freed_memory and not keep_freed_memory():
        parser.error("--keep-freed-memory needs glibc's mallopt")
    sizes = QUICK_SIZES if args.quick else SIZES
    repeats, budget_s = (3, 0.5) if args.quick else (7, 4.0)
    flags = [flag for flag, on in (("--quick", args.quick), ("--no-compile", args.no_compile), ("--keep-freed-memory", args.keep_freed_memory)) if on]
    command = " ".join(["python -m benchmarks.losses", *flags])
    print_header("Loss kernels (float32, CPU, reduction sum, registry defaults)", command)
    batches = {num_tokens: make_batch(num_tokens, seed=index) for index, num_tokens in enumerate(sizes)}
    for kernel in LOSSES.values():
        check_kernel_matches_loop(kernel, batches[sizes[0]])
    print(f"per-datum loop checked equal to every kernel (loss and gradient) at {size_label(sizes[0])} tokens")
    print(f"timings: best of up to {repeats} calls after a warm-up (each measurement capped at ~{budget_s:g} s)\n")
    for label, threads in thread_settings(args.quick):
        rows: list[Row] = []
        rooflines: dict[int, Timing] = {}
        with torch_threads(threads):
            for kernel in LOSSES.values():
                compiled = None if args.quick or args.no_compile else compile_kernel(kernel, batches[sizes[0]])
                for num_tokens in sizes:
                    rows.append(time_kernel(kernel, batches[num_tokens], compiled, rooflines, repeats=repeats, budget_s=budget_s))
        print(f"### torch {label}\n")
        print(tables(rows))
        print("\ntargets (fwd+bwd: the loop >= 20x slower than the kernel at 256 x 1024; kernel <= 4x roofline at >= 2M)\n")
        print(
            markdown_table(
                [
                    "kernel",
                    "loop/kernel fwd+bwd @256k",
                    "loop/(cat+kernel) fwd+bwd @256k",
                    "worst fwd+bwd/roofline @>=2M",
                    "worst fwd/roofline @>=2M",
                    "compiled fwd+bwd/roofline @>=2M",
                ],
                target_lines(rows, args.quick),
            )
        )
        print()
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
