"""Prices the user supplies: a TOML price file and `--price-*` flags -> `grpo.core.usage.Prices`.

No price is built in: a run shows a cost only when its user gave prices, and every cost is
shown with where its prices came from. A price file (per million tokens)::

    currency = "CNY"
    source = "my reading of the price page, 2026-12-01"   # optional, shown with every cost

    [models."Qwen/Qwen3-4B-Instruct-2507"]
    prompt = 0.8        # prompt tokens sent to the sampler
    completion = 3.2    # completion tokens sampled
    train = 2.4         # trained tokens (positions x passes)
    forward = 0.8       # forward-only tokens (optional; default: the train price)

`--price-prompt`, `--price-completion`, `--price-train`, `--price-forward` and
`--price-currency` override the file's values for the run's model (or give prices alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from grpo.core.usage import Prices
from grpo.training.settings.config import ConfigError, TrainConfig
from grpo.training.settings.fields import MAX_PRICE
from grpo.training.settings.flags import read_toml

KINDS = ("prompt", "completion", "train", "forward")


def _file_prices(path: str, model: str) -> tuple[dict[str, Any], str | None, str | None]:
    """The price entries of `model` in price file `path`, its currency and its source note."""
    raw, _text = read_toml(path, what="--price-file")
    models = raw.get("models", {})
    if not isinstance(models, Mapping):
        raise ConfigError(f"--price-file {path}: [models] must be a table of model names")
    unknown = set(raw) - {"currency", "source", "models"}
    if unknown:
        raise ConfigError(
            f"--price-file {path}: unknown key(s) {sorted(unknown)}; a price file holds "
            'currency, source and [models."NAME"] tables'
        )
    entry = models.get(model)
    if entry is None:
        raise ConfigError(
            f"--price-file {path} has no prices for model {model!r} (it has "
            f'{sorted(models) or "none"}); add a [models."{model}"] table or pass --price-*'
        )
    if not isinstance(entry, Mapping) or set(entry) - set(KINDS):
        raise ConfigError(
            f'--price-file {path}: [models."{model}"] may hold only {", ".join(KINDS)} '
            f"(numbers per million tokens), got {entry!r}"
        )
    for kind, value in entry.items():
        bad = isinstance(value, bool) or not isinstance(value, (int, float))
        if bad or not 0 <= value <= MAX_PRICE:
            raise ConfigError(
                f'--price-file {path}: models."{model}".{kind} must be a number >= 0 and '
                f"<= {MAX_PRICE:g}, got {value!r}"
            )
    currency, source = raw.get("currency"), raw.get("source")
    return {kind: float(value) for kind, value in entry.items()}, currency, source


def prices_for(config: TrainConfig) -> Prices | None:
    """The run's prices (file, then flags on top), or None when the user gave none."""
    entries: dict[str, float] = {}
    currency, note, sources = None, None, []
    if config.price_file is not None:
        entries, currency, note = _file_prices(config.price_file, config.base_model)
        sources.append(f"price file {config.price_file}")
    flagged = {
        kind: getattr(config, f"price_{kind}")
        for kind in KINDS
        if getattr(config, f"price_{kind}") is not None
    }
    if flagged:
        sources.append("--price-* flags")
    entries.update(flagged)
    currency = config.price_currency or currency
    if not entries and currency is None:
        return None
    missing = [kind for kind in ("prompt", "completion", "train") if kind not in entries]
    if missing:
        raise ConfigError(
            "prices are incomplete: no "
            + ", ".join(f"--price-{kind}" for kind in missing)
            + " (give every one of prompt, completion and train, in --price-file or as flags)"
        )
    if not isinstance(currency, str) or not currency.strip():
        raise ConfigError(
            "prices need a currency: pass --price-currency (e.g. CNY) or set currency in the "
            "price file"
        )
    source = " + ".join(sources) + (f" ({note})" if note else "")
    return Prices(
        currency=currency,
        prompt=entries["prompt"],
        completion=entries["completion"],
        train=entries["train"],
        forward=entries.get("forward", entries["train"]),
        source=f"user-supplied: {source}",
    )
