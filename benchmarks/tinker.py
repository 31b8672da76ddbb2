"""What the Tinker route costs: an rl_loop-shaped step through the `tinker` SDK vs in process.

`python -m benchmarks.tinker [--quick] [--steps N] [--rounds R] [--no-hog] [--phases]`

One step of tinker-cookbook's rl_loop shape on the built-in tiny model (LoRA rank 32):
`save_weights_and_get_sampling_client`, 8 prompts x 8 completions of up to 24 new tokens
(the 8 sampling requests in flight at once), 64 `importance_sampling` datums (group-centred
rewards from the completions' tokens), `forward_backward`, `optim_step` (Adam). The same
step once on an in-process `LocalServiceClient` (pytrio's types, Tinker's `sum`
normalization) and once through the official `tinker` SDK (0.38.0) against `grpo serve`
on loopback: the difference is the route (HTTP, protobuf and JSON, the SDK's futures and
long polls). Both sides run torch on 1 thread.

The two alternate, a round of `--steps` steps each way, `--rounds` times, quiet and then
beside a CPU hog (`while True: pass`, stopped with the benchmark); the table gives each
way's median step and the ratio of the medians (`--phases`: then each phase of the step,
quiet: the sampler save, the 8 sampling requests, datum building, forward_backward,
optim_step). Target (issue 48): the route at most 1.3x
the in-process step. The full benchmark runs the server as a separate process
(`python -m grpo serve`), as users do; `--quick` (1 round of 1 step, quiet only) runs it on
a thread of this process, so the SDK and the server share one GIL.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import argument_parser, markdown_table, print_header, torch_threads
from benchmarks.serve import server
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME

API_KEY = "benchmark"
PROMPTS, GROUP, MAX_TOKENS, RANK = 8, 8, 24, 32
LEARNING_RATE = 1e-4
QUESTIONS = tuple(
    f"What is {a} + {b}? Answer in \\boxed{{}}."
    for a, b in zip((12, 7, 31, 45, 3, 28, 19, 50), (34, 15, 9, 22, 61, 5, 40, 17), strict=True)
)
HOG_TIMEOUT_S = 1800
CPU_HOG = (
    f"import time\nend = time.monotonic() + {HOG_TIMEOUT_S}\n"
    "while time.monotonic() < end:\n    pass"
)


def rewards(completions: Sequence[Sequence[int]]) -> np.ndarray:
    """A reward per completion from its tokens alone (both ways get the same for the same
    tokens): 1 where the sum of its tokens is even, else 0."""
    return np.array([float(sum(tokens) % 2 == 0) for tokens in completions])


def policy_rows(
    prompt: Sequence[int], completions: Sequence[tuple[Sequence[int], Sequence[float]]]
) -> list[dict[str, Any]]:
    """One group's importance_sampling rows: input tokens, next-token targets, sampling
    log-probs (0 on the prompt) and group-centred advantages on the completion."""
    advantages_G = rewards([tokens for tokens, _ in completions])
    advantages_G = advantages_G - advantages_G.mean()
    rows = []
    for (tokens, logprobs), advantage in zip(completions, advantages_G, strict=True):
        sequence = [*prompt, *tokens]
        completion_mask = np.arange(1, len(sequence)) >= len(prompt)
        sampled = np.zeros(len(sequence) - 1, dtype=np.float32)
        sampled[completion_mask] = logprobs
        rows.append(
            {
                "input": sequence[:-1],
                "target_tokens": np.asarray(sequence[1:], dtype=np.int64),
                "logprobs": sampled,
                "advantages": np.where(completion_mask, advantage, 0.0).astype(np.float32),
            }
        )
    return rows


def step_datums(
    prompts: Sequence[Sequence[int]], futures: Sequence[Any], datum: Any, model_input: Any
) -> list[Any]:
    """A step's datums (`datum`, `model_input`: pytrio's or tinker's types) from the sampling
    `futures` of `prompts`, one group each (`policy_rows`)."""
    return [
        datum(
            model_input=model_input.from_ints(row["input"]),
            loss_fn_inputs={k: v for k, v in row.items() if k != "input"},
        )
        for prompt, future in zip(prompts, futures, strict=True)
        for row in policy_rows(prompt, [(s.tokens, s.logprobs) for s in future.result().sequences])
    ]


PHASES = ("sampler save", "sampling", "datums", "forward_backward", "optim_step")


class PhaseClock:
    """Seconds of each phase of a step, `mark`ed as each ends (one list per phase name)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {name: [] for name in PHASES}
        self._last = time.perf_counter()

    def start(self) -> None:
        """A step begins."""
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        """Phase `name` ended now."""
        now = time.perf_counter()
        self.times[name].append(now - self._last)
        self._last = now


class InProcess:
    """The step on an in-process `LocalServiceClient` (pytrio's types, Tinker's sum)."""

    def __init__(self, root: Path) -> None:
        from pytrio.types import AdamParams, Datum, ModelInput, SamplingParams

        self.types = (AdamParams, Datum, ModelInput, SamplingParams)
        self.service = LocalServiceClient(root=root, seed=0)
        self.training = self.service.create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=RANK, seed=0, service_normalization="sum"
        )
        tokenizer = self.training.get_tokenizer()
        self.prompts = [tokenizer.encode(q, add_special_tokens=False) for q in QUESTIONS]

    def step(self, seed: int, clock: PhaseClock | None = None) -> float:
        """One rl_loop step (its phases timed on `clock`, if given); its summed loss."""
        mark = clock.mark if clock else lambda _phase: None
        adam, datum, model_input, sampling = self.types
        sampler = self.training.save_weights_and_get_sampling_client()
        mark("sampler save")
        params = sampling(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        futures = [
            sampler.sample(model_input.from_ints(prompt), GROUP, params) for prompt in self.prompts
        ]
        [future.result() for future in futures]
        mark("sampling")
        datums = step_datums(self.prompts, futures, datum, model_input)
        mark("datums")
        out = self.training.forward_backward(datums, "importance_sampling").result()
        mark("forward_backward")
        self.training.optim_step(adam(learning_rate=LEARNING_RATE)).result()
        mark("optim_step")
        return float(out.metrics.get("loss:sum", next(iter(out.metrics.values()))))

    def close(self) -> None:
        """Release the in-process service."""
        self.service.close()


class ThroughSdk:
    """The step through the official `tinker` SDK against `grpo serve` at `url`."""

    def __init__(self, url: str, prompts: Sequence[Sequence[int]]) -> None:
        import tinker

        self.tinker = tinker
        self.service = tinker.ServiceClient(base_url=url, api_key=f"tml-{API_KEY}")
        self.training = self.service.create_lora_training_client(
            base_model=TINY_MODEL_NAME, rank=RANK, seed=0
        ).result()
        self.prompts = [list(prompt) for prompt in prompts]

    def step(self, seed: int, clock: PhaseClock | None = None) -> float:
        """One rl_loop step (its phases timed on `clock`, if given); its summed loss."""
        mark = clock.mark if clock else lambda _phase: None
        types = self.tinker.types
        sampler = self.training.save_weights_and_get_sampling_client().result()
        mark("sampler save")
        params = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(prompt), num_samples=GROUP, sampling_params=params
            )
            for prompt in self.prompts
        ]
        [future.result() for future in futures]
        mark("sampling")
        datums = step_datums(self.prompts, futures, types.Datum, types.ModelInput)
        mark("datums")
        out = self.training.forward_backward(datums, "importance_sampling").result()
        mark("forward_backward")
        self.training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()
        mark("optim_step")
        return float(out.metrics["loss:sum"])

    def close(self) -> None:
        """Finish the SDK's session (the server frees its training client)."""
        self.service.close("success").result()


@contextmanager
def cpu_hog(on: bool) -> Iterator[None]:
    """A busy-loop process beside the block (none when not `on`), bounded in time."""
    if not on:
        yield
        return
    hog = subprocess.Popen(  # bounded by its own clock; killed itself, no wrapper to orphan it
        [sys.executable, "-c", CPU_HOG], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        time.sleep(0.5)
        yield
    finally:
        hog.kill()
        hog.wait(timeout=30)


def timed_steps(step: Callable[[int], float], seeds: Sequence[int]) -> list[float]:
    """Seconds of each `step(seed)`."""
    durations = []
    for seed in seeds:
        begin = time.perf_counter()
        step(seed)
        durations.append(time.perf_counter() - begin)
    return durations


def scenario_rows(
    local: InProcess,
    remote: ThroughSdk,
    scenarios: Sequence[tuple[str, bool]],
    steps: int,
    rounds: int,
) -> list[list[str]]:
    """A table row per (label, hog) scenario: each way's median step and their ratio, the two
    ways alternated in `rounds` rounds of `steps` steps."""
    rows = []
    for label, hog in scenarios:
        times: dict[str, list[float]] = {"in process": [], "through the SDK": []}
        with cpu_hog(hog):
            for round_index in range(rounds):
                seeds = [1 + round_index * steps + i for i in range(steps)]
                times["in process"] += timed_steps(local.step, seeds)
                times["through the SDK"] += timed_steps(remote.step, seeds)
        local_s = statistics.median(times["in process"])
        sdk_s = statistics.median(times["through the SDK"])
        rows.append(
            [
                label,
                f"{local_s:.3f}",
                f"{sdk_s:.3f}",
                f"{sdk_s / local_s:.2f}x",
                f"{len(times['in process'])} + {len(times['through the SDK'])}",
            ]
        )
    return rows


def phase_rows(local: InProcess, remote: ThroughSdk, steps: int, rounds: int) -> list[list[str]]:
    """A table row per phase of the step, quiet: each way's median ms and their difference,
    the two ways alternated in `rounds` rounds of `steps` steps."""
    clocks = {"in process": PhaseClock(), "through the SDK": PhaseClock()}
    ways = (("in process", local), ("through the SDK", remote))
    for round_index in range(rounds):
        for label, way in ways:
            for i in range(steps):
                clocks[label].start()
                way.step(1 + round_index * steps + i, clocks[label])
    rows = []
    for phase in PHASES:
        local_ms, sdk_ms = (
            1000 * statistics.median(clocks[label].times[phase]) for label, _ in ways
        )
        rows.append([phase, f"{local_ms:.1f}", f"{sdk_ms:.1f}", f"{sdk_ms - local_ms:+.1f}"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Run the Tinker-route benchmark and print its table."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="steps each way in a round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds each way")
    parser.add_argument("--no-hog", action="store_true", help="the quiet scenario only")
    parser.add_argument(
        "--phases", action="store_true", help="also time each phase of the step (quiet)"
    )
    args = parser.parse_args(argv)
    steps, rounds = (1, 1) if args.quick else (args.steps, args.rounds)
    given = list(sys.argv[1:] if argv is None else argv)
    print_header(
        "Tinker route vs in process (rl_loop step: 8 x 8 completions, 24 tokens, LoRA rank 32)",
        " ".join(["python -m benchmarks.tinker", *given]),
    )
    where = "a thread of this process" if args.quick else "a separate process"
    print(f"server on {where}; {rounds} round(s) of {steps} step(s) each way, alternated\n")
    scenarios = [("quiet", False)] + ([] if args.quick or args.no_hog else [("CPU hog", True)])
    with tempfile.TemporaryDirectory(prefix="grpo-bench-tinker-") as scratch, torch_threads(1):
        root = Path(scratch)
        local = InProcess(root / "local")
        try:
            with server(
                root / "served", subprocess_server=not args.quick, export="TINKER_BASE_URL"
            ) as served:
                remote = ThroughSdk(served.url, local.prompts)
                local.step(0), remote.step(0)  # warm-up: first compiles, first connections
                with closing(remote):
                    rows = scenario_rows(local, remote, scenarios, steps, rounds)
                    phases = phase_rows(local, remote, steps, rounds) if args.phases else []
        finally:
            local.close()
    print(
        markdown_table(
            ["scenario", "in process s/step", "through the SDK s/step", "ratio", "steps timed"],
            rows,
        )
    )
    print("\ntarget: through the SDK at most 1.3x the in-process step (issue 48)")
    if phases:
        print("\nphase by phase, quiet (medians)\n")
        print(
            markdown_table(["phase", "in process ms", "through the SDK ms", "difference"], phases)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
