"""What `grpo serve` costs: per-call overhead through pytrio's client vs in process, and a run.

`python -m benchmarks.serve [--quick] [--steps N] [--no-run]`

The same calls on the built-in tiny model (LoRA rank 32, 1 torch thread), once on an
in-process `LocalServiceClient` and once through pytrio 0.2.9's own client against
`grpo serve` on loopback: a sample (1 prompt x 8 samples, up to 16 new tokens, fixed
seed), a forward_backward (`importance_sampling`, 8 datums of 48 positions), the same
loss through forward_backward_custom (two events), an optim_step and
save_weights_and_get_sampling_client. Overhead = server - in process (the HTTP
round trips, msgpack/JSON, pytrio's validation and event polling); each timing is the
best of several calls after a warm-up.

Then the default training run (`grpo train` defaults, `--steps` steps, default 20) both
ways: wall time of `grpo.training.recipes.grpo.run.train` in process vs through the server, whose
`--concurrency` (32 sampling requests in flight) is applied with `configure_concurrency`;
the two alternate `--run-repeats` times (default 2) and the best of each is compared.
Target (issue 13): under 15% slower end to end. The full benchmark runs the server as a
separate process (`python -m grpo serve`), as users do; `--quick` (2 tiny steps, 3 calls
each) runs it on a thread of this process, so the client and the server share one GIL.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from pytrio.types import AdamParams, Datum, ModelInput, SamplingParams

from benchmarks.common import (
    Timing,
    argument_parser,
    markdown_table,
    measure,
    print_header,
    torch_threads,
)
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.backends.pytrio import make_service_client
from grpo.serve.client import configured_pytrio
from grpo.serve.server import serve_in_thread
from grpo.training.custom_loss import as_custom_loss
from grpo.training.recipes.grpo.run import train
from grpo.training.settings.config import TrainConfig

API_KEY = "benchmark"
DATUMS, POSITIONS, TRAINED = 8, 48, 16
ADAM = AdamParams(learning_rate=1e-5)


def datums(vocab_size: int, seed: int = 0) -> list[Datum]:
    """DATUMS policy datums of POSITIONS random tokens, the last TRAINED with advantage ±1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(DATUMS):
        advantages = np.zeros(POSITIONS, dtype=np.float32)
        advantages[-TRAINED:] = rng.choice([-1.0, 1.0])
        out.append(
            Datum(
                model_input=ModelInput.from_ints(rng.integers(0, vocab_size, POSITIONS).tolist()),
                loss_fn_inputs={
                    "target_tokens": rng.integers(0, vocab_size, POSITIONS),
                    "logprobs": np.where(advantages != 0, -1.0, 0.0).astype(np.float32),
                    "advantages": advantages,
                },
            )
        )
    return out


def time_calls(service: Any, repeats: int) -> dict[str, Timing]:
    """Best-of-`repeats` seconds per call of each operation on `service`."""
    training = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=32, seed=0)
    tokenizer = training.get_tokenizer()
    batch = datums(len(tokenizer))
    custom = as_custom_loss("importance_sampling", batch)
    sampler = training.save_weights_and_get_sampling_client()
    prompt = ModelInput.from_ints(tokenizer.encode("What is 12+34?", add_special_tokens=False))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=0)
    calls: dict[str, Callable[[], object]] = {
        "sample (1 x 8 samples)": lambda: sampler.sample(prompt, 8, params).result(),
        "forward_backward (8 datums)": lambda: training.forward_backward(
            batch, "importance_sampling"
        ).result(),
        "forward_backward_custom (8 datums)": lambda: training.forward_backward_custom(
            batch, custom
        ).result(),
        "optim_step": lambda: training.optim_step(ADAM).result(),
        "save_weights_and_get_sampling_client": training.save_weights_and_get_sampling_client,
    }
    return {name: measure(call, repeats=repeats) for name, call in calls.items()}


@attrs.frozen
class Server:
    """A running `grpo serve`: its URL."""

    url: str


@contextmanager
def server(
    root: Path, *, subprocess_server: bool, export: str = "PYTRIO_BASE_URL"
) -> Iterator[Server]:
    """`grpo serve` on a free loopback port (a child process, or a thread of this one); its URL
    as the child prints it in the `export` line (the PyTRIO one, or e.g. TINKER_BASE_URL)."""
    if not subprocess_server:
        with serve_in_thread(root=root, api_key=API_KEY) as handle:
            yield Server(handle.url)
        return
    env = {**os.environ, "GRPO_SERVE_API_KEY": API_KEY, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "grpo", "serve", "--port", "0", "--root", str(root)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        url = ""
        while not url:
            line = child.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise RuntimeError("grpo serve exited before printing its URL")
            match = re.search(rf"{export}=(\S+)", line)
            url = match.group(1) if match else ""
        yield Server(url)
    finally:
        child.terminate()
        child.wait(timeout=30)


def run_wall_time(config: TrainConfig, service: Any) -> float:
    """Seconds of `grpo.training.recipes.grpo.run.train(config)` on `service`."""
    started = time.perf_counter()
    train(config, service_client=service, echo=lambda _line: None, progress=False)
    return time.perf_counter() - started


def end_to_end_table(root: Path, args: Any) -> str:
    """The default run's wall time in process and through the server, alternating, best of each."""
    overrides: dict[str, Any] = (
        dict(steps=2, batch_size=2, group_size=4, eval_every=0, save_every=0, concurrency=4)
        if args.quick
        else dict(steps=args.steps)
    )
    times: dict[str, list[float]] = {"local": [], "served": []}
    for repeat in range(1 if args.quick else args.run_repeats):
        config = TrainConfig(**{**overrides, "run_dir": str(root / f"run-local-{repeat}")})
        with LocalServiceClient(root=root / f"backend-{repeat}", seed=config.seed) as local:
            times["local"].append(run_wall_time(config, local))
        config = TrainConfig(
            **{**overrides, "run_dir": str(root / f"run-served-{repeat}"), "backend": "pytrio"}
        )
        with (
            server(root / f"served-{repeat}", subprocess_server=not args.quick) as served,
            configured_pytrio(served.url, api_key=API_KEY, home=root),
        ):
            service = make_service_client("pytrio", concurrency=config.concurrency)
            times["served"].append(run_wall_time(config, service))
    local_s, served_s = min(times["local"]), min(times["served"])
    every = "; ".join(
        f"{name}: " + ", ".join(f"{t:.1f}" for t in values) for name, values in times.items()
    )
    return markdown_table(
        ["run", "in process s", "through server s", "slower by", "every run (s)"],
        [
            [
                f"default config, {overrides['steps']} steps",
                f"{local_s:.1f}",
                f"{served_s:.1f}",
                f"{100 * (served_s / local_s - 1):+.1f}%",
                every,
            ]
        ],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the serve benchmark and print its tables."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps of the default run")
    parser.add_argument("--no-run", action="store_true", help="skip the end-to-end run")
    parser.add_argument(
        "--run-repeats", type=int, default=2, help="alternating runs each way (best reported)"
    )
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 10
    given = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m benchmarks.serve", *given])
    print_header("grpo serve vs in process (tiny model, LoRA rank 32, 1 torch thread)", command)
    where = "a thread of this process" if args.quick else "a separate process"
    print(f"timings: best of {repeats} calls after a warm-up; server on {where}\n")
    with tempfile.TemporaryDirectory(prefix="grpo-bench-serve-") as scratch, torch_threads(1):
        root = Path(scratch)
        with LocalServiceClient(root=root / "local", seed=0) as local:
            in_process = time_calls(local, repeats)
        with (
            server(root / "served", subprocess_server=not args.quick) as served,
            configured_pytrio(served.url, api_key=API_KEY, home=root),
        ):
            import pytrio

            through = time_calls(pytrio.ServiceClient(), repeats)
        rows = [
            [
                name,
                f"{in_process[name].best_ms:.1f}",
                f"{through[name].best_ms:.1f}",
                f"{through[name].best_ms - in_process[name].best_ms:+.1f}",
                f"{through[name].best_s / in_process[name].best_s:.2f}x",
            ]
            for name in in_process
        ]
        print(
            markdown_table(
                ["call", "in process ms", "through server ms", "overhead ms", "ratio"], rows
            )
        )
        print()
        if not args.no_run:
            print(end_to_end_table(root, args))
            print()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
