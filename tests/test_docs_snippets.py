"""Every fenced code block of README.md and docs/*.md runs as written, so no snippet can rot.

A document's blocks run in order, in one temporary working directory (holding links to the
repository's `examples/`, `docs/` and `grpo/`, so the paths the docs use resolve), so a later
block uses what an earlier one wrote (`runs/quickstart` ...):

- ```python blocks run as a script (`sys.executable`), with their `steps=N` and `limit=N`
  arguments made small too (`SMALL_PYTHON`);
- ```bash and ```console blocks run under `bash -e -o pipefail`, every `grpo` recipe command
  in them with small step counts (`SMALL`: `grpo train ...` gets `--steps 2` and batches of
  4 x 4, `grpo eval` `--limit 5 --seeds 1` ...), so the document's figures come from its
  full runs, not these;
- a marker on the line before a block says otherwise: `<!-- docs-test: KIND ARG (why) -->`
  with KIND `illustrative` (not run: it needs an account, a server of yours, or is an output
  whose digits depend on the CPU), `check` (a ```text block: each of its lines must be a line
  of the previous block's output), `file NAME` (written to NAME for the blocks after it),
  `copy-of PATH` (must be a part of the repository file PATH), `serve PORT` (runs while a
  `grpo serve` listens on PORT), `slow` (runs in the `slow` test of the document), `diagram`
  (a ```text block that is no output: a tree or a flow).

The port 8765 that the docs name is replaced by a free port in every block of a document.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.warm_grpo import warm_commands

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"python", "bash", "console"}
MARKERS = {"illustrative", "check", "file", "copy-of", "serve", "slow", "diagram"}
OUTPUT_MARKERS = {"illustrative", "check", "diagram"}  # what a ```text block must carry
DOCS_PORT = "8765"
GRPO = (sys.executable, "-m", "grpo")  # the `grpo` command, where no warm one runs
TIMEOUT_S = 600

# flag -> value set on every `grpo <recipe>` command a block runs (added or replaced);
# --eval-every is lowered to 2 where a command evaluates at all.
# Batches of 4 prompts x 4 completions (the default 8 x 8 costs 4x the rollouts; 4 x 4 still
# trains on the tool model of docs/environments.md, where 2 x 4 leaves every group degenerate).
SMALL_BATCH = {"--batch-size": "4", "--group-size": "4"}
SMALL: dict[str, dict[str, str]] = {
    "train": {"--steps": "2", "--eval-limit": "10", **SMALL_BATCH},
    "distill": {"--steps": "2", "--eval-limit": "10", **SMALL_BATCH},
    "sft": {"--epochs": "1"},
    "dpo": {"--steps": "2"},
    "eval": {"--limit": "5", "--seeds": "1"},
    "compare": {"--steps": "2", "--seeds": "1", "--eval-limit": "10", "--jobs": "2", **SMALL_BATCH},
}
# keyword argument -> value set in every ```python block (`train(TrainConfig(steps=10))` trains
# 2 steps, `evaluate(..., limit=100)` grades 5 problems).
SMALL_PYTHON = {"steps": "2", "limit": "5"}
SMALL_PYTHON_ARGUMENT = re.compile(r"\b(" + "|".join(SMALL_PYTHON) + r")=\d+")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
# A `grpo` command in a bash line: first on the line or after `;`, `&`, `|`, `(` or `$(`.
GRPO_COMMAND = re.compile(r"(?:^|[;&|(])\s*grpo\s", re.M)
# Documents that start this many interpreters or more fork them from a warm one (the warm
# one's start-up costs about as much as two commands' own).
WARM_FROM = 3
MARKER = re.compile(r"<!-- docs-test: ([\w-]+)(?: ([^\s(]+))?(?: \([^)]*\))? -->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its text and its marker."""

    document: Path
    line: int
    language: str
    text: str
    marker: str = ""
    argument: str = ""

    @property
    def where(self) -> str:
        """`README.md:12`, for failure messages."""
        return f"{self.document.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the test runs this block."""
        return self.language in RUN_LANGUAGES and self.marker != "illustrative"


def blocks_of(document: Path) -> list[Block]:
    """Every fenced block of `document`, with the marker of the line before it."""
    text = document.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        blocks.append(
            Block(
                document=document,
                line=text.count("\n", 0, match.start()) + 1,
                language=match.group(1).strip(),
                text=match.group(2),
                marker=marker.group(1) if marker else "",
                argument=(marker.group(2) or "") if marker else "",
            )
        )
    return blocks


def small(command: str) -> str:
    """`command` with SMALL's flags set when it is a `grpo <recipe>` command (not a dry run)."""
    words = shlex.split(command, comments=True)
    if len(words) < 2 or words[0] != "grpo" or words[1] not in SMALL or "--dry-run" in words:
        return command
    for flag, value in SMALL[words[1]].items():
        if flag in words:
            words[words.index(flag) + 1] = value
        else:
            words += [flag, value]
    if "--eval-every" in words and words[words.index("--eval-every") + 1] != "0":
        words[words.index("--eval-every") + 1] = "2"
    return shlex.join(words)


def small_script(script: str) -> str:
    """A bash block with its continued lines joined and each recipe command made small."""
    lines = script.replace("\\\n", " ").splitlines()
    return "\n".join(line if re.search(r"[&|;$<>]", line) else small(line) for line in lines)


def small_python(script: str) -> str:
    """A python block with its `steps=N` and `limit=N` keyword arguments set by SMALL_PYTHON."""
    return SMALL_PYTHON_ARGUMENT.sub(lambda match: f"{match[1]}={SMALL_PYTHON[match[1]]}", script)


def runs_now(block: Block, slow: bool) -> bool:
    """Whether `block` runs in this pass: a block that runs, marked `slow` only when `slow`."""
    return block.runs and (block.marker == "slow") == slow


def interpreters_started(block: Block) -> int:
    """How many `grpo` commands and python scripts the block starts."""
    if block.language == "python":
        return 1
    return len(GRPO_COMMAND.findall(small_script(block.text)))


def free_port() -> str:
    """A free loopback port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def environment(home: Path) -> dict[str, str]:
    """This checkout first on the path, this interpreter's `grpo` and `python`, a fresh HOME."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HOME"] = str(home)
    env["GRPO_DOCS_TEST"] = "1"
    return env


def run_block(
    block: Block,
    text: str,
    workdir: Path,
    env: dict[str, str],
    index: int,
    python: str = sys.executable,
) -> str:
    """Run one block in `workdir` (a python block with `python`); its combined output (a
    failure names the block)."""
    if block.language == "python":
        script = workdir / f"snippet_{index}.py"
        script.write_text(small_python(text), encoding="utf-8")
        argv = [python, str(script)]
    else:
        argv = ["bash", "-e", "-o", "pipefail", "-c", small_script(text)]
    process = subprocess.Popen(
        argv,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        try:  # whatever the block left behind (a server it started) goes with it
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        process.wait()
    assert process.returncode == 0, f"{block.where} failed ({process.returncode}):\n{output}"
    return output


class Server:
    """`grpo serve --port PORT` for a block marked `serve`, stopped after it."""

    def __init__(
        self, port: str, workdir: Path, env: dict[str, str], grpo: Sequence[str] = GRPO
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [*grpo, "serve", "--port", port],
            cwd=workdir,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def __enter__(self) -> Server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url, timeout=5)
                return self
            except urllib.error.HTTPError:
                return self
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"grpo serve did not answer at {self.url}")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def run_document(document: Path, tmp_path: Path, *, slow: bool) -> None:
    """Run the document's blocks in order (those marked `slow` only when `slow`).

    Where it starts WARM_FROM interpreters or more (`grpo` commands and python blocks), they
    run in processes forked from one warm interpreter (`tests.warm_grpo.warm_commands`,
    started in the working directory with the blocks' environment), so that each pays no
    start-up but the warm one's."""
    workdir, home = tmp_path / "work", tmp_path / "home"
    workdir.mkdir()
    home.mkdir()
    for name in ("examples", "docs", "grpo"):
        (workdir / name).symlink_to(ROOT / name)
    env, port = environment(home), free_port()
    blocks = blocks_of(document)
    run = [block for block in blocks if runs_now(block, slow)]
    if sum(map(interpreters_started, run)) < WARM_FROM:
        run_blocks(blocks, workdir, env, port, slow=slow)
        return
    with warm_commands(tmp_path / "warm-bin", workdir, env) as bin_dir:
        env = {**env, "PATH": os.pathsep.join([str(bin_dir), env["PATH"]])}
        run_blocks(
            blocks,
            workdir,
            env,
            port,
            slow=slow,
            python=str(bin_dir / "warm-python"),
            grpo=(str(bin_dir / "grpo"),),
        )


def run_blocks(
    blocks: list[Block],
    workdir: Path,
    env: dict[str, str],
    port: str,
    *,
    slow: bool,
    python: str = sys.executable,
    grpo: Sequence[str] = GRPO,
) -> None:
    """Run `blocks` in order in `workdir` (those marked `slow` only when `slow`), python
    blocks with `python`, the server of a `serve` block with `grpo`."""
    last_output = ""
    for index, block in enumerate(blocks):
        text = block.text.replace(DOCS_PORT, port)
        if block.marker == "file":
            (workdir / block.argument).write_text(text, encoding="utf-8")
        elif block.marker == "check":
            missing = [
                line
                for line in text.splitlines()
                if line.strip() and line.rstrip() not in last_output.splitlines()
            ]
            assert not missing, f"{block.where}: not in the output above: {missing}\n{last_output}"
        elif runs_now(block, slow):
            if block.marker == "serve":
                with Server(port, workdir, env, grpo):
                    last_output = run_block(block, text, workdir, env, index, python)
            else:
                last_output = run_block(block, text, workdir, env, index, python)


def documents_with(predicate) -> list[Path]:
    """The documents with a block that `predicate` holds for."""
    return [path for path in DOCUMENTS if any(predicate(block) for block in blocks_of(path))]


def test_every_block_has_a_language_a_known_marker_and_outputs_are_marked() -> None:
    problems = []
    for document in DOCUMENTS:
        for block in blocks_of(document):
            if not block.language:
                problems.append(f"{block.where}: no language (```text for an output)")
            if block.marker and block.marker not in MARKERS:
                problems.append(f"{block.where}: unknown marker {block.marker!r}")
            if block.language == "text" and block.marker not in OUTPUT_MARKERS:
                problems.append(f"{block.where}: an output must be checked or illustrative")
            if block.marker in {"file", "copy-of", "serve"} and not block.argument:
                problems.append(f"{block.where}: marker {block.marker!r} needs its argument")
    assert not problems, "\n".join(problems)


def test_copies_of_repository_files_are_copies() -> None:
    for document in DOCUMENTS:
        for block in blocks_of(document):
            if block.marker == "copy-of":
                source = (ROOT / block.argument).read_text(encoding="utf-8")
                assert block.text in source, f"{block.where} is no longer {block.argument}"


def test_the_marker_parser_and_the_small_commands() -> None:
    batch = "--batch-size 4 --group-size 4"
    assert (
        small("grpo train --run-name q")
        == f"grpo train --run-name q --steps 2 --eval-limit 10 {batch}"
    )
    assert small("grpo train --steps 40 --eval-every 10 --batch-size 8") == (
        "grpo train --steps 2 --eval-every 2 --batch-size 4 --eval-limit 10 --group-size 4"
    )
    assert small("grpo train --eval-every 0  # no evaluation") == (
        f"grpo train --eval-every 0 --steps 2 --eval-limit 10 {batch}"
    )
    assert small("grpo train --dry-run --steps 20") == "grpo train --dry-run --steps 20"
    assert small("grpo plot runs/q --out q.png") == "grpo plot runs/q --out q.png"
    joined = small_script("grpo eval \\\n  --samples 8")
    assert joined == "grpo eval --samples 8 --limit 5 --seeds 1"
    assert small_python("train(TrainConfig(steps=10, num_substeps=4))\nevaluate(d, limit=100)") == (
        "train(TrainConfig(steps=2, num_substeps=4))\nevaluate(d, limit=5)"
    )
    script = "grpo serve --port 1 &\nexport A=1\npython x.py\ngrpo eval | tee o; (grpo show r)"
    assert interpreters_started(Block(ROOT, 1, "bash", script)) == 3
    assert interpreters_started(Block(ROOT, 1, "python", "print(1)")) == 1
    assert MARKER.search("<!-- docs-test: file prices.toml -->").groups() == ("file", "prices.toml")
    assert MARKER.search("<!-- docs-test: illustrative (needs a login) -->").groups() == (
        "illustrative",
        None,
    )


@pytest.mark.parametrize(
    "document",
    documents_with(lambda block: block.runs and block.marker != "slow"),
    ids=lambda path: path.name,
)
def test_the_snippets_run(document: Path, tmp_path: Path) -> None:
    run_document(document, tmp_path, slow=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "document",
    documents_with(lambda block: block.runs and block.marker == "slow"),
    ids=lambda path: path.name,
)
def test_the_slow_snippets_run(document: Path, tmp_path: Path) -> None:
    run_document(document, tmp_path, slow=True)
