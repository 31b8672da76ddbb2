"""The judge of `grpo.rewards:judge` and `grpo.rewards:judge_rank`: resolved, asked, cached.

docs/FORMULAS.md, "Judge rewards"; the parsing and the rank rule are `grpo.core.judging`.

- The backends: `SamplerJudge` (a sampler on the run's backend) and `EndpointJudge` (an
  OpenAI-compatible endpoint, its key read from `--judge-api-key-env`'s variable), which
  `grpo.training.recipes.grpo.judge_setup.resolve_judge` builds from a run's flags before
  any training call (the rubric read and checked there).
- `Judge.score_groups` / `Judge.rank_groups`: every completion (every group) judged on the
  judge's own pool (`--judge-concurrency`), each request bounded by `--judge-timeout` and
  retried (`--max-retries`). Each prompt fences its completions with a fence drawn from
  `secrets` for that request (`grpo.core.judging.judge_prompt`), so the policy can neither
  guess nor forge it; a judge on the run's backend also encodes the prompt with its special
  tokens split (a `<|im_end|>` a completion writes is text, not a turn). A reply is cached
  in the run directory (`judge_cache.jsonl`, keyed by judge, rubric, prompt and completions
  without the fence), so a resumed run does not ask twice. A reply that does not parse, or
  a call that kept failing, is returned as an exception for that completion: the reward
  caller counts it (`--reward-errors`).
- `Judge.take_metrics`: the tokens and counts since the last take (`usage/judge_*`,
  `judge/calls`, `judge/cache_hits`, `judge/parse_errors`, `judge/errors`). An endpoint's
  `usage` field that is no token count (`grpo.core.judging.reported_tokens`) counts 0, with
  one warning naming the endpoint and the field.
"""

from __future__ import annotations

import inspect
import json
import secrets
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
from pytrio.types import ModelInput, SamplingParams

from grpo.backends.clients import Note
from grpo.backends.pytrio import RetriesExhaustedError, call_with_retries
from grpo.core.judging import (
    FENCE_CHARS,
    MAX_REPLY_CHARS,
    MAX_REPORTED_TOKENS,
    NO_REFERENCE,
    JudgeFormatError,
    JudgeGroup,
    cache_key,
    json_int,
    judge_prompt,
    parse_ranking,
    parse_score,
    rank_rewards,
    reported_tokens,
)
from grpo.core.usage import TokenUsage, sample_usage

__all__ = [
    "CACHE_FILE",
    "EndpointJudge",
    "Judge",
    "JudgeCallError",
    "JudgeBackend",
    "SamplerJudge",
]

CACHE_FILE = "judge_cache.jsonl"
MAX_RESPONSE_BYTES = 4_000_000
JUDGE_SEED = 0


class JudgeCallError(RuntimeError):
    """A judge request that failed for good (after its retries, or refused by the endpoint)."""


class _Transient(ConnectionError):
    """A judge request that may succeed if retried (a 429, a 5xx, a dropped connection)."""


@attrs.frozen
class JudgeReply:
    """One judge reply: its text and the tokens it cost."""

    text: str
    usage: TokenUsage


class JudgeBackend(Protocol):
    """Where a judge prompt goes: `identity` names it in the cache key."""

    identity: str

    def ask(self, prompt: str) -> JudgeReply: ...


class SamplerJudge:
    """A judge model on the run's backend: the rubric as one user message, sampled greedily
    (or at --judge-temperature), one request per prompt."""

    def __init__(
        self, sampler: Any, *, identity: str, max_tokens: int, temperature: float, timeout_s: float
    ) -> None:
        self.sampler = sampler
        self.tokenizer = sampler.get_tokenizer()
        self.identity = identity
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s

    def _encode(self, prompt: str) -> list[int]:
        """``prompt`` as the one user message of the chat template, its own text encoded with
        special tokens split, so a `<|im_end|>` inside it is text and never ends the turn."""
        sentinel = _fresh_token(prompt)
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": sentinel}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        before, found, after = text.partition(sentinel)
        if not found or sentinel in after:
            raise JudgeCallError(
                "the judge model's chat template does not show the user message once as "
                "written; use a --judge-model whose template does, or a --judge-url endpoint"
            )
        encode = self.tokenizer.encode
        return [
            *encode(before, add_special_tokens=False),
            *encode(prompt, add_special_tokens=False, split_special_tokens=True),
            *encode(after, add_special_tokens=False),
        ]

    def ask(self, prompt: str) -> JudgeReply:
        """The judge's reply to ``prompt`` (a TimeoutError past --judge-timeout: retried)."""
        tokens = self._encode(prompt)
        params = SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, seed=JUDGE_SEED
        )
        future = self.sampler.sample(
            prompt=ModelInput.from_ints(tokens),
            num_samples=1,
            sampling_params=params,
            return_text=True,
        )
        try:
            response = _result(future, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no reply within --judge-timeout {self.timeout_s:g}s") from None
        (sequence,) = response.sequences
        reply = sequence.text
        if reply is None:
            reply = self.tokenizer.decode(sequence.tokens, skip_special_tokens=True)
        usage = sample_usage(
            response.input_tokens, response.output_tokens, len(tokens), [len(sequence.tokens)]
        )
        return JudgeReply(
            text=reply,
            usage=TokenUsage(
                judge_prompt_tokens=usage.prompt_tokens,
                judge_completion_tokens=usage.completion_tokens,
            ),
        )


class EndpointJudge:
    """A judge behind an OpenAI-compatible endpoint: POST {url}/chat/completions."""

    def __init__(
        self,
        url: str,
        *,
        model: str,
        api_key: str | None,
        max_tokens: int,
        temperature: float,
        timeout_s: float,
        note: Note = print,
    ) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.identity = f"endpoint:{self.url}:{model}:{max_tokens}:{temperature:g}"
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.note = note
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()

    def __repr__(self) -> str:  # never the key
        return f"EndpointJudge({self.url!r}, model={self.model!r})"

    def _request(self, path: str, body: Mapping[str, Any] | None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode("utf-8")
        request = urllib.request.Request(
            self.url + path, data=data, headers=headers, method="GET" if body is None else "POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                raw = answer.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as error:
            detail = error.read(300).decode("utf-8", "replace").strip()
            if error.code == 429 or error.code >= 500:
                raise _Transient(f"{self.url}{path} answered HTTP {error.code}: {detail}") from None
            raise JudgeCallError(
                f"{self.url}{path} answered HTTP {error.code}: {detail}"
                + (" (check --judge-api-key-env)" if error.code in (401, 403) else "")
            ) from None
        except (TimeoutError, socket.timeout):
            raise TimeoutError(
                f"{self.url}{path} gave no answer within --judge-timeout {self.timeout_s:g}s"
            ) from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise _Transient(f"cannot reach {self.url}{path}: {reason}") from None
        if len(raw) > MAX_RESPONSE_BYTES:
            raise JudgeCallError(f"{self.url}{path} answered more than {MAX_RESPONSE_BYTES} bytes")
        try:
            return json.loads(raw, parse_int=json_int)
        except ValueError:
            raise JudgeCallError(
                f"{self.url}{path} answered {raw[:120]!r}, not JSON (is it an OpenAI-compatible "
                "endpoint, e.g. http://HOST:PORT/v1?)"
            ) from None

    def check(self) -> None:
        """JudgeCallError unless the endpoint answers (GET /models, one try, --judge-timeout)."""
        try:
            self._request("/models", None)
        except (JudgeCallError, ConnectionError, TimeoutError) as error:
            raise JudgeCallError(
                f"--judge-url {self.url}: {error}; start the endpoint or fix the URL (an "
                "OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1)"
            ) from None

    def ask(self, prompt: str) -> JudgeReply:
        """The endpoint's reply to ``prompt`` as one user message."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": JUDGE_SEED,
        }
        answer = self._request("/chat/completions", body)
        try:
            text = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise JudgeCallError(
                f"{self.url}/chat/completions answered without choices[0].message.content: "
                f"{json.dumps(answer)[:200]}"
            ) from None
        if not isinstance(text, str):
            raise JudgeCallError(f"{self.url}/chat/completions answered content {text!r}")
        usage = answer.get("usage") if isinstance(answer, Mapping) else None
        usage = usage if isinstance(usage, Mapping) else {}
        return JudgeReply(
            text=text,
            usage=TokenUsage(
                judge_prompt_tokens=self._reported(usage, "prompt_tokens"),
                judge_completion_tokens=self._reported(usage, "completion_tokens"),
            ),
        )

    def _reported(self, usage: Mapping[str, Any], field: str) -> int:
        """``usage[field]`` as a token count; 0 where absent, and 0 with one warning (per
        field) where it is no count: a run never stops, now or on resume, on a judge's
        bookkeeping."""
        value = usage.get(field)
        if value is None:
            return 0
        count = reported_tokens(value)
        if count is not None:
            return count
        with self._warned_lock:
            first = field not in self._warned
            self._warned.add(field)
        if first:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            self.note(
                f"warning: the judge endpoint {self.url} reported usage.{field} = {shown}, "
                f"which is no token count (an integer 0..{MAX_REPORTED_TOKENS:,}); such "
                f"replies count 0 judge {field.replace('_', ' ')} (said once); the rewards "
                "are unaffected"
            )
        return 0


def _result(future: Any, timeout_s: float) -> Any:
    """``future.result()``, waited at most ``timeout_s`` where the future takes a timeout."""
    try:
        takes_timeout = "timeout" in inspect.signature(future.result).parameters
    except (TypeError, ValueError):
        takes_timeout = False
    return future.result(timeout=timeout_s) if takes_timeout else future.result()


def _fresh_token(*texts: str) -> str:
    """``FENCE_CHARS`` random hex digits (from `secrets`) found in none of ``texts``."""
    while True:
        token = secrets.token_hex(FENCE_CHARS // 2)
        if not any(token in text for text in texts):
            return token


@attrs.define(eq=False)
class Judge:
    """The run's judge: a backend, the rubrics, the cache, the pool and the counters."""

    backend: JudgeBackend
    rubrics: dict[str, str] = attrs.field(converter=dict, kw_only=True)
    max_score: float = attrs.field(kw_only=True)
    question_column: str = attrs.field(kw_only=True)
    concurrency: int = attrs.field(kw_only=True)
    max_retries: int = attrs.field(kw_only=True)
    cache_path: Path | None = attrs.field(kw_only=True)
    note: Note = attrs.field(default=print, kw_only=True)
    retry_delay_s: float = attrs.field(default=1.0, kw_only=True)
    pool: ThreadPoolExecutor = attrs.field(init=False)
    _lock: threading.Lock = attrs.field(init=False, factory=threading.Lock)
    _cache: dict[str, str] = attrs.field(init=False)
    _usage: TokenUsage = attrs.field(init=False, factory=TokenUsage)
    _counts: dict[str, int] = attrs.field(
        init=False,
        factory=lambda: dict.fromkeys(("calls", "cache_hits", "parse_errors", "errors"), 0),
    )

    def __attrs_post_init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="judge")
        self._cache = _read_cache(self.cache_path)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def _reply(self, key: str, prompt: str) -> str:
        """The cached reply under ``key``, else the judge's (retried, then cached)."""
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            self._count("cache_hits")
            return cached
        try:
            reply = call_with_retries(
                lambda: self.backend.ask(prompt),
                what="judge request",
                max_retries=self.max_retries,
                base_delay_s=self.retry_delay_s,
                note=self.note,
            )
        except Exception as error:
            self._count("errors")
            if isinstance(error, RetriesExhaustedError | JudgeCallError):
                raise JudgeCallError(str(error)) from None
            raise JudgeCallError(
                f"the judge request raised {type(error).__name__}: {error}"
            ) from None
        text = reply.text[: MAX_REPLY_CHARS + 1]
        with self._lock:
            self._usage += reply.usage
            self._counts["calls"] += 1
            self._cache[key] = text
            if self.cache_path is not None:
                with self.cache_path.open("a", encoding="utf-8") as file:
                    file.write(json.dumps({"key": key, "reply": text}) + "\n")
        return text

    def _values(self, group: JudgeGroup) -> tuple[str, str]:
        question = str(group.row.get(self.question_column, ""))
        gold = group.samples[0].gold if group.samples else ""
        return question, (gold if gold.strip() else NO_REFERENCE)

    def score_groups(self, groups: Sequence[JudgeGroup]) -> list[list[float | Exception]]:
        """`grpo.rewards:judge`: s / S of every completion, or why it has none."""
        rubric = self.rubrics["score"]

        def one(group: JudgeGroup, completion: str) -> float | Exception:
            question, reference = self._values(group)
            prompt = judge_prompt(
                rubric,
                question=question,
                reference=reference,
                completions=[completion],
                fence=_fresh_token(rubric, question, reference, completion),
                rank=False,
            )
            key = cache_key(self.backend.identity, rubric, f"{question}\n{reference}", [completion])
            try:
                return parse_score(self._reply(key, prompt), self.max_score)
            except JudgeFormatError as error:
                self._count("parse_errors")
                return error
            except JudgeCallError as error:
                return error

        futures = [
            [self.pool.submit(one, group, completion) for completion in group.completions]
            for group in groups
        ]
        return [[future.result() for future in row] for row in futures]

    def rank_groups(self, groups: Sequence[JudgeGroup]) -> list[list[float | Exception]]:
        """`grpo.rewards:judge_rank`: each group ranked in one request, ranks -> rewards."""
        rubric = self.rubrics["rank"]

        def one(group: JudgeGroup) -> list[float | Exception]:
            question, reference = self._values(group)
            size = len(group.completions)
            if size < 2:  # nothing to rank against: the all-tied value, no call
                return [0.5] * size
            prompt = judge_prompt(
                rubric,
                question=question,
                reference=reference,
                completions=group.completions,
                fence=_fresh_token(rubric, question, reference, *group.completions),
                rank=True,
            )
            key = cache_key(
                self.backend.identity, rubric, f"{question}\n{reference}", group.completions
            )
            try:
                rewards_G = rank_rewards(parse_ranking(self._reply(key, prompt), size), size)
            except JudgeFormatError as error:
                self._count("parse_errors", size)
                return [error] * size
            except JudgeCallError as error:
                return [error] * size
            return [float(value) for value in np.asarray(rewards_G)]

        futures = [self.pool.submit(one, group) for group in groups]
        return [future.result() for future in futures]

    def take_metrics(self, prefix: str = "judge/") -> tuple[TokenUsage, dict[str, float]]:
        """The judge's tokens and `<prefix>calls|cache_hits|parse_errors|errors` since the last
        take (then zeroed)."""
        with self._lock:
            usage, counts = self._usage, dict(self._counts)
            self._usage = TokenUsage()
            self._counts = dict.fromkeys(self._counts, 0)
        return usage, {f"{prefix}{name}": float(value) for name, value in counts.items()}

    def close(self) -> None:
        """Drop the judge requests that have not started."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def _read_cache(path: Path | None) -> dict[str, str]:
    """The replies stored at ``path`` (a torn last line, from a killed run, is skipped)."""
    cache: dict[str, str] = {}
    if path is None or not path.is_file():
        return cache
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            cache[str(record["key"])] = str(record["reply"])
        except (ValueError, KeyError, TypeError):
            continue
    return cache
