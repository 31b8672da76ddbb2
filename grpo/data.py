"""Problem datasets: every source yields rows with a `question` and a GSM8K-format `answer`.

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
  ``#### N`` (e.g. ``"9 + 4 = 13\\n13 - 6 = 7\\n#### 7"``). Train and test are disjoint by
  construction: each split has its own story templates, names and objects, so no test
  question can equal a train question. Sizes: train 2,000 and test 300.
- ``"gsm8k"``: ``openai/gsm8k`` (config ``main``) from the Hugging Face hub or its cache.
- a path: a ``.jsonl``/``.json``/``.parquet``/``.csv`` file (it serves whichever split is
  asked for), or a directory holding ``{split}.jsonl`` / ``.json`` / ``.parquet`` / ``.csv``.

The gold answer is the text after the last ``####`` (e.g. ``"3 + 4 = 7\\n#### 7"``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets

from grpo.core.rewards import gsm8k_gold

SPLITS = ("train", "test")
ARITHMETIC_SPLIT_SIZES = {"train": 2000, "test": 300}
WORD_PROBLEM_SPLIT_SIZES = {"train": 2000, "test": 300}
WORD_PROBLEM_MAX_OPERAND = 20
BUILTIN_SOURCES = ("arithmetic", "wordproblems")
GSM8K_HUB_ID = "openai/gsm8k"
LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
REQUIRED_COLUMNS = ("question", "answer")

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
# operands in order, `{name}` a person, `{thing}` a plural noun. Every split has its own
# templates, names and things (disjoint by construction).
WORD_PROBLEM_TEMPLATES: dict[str, tuple[tuple[str, str], ...]] = {
    "train": (
        ("+", "{name} has {a} {thing}. {name} buys {b} more {thing}. "
         "How many {thing} does {name} have now?"),
        ("-", "{name} had {a} {thing} and gave {b} of them to a friend. "
         "How many {thing} does {name} have left?"),
        ("+", "There are {a} {thing} in a box and {b} {thing} on the table. "
         "How many {thing} are there in all?"),
        ("-", "A shop had {a} {thing}. It sold {b} of them in the morning. "
         "How many {thing} are left?"),
        ("++", "{name} picked {a} {thing} on Monday, {b} on Tuesday and {c} on Wednesday. "
         "How many {thing} did {name} pick in total?"),
        ("+-", "{name} has {a} {thing}. A friend gives {name} {b} more, then {name} loses {c}. "
         "How many {thing} does {name} have now?"),
        ("-+", "{name} had {a} {thing} and used {b} of them. Later {name} bought {c} more. "
         "How many {thing} does {name} have now?"),
        ("--", "A basket holds {a} {thing}. {name} takes out {b}, then takes out {c} more. "
         "How many {thing} are still in the basket?"),
    ),
    "test": (
        ("+", "{name} owns {a} {thing} and wins {b} more at a fair. "
         "How many {thing} does {name} own now?"),
        ("-", "{name} started with {a} {thing} and lost {b} on the way home. "
         "How many {thing} are left?"),
        ("++", "{name} collected {a} {thing} in the first week, {b} in the second and {c} in "
         "the third. How many {thing} were collected altogether?"),
        ("+-", "A jar has {a} {thing}. {name} adds {b} {thing} and then removes {c}. "
         "How many {thing} are in the jar now?"),
        ("-+", "{name} had {a} {thing}, sold {b} and then received {c} as a gift. "
         "How many {thing} does {name} have now?"),
        ("--", "{name} had {a} {thing}. {name} gave {b} to a neighbour and {c} to a cousin. "
         "How many {thing} does {name} have left?"),
    ),
}
WORD_PROBLEM_NAMES = {
    "train": ("Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gil", "Hugo", "Ida", "Jon"),
    "test": ("Kim", "Leo", "Mia", "Ned", "Ola", "Pia"),
}
WORD_PROBLEM_THINGS = {
    "train": ("apples", "pens", "stickers", "marbles", "eggs", "stamps", "shells", "cookies"),
    "test": ("cards", "coins", "books", "beads", "plums"),
}


def load_problems(
    source: str,
    split: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    difficulty: int = 1,
) -> datasets.Dataset:
    """Rows {question, answer} from `source` (see module doc); the first `limit` rows if given.

    `seed` shapes the built-in problems and `difficulty` the arithmetic ones only; files
    and GSM8K keep their own order.
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
        problems = _validated(_load_gsm8k(split), f"{GSM8K_HUB_ID} ({split})")
    else:
        path = _local_file(Path(source).expanduser(), split)
        problems = _validated(_load_local_file(path), str(path))
    if limit is not None and limit < len(problems):
        problems = problems.select(range(limit))
    return problems


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
    rng = random.Random(f"grpo.data.wordproblems/{split}/{seed}")
    chosen: set[str] = set()
    questions: list[str] = []
    answers: list[str] = []
    while len(questions) < size:
        operations, template = rng.choice(WORD_PROBLEM_TEMPLATES[split])
        name = rng.choice(WORD_PROBLEM_NAMES[split])
        thing = rng.choice(WORD_PROBLEM_THINGS[split])
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


def _load_gsm8k(split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(GSM8K_HUB_ID, "main", split=split)
    except OSError as error:
        # ConnectionError (offline mode, no DNS) and DatasetNotFoundError are both OSErrors.
        raise ConnectionError(
            f"could not load {GSM8K_HUB_ID} from the Hugging Face hub ({error}); the hub is "
            "unreachable and the dataset is not cached. Pass a local file instead, e.g. "
            f"source='path/to/gsm8k_{split}.jsonl' or a directory with {split}.jsonl / "
            f"{split}.parquet holding `question` and `answer` columns"
        ) from error


def _local_file(path: Path, split: str) -> Path:
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
    if path.stat().st_size == 0 or (path.suffix != ".parquet" and not path.read_bytes().strip()):
        raise ValueError(f"data file {path} is empty; it needs rows with `question` and `answer`")
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


def _validated(problems: datasets.Dataset, origin: str) -> datasets.Dataset:
    """Only the question and answer columns, each row a non-empty question and a `####` answer."""
    missing = [column for column in REQUIRED_COLUMNS if column not in problems.column_names]
    if missing:
        raise ValueError(
            f"{origin} lacks column(s) {missing}; found columns {problems.column_names}. "
            "Rename the columns to `question` and `answer`"
        )
    problems = problems.select_columns(list(REQUIRED_COLUMNS))
    for row, (question, answer) in enumerate(zip(problems["question"], problems["answer"])):
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question in row {row} of {origin} is {question!r}; expected text")
        if not isinstance(answer, str) or not _has_gold(answer):
            raise ValueError(
                f"answer in row {row} of {origin} is {answer!r}; expected GSM8K-format text "
                "ending in '#### <final answer>', e.g. '3 + 4 = 7\\n#### 7'"
            )
    return problems


def _has_gold(answer: str) -> bool:
    try:
        gsm8k_gold(answer)
    except ValueError:
        return False
    return True
