"""The same GRPO job through Hugging Face TRL's `GRPOTrainer` and through grpo, one after the other.

`python -m benchmarks.peer [--quick] [--steps N]`

TRL is an optional benchmark dependency, never part of grpo's install:
`pip install trl==1.16.0` (the version measured; it needs nothing the install lacks).
Without it the benchmark says so and times grpo alone.

The job: the built-in model (`grpo/tiny-qwen3-bpe`) and its arithmetic training prompts, the
default reward (`boxed_match`: 1 when the last `\\boxed{}` equals the gold answer), 8 prompts
x 8 completions a step of up to 24 tokens at temperature 1 (no top-k/top-p), LoRA rank 32
(alpha 32, no dropout) on every attention and MLP projection and the unembedding, Adam at
2e-4 (betas 0.9/0.95, eps 1e-8, no weight decay, constant rate), gradient norm clipped at
1, mean-centred group advantages (no std scaling), no KL term, 2 optimizer steps a step
(each on 4 groups), N steps (default 20), 1 torch thread. Both walk the same prompts in the
same order (grpo's per-step pick, handed to TRL as an unshuffled dataset).

Reported: wall time of the training call ÷ steps (both include their first step; grpo's
call also loads the model and builds the prompts, TRL's constructor is not timed), the
median step from the second on (grpo's `time/step`; TRL's logged `step_time` of a step's
two optimizer steps, generation included), and the reward gain: mean reward of the last
quarter of the steps minus that of the first quarter (last minus first step under --quick).
Settings that cannot match are listed in benchmarks/README.md.

--quick: 2 steps each (CI: the benchmark runs; no threshold).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import argument_parser, markdown_table, print_header, torch_threads
from grpo.backends.local.model import ATTENTION_MODULES, LORA_ALPHA, MLP_MODULES
from grpo.backends.local.tiny import load_tiny_model
from grpo.core.rewards import grade
from grpo.tasks.data import load_run_problems
from grpo.training.recipes.grpo.run import train
from grpo.training.rollouts.problems import run_problems, step_problems
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import TrainConfig

PROMPTS, GROUP, MINIBATCHES = 8, 8, 2


def grpo_config(steps: int, run_dir: str) -> TrainConfig:
    """The default run for `steps` steps without evaluation or checkpoints."""
    return TrainConfig(steps=steps, eval_every=0, save_every=0, run_dir=run_dir)


def reward_gain(rewards: Sequence[float]) -> float:
    """Mean of the last quarter of the steps' rewards minus the first quarter's (at least one)."""
    quarter = max(1, len(rewards) // 4)
    return float(np.mean(rewards[-quarter:]) - np.mean(rewards[:quarter]))


def run_grpo(steps: int) -> dict[str, Any]:
    """The default job through grpo: seconds per step, per-step rewards, median time/step."""
    with tempfile.TemporaryDirectory(prefix="grpo-bench-peer-") as root:
        started = time.perf_counter()
        result = train(grpo_config(steps, f"{root}/run"), echo=lambda _line: None, progress=False)
        wall = time.perf_counter() - started
        rows = [row for row in read_metrics(result.run_dir) if row["step"] >= 1]
    return {
        "s_per_step": wall / steps,
        "rewards": [row["reward"] for row in rows],
        "median_step_s": float(np.median([row["time/step"] for row in rows[1:] or rows])),
    }


def trl_prompts(steps: int) -> tuple[list[dict[str, str]], int]:
    """The grpo run's prompts, step by step, as TRL dataset rows (prompt text, gold answer),
    and how many of them re-tokenize to other ids than grpo samples from."""
    config = grpo_config(steps, "unused")
    _model, tokenizer = load_tiny_model()
    dataset_rows = load_run_problems(config, "train")
    problems = run_problems(tokenizer, dataset_rows, config, "train", max_len=None)
    rows, differing = [], 0
    for step in range(steps):
        for problem in step_problems(problems, config.batch_size, step, config.seed):
            text = tokenizer.decode(list(problem.prompt_tokens), skip_special_tokens=False)
            differing += tokenizer.encode(text, add_special_tokens=False) != list(
                problem.prompt_tokens
            )
            rows.append({"prompt": text, "gold": problem.gold})
    return rows, differing


def boxed_match_reward(completions: list[str], gold: list[str], **_: Any) -> list[float]:
    """grpo's default reward in TRL's reward-function form."""
    return [grade(completion, answer) for completion, answer in zip(completions, gold, strict=True)]


def run_trl(steps: int) -> dict[str, Any]:
    """The same job through TRL's GRPOTrainer: seconds per step, per-step rewards."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    rows, differing = trl_prompts(steps)
    model, tokenizer = load_tiny_model()
    tokenizer.padding_side = "left"
    with tempfile.TemporaryDirectory(prefix="grpo-bench-trl-") as root:
        args = GRPOConfig(
            output_dir=root,
            use_cpu=True,
            bf16=False,
            seed=0,
            max_steps=steps * MINIBATCHES,  # TRL counts optimizer steps
            per_device_train_batch_size=PROMPTS * GROUP // MINIBATCHES,
            steps_per_generation=MINIBATCHES,
            num_generations=GROUP,
            max_completion_length=24,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            learning_rate=2e-4,
            lr_scheduler_type="constant",
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_epsilon=1e-8,
            weight_decay=0.0,
            optim="adamw_torch",
            max_grad_norm=1.0,
            beta=0.0,
            scale_rewards="none",
            loss_type="dr_grpo",
            shuffle_dataset=False,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        lora = LoraConfig(
            r=32,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            # TRL refuses a LoRA on lm_head (it reads lm_head.weight directly): not matched.
            target_modules=[*ATTENTION_MODULES, *MLP_MODULES],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=[boxed_match_reward],
                args=args,
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer,
                peft_config=lora,
            )
            trainer.remove_callback(PrinterCallback)  # its per-step dicts would flood the table
            started = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - started
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    # TRL logs each optimizer step's time; a grpo step is MINIBATCHES of them.
    optimizer_steps = [
        entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry
    ]
    per_step = np.asarray(optimizer_steps).reshape(-1, MINIBATCHES).sum(axis=1)
    return {
        "s_per_step": wall / steps,
        "rewards": rewards,
        "retokenized": differing,
        "median_step_s": float(np.median(per_step[1:] if len(per_step) > 1 else per_step)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job through TRL (when installed) and through grpo; print the comparison."""
    parser = argument_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="grpo steps (TRL: twice as many optimizer steps, as grpo takes 2 a step)",
    )
    args = parser.parse_args(argv)
    steps = 2 if args.quick else args.steps
    print_header(
        "grpo vs TRL's GRPOTrainer on the same job (1 torch thread)",
        "python -m benchmarks.peer" + (" --quick" if args.quick else f" --steps {steps}"),
    )
    have_trl = importlib.util.find_spec("trl") is not None
    results: dict[str, dict[str, Any]] = {}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with torch_threads(1):
        if have_trl:
            results["TRL GRPOTrainer"] = run_trl(steps)
        results["grpo (local backend)"] = run_grpo(steps)
    if not have_trl:
        print("trl is not installed (`pip install trl==1.16.0`): grpo alone\n")
    else:
        import trl

        print(
            f"trl {trl.__version__}; prompts whose decoded text re-tokenizes differently: "
            f"{results['TRL GRPOTrainer']['retokenized']}\n"
        )
    rows = []
    for name, result in results.items():
        rows.append(
            [
                name,
                f"{result['s_per_step']:.3f}",
                f"{result['median_step_s']:.3f}",
                f"{np.mean(result['rewards']):.3f}",
                f"{reward_gain(result['rewards']):+.3f}",
                " ".join(f"{value:.2f}" for value in result["rewards"]),
            ]
        )
    print(
        markdown_table(
            [
                "trainer",
                "s/step (wall ÷ steps)",
                "median s/step (2nd step on)",
                "mean reward",
                "reward gain",
                "reward per step",
            ],
            rows,
        )
    )
    if have_trl:
        trl_result, grpo_result = results["TRL GRPOTrainer"], results["grpo (local backend)"]
        print(
            f"\nTRL / grpo s/step: {trl_result['s_per_step'] / grpo_result['s_per_step']:.2f}x "
            f"(wall ÷ steps), {trl_result['median_step_s'] / grpo_result['median_step_s']:.2f}x "
            "(median step)"
        )
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
