"""Problem datasets: every source yields rows with a question column and an answer column.

Sources accepted by ``load_problems``:

- ``"arithmetic"``: built-in, seeded + and − word problems, offline. Operands range over
  ``0..2·10^difficulty`` (0..20 at difficulty 1); for − the first operand is the larger,
  so answers are never negative. The splits are disjoint by phrasing: train uses three
  phrasings per operation, test two others, so test questions are never seen in training
  while every arithmetic fact may be. Sizes:
  train 2,000 and test 300 distinct questions (fewer if the difficulty's problem space is
  smaller; difficulty 1 has 2,016 train and 1,344 test questions in all).
- ``"wordproblems"``: built-in, seeded GSM8K-style stories of one or two steps (+ and −
  over 0..20, never negative), answers in GSM8K's form: one equation per line, then
  ``#### N`` (e.g. ``"9 + 4 = 13\\n13 - 6 = 7\\n#### 7"``). Both splits tell the same
  8 kinds of story; train and test are disjoint by construction: each split has its own
  people and objects, so no test question can equal a train question. Sizes: train 2,000
  and test 300.
- ``"gsm8k"``: ``openai/gsm8k`` (config ``main``) from the Hugging Face hub or its cache.
- a path: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file (it serves whichever split is
  asked for), or a directory holding ``{split}.jsonl`` / ``.json`` / ``.parquet`` / ``.csv``.
- ``OWNER/NAME`` that is no local path: a Hugging Face hub dataset (``hub_config``,
  ``hub_split``), from the hub or its cache. Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE,
  or the hub not answering one request within HUB_PROBE_TIMEOUT_S) it is read from the cache
  alone, without the hub client's retries, and when not cached fails at once saying how to
  use a local file instead. A value that looks like a path (a suffix of ``LOCAL_SUFFIXES``, a
  leading ``.``, ``~`` or ``/``, a backslash) is never sent to the hub: missing, it fails
  with "no such file" naming the path.

The question is column ``prompt_column`` (default ``question``), the answer column
``answer_column`` (default ``answer``); the gold answer comes from the answer by
``gold_rule`` (``grpo.core.rewards.extract_gold``; default the text after the last
``####``, e.g. ``"3 + 4 = 7\\n#### 7"``). Every other column is kept: rewards see the row.
"""

from __future__ import annotations

import json
import os
import random
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import cache
from pathlib import Path
from typing import Any

import datasets

from grpo.core.rewards import GoldRuleTimeout, extract_gold
from grpo.tasks.text_files import text_problem

SPLITS = ("train", "test")
ARITHMETIC_SPLIT_SIZES = {"train": 2000, "test": 300}
WORD_PROBLEM_SPLIT_SIZES = {"train": 2000, "test": 300}
WORD_PROBLEM_MAX_OPERAND = 20
BUILTIN_SOURCES = ("arithmetic", "wordproblems", "gsm8k")
"""Datasets with their own columns and gold rule (the column flags do not apply)."""
GSM8K_HUB_ID = "openai/gsm8k"
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
REQUIRED_COLUMNS = ("question", "answer")
_HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")
_OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
HUB_PROBE_TIMEOUT_S = 3.0
"""How long `hub_reachable` waits for the hub's answer (unreachable, the hub client retries
a request for about half a minute before it gives up)."""

# Train and test never share a phrasing; the operation words (plus/more, minus/away) recur
# across splits so a model that learned the train phrasings can read the test ones.
ARITHMETIC_PHRASINGS: dict[str, dict[str, tuple[str, ...]]] = {
    "train": {
        "+": (
            "What is {a} plus {b}?",
            "Add {b} to {a}.",
            "Ann has {a} pens, gets {b} more. Total?",
        ),
        "-": (
            "What is {a} minus {b}?",
            "Take {b} away from {a}.",
            "Ann has {a} pens, gives {b} away. Left?",
        ),
    },
    "test": {
        "+": (
            "Find {a} plus {b}.",
            "Bob has {a} cups, gets {b} more. Total?",
        ),
        "-": (
            "Find {a} minus {b}.",
            "Bob has {a} cups, gives {b} away. Left?",
        ),
    },
}


# GSM8K-style stories. Each template is (operations, text): `{a}` `{b}` `{c}` are the
# operands in order, `{name}` a person, `{thing}` a plural noun. Both splits tell these
# stories; each split has its own names and objects (disjoint by construction), so a test
# question always differs from every train question in who and what it is about.
WORD_PROBLEM_TEMPLATES: tuple[tuple[str, str], ...] = (
    (
        "+",
        "{name} has {a} {thing}. {name} buys {b} more {thing}. "
        "How many {thing} does {name} have now?",
    ),
    (
        "-",
        "{name} had {a} {thing} and gave {b} of them to a friend. "
        "How many {thing} does {name} have left?",
    ),
    (
        "+",
        "There are {a} {thing} in a box and {b} {thing} on the table. "
        "How many {thing} are there in all?",
    ),
    (
        "-",
        "A shop had {a} {thing}. It sold {b} of them in the morning. How many {thing} are left?",
    ),
    (
        "++",
        "{name} picked {a} {thing} on Monday, {b} on Tuesday and {c} on Wednesday. "
        "How many {thing} did {name} pick in total?",
    ),
    (
        "+-",
        "{name} has {a} {thing}. A friend gives {name} {b} more, then {name} loses {c}. "
        "How many {thing} does {name} have now?",
    ),
    (
        "-+",
        "{name} had {a} {thing} and used {b} of them. Later {name} bought {c} more. "
        "How many {thing} does {name} have now?",
    ),
    (
        "--",
        "A basket holds {a} {thing}. {name} takes out {b}, then takes out {c} more. "
        "How many {thing} are still in the basket?",
    ),
)
WORD_PROBLEM_NAMES = {
    "train": ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gil", "Hugo", "Ida", "Jon"),
    "test": ("Kim", "Leo", "Mia", "Ned", "Ola", "Pia"),
}
WORD_PROBLEM_THINGS = {
    "train": ("apples", "pens", "stickers", "marbles", "eggs", "stamps", "shells", "cookies"),
    "test": ("cards", "coins", "books", "beads", "plums"),
}
# People and objects of neither split, for warm starts that must see no story of either
# split (`warm_start_word_problems`; `scripts/make_tiny_model.py --tools`).
WARM_START_NAMES = tuple(
    (
        "Abe Bea Cal Dora Ezra Finn Gwen Hank Iris Jade Kai Lena Max Nora Omar Pam Quinn "
        "Rosa Sam Tess Uma Vic Wes Xena Yuri Zoe Anil Bo Chen Dana Emil Femi"
    ).split()
)
WARM_START_THINGS = tuple(
    (
        "grapes toys cups nuts bricks ropes hats socks rocks pears bells tiles cans "
        "seeds kites buttons boxes flags leaves nails rings spoons tickets wheels"
    ).split()
)


def load_problems(
    source: str,
    split: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    difficulty: int = 1,
    prompt_column: str = "question",
    answer_column: str = "answer",
    gold_rule: str = "####",
    hub_config: str | None = None,
    hub_split: str | None = None,
) -> datasets.Dataset:
    """Rows from `source` (see module doc), columns checked; the first `limit` rows if given.

    `seed` shapes the built-in problems and `difficulty` the arithmetic ones only; files
    and hub datasets keep their own order. A hub dataset serves split `hub_split` (default
    `split`).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}; pass split='train' or 'test'")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit={limit!r} must be a positive integer or None (all rows)")
    if source == "arithmetic":
        problems = arithmetic_problems(
            split, size=ARITHMETIC_SPLIT_SIZES[split], seed=seed, difficulty=difficulty
        )
    elif source == "wordproblems":
        problems = word_problems(split, size=WORD_PROBLEM_SPLIT_SIZES[split], seed=seed)
    elif source == "gsm8k":
        problems = _validated(_load_hub(GSM8K_HUB_ID, "main", split), f"{GSM8K_HUB_ID} ({split})")
    elif _is_hub_name(source):
        hub_split = hub_split or split
        problems = _load_hub(source, hub_config, hub_split)
        problems = _validated(
            problems, f"{source} ({hub_split})", prompt_column, answer_column, gold_rule
        )
    else:
        path = _local_file(source, split)
        problems = _validated(
            _load_local_file(path), str(path), prompt_column, answer_column, gold_rule
        )
    if limit is not None and limit < len(problems):
        problems = problems.select(range(limit))
    return problems


def columns_of(config: Any) -> tuple[str, str, str]:
    """(question column, answer column, gold rule) of a run's --dataset (built-ins: their own)."""
    if config.dataset in BUILTIN_SOURCES:
        return "question", "answer", "####"
    return config.prompt_column, config.answer_column, config.gold_rule


def run_problem_source(config: Any, split: str, *, limit: int | None = None) -> dict[str, Any]:
    """The keyword arguments of `load_problems` for a run's TrainConfig: its --dataset,
    columns, gold rule and splits (what the rows depend on, so also a key to share them)."""
    prompt_column, answer_column, gold_rule = columns_of(config)
    return {
        "source": config.dataset,
        "split": split,
        "limit": limit,
        "seed": config.seed,
        "difficulty": config.difficulty,
        "prompt_column": prompt_column,
        "answer_column": answer_column,
        "gold_rule": gold_rule,
        "hub_config": config.dataset_config,
        "hub_split": config.train_split if split == "train" else config.test_split,
    }


def load_run_problems(config: Any, split: str, *, limit: int | None = None) -> datasets.Dataset:
    """`load_problems` of a run's TrainConfig: its --dataset, columns, gold rule and splits."""
    return load_problems(**run_problem_source(config, split, limit=limit))


def max_operand(difficulty: int) -> int:
    """The largest operand of arithmetic problems: 2·10^difficulty (20 at difficulty 1)."""
    if isinstance(difficulty, bool) or not isinstance(difficulty, int) or difficulty < 1:
        raise ValueError(f"difficulty={difficulty!r} must be an integer >= 1 (1 means 0..20)")
    return 2 * 10**difficulty


def arithmetic_problems(split: str, *, size: int, seed: int, difficulty: int) -> datasets.Dataset:
    """`size` distinct seeded problems a + b or a − b (b <= a), a, b in 0..max_operand(difficulty).

    Each draw picks a phrasing of this split uniformly, then a and b uniformly (swapped for
    − when b > a); repeated questions are redrawn.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}; pass split='train' or 'test'")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size={size!r} must be a non-negative integer")
    largest = max_operand(difficulty)
    phrasings = ARITHMETIC_PHRASINGS[split]
    distinct_questions = len(phrasings["+"]) * (largest + 1) ** 2 + len(phrasings["-"]) * (
        (largest + 1) * (largest + 2) // 2
    )
    size = min(size, distinct_questions)
    templates = [(operation, phrasing) for operation in "+-" for phrasing in phrasings[operation]]
    # A string seed makes `random` derive its state from sha512: stable across processes.
    # The seed label keeps the module's old name: it fixes the problems, not a location.
    rng = random.Random(f"grpo.data.arithmetic/{split}/{difficulty}/{seed}")
    chosen: set[str] = set()
    questions: list[str] = []
    answers: list[str] = []
    while len(questions) < size:
        operation, phrasing = rng.choice(templates)
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        if operation == "-" and b > a:
            a, b = b, a
        question = phrasing.format(a=a, b=b)
        if question in chosen:
            continue
        chosen.add(question)
        result = a + b if operation == "+" else a - b
        questions.append(question)
        answers.append(f"{a} {operation} {b} = {result}\n#### {result}")
    return datasets.Dataset.from_dict({"question": questions, "answer": answers})


def word_problems(split: str, *, size: int, seed: int) -> datasets.Dataset:
    """`size` distinct seeded stories of this split: template, name, thing, then operands.

    Operands are uniform in 0..WORD_PROBLEM_MAX_OPERAND; draws whose running total would go
    negative are redrawn, as are repeated questions. Answers list one equation per step.
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}; pass split='train' or 'test'")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size={size!r} must be a non-negative integer")
    # The seed label keeps the module's old name: it fixes the problems, not a location.
    rng = random.Random(f"grpo.data.wordproblems/{split}/{seed}")
    return _stories(rng, WORD_PROBLEM_NAMES[split], WORD_PROBLEM_THINGS[split], size)


def warm_start_word_problems(*, size: int, seed: int) -> datasets.Dataset:
    """`size` distinct seeded stories told of WARM_START_NAMES and WARM_START_THINGS: the
    built-in templates and operands with no person or object of either split."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size={size!r} must be a non-negative integer")
    rng = random.Random(f"grpo.data.wordproblems/warm/{seed}")
    return _stories(rng, WARM_START_NAMES, WARM_START_THINGS, size)


def _stories(
    rng: random.Random, names: tuple[str, ...], things: tuple[str, ...], size: int
) -> datasets.Dataset:
    """`size` distinct stories drawn from rng: template, name, thing, then operands."""
    chosen: set[str] = set()
    questions: list[str] = []
    answers: list[str] = []
    while len(questions) < size:
        operations, template = rng.choice(WORD_PROBLEM_TEMPLATES)
        name = rng.choice(names)
        thing = rng.choice(things)
        operands = [rng.randint(0, WORD_PROBLEM_MAX_OPERAND) for _ in range(len(operations) + 1)]
        total, lines, went_negative = operands[0], [], False
        for operation, operand in zip(operations, operands[1:]):
            result = total + operand if operation == "+" else total - operand
            lines.append(f"{total} {operation} {operand} = {result}")
            went_negative |= result < 0
            total = result
        if went_negative:
            continue
        fields = dict(zip("abc", operands))
        question = template.format(name=name, thing=thing, **fields)
        if question in chosen:
            continue
        chosen.add(question)
        questions.append(question)
        answers.append("\n".join([*lines, f"#### {total}"]))
    return datasets.Dataset.from_dict({"question": questions, "answer": answers})


def looks_like_path(source: str) -> bool:
    """True when `source` is written as a file path, not a hub OWNER/NAME (see module doc)."""
    return (
        Path(source).suffix.lower() in LOCAL_SUFFIXES
        or source.startswith((".", "~", "/"))
        or "\\" in source
    )


def _is_hub_name(source: str) -> bool:
    """OWNER/NAME that is not a local path."""
    return (
        _HUB_NAME.fullmatch(source) is not None
        and not looks_like_path(source)
        and not Path(source).expanduser().exists()
    )


def _offline_message(name: str, split: str, why: str) -> str:
    return (
        f"could not load {name} from the Hugging Face hub ({why}); the hub is unreachable "
        "and the dataset is not cached. Pass a local file instead: --dataset "
        f"path/to/{split}.jsonl (or .parquet / .csv), or a directory with {split}.jsonl, "
        "with --prompt-column / --answer-column naming its columns"
    )


@cache
def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Does the Hugging Face hub (its endpoint, HF_ENDPOINT, through the environment's proxy)
    answer one request within ``timeout_s``? Any HTTP answer counts; asked once a process."""
    from huggingface_hub import constants

    request = urllib.request.Request(constants.ENDPOINT, method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return True
    except urllib.error.HTTPError:  # an answer, if not a 2xx one: the hub is there
        return True
    except (OSError, ValueError):  # no route, no DNS, refused, timed out; a malformed endpoint
        return False


@contextmanager
def _hub_offline() -> Iterator[None]:
    """datasets and huggingface_hub in offline mode for the block (the cache alone, no request
    and no retry), as HF_HUB_OFFLINE=1 set before they were imported would put them."""
    from huggingface_hub import constants

    modules = [
        module for module in (datasets.config, constants) if hasattr(module, "HF_HUB_OFFLINE")
    ]
    saved = [module.HF_HUB_OFFLINE for module in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for module, value in zip(modules, saved, strict=True):
            module.HF_HUB_OFFLINE = value


def _load_hub(name: str, config: str | None, split: str) -> datasets.Dataset:
    """A hub dataset's split; offline (the environment says so, or the hub does not answer
    `hub_reachable`'s request) from the cache alone, failing at once when it is not cached."""
    if any(os.environ.get(variable, "") not in ("", "0") for variable in _OFFLINE_ENV):
        why: str | None = "offline mode"
    elif not hub_reachable():
        why = f"no answer from it within {HUB_PROBE_TIMEOUT_S:g} s"
    else:
        why = None
    try:
        with _hub_offline() if why is not None else nullcontext():
            return datasets.load_dataset(name, config, split=split)
    except OSError as error:
        # ConnectionError (offline mode, no DNS) and DatasetNotFoundError are both OSErrors.
        raise ConnectionError(_offline_message(name, split, why or str(error))) from error
    except ValueError as error:
        raise ValueError(
            f"hub dataset {name} (config {config!r}, split {split!r}): {error}; check "
            "--dataset-config and --train-split / --test-split"
        ) from error


def _local_file(given: str, split: str) -> Path:
    path = Path(given).expanduser()
    if path.is_dir():
        candidates = [path / f"{split}{suffix}" for suffix in LOCAL_SUFFIXES]
        for candidate in candidates:
            if candidate.is_file():
                return candidate
        found = sorted(entry.name for entry in path.iterdir())
        raise FileNotFoundError(
            f"data directory {path} has no file for split {split!r}: expected one of "
            f"{[candidate.name for candidate in candidates]}, found {found}"
        )
    if not path.exists() and looks_like_path(given):
        raise FileNotFoundError(
            f"data file {given!r}: no such file or directory (looked in {path.absolute()}); "
            "check the path, or give a built-in source ('arithmetic', 'wordproblems', "
            "'gsm8k') or a hub dataset as OWNER/NAME"
        )
    if not path.exists():
        raise FileNotFoundError(
            f"data source {str(path)!r} is neither a built-in source ('arithmetic', "
            "'wordproblems', 'gsm8k') "
            "nor an existing file or directory; check the path"
        )
    if path.suffix not in LOCAL_SUFFIXES:
        raise ValueError(
            f"data file {path} has suffix {path.suffix!r}; supported: {', '.join(LOCAL_SUFFIXES)}"
        )
    return path


def _load_local_file(path: Path) -> datasets.Dataset:
    data = b"" if path.suffix == ".parquet" else path.read_bytes()
    if path.suffix != ".parquet":
        problem = text_problem(path, data)
        if problem is not None:
            raise ValueError(problem)
    if path.stat().st_size == 0 or (path.suffix != ".parquet" and not data.strip()):
        raise ValueError(f"data file {path} is empty; it needs rows with `question` and `answer`")
    if path.suffix == ".csv" and len([line for line in data.splitlines() if line.strip()]) < 2:
        raise ValueError(
            f"data file {path} has a header but no rows; add rows under it "
            "(e.g. a line `1 + 2?,#### 3` under `question,answer`)"
        )
    if path.suffix in (".jsonl", ".json"):
        bad_line = _bad_json_line(path)
        if bad_line is not None:
            raise ValueError(
                f"data file {path} cannot be read: {bad_line}; a .jsonl file holds one JSON "
                'object per line, e.g. {"question": "1 + 2?", "answer": "1 + 2 = 3\\n#### 3"}'
            )
        return datasets.Dataset.from_json(str(path), keep_in_memory=True)
    try:
        if path.suffix == ".parquet":
            return datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
        return datasets.Dataset.from_csv(str(path), keep_in_memory=True)
    except datasets.exceptions.DatasetGenerationError as error:
        raise ValueError(
            f"data file {path} cannot be read as {path.suffix[1:]}: {error.__cause__}"
        ) from None


def _bad_json_line(path: Path) -> str | None:
    """Where a JSON / JSON Lines file stops being valid JSON ("line N is not valid JSON (...)")."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as error:
                return f"line {number} is not valid JSON ({error.msg})"
    return None


def _validated(
    problems: datasets.Dataset,
    origin: str,
    prompt_column: str = "question",
    answer_column: str = "answer",
    gold_rule: str = "####",
) -> datasets.Dataset:
    """Each row a non-empty question and an answer with a gold answer under `gold_rule`."""
    columns = (prompt_column, answer_column)
    missing = [column for column in columns if column not in problems.column_names]
    if missing:
        raise ValueError(
            f"{origin} lacks column(s) {missing}; found columns {problems.column_names}. "
            "Name the question and answer columns with --prompt-column and --answer-column"
        )
    for row, (question, answer) in enumerate(zip(problems[prompt_column], problems[answer_column])):
        if not isinstance(question, str) or not question.strip():
            raise ValueError(
                f"{prompt_column} in row {row} of {origin} is {question!r}; expected text"
            )
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        try:
            has_gold = isinstance(answer, str) and _has_gold(answer, gold_rule)
        except GoldRuleTimeout as error:
            raise ValueError(f"{answer_column} in row {row} of {origin}: {error}") from None
        if not has_gold:
            expected = (
                "GSM8K-format text ending in '#### <final answer>', e.g. '3 + 4 = 7\\n#### 7' "
                "(or choose --gold-rule whole / regex:PATTERN)"
                if gold_rule == "####"
                else f"text from which --gold-rule {gold_rule!r} extracts an answer"
            )
            raise ValueError(
                f"{answer_column} in row {row} of {origin} is {answer!r}; expected {expected}"
            )
    return problems


def _has_gold(answer: str, gold_rule: str) -> bool:
    try:
        extract_gold(answer, gold_rule)
    except GoldRuleTimeout:
        raise
    except ValueError:
        return False
    return True
