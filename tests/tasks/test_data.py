"""Problem datasets: the built-in arithmetic generator, GSM8K from the hub, local files."""

import gzip
import json
import re

import datasets
import pytest

from grpo.core.rewards import gsm8k_gold
from grpo.tasks import data
from grpo.tasks.data import (
    ARITHMETIC_PHRASINGS,
    ARITHMETIC_SPLIT_SIZES,
    WARM_START_NAMES,
    WARM_START_THINGS,
    WORD_PROBLEM_MAX_OPERAND,
    WORD_PROBLEM_NAMES,
    WORD_PROBLEM_SPLIT_SIZES,
    WORD_PROBLEM_TEMPLATES,
    WORD_PROBLEM_THINGS,
    arithmetic_problems,
    hub_reachable,
    load_problems,
    max_operand,
    warm_start_word_problems,
    word_problems,
)

ROWS = [
    {"question": "What is 2 plus 2?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "Tom has 5 apples and eats 2. How many are left?", "answer": "5 - 2 = 3\n#### 3"},
]
EQUATION = re.compile(r"^(\d+) ([+-]) (\d+) = (\d+)\n#### (\d+)$")


@pytest.fixture(scope="module")
def train():
    return load_problems("arithmetic", "train")


@pytest.fixture(scope="module")
def test():
    return load_problems("arithmetic", "test")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# --- built-in arithmetic ------------------------------------------------------------------


def test_arithmetic_splits_have_the_documented_sizes_and_columns(train, test):
    assert train.column_names == ["question", "answer"]
    assert (len(train), len(test)) == (
        ARITHMETIC_SPLIT_SIZES["train"],
        ARITHMETIC_SPLIT_SIZES["test"],
    )


def test_arithmetic_questions_are_distinct_within_each_split(train, test):
    assert len(set(train["question"])) == len(train)
    assert len(set(test["question"])) == len(test)


def test_arithmetic_train_and_test_share_no_question_and_no_phrasing(train, test):
    assert not set(train["question"]) & set(test["question"])
    train_phrasings = {p for ps in ARITHMETIC_PHRASINGS["train"].values() for p in ps}
    test_phrasings = {p for ps in ARITHMETIC_PHRASINGS["test"].values() for p in ps}
    assert not train_phrasings & test_phrasings


def test_arithmetic_has_at_least_three_phrasings_per_operation_in_train():
    assert all(len(phrasings) >= 3 for phrasings in ARITHMETIC_PHRASINGS["train"].values())


def test_arithmetic_answers_are_correct_nonnegative_and_in_gsm8k_format(train, test):
    for question, answer in zip(
        [*train["question"], *test["question"]], [*train["answer"], *test["answer"]]
    ):
        a, operation, b, result, gold = EQUATION.match(answer).groups()
        a, b, result = int(a), int(b), int(result)
        assert result == (a + b if operation == "+" else a - b) >= 0
        assert gsm8k_gold(answer) == gold == str(result)
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert sorted(re.findall(r"\d+", question)) == sorted([str(a), str(b)])


def test_arithmetic_uses_every_phrasing_of_its_split(train, test):
    for split, problems in (("train", train), ("test", test)):
        for phrasings in ARITHMETIC_PHRASINGS[split].values():
            for phrasing in phrasings:
                pattern = re.escape(phrasing).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+")
                assert any(re.fullmatch(pattern, q) for q in problems["question"]), phrasing


def test_arithmetic_is_deterministic_for_a_seed_and_varies_with_it():
    first = load_problems("arithmetic", "test", seed=3)
    again = load_problems("arithmetic", "test", seed=3)
    other = load_problems("arithmetic", "test", seed=4)
    assert first["question"] == again["question"] and first["answer"] == again["answer"]
    assert first["question"] != other["question"]


def test_higher_difficulty_uses_larger_operands():
    problems = load_problems("arithmetic", "train", difficulty=2, limit=500)
    operands = []
    for answer in problems["answer"]:
        a, _, b, _, _ = EQUATION.match(answer).groups()
        operands += [int(a), int(b)]
    assert max_operand(2) == 200
    assert max(operands) > 20 and max(operands) <= 200


def test_arithmetic_size_is_capped_by_the_number_of_distinct_questions():
    # Difficulty 1 test phrasings: 2 · 21² sums + 2 · 231 differences.
    assert len(arithmetic_problems("test", size=5000, seed=0, difficulty=1)) == 2 * 441 + 2 * 231


@pytest.mark.parametrize("difficulty", [0, -1, 1.5, True])
def test_invalid_difficulty_is_rejected(difficulty):
    with pytest.raises(ValueError, match="difficulty"):
        load_problems("arithmetic", "train", difficulty=difficulty)


def test_limit_keeps_the_first_rows(train):
    limited = load_problems("arithmetic", "train", limit=10)
    assert limited["question"] == train["question"][:10]
    assert len(load_problems("arithmetic", "test", limit=10_000)) == ARITHMETIC_SPLIT_SIZES["test"]


@pytest.mark.parametrize("limit", [0, -5, True, 2.5])
def test_invalid_limit_is_rejected(limit):
    with pytest.raises(ValueError, match="limit"):
        load_problems("arithmetic", "train", limit=limit)


# --- built-in word problems ---------------------------------------------------------------

STEP = re.compile(r"^(\d+) ([+-]) (\d+) = (-?\d+)$")


@pytest.fixture(scope="module")
def words():
    return {split: load_problems("wordproblems", split) for split in ("train", "test")}


def test_word_problems_have_the_documented_sizes_and_distinct_questions(words):
    for split, problems in words.items():
        assert problems.column_names == ["question", "answer"]
        assert len(problems) == WORD_PROBLEM_SPLIT_SIZES[split]
        assert len(set(problems["question"])) == len(problems)


def test_word_problem_splits_are_disjoint_by_construction(words):
    assert not set(words["train"]["question"]) & set(words["test"]["question"])
    for vocabulary in (WORD_PROBLEM_NAMES, WORD_PROBLEM_THINGS):
        assert not set(vocabulary["train"]) & set(vocabulary["test"])
    # No template text names a person or object of either split.
    every_word = {*sum(WORD_PROBLEM_NAMES.values(), ()), *sum(WORD_PROBLEM_THINGS.values(), ())}
    for _, template in WORD_PROBLEM_TEMPLATES:
        assert not any(re.search(rf"\b{word}\b", template) for word in every_word), template
    # Each question names a person or object of its own split only.
    for split, other in (("train", "test"), ("test", "train")):
        foreign = [*WORD_PROBLEM_NAMES[other], *WORD_PROBLEM_THINGS[other]]
        for question in words[split]["question"]:
            assert not any(re.search(rf"\b{word}\b", question) for word in foreign), question


def test_word_problem_answers_chain_correct_nonnegative_steps_in_gsm8k_format(words):
    steps_seen = set()
    for problems in words.values():
        for question, answer in zip(problems["question"], problems["answer"]):
            *lines, gold_line = answer.split("\n")
            total = None
            operands = []
            for line in lines:
                a, operation, b, result = STEP.match(line).groups()
                if total is None:
                    operands.append(a)
                else:
                    assert a == str(total)  # each step starts from the previous result
                total = int(a) + int(b) if operation == "+" else int(a) - int(b)
                assert int(result) == total >= 0
                operands.append(b)
            assert gold_line == f"#### {total}" and gsm8k_gold(answer) == str(total)
            assert sorted(re.findall(r"\d+", question)) == sorted(operands)
            assert all(0 <= int(n) <= WORD_PROBLEM_MAX_OPERAND for n in operands)
            steps_seen.add(len(lines))
    assert steps_seen == {1, 2}


def test_word_problems_of_both_splits_use_every_template(words):
    for split, problems in words.items():
        for _, template in WORD_PROBLEM_TEMPLATES:
            pattern = re.escape(template)
            for field in ("a", "b", "c"):
                pattern = pattern.replace(rf"\{{{field}\}}", r"\d+")
            pattern = pattern.replace(r"\{name\}", r"\w+").replace(r"\{thing\}", r"\w+")
            assert any(re.fullmatch(pattern, q) for q in problems["question"]), template


def test_word_problems_are_deterministic_for_a_seed_and_vary_with_it():
    first, again = word_problems("test", size=50, seed=3), word_problems("test", size=50, seed=3)
    assert first.to_list() == again.to_list()
    assert first["question"] != word_problems("test", size=50, seed=4)["question"]
    assert load_problems("wordproblems", "test", seed=3, limit=50).to_list() == first.to_list()


def test_warm_start_stories_name_no_person_or_object_of_either_split(words):
    """The tool warm start's stories: the same templates, none of either split's words."""
    stories = warm_start_word_problems(size=2000, seed=0)
    assert len(set(stories["question"])) == 2000
    split_words = {*sum(WORD_PROBLEM_NAMES.values(), ()), *sum(WORD_PROBLEM_THINGS.values(), ())}
    assert not split_words & {*WARM_START_NAMES, *WARM_START_THINGS}
    for question in stories["question"]:
        assert not any(re.search(rf"\b{word}\b", question) for word in split_words), question
    assert not set(stories["question"]) & {*words["train"]["question"], *words["test"]["question"]}
    for _, template in WORD_PROBLEM_TEMPLATES:
        pattern = re.escape(template).replace(r"\{a\}", r"\d+").replace(r"\{b\}", r"\d+")
        pattern = pattern.replace(r"\{c\}", r"\d+").replace(r"\{name\}", r"\w+")
        pattern = pattern.replace(r"\{thing\}", r"\w+")
        assert any(re.fullmatch(pattern, q) for q in stories["question"]), template
    assert stories.to_list() == warm_start_word_problems(size=2000, seed=0).to_list()
    with pytest.raises(ValueError, match="size=-1 must be a non-negative integer"):
        warm_start_word_problems(size=-1, seed=0)


@pytest.mark.parametrize("source", ["arithmetic", "wordproblems", "gsm8k"])
def test_unknown_split_is_rejected_with_the_choices(source):
    with pytest.raises(ValueError, match=r"split='validation' is not one of \('train', 'test'\)"):
        load_problems(source, "validation")


# --- GSM8K --------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _hub_answers(monkeypatch):
    """The hub probe answers (no request) unless a test says otherwise: the tests that fake
    `datasets.load_dataset` exercise the online path without the network."""
    monkeypatch.setattr(data, "hub_reachable", lambda: True)


def test_gsm8k_offline_raises_a_clear_error_pointing_to_local_files(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(ConnectionError, match="hub is unreachable.*Pass a local file"):
        load_problems("gsm8k", "test")


def test_gsm8k_is_loaded_from_the_hub_id_keeping_every_column_for_rewards(monkeypatch):
    calls = []

    def fake_hub(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{**row, "extra": 1} for row in ROWS])

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    problems = load_problems("gsm8k", "train", limit=1)
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]
    assert problems.column_names == ["question", "answer", "extra"] and len(problems) == 1


# --- local files --------------------------------------------------------------------------


def test_jsonl_file_is_loaded(tmp_path):
    problems = load_problems(str(write_jsonl(tmp_path / "p.jsonl", ROWS)), "test")
    assert problems.to_list() == ROWS


def test_json_array_file_is_loaded(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ROWS))
    assert load_problems(str(path), "train").to_list() == ROWS


def test_parquet_file_is_loaded_and_extra_columns_kept_for_rewards(tmp_path):
    path = tmp_path / "p.parquet"
    rows = [{**row, "id": i} for i, row in enumerate(ROWS)]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    assert load_problems(str(path), "train").to_list() == rows


def test_csv_file_is_loaded(tmp_path):
    path = tmp_path / "p.csv"
    datasets.Dataset.from_list(ROWS).to_csv(str(path), index=False)
    assert load_problems(str(path), "train").to_list() == ROWS


def test_directory_serves_the_file_named_after_the_split(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(load_problems(str(tmp_path), "train")) == 2
    assert load_problems(str(tmp_path), "test").to_list() == ROWS[:1]


def test_directory_without_the_split_file_names_what_it_expected_and_found(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    with pytest.raises(
        FileNotFoundError, match=r"no file for split 'test'.*test\.jsonl.*train\.jsonl"
    ):
        load_problems(str(tmp_path), "test")


def test_missing_file_error_names_the_path(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_problems(str(missing), "train")


def test_unsupported_suffix_is_rejected(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("question,answer\n")
    with pytest.raises(ValueError, match=r"suffix '\.txt'"):
        load_problems(str(path), "train")


def test_missing_column_error_names_it_and_the_columns_found(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1+1?", "answer": "#### 2"}])
    with pytest.raises(ValueError, match=r"\['question'\].*found columns \['problem', 'answer'\]"):
        load_problems(str(path), "train")


def test_answer_without_final_marker_is_rejected_with_its_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [ROWS[0], {"question": "1+1?", "answer": "2"}])
    with pytest.raises(ValueError, match=r"answer in row 1 .* is '2'.*#### <final answer>"):
        load_problems(str(path), "train")


def test_empty_question_is_rejected_with_its_row(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": " ", "answer": "#### 2"}])
    with pytest.raises(ValueError, match="question in row 0"):
        load_problems(str(path), "train")


# --- columns, gold rules, hub names -----------------------------------------------------------


def test_columns_and_gold_rule_of_a_local_file(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"problem": "1 + 2?", "solution": "3", "id": 9}])
    problems = load_problems(
        str(path), "train", prompt_column="problem", answer_column="solution", gold_rule="whole"
    )
    assert problems.to_list() == [{"problem": "1 + 2?", "solution": "3", "id": 9}]
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['question'\].*--prompt-column"):
        load_problems(str(path), "train", answer_column="solution", gold_rule="whole")
    with pytest.raises(ValueError, match="solution in row 0 .* ending in '####"):
        load_problems(str(path), "train", prompt_column="problem", answer_column="solution")


def test_a_hub_name_offline_fails_at_once_saying_how_to_use_a_local_file(monkeypatch):
    calls = []

    def unreachable(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("Couldn't reach the Hub (OfflineModeIsEnabled)")

    def probe() -> bool:
        raise AssertionError("HF_HUB_OFFLINE says offline: the hub is not probed")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(data, "hub_reachable", probe)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConnectionError,
        match=r"owner/set from the Hugging Face hub \(offline "
        r"mode\).*--dataset path/to/validation.jsonl",
    ):
        load_problems("owner/set", "test", hub_config="main", hub_split="validation")
    assert calls == [(("owner/set", "main"), {"split": "validation"})]


def test_run_config_passes_hub_config_split_and_columns(monkeypatch):
    from grpo.tasks.data import load_run_problems
    from grpo.training.settings.config import TrainConfig

    calls = []

    def fake_hub(*args, **kwargs):
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([{"q": "1 + 1?", "a": "2"}])

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    config = TrainConfig(
        dataset="owner/set",
        dataset_config="cfg",
        train_split="tr",
        test_split="te",
        prompt_column="q",
        answer_column="a",
        gold_rule="whole",
    )
    assert load_run_problems(config, "train").to_list() == [{"q": "1 + 1?", "a": "2"}]
    load_run_problems(config, "test")
    assert calls == [
        (("owner/set", "cfg"), {"split": "tr"}),
        (("owner/set", "cfg"), {"split": "te"}),
    ]


def test_builtin_datasets_ignore_the_column_flags():
    from grpo.tasks.data import columns_of
    from grpo.training.settings.config import TrainConfig

    config = TrainConfig(prompt_column="problem", answer_column="solution", gold_rule="whole")
    assert columns_of(config) == ("question", "answer", "####")
    assert columns_of(TrainConfig(dataset="x.jsonl", prompt_column="p")) == ("p", "answer", "####")


def test_a_backtracking_gold_rule_is_an_error_naming_the_row_not_a_hang(tmp_path):
    import time

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a" * 5000 + "!"}) + "\n")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"answer in row 0 of .*rows.jsonl: --gold-rule"):
        load_problems(str(path), "train", gold_rule=r"regex:(a+)+$")
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        (
            "latin1.jsonl",
            b'{"question": "caf\xe9", "answer": "#### 1"}\n',
            "not UTF-8 text: byte 0xe9 at line 1, column 18; save it as UTF-8",
        ),
        (
            "latin1.csv",
            b"question,answer\ncaf\xe9,#### 1\n",
            "not UTF-8 text: byte 0xe9 at line 2, column 4",
        ),
        (
            "packed.jsonl",
            gzip.compress(b'{"question": "q", "answer": "#### 1"}\n'),
            r"gzip-compressed; decompress it first \(gunzip ",
        ),
        ("header.csv", b"question,answer\n", "has a header but no rows"),
    ],
)
def test_undecodable_compressed_or_header_only_files_are_errors_naming_the_file(
    tmp_path, name, data, message
):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"data file {re.escape(str(path))} .*{message}"):
        load_problems(str(path), "train")


def _offline_flags() -> tuple[bool, bool]:
    from huggingface_hub import constants

    return datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE


def test_an_unreachable_hub_is_probed_once_then_read_from_the_cache_alone(monkeypatch):
    probes, loads = [], []
    monkeypatch.setattr(data, "hub_reachable", lambda: probes.append(1) or False)

    def cached(*args, **kwargs):
        loads.append(_offline_flags())
        return datasets.Dataset.from_list(ROWS)

    monkeypatch.setattr(datasets, "load_dataset", cached)
    before = _offline_flags()
    assert len(load_problems("gsm8k", "test")) == len(ROWS)
    assert probes == [1] and loads == [(True, True)]  # offline mode: no request, no retry
    assert _offline_flags() == before


def test_an_unreachable_hub_fails_at_once_without_a_request(monkeypatch):
    import socket

    lookups = []

    def no_dns(*args, **kwargs):
        lookups.append(args)
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(data, "hub_reachable", lambda: False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    with pytest.raises(
        ConnectionError,
        match=r"grpo-tests/no-such-set from the Hugging Face hub \(no answer from it within "
        r"3 s\); the hub is unreachable.*--dataset path/to/test.jsonl",
    ):
        load_problems("grpo-tests/no-such-set", "test")
    assert lookups == []  # the hub client made no request (unpatched: 5 retries, ~30 s)


def test_the_hub_probe_counts_any_http_answer_as_reachable(monkeypatch):
    import http.server
    import threading

    from huggingface_hub import constants

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    probe = hub_reachable.__wrapped__  # the probe itself, not its per-process answer
    try:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert probe(timeout_s=5.0) is True
    finally:
        server.shutdown()
        server.server_close()
    assert probe(timeout_s=5.0) is False  # the port is closed now: refused
