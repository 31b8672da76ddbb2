"""Regenerate the built-in tiny model's warm-started weights, bit-for-bit.

    python scripts/make_tiny_model.py                 # train, save, measure, write MANIFEST.md
    python scripts/make_tiny_model.py --check         # retrain in a temp dir, compare with shipped

    python scripts/make_tiny_model.py --steps 600 --snapshot-steps 200,300,400 --snapshot-dir D
                                                      # also save the model at those steps
    python scripts/make_tiny_model.py --tools         # the tool-use model (tiny_model_tools/)
    python scripts/make_tiny_model.py --tools --check # retrain it and compare with shipped

Training is single-threaded and deterministic (see grpo/tools/warm_start.py), so the same
torch and transformers versions reproduce the shipped tokenizer and `model.safetensors` byte
for byte. The tokenizer is trained first, on the warm start's own conversations (both
prompt styles).

The third style, ``--tools``, warm-starts the tool-use model (``grpo/tiny-qwen3-bpe-tools``,
files in ``grpo/backends/local/tiny_model_tools/``) from the shipped weights: word problems
of people and objects of neither split (``warm_start_word_problems``) and the arithmetic
train split, solved in two turns, a calculator call then the boxed answer after its
``<tool_response>`` (``grpo.envs.wordproblems.tool_solution``), each turn's prompt built as
`grpo train --env grpo.envs:calculator_wordproblems` builds it; the shipped tokenizer is
kept.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from pathlib import Path

import tokenizers
import torch
import transformers

from grpo.backends.local.tiny import (
    MAX_POSITIONS,
    TINY_MODEL_DIR,
    TINY_TOOLS_MODEL_DIR,
    init_tiny_model,
    load_tiny_model,
    train_tokenizer,
)
from grpo.tasks.data import (
    ARITHMETIC_SPLIT_SIZES,
    WORD_PROBLEM_SPLIT_SIZES,
    load_problems,
    warm_start_word_problems,
)
from grpo.tasks.prompts import FEWSHOT_PREFIX
from grpo.tools import warm_start

WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SAVED_FILES = ("config.json", "generation_config.json", WEIGHTS_FILE, *TOKENIZER_FILES)
SAMPLING_SEED = 0
PROMPT_STYLES = {"own prompt": (), "few-shot prompt": FEWSHOT_PREFIX}
TOOLS_STEPS = 300
TOOLS_BATCH_SIZE = 32
TOOLS_LEARNING_RATE = 2e-3
TOOLS_WARMUP_STEPS = 10
TOOLS_MAX_TOKENS = 96


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def save(model: transformers.PreTrainedModel, tokenizer: object, out: Path) -> None:
    """Model, generation config (stopping at the end of the assistant turn) and tokenizer."""
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def make_model(
    out: Path, *, steps: int, seed: int, snapshots: dict[int, Path] | None = None
) -> tuple[transformers.PreTrainedModel, object]:
    """Train the tokenizer, then warm-start init_tiny_model(seed) for `steps` steps; save to out.

    `snapshots` maps a step (1-based) to a directory that receives the model at that step.
    """
    conversations = warm_start.warm_start_conversations(seed)
    tokenizer = train_tokenizer(warm_start.tokenizer_corpus(conversations))
    model, _ = init_tiny_model(seed, tokenizer)
    examples = warm_start.encode_examples(tokenizer, conversations)
    started = time.perf_counter()

    def report(step: int, loss: float) -> None:
        if (step + 1) % 25 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - started
            print(f"step {step + 1:4d}/{steps}  loss {loss:.4f}  {elapsed:6.1f} s", flush=True)
        if snapshots and step + 1 in snapshots:
            save(model, tokenizer, snapshots[step + 1])

    warm_start.train_warm_start(
        model, examples, steps=steps, pad_token_id=tokenizer.pad_token_id, seed=seed, on_step=report
    )
    save(model, tokenizer, out)
    return model, tokenizer


def tool_problems(source: str) -> object:
    """The problems the tool warm start solves for `source`: the arithmetic train split, and
    for word problems stories of people and objects of neither split, so that the model
    does not learn the train split's names (GRPO's test reward then measures transfer)."""
    if source == "wordproblems":
        return warm_start_word_problems(size=WORD_PROBLEM_SPLIT_SIZES["train"], seed=0)
    return load_problems(source, "train")


def tool_examples(tokenizer: object) -> list[tuple[list[int], list[int]]]:
    """Both turns of every tool_problems problem solved with the calculator, as (prompt,
    completion) token pairs; each prompt is built as the --env rollout builds it."""
    from grpo.envs import CalculatorEnv, Task
    from grpo.envs.wordproblems import tool_solution
    from grpo.tasks.prompts import build_messages
    from grpo.training.rollouts.episodes import bridge_text, render

    eos = tokenizer.eos_token_id
    end = tokenizer.decode([eos], skip_special_tokens=False)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    examples = []
    for source in warm_start.DATASETS:
        problems = tool_problems(source)
        for question, answer in zip(problems["question"], problems["answer"]):
            env = CalculatorEnv(
                Task(question, "", messages=build_messages(question, fewshot=False))
            )
            opening = env.initial_observation()
            call, final = tool_solution(answer)
            messages = [
                *opening,
                {"role": "assistant", "content": call},
                *env.step(call).observation,
            ]
            shown = render(tokenizer, opening, env.tools)
            bridge, _ = bridge_text(tokenizer, shown, call, end, messages, env.tools)
            first = (encode(shown), [*encode(call), eos])
            examples += [first, ([*first[0], *first[1], *encode(bridge)], [*encode(final), eos])]
    return examples


def make_tools_model(out: Path, *, steps: int, seed: int) -> tuple[object, object]:
    """The shipped model trained `steps` more steps on tool_examples (TOOLS_BATCH_SIZE,
    TOOLS_LEARNING_RATE, TOOLS_WARMUP_STEPS); saved to out."""
    model, tokenizer = load_tiny_model()
    examples = tool_examples(tokenizer)
    started = time.perf_counter()

    def report(step: int, loss: float) -> None:
        if (step + 1) % 10 == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - started
            print(f"step {step + 1:4d}/{steps}  loss {loss:.4f}  {elapsed:6.1f} s", flush=True)

    warm_start.train_warm_start(
        model,
        examples,
        steps=steps,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
        batch_size=TOOLS_BATCH_SIZE,
        learning_rate=TOOLS_LEARNING_RATE,
        warmup_steps=TOOLS_WARMUP_STEPS,
        on_step=report,
    )
    save(model, tokenizer, out)
    return model, tokenizer


def measure_tools(out: Path, problems: int) -> dict:
    """Mean return and tool-use rate of one calculator_wordproblems episode per test word
    problem, greedy and at temperature 1, sampled by the local backend as a run samples."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo.backends.local import LocalServiceClient
    from grpo.envs import CalculatorEnv, Task
    from grpo.tasks.prompts import build_messages
    from grpo.training.rollouts.episodes import EpisodeLimits, play_episode
    from grpo.training.run.seeds import episode_seed

    results = {}
    test = load_problems("wordproblems", "test", limit=problems)
    with tempfile.TemporaryDirectory() as root, LocalServiceClient(root=Path(root)) as service:
        sampler = service.create_sampling_client(base_model=str(out))
        tokenizer = sampler.get_tokenizer()
        for label, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
            limits = EpisodeLimits(
                max_turns=4,
                max_tokens=TOOLS_MAX_TOKENS,
                max_len=MAX_POSITIONS,
                temperature=temperature,
            )

            def one(index: int, limits: EpisodeLimits = limits) -> tuple[float, bool]:
                question = test[index]["question"]
                gold = test[index]["answer"].split("#### ")[-1]
                env = CalculatorEnv(
                    Task(question, gold, messages=build_messages(question, fewshot=False))
                )
                episode, _usage, _seen = play_episode(
                    sampler,
                    env,
                    tokenizer,
                    limits,
                    lambda turn: episode_seed(SAMPLING_SEED, 4, 0, index, turn),
                    max_retries=0,
                    note=print,
                )
                return episode.reward, any(turn.tool_calls for turn in episode.turns)

            with ThreadPoolExecutor(32) as pool:
                scored = list(pool.map(one, range(len(test))))
            results[label] = (
                sum(reward for reward, _ in scored) / len(scored),
                sum(used for _, used in scored) / len(scored),
            )
    return results


def write_tools_manifest(out: Path, *, command: str, steps: int, seed: int, results: dict) -> None:
    """The tool model's MANIFEST.md: recipe, versions, sha256, the measured tool task."""
    lines = [
        "# Built-in tiny model, tool-use warm start (grpo/tiny-qwen3-bpe-tools)",
        "",
        "The shipped `tiny_model/` weights trained further by `scripts/make_tiny_model.py --tools`",
        "on built-in problems solved in two turns (a calculator call, then the boxed answer",
        "after the tool response): the arithmetic train split, and word problems told of people",
        "and objects of neither split (`grpo.tasks.data.warm_start_word_problems`), so the",
        "model is not tied to the train split's names. The tokenizer is the shipped one.",
        "`--tools --check` retrains and compares the bytes.",
        "",
        f"- command: `{command}`",
        f"- steps: {steps}, seed: {seed}, batch {TOOLS_BATCH_SIZE}, Adam lr "
        f"{TOOLS_LEARNING_RATE} betas {warm_start.ADAM_BETAS}, {TOOLS_WARMUP_STEPS} warm-up "
        f"steps, grad clip {warm_start.MAX_GRAD_NORM}",
        f"- versions: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}",
        f"- {WEIGHTS_FILE} sha256: `{sha256_of(out / WEIGHTS_FILE)}`",
        f"- tokenizer.json sha256: `{sha256_of(out / 'tokenizer.json')}`",
        f"- training wall time: {results['seconds']:.0f} s (one thread)",
        "",
        f"`grpo.envs:calculator_wordproblems` on the first {results['problems']} test word "
        f"problems, one episode each (up to 4 turns of {TOOLS_MAX_TOKENS} tokens, seed "
        f"{SAMPLING_SEED}):",
        "",
        "| sampling | test reward | episodes that call the tool |",
        "|---|---|---|",
        *(
            f"| {label} | {reward:.3f} | {used:.3f} |"
            for label, (reward, used) in results["tools"].items()
        ),
        "",
    ]
    (out / "MANIFEST.md").write_text("\n".join(lines))


def tools_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """--tools: make (or --check) the tool-use model in TINY_TOOLS_MODEL_DIR."""
    out, steps = TINY_TOOLS_MODEL_DIR, args.steps if args.steps_given else TOOLS_STEPS
    if args.check:
        with tempfile.TemporaryDirectory() as scratch:
            make_tools_model(Path(scratch), steps=steps, seed=args.seed)
            same = sha256_of(Path(scratch) / WEIGHTS_FILE) == sha256_of(out / WEIGHTS_FILE)
        print("OK: regenerated weights match" if same else f"MISMATCH with {out}")
        return 0 if same else 1
    started = time.perf_counter()
    make_tools_model(out, steps=steps, seed=args.seed)
    results = {
        "seconds": time.perf_counter() - started,
        "problems": args.eval_problems,
        "tools": measure_tools(out, args.eval_problems),
    }
    command = " ".join(
        ["python", "scripts/make_tiny_model.py", *(sys.argv[1:] if argv is None else argv)]
    )
    write_tools_manifest(out, command=command, steps=steps, seed=args.seed, results=results)
    print((out / "MANIFEST.md").read_text())
    return 0


def measure(model: transformers.PreTrainedModel, tokenizer: object, problems: int) -> dict:
    """Greedy and temperature-1 accuracy on the first `problems` test problems of each dataset
    in each prompt style."""
    accuracy = {}
    for source in warm_start.DATASETS:
        test = load_problems(source, "test", limit=problems)
        for style, prefix in PROMPT_STYLES.items():
            for label, temperature in (("greedy", 0.0), ("temperature 1", 1.0)):
                accuracy[(source, style, label)] = warm_start.solve_rate(
                    model,
                    tokenizer,
                    test,
                    temperature=temperature,
                    prefix=prefix,
                    seed=SAMPLING_SEED,
                    max_new_tokens=warm_start.MAX_NEW_TOKENS * 2,
                )
    return accuracy


def accuracy_lines(accuracy: dict, problems: int) -> list[str]:
    """One markdown table row per dataset and prompt style: greedy and temperature-1 accuracy."""
    lines = [
        f"| test problems (first {problems}) | prompt | greedy | temperature 1 |",
        "|---|---|---|---|",
    ]
    for source in warm_start.DATASETS:
        for style in PROMPT_STYLES:
            lines.append(
                f"| {source} | {style} | {accuracy[(source, style, 'greedy')]:.3f} "
                f"| {accuracy[(source, style, 'temperature 1')]:.3f} |"
            )
    return lines


def write_manifest(out: Path, *, command: str, steps: int, seed: int, results: dict) -> None:
    """MANIFEST.md: what produced the files, their sha256, size and measured accuracy."""
    lines = [
        "# Built-in tiny model (warm start)",
        "",
        "Produced by `grpo/tools/warm_start.py` through `scripts/make_tiny_model.py`; `--check`",
        "retrains and compares the bytes with this directory. Byte equality holds for the torch,",
        "transformers and tokenizers versions below on CPU; other versions, or CPUs whose",
        "kernels pick different vector instructions, may round differently.",
        "",
        f"- command: `{command}`",
        f"- steps: {steps}, seed: {seed}, batch {warm_start.BATCH_SIZE}, "
        f"Adam lr {warm_start.LEARNING_RATE} betas {warm_start.ADAM_BETAS}, "
        f"{warm_start.WARMUP_STEPS} warm-up steps, grad clip {warm_start.MAX_GRAD_NORM}",
        f"- versions: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}",
        f"- parameters: {results['parameters']:,}; vocabulary {results['vocab']} ids "
        f"(byte-level BPE); {MAX_POSITIONS} positions",
        f"- {WEIGHTS_FILE} sha256: `{sha256_of(out / WEIGHTS_FILE)}`",
        f"- tokenizer.json sha256: `{sha256_of(out / 'tokenizer.json')}`",
        f"- training wall time: {results['seconds']:.0f} s (one thread)",
        "",
        f"Accuracy, one completion per problem (sampling seed {SAMPLING_SEED}, up to "
        f"{warm_start.MAX_NEW_TOKENS * 2} new tokens); the few-shot prompt is "
        "`grpo.tasks.prompts.FEWSHOT_PREFIX` before the question:",
        "",
        *accuracy_lines(results["accuracy"], results["problems"]),
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
    print(
        f"OK: regenerated files match {shipped} "
        f"({WEIGHTS_FILE} {sha256_of(shipped / WEIGHTS_FILE)})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default 400; --tools 300)"
    )
    parser.add_argument(
        "--tools",
        action="store_true",
        help="the third style: warm-start the tool-use model from the shipped weights",
    )
    parser.add_argument(
        "--seed", type=int, default=warm_start.WARM_START_SEED, help="init and data-order seed"
    )
    parser.add_argument("--out", type=Path, default=TINY_MODEL_DIR, help="output directory")
    parser.add_argument(
        "--eval-problems",
        type=int,
        default=ARITHMETIC_SPLIT_SIZES["test"],
        help="test problems used to measure accuracy",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="retrain in a temp dir and compare with --out; exit 1 on mismatch",
    )
    parser.add_argument(
        "--snapshot-steps", default="", help="comma-separated steps at which to save the model too"
    )
    parser.add_argument("--snapshot-dir", type=Path, help="where snapshots go (step-N/ each)")
    parser.add_argument(
        "--measure", type=Path, help="only measure the model saved in this directory, then exit"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    args.steps_given = args.steps is not None
    if args.tools:
        return tools_main(args, argv)
    if not args.steps_given:
        args.steps = warm_start.WARM_START_STEPS
    if args.check:
        return check(args.out, steps=args.steps, seed=args.seed)
    if args.measure is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.measure)
        model = transformers.AutoModelForCausalLM.from_pretrained(args.measure).eval()
        accuracy = measure(model, tokenizer, args.eval_problems)
        print("\n".join(accuracy_lines(accuracy, args.eval_problems)))
        return 0
    snapshot_steps = [int(step) for step in args.snapshot_steps.split(",") if step]
    if snapshot_steps and args.snapshot_dir is None:
        parser.error("--snapshot-steps needs --snapshot-dir")
    snapshots = {step: args.snapshot_dir / f"step-{step}" for step in snapshot_steps}

    started = time.perf_counter()
    model, tokenizer = make_model(args.out, steps=args.steps, seed=args.seed, snapshots=snapshots)
    seconds = time.perf_counter() - started
    results = {
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "vocab": len(tokenizer),
        "seconds": seconds,
        "problems": args.eval_problems,
        "accuracy": measure(model, tokenizer, args.eval_problems),
    }
    command = " ".join(
        ["python", "scripts/make_tiny_model.py", *(sys.argv[1:] if argv is None else argv)]
    )
    write_manifest(args.out, command=command, steps=args.steps, seed=args.seed, results=results)
    print(
        f"saved {args.out / WEIGHTS_FILE} (sha256 {sha256_of(args.out / WEIGHTS_FILE)}), "
        f"{results['parameters']:,} parameters, trained in {seconds:.0f} s"
    )
    print("\n".join(accuracy_lines(results["accuracy"], args.eval_problems)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
