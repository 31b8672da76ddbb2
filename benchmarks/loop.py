"""The training loop's own overhead next to a backend with a fixed latency per call.

`python -m benchmarks.loop [--quick] [--backend canned|local]`

The service client handed to `grpo.training.recipes.grpo.run.train` is wrapped so that every backend
call takes a fixed added latency, as a remote service's network and GPU would: 300 ms a
`sample`, 800 ms a `forward_backward`, 100 ms an `optim_step`, 50 ms a
`save_weights_and_get_sampling_client` or checkpoint save (--quick: a tenth of each).
With `--backend canned` (the default) the wrapped service does no compute at all: its
sampler returns pre-built completions (half of each group correct, so every group
trains) and its forward_backward returns the datums' own sampling log-probs; so the
step time is the latency plus the loop's own work. `--backend local` wraps the real
embedded local backend instead (its tiny model's compute then adds to the latency).

Steps of 32 prompts x group 8 (--quick: 4 x 4), two minibatches a step, under three
settings: sequential rollouts (`concurrency=1`), concurrent (`concurrency` = prompts per
step) and concurrent with `max_steps_off_policy=1`, each with torch pinned to 1 thread
and with torch's default (--quick: 1 thread). The first step is a warm-up and is left out.
Per step it reports the loop's own `time/sample`, `time/train`, `time/step`,
and the client's overhead: the step time during which no backend call was in flight
(the client's work on the critical path) and the process CPU time (all threads; the
canned backend's own work is tiny and included).

Targets (issue 5): the concurrent sampling phase within 1.5x of one call's latency (not
32x); everything the client does besides waiting under 5% of step time.
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from pytrio.types import (
    Datum,
    ForwardBackwardOutput,
    OptimStepResponse,
    SampleResponse,
    SampleSequence,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)

from benchmarks.common import (
    argument_parser,
    markdown_table,
    print_header,
    thread_settings,
    torch_threads,
)
from grpo.backends.local.tiny import IM_END, TINY_MODEL_NAME, build_tokenizer
from grpo.tasks.data import load_problems
from grpo.training.recipes.grpo.run import train
from grpo.training.rollouts.problems import Problem, build_problems
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig

FULL_LATENCY_S = {
    "sample": 0.300,
    "forward_backward": 0.800,
    "forward_backward_custom": 0.800,
    "optim_step": 0.100,
    "save_weights_and_get_sampling_client": 0.050,
    "save_state": 0.050,
    "save_weights_for_sampler": 0.050,
}
FUTURE_METHODS = frozenset(
    {
        "sample",
        "forward_backward",
        "forward_backward_custom",
        "optim_step",
        "save_state",
        "save_weights_for_sampler",
    }
)
CLIENT_METHODS = frozenset({"save_weights_and_get_sampling_client", "create_lora_training_client"})
SAMPLING_PHASE_TARGET = 1.5
OVERHEAD_TARGET = 0.05


# --- the latency wrapper ---------------------------------------------------------------------


class CallLog:
    """Thread-safe record of (start, end) wall-clock intervals of backend calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.intervals: list[tuple[float, float]] = []

    def add(self, start: float, end: float) -> None:
        """Record one call's interval."""
        with self._lock:
            self.intervals.append((start, end))

    def covered(self, window_start: float, window_end: float) -> float:
        """Seconds of [window_start, window_end] during which at least one call was in flight."""
        with self._lock:
            clipped = sorted(
                (max(start, window_start), min(end, window_end))
                for start, end in self.intervals
                if end > window_start and start < window_end
            )
        total, current_start, current_end = 0.0, None, None
        for start, end in clipped:
            if current_end is None or start > current_end:
                if current_end is not None:
                    total += current_end - current_start  # type: ignore[operator]
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        if current_end is not None:
            total += current_end - current_start  # type: ignore[operator]
        return total


class Resolved:
    """An already completed future: what the loop needs of PyTRIO's APIFuture (`result()`)."""

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self, timeout: float | None = None) -> Any:
        """The call's value."""
        return self._value


class WithLatency:
    """Proxy of a PyTRIO-style client: FUTURE_METHODS and CLIENT_METHODS take a fixed extra latency.

    A future-returning call waits for the inner result, then sleeps its latency (so
    latency adds to the inner compute, as network and queueing add to a remote GPU's),
    and returns a completed future. Clients it returns are wrapped the same way.
    """

    def __init__(self, inner: Any, latency_s: Mapping[str, float], log: CallLog) -> None:
        self._inner, self._latency_s, self._log = inner, latency_s, log

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name not in FUTURE_METHODS and name not in CLIENT_METHODS:
            return attribute
        latency = self._latency_s.get(name, 0.0)

        def delayed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            value = attribute(*args, **kwargs)
            if name in FUTURE_METHODS:
                value = Resolved(value.result())
            else:
                value = WithLatency(value, self._latency_s, self._log)
            time.sleep(latency)
            self._log.add(start, time.perf_counter())
            return value

        return delayed


# --- the canned backend -----------------------------------------------------------------------


@attrs.frozen
class CannedSampler:
    """Returns pre-built completions per prompt: group members alternate correct and wrong."""

    sequences_by_prompt: Mapping[tuple[int, ...], tuple[SampleSequence, SampleSequence]]

    def sample(
        self, prompt: Any, num_samples: int = 1, sampling_params: Any = None, **_options: Any
    ) -> Resolved:
        """num_samples canned sequences for this prompt."""
        correct, wrong = self.sequences_by_prompt[tuple(prompt.to_ints())]
        sequences = [correct if index % 2 == 0 else wrong for index in range(num_samples)]
        return Resolved(SampleResponse(sequences=sequences))


@attrs.frozen
class CannedTrainingClient:
    """A training client that computes nothing.

    forward_backward returns the datums' sampling log-probs.
    """

    tokenizer: Any
    sampler: CannedSampler

    def get_tokenizer(self) -> Any:
        """The tiny model's tokenizer."""
        return self.tokenizer

    def save_weights_and_get_sampling_client(self) -> CannedSampler:
        """The canned sampler."""
        return self.sampler

    def forward_backward(
        self, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: Any = None
    ) -> Resolved:
        """Log-probs equal to each datum's sampling log-probs (ratio 1), no gradient."""
        outputs = [{"logprobs": datum.loss_fn_inputs["logprobs"]} for datum in data]
        return Resolved(ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss_sum": 0.0}))

    def forward(
        self, data: list[Datum], loss_fn: str = "cross_entropy", loss_fn_config: Any = None
    ) -> Resolved:
        """Zero log-probs (the loop's check before a checkpoint), computing nothing."""
        outputs = [
            {
                "logprobs": TensorData(
                    data=[0.0] * len(datum.loss_fn_inputs["target_tokens"].data), dtype="float32"
                )
            }
            for datum in data
        ]
        return Resolved(ForwardBackwardOutput(loss_fn_outputs=outputs, metrics={"loss_sum": 0.0}))

    def optim_step(self, adam_params: Any) -> Resolved:
        """No-op optimizer step."""
        return Resolved(OptimStepResponse(metrics={}))

    def save_state(self, name: str, ttl_seconds: int | None = None) -> Resolved:
        """A checkpoint path that is never read back."""
        return Resolved(SaveWeightsResponse(path=f"canned://{name}", model=TINY_MODEL_NAME, size=0))

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None) -> Resolved:
        """A sampler-weights path that is never read back."""
        return Resolved(
            SaveWeightsForSamplerResponse(path=f"canned://{name}", model=TINY_MODEL_NAME, size=0)
        )


@attrs.frozen
class CannedService:
    """A service client whose training client is a CannedTrainingClient."""

    client: CannedTrainingClient

    def create_lora_training_client(
        self, base_model: str, rank: int = 32, seed: int | None = None, **_options: Any
    ) -> CannedTrainingClient:
        """The canned training client."""
        return self.client

    def create_sampling_client(self, base_model: str, **_options: Any) -> CannedTrainingClient:
        """The base-model sampler the pre-flight asks for (only its tokenizer is used)."""
        return self.client


def canned_sequence(tokenizer: Any, text: str, rng: np.random.Generator) -> SampleSequence:
    """A completion of `text` and the end-of-turn token, with made-up sampler log-probs."""
    tokens = [
        *tokenizer.encode(text, add_special_tokens=False),
        tokenizer.convert_tokens_to_ids(IM_END),
    ]
    logprobs = (-rng.exponential(0.3, len(tokens))).tolist()
    return SampleSequence(stop_reason="stop", tokens=tokens, text=text, logprobs=logprobs)


def canned_service(problems: Sequence[Problem], tokenizer: Any) -> CannedService:
    """Canned completions per problem: `\\boxed{gold}` (reward 1) and a wrong answer (reward 0)."""
    rng = np.random.default_rng(0)
    sequences = {
        problem.prompt_tokens: (
            canned_sequence(
                tokenizer, f"the answer is {problem.gold}. \\boxed{{{problem.gold}}}", rng
            ),
            canned_sequence(
                tokenizer, f"the answer is {problem.gold}1. \\boxed{{{problem.gold}1}}", rng
            ),
        )
        for problem in problems
    }
    return CannedService(
        CannedTrainingClient(tokenizer=tokenizer, sampler=CannedSampler(sequences))
    )


# --- the run ------------------------------------------------------------------------------------


@attrs.frozen
class Setting:
    """One loop configuration to time."""

    label: str
    concurrency: int
    max_steps_off_policy: int


@attrs.frozen
class StepTimes:
    """Means over the timed steps (the first step left out)."""

    sample_s: float
    train_s: float
    step_s: float
    uncovered_s: float
    cpu_s: float


def run_setting(
    setting: Setting,
    *,
    backend: str,
    batch_size: int,
    group_size: int,
    steps: int,
    latency_s: Mapping[str, float],
    dataset: Path,
    workdir: Path,
) -> StepTimes:
    """Train `steps` steps through the latency wrapper.

    Per-step times come from the loop's metrics and the call log.
    """
    config = TrainConfig(
        base_model=TINY_MODEL_NAME,
        dataset=str(dataset),
        steps=steps,
        batch_size=batch_size,
        group_size=group_size,
        concurrency=setting.concurrency,
        max_steps_off_policy=setting.max_steps_off_policy,
        eval_every=0,
        save_every=0,
        run_dir=str(workdir / f"run-{setting.concurrency}-{setting.max_steps_off_policy}"),
    )
    if backend == "canned":
        tokenizer = build_tokenizer()
        rows = load_problems(config.dataset, "train")
        problems = build_problems(
            tokenizer,
            rows,
            fewshot=False,
            max_tokens=config.max_tokens,
            max_len=None,
            split="train",
        )
        inner: Any = canned_service(problems, tokenizer)
    else:
        from grpo.backends.local import (
            LocalServiceClient,
        )  # the canned runs never load the model code

        inner = LocalServiceClient(root=workdir / "backend", seed=config.seed)
    log = CallLog()
    step_ends: list[tuple[float, float]] = []

    def on_line(line: str) -> None:
        if not line.startswith("[grpo]"):
            step_ends.append((time.perf_counter(), time.process_time()))

    result = train(
        config, service_client=WithLatency(inner, latency_s, log), echo=on_line, progress=False
    )
    if backend == "local":
        inner.close()
    rows_by_step = read_metrics(result.run_dir)
    timed = range(1, len(step_ends))  # step k runs from the end of step k-1 to its own end
    uncovered = [
        (step_ends[k][0] - step_ends[k - 1][0]) - log.covered(step_ends[k - 1][0], step_ends[k][0])
        for k in timed
    ]
    return StepTimes(
        sample_s=float(np.mean([rows_by_step[k]["time/sample"] for k in timed])),
        train_s=float(np.mean([rows_by_step[k]["time/train"] for k in timed])),
        step_s=float(np.mean([step_ends[k][0] - step_ends[k - 1][0] for k in timed])),
        uncovered_s=float(np.mean(uncovered)),
        cpu_s=float(np.mean([step_ends[k][1] - step_ends[k - 1][1] for k in timed])),
    )


def write_problems(path: Path, count: int) -> Path:
    """The first `count` built-in arithmetic training problems as a JSONL file.

    Exactly what the run reads.
    """
    rows = load_problems("arithmetic", "train", limit=count)
    path.write_text(
        "".join(
            json.dumps({"question": row["question"], "answer": row["answer"]}) + "\n"
            for row in rows
        )
    )
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the loop-overhead benchmark and print its table."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--backend",
        choices=("canned", "local"),
        default="canned",
        help="canned responses (no compute) or the real local backend",
    )
    args = parser.parse_args(argv)
    batch_size, group_size, steps, scale = (4, 4, 3, 0.1) if args.quick else (32, 8, 4, 1.0)
    latency_s = {name: seconds * scale for name, seconds in FULL_LATENCY_S.items()}
    command = (
        "python -m benchmarks.loop"
        + (" --quick" if args.quick else "")
        + (" --backend local" if args.backend == "local" else "")
    )
    print_header(
        f"Training-loop overhead ({args.backend} backend + fixed latency per call)", command
    )
    print(
        f"{batch_size} prompts x group {group_size}, 2 minibatches a step, "
        f"{steps} steps (first left out); latency per call: "
        + ", ".join(
            f"{name} {seconds * 1e3:g} ms"
            for name, seconds in latency_s.items()
            if name != "forward_backward_custom"
        )
        + "\n"
    )
    settings = [
        Setting("sequential (concurrency=1)", 1, 0),
        Setting(f"concurrent (concurrency={batch_size})", batch_size, 0),
        Setting("concurrent + max_steps_off_policy=1", batch_size, 1),
    ]
    sample_latency = latency_s["sample"]
    table = []
    with tempfile.TemporaryDirectory(prefix="grpo-bench-loop-") as workdir:
        # Only the problems the steps use: the loop builds a prompt for every training row.
        dataset = write_problems(Path(workdir) / "problems.jsonl", steps * batch_size)
        for (thread_label, threads), setting in itertools.product(
            thread_settings(args.quick), settings
        ):
            with torch_threads(threads):
                times = run_setting(
                    setting,
                    backend=args.backend,
                    batch_size=batch_size,
                    group_size=group_size,
                    steps=steps,
                    latency_s=latency_s,
                    dataset=dataset,
                    workdir=Path(workdir) / f"threads-{threads}",
                )
            phase = times.sample_s / sample_latency
            overhead = times.uncovered_s / times.step_s
            table.append(
                [
                    thread_label,
                    setting.label,
                    f"{times.sample_s * 1e3:.0f}",
                    f"{phase:.2f}x"
                    + (
                        f": {'met' if phase <= SAMPLING_PHASE_TARGET else 'missed'}"
                        if setting.max_steps_off_policy == 0 and setting.concurrency > 1
                        else ""
                    ),
                    f"{times.train_s * 1e3:.0f}",
                    f"{times.step_s * 1e3:.0f}",
                    f"{times.uncovered_s * 1e3:.1f} ({overhead:.1%}): "
                    f"{'met' if overhead < OVERHEAD_TARGET else 'missed'}",
                    f"{times.cpu_s * 1e3:.0f} ({times.cpu_s / times.step_s:.1%})",
                ]
            )
    print(
        markdown_table(
            [
                "torch",
                "setting",
                "time/sample ms",
                "time/sample ÷ one sample call",
                "time/train ms",
                "time/step ms",
                "client on critical path ms (share of step)",
                "process CPU ms (share of step)",
            ],
            table,
        )
    )
    print(
        "\ntime/sample includes the save_weights_and_get_sampling_client call"
        " that refreshes the sampler;"
        " targets: concurrent time/sample <= 1.5x one sample call, client share < 5%\n"
    )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
