"""Where one default training step's time goes, at 1 torch thread, with each phase's limit.

`python -m benchmarks.step [--quick] [--steps N] [--rounds R]`

Runs the default `grpo train` job (built-in model and prompts, 8 prompts x 8 completions of
up to 24 tokens, LoRA rank 32, 2 minibatches a step) for N steps, `--eval-every 0`, with the
trainer's shared-prefix forward on and off (`ModelHost.shared_prefix_forward`), alternated
R times in one process; the first step of every run (warm-up) is left out. Each phase is
timed by wrapping the function that does it (wall time, summed per step); the table gives
ms per step (median over steps) and, for the phases that are matmuls, the compute limit:
FLOPs ÷ the matmul rate measured at that phase's shape on this thread count. Nested rows
(indented) are parts of the row above. Tokenizing the prompts happens once, before step 1.

--quick: 3 steps, 1 round (CI: the benchmark runs; no threshold).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

import grpo.training.recipes.grpo.recipe as grpo_recipe
import grpo.training.rollouts.step as rollout_step
import grpo.training.run.learner as learner
import grpo.training.run.lifecycle as lifecycle
from benchmarks.common import argument_parser, markdown_table, print_header, torch_threads
from benchmarks.local import matmul_gflops
from grpo.backends.local import loss_execution
from grpo.backends.local import training as local_training
from grpo.backends.local.model import ModelHost
from grpo.backends.local.sampler import loop as sampler_loop
from grpo.backends.local.shared_prefix import attention_weight, group_by_prefix
from grpo.backends.local.tiny import load_tiny_model
from grpo.core.loss_spec import LossSpec
from grpo.training.recipes.grpo.run import train
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig

LORA_RANK = 32  # the default run's

# (label, owner, attribute): the function whose calls make up the phase.
PHASES: tuple[tuple[str, Any, str], ...] = (
    ("sampler: merge LoRA into the weights", sampler_loop, "_merged_step"),
    ("sampler: prefill", sampler_loop, "_prefill"),
    ("sampler: decode", sampler_loop, "_decode"),
    ("sampler: detokenize, responses", sampler_loop, "_sequence"),
    ("grading (reward)", rollout_step, "grade_rollouts"),
    ("datums: align + pack", grpo_recipe, "pack_rollout_groups"),
    ("datums: to PyTRIO datums", learner, "batch_to_datums"),
    ("trainer: request validation", local_training, "prepare_loss_batch"),
    ("trainer: forward (log-probs)", loss_execution, "target_logprobs"),
    ("trainer: loss kernel", LossSpec, "__call__"),
    ("trainer: backward", torch.autograd, "backward"),
    ("trainer: optimizer (AdamW)", local_training.LocalTrainingClient, "_step"),
    ("client: update metrics", learner, "update_metrics"),
    ("logging (outside time/step)", lifecycle, "log_step"),
)


class PhaseClock:
    """Wall time and work counts per phase, collected per training step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = defaultdict(float)

    def add(self, key: str, value: float) -> None:
        """Add `value` to this step's `key`."""
        self.current[key] += value

    def next_step(self) -> None:
        """Close the step in progress."""
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


@contextlib.contextmanager
def timed_phases(clock: PhaseClock) -> Iterator[None]:
    """Wrap every PHASES function to add its wall time to `clock`; count the work done."""
    originals = [(owner, name, getattr(owner, name)) for _label, owner, name in PHASES]

    def wrap(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                clock.add(label, time.perf_counter() - started)
                if label == "logging (outside time/step)":
                    clock.next_step()

        return timed

    def forward(host: ModelHost, inputs: Sequence[Sequence[int]], targets: Any, **kw: Any) -> Any:
        lengths = [len(tokens) for tokens in inputs]
        if host.shared_prefix_forward:
            groups = group_by_prefix(inputs, attention_weight(host.model.config))
            widths = [
                sum(lengths[m] for m in g.members) - (len(g.members) - 1) * g.prefix_length
                for g in groups
            ]
            clock.add("forward positions", len(widths) * max(widths))
            clock.add("real positions", sum(widths))
            clock.add("unembedded", sum(int((np.asarray(t) != -100).sum()) for t in targets))
        else:
            clock.add("forward positions", len(lengths) * max(lengths))
            clock.add("real positions", sum(lengths))
            clock.add("unembedded", len(lengths) * max(lengths))
        return original_forward(host, inputs, targets, **kw)

    def prefill(model: Any, specs: Any) -> Any:
        prompts = {spec.prompt for spec in specs}
        clock.add("prefill positions", sum(-(-len(p) // 8) * 8 for p in prompts))
        return original_prefill(model, specs)

    def decode(*args: Any) -> Any:
        rows = original_decode(*args)
        clock.add("generated tokens", sum(len(row.tokens) for row in rows))
        return rows

    original_forward, original_prefill, original_decode = (
        loss_execution.target_logprobs,
        sampler_loop._prefill,
        sampler_loop._decode,
    )
    for (label, owner, name), (_owner, _name, function) in zip(PHASES, originals, strict=True):
        replacement = {"_prefill": prefill, "_decode": decode}.get(name, function)
        if name == "target_logprobs":
            replacement = forward
        setattr(owner, name, wrap(label, replacement))
    try:
        yield
    finally:
        for owner, name, function in originals:
            setattr(owner, name, function)


def run_job(steps: int, *, shared_prefix: bool) -> tuple[list[dict[str, float]], PhaseClock]:
    """The default job for `steps` steps; (its metrics rows, its phase clock)."""
    clock = PhaseClock()
    switch = ModelHost.__init__

    def init(self: ModelHost, *args: Any, **kwargs: Any) -> None:
        switch(self, *args, **kwargs)
        self.shared_prefix_forward = self.shared_prefix_forward and shared_prefix

    ModelHost.__init__ = init  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory(prefix="grpo-bench-step-") as root, timed_phases(clock):
            config = TrainConfig(steps=steps, eval_every=0, save_every=0, run_dir=f"{root}/run")
            result = train(config, echo=lambda _line: None, progress=False)
            rows = read_metrics(result.run_dir)
    finally:
        ModelHost.__init__ = switch  # type: ignore[method-assign]
    return rows, clock


def lora_weights(config: Any) -> tuple[int, int]:
    """(decoder LoRA weights, unembedding LoRA weights) of a rank-LORA_RANK adapter on every
    linear layer: r x (in + out) each."""
    hidden, inner = config.hidden_size, config.intermediate_size
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = (hidden + heads * dim) * 2 + (hidden + kv_heads * dim) * 2
    mlp = 3 * (hidden + inner)
    return config.num_hidden_layers * LORA_RANK * (attention + mlp), LORA_RANK * (
        hidden + config.vocab_size
    )


def base_weights(config: Any) -> tuple[int, int]:
    """(decoder matmul weights, unembedding weights)."""
    hidden, inner = config.hidden_size, config.intermediate_size
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    layer = hidden * dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inner
    return config.num_hidden_layers * layer, hidden * config.vocab_size


def phase_table(
    rows: list[dict[str, float]], clock: PhaseClock, rates: dict[str, float], config: Any
) -> tuple[str, dict[str, float]]:
    """The markdown table of one setting's steps (warm-up left out) and its medians."""
    measured = [step for row, step in zip(rows, clock.steps, strict=False) if row["step"] > 1]
    metrics = [row for row in rows if row["step"] > 1]

    def median(key: str, source: Sequence[dict[str, float]] = measured) -> float:
        return statistics.median(step.get(key, 0.0) for step in source)

    decoder, unembed = base_weights(config)
    lora_decoder, lora_unembed = lora_weights(config)
    positions, unembedded = median("forward positions"), median("unembedded")
    forward_flops = 2 * (decoder + lora_decoder) * positions + 2 * (unembed + lora_unembed) * (
        unembedded
    )
    # Backward: gradients of the activations (the forward's matmuls again) plus the LoRA
    # weights' gradients (r x (in + out) per layer and position, twice).
    backward_flops = forward_flops + 2 * (lora_decoder * positions + lora_unembed * unembedded)
    prefill_flops = 2 * (decoder + unembed) * median("prefill positions")
    decode_flops = 2 * (decoder + unembed) * median("generated tokens")
    limits = {
        "trainer: forward (log-probs)": forward_flops / rates["train"],
        "trainer: backward": backward_flops / rates["train"],
        "sampler: prefill": prefill_flops / rates["decode"],
        "sampler: decode": decode_flops / rates["decode"],
    }
    step_s = median("time/step", metrics)
    table_rows = [
        ["time/step (median)", f"{step_s * 1e3:.0f}", "100%", "", ""],
        ["  time/sample", f"{median('time/sample', metrics) * 1e3:.0f}", "", "", ""],
        ["  time/train", f"{median('time/train', metrics) * 1e3:.0f}", "", "", ""],
    ]
    for label, _owner, _name in PHASES:
        spent = median(label)
        limit = limits.get(label)
        table_rows.append(
            [
                label,
                f"{spent * 1e3:.1f}",
                f"{spent / step_s:.0%}",
                "" if limit is None else f"{limit * 1e3:.1f}",
                "" if limit is None or spent == 0 else f"{limit / spent:.0%}",
            ]
        )
    table = markdown_table(
        ["phase", "ms/step", "share of time/step", "compute limit ms", "limit / measured"],
        table_rows,
    )
    work = {
        "step_s": step_s,
        "positions": positions,
        "real": median("real positions"),
        "unembedded": unembedded,
        "reward": statistics.mean(row["reward"] for row in rows),
    }
    return table, work


def main(argv: Sequence[str] | None = None) -> int:
    """Profile the default step at 1 thread, shared-prefix forward on and off."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per run (first left out)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each setting, alternated")
    args = parser.parse_args(argv)
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    command = "python -m benchmarks.step" + (
        " --quick" if args.quick else f" --steps {steps} --rounds {rounds}"
    )
    print_header("One default training step, phase by phase (1 torch thread)", command)
    config = load_tiny_model()[0].config
    settings = (("shared-prefix forward", True), ("unshared forward", False))
    collected: dict[str, tuple[list[dict[str, float]], PhaseClock]] = {}
    with torch_threads(1):
        rates = {
            "train": matmul_gflops(
                1024, config.hidden_size, 2 * config.intermediate_size, repeats=20
            )
            * 1e9,
            "decode": matmul_gflops(
                64, config.hidden_size, 2 * config.intermediate_size, repeats=20
            )
            * 1e9,
        }
        for _round in range(rounds):
            for label, shared in settings:
                rows, clock = run_job(steps, shared_prefix=shared)
                kept_rows, kept_clock = collected.get(label, ([], PhaseClock()))
                kept_clock.steps.extend(clock.steps)
                collected[label] = (kept_rows + rows, kept_clock)
    print(
        f"{steps} steps per run, {rounds} run(s) of each setting alternated; medians over the "
        f"steps after each run's first. Matmul rate, 1 thread: {rates['train'] / 1e9:.1f} "
        f"GFLOP/s at 1024 x {config.hidden_size} x {2 * config.intermediate_size} (training), "
        f"{rates['decode'] / 1e9:.1f} GFLOP/s at 64 x {config.hidden_size} x "
        f"{2 * config.intermediate_size} (decode)\n"
    )
    summary = []
    for label, _shared in settings:
        rows, clock = collected[label]
        table, work = phase_table(rows, clock, rates, config)
        print(f"### {label}\n")
        print(
            f"per step: {work['positions']:.0f} positions through the model "
            f"({work['real']:.0f} real), {work['unembedded']:.0f} unembedded\n"
        )
        print(table)
        print()
        summary.append([label, f"{work['step_s'] * 1e3:.0f}", f"{work['reward']:.3f}"])
    print(markdown_table(["setting", "median time/step ms", "mean reward"], summary))
    baseline, shared_step = float(summary[1][1]), float(summary[0][1])
    print(f"\nunshared / shared time/step: {baseline / shared_step:.2f}x")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
