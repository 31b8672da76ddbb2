"""Regenerate the built-in tiny model's warm-started weights, bit-for-bit.

    python scripts/make_tiny_model.py                 # train, save, measure, write MANIFEST.md
    python scripts/make_tiny_model.py --check         # retrain in a temp dir, compare with shipped

Training is single-threaded and deterministic (see grpo/backends/warm_start.py), so the same
torch and transformers versions reproduce the shipped `model.safetensors` byte for byte.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from grpo.backends import warm_start
from grpo.backends.tiny import TINY_MODEL_DIR, build_tokenizer, init_tiny_model
from grpo.data import ARITHMETIC_SPLIT_SIZES, load_problems

WEIGHTS_FILE = "model.safetensors"
SAVED_FILES = ("config.json", "generation_config.json", WEIGHTS_FILE)
SAMPLING_SEED = 0


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_model(out: Path, *, steps: int, seed: int) -> transformers.PreTrainedModel:
    """Warm-start init_tiny_model(seed) for `steps` steps on the arithmetic train split; save to out."""
    model, tokenizer = init_tiny_model(seed)
    examples = warm_start.encode_examples(tokenizer, load_problems("arithmetic", "train"))
    started = time.perf_counter()

    def report(step: int, loss: float) -> None:
        if (step + 1) % 25 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - started
            print(f"step {step + 1:4d}/{steps}  loss {loss:.4f}  {elapsed:6.1f} s", flush=True)

    warm_start.train_warm_start(
        model, examples, steps=steps, pad_token_id=tokenizer.pad_token_id, seed=seed, on_step=report
    )
    # Shipped so that a plain `generate` stops at the end of the assistant turn.
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return model


def write_manifest(out: Path, *, command: str, steps: int, seed: int, results: dict) -> None:
    """MANIFEST.md: what produced the weights, their sha256, size and measured accuracy."""
    lines = [
        "# Built-in tiny model (warm start)",
        "",
        "Produced by `grpo/backends/warm_start.py` through `scripts/make_tiny_model.py`;",
        "`--check` retrains and compares the bytes with this directory. Byte equality holds for",
        "the torch and transformers versions below on CPU; other versions, or CPUs whose kernels",
        "pick different vector instructions, may round differently.",
        "",
        f"- command: `{command}`",
        f"- steps: {steps}, seed: {seed}, batch {warm_start.BATCH_SIZE}, "
        f"Adam lr {warm_start.LEARNING_RATE} betas {warm_start.ADAM_BETAS}, "
        f"{warm_start.WARMUP_STEPS} warm-up steps, grad clip {warm_start.MAX_GRAD_NORM}",
        f"- versions: torch {torch.__version__}, transformers {transformers.__version__}",
        f"- parameters: {results['parameters']:,}",
        f"- {WEIGHTS_FILE} sha256: `{sha256_of(out / WEIGHTS_FILE)}`",
        f"- training wall time: {results['seconds']:.0f} s",
        f"- accuracy on the first {results['problems']} arithmetic test problems "
        f"(sampling seed {SAMPLING_SEED}): greedy {results['greedy']:.3f}, "
        f"temperature 1 {results['temperature_1']:.3f}",
        "",
    ]
    (out / "MANIFEST.md").write_text("\n".join(lines))


def check(shipped: Path, *, steps: int, seed: int) -> int:
    """Retrain into a temporary directory; 0 when every saved file matches the shipped bytes."""
    with tempfile.TemporaryDirectory() as scratch:
        make_model(Path(scratch), steps=steps, seed=seed)
        mismatched = [
            name
            for name in SAVED_FILES
            if not (shipped / name).exists()
            or sha256_of(Path(scratch) / name) != sha256_of(shipped / name)
        ]
    if mismatched:
        print(f"MISMATCH with {shipped}: {', '.join(mismatched)}", file=sys.stderr)
        return 1
    print(f"OK: regenerated files match {shipped} ({WEIGHTS_FILE} {sha256_of(shipped / WEIGHTS_FILE)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--steps", type=int, default=warm_start.WARM_START_STEPS, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=warm_start.WARM_START_SEED, help="init and data-order seed")
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR, help="output directory")
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=ARITHMETIC_SPLIT_SIZES["test"],
        help="test problems used to measure accuracy",
    )
    parser.add_argument(
        "--check", action="store_true", help="retrain in a temp dir and compare with --out; exit 1 on mismatch"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.check:
        return check(args.out, steps=args.steps, seed=args.seed)

    started = time.perf_counter()
    model = make_model(args.out, steps=args.steps, seed=args.seed)
    seconds = time.perf_counter() - started
    tokenizer = build_tokenizer()
    test = load_problems("arithmetic", "test", limit=args.eval_problems)
    results = {
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "seconds": seconds,
        "problems": len(test),
        "greedy": warm_start.solve_rate(model, tokenizer, test, temperature=0.0),
        "temperature_1": warm_start.solve_rate(model, tokenizer, test, temperature=1.0, seed=SAMPLING_SEED),
    }
    command = " ".join(["python", "scripts/make_tiny_model.py", *(sys.argv[1:] if argv is None else argv)])
    write_manifest(args.out, command=command, steps=args.steps, seed=args.seed, results=results)
    print(
        f"saved {args.out / WEIGHTS_FILE} (sha256 {sha256_of(args.out / WEIGHTS_FILE)}), "
        f"{results['parameters']:,} parameters, trained in {seconds:.0f} s"
    )
    print(
        f"accuracy on {len(test)} test problems: greedy {results['greedy']:.3f}, "
        f"temperature 1 {results['temperature_1']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
