"""The compiled single-pass path of the loss kernels: same numbers as the eager kernel,
chosen when it should be, and a clean fallback when torch.compile fails.

The fused forms' math is checked against the per-token reference, law by law, in
tests/core/test_losses.py (there they run uncompiled); here they run compiled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from grpo.core import compiled_losses, losses
from grpo.core.fused_losses import FusedTerms

FUSED_KERNELS = [name for name, kernel in losses.LOSSES.items() if kernel.fused_form is not None]


@pytest.fixture(scope="module")
def compiler() -> None:
    """Skip (saying why) where torch.compile cannot build a CPU kernel at all."""
    try:
        torch.compile(lambda values: values.exp().sum(), dynamic=True)(torch.ones(4))
    except Exception as error:  # noqa: BLE001 - any compiler failure means no compiler here
        pytest.skip(f"torch.compile does not work here: {type(error).__name__}: {error}")


@pytest.fixture
def fallback_is_an_error() -> Iterator[None]:
    """A compiled call that falls back to eager warns; in these tests that is a failure."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        yield


def _batch(num_sequences: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Ragged sequences, a masked prompt at the start of each, ratios near 1, float32."""
    rng = np.random.default_rng(seed)
    seq_lens = rng.integers(2, 60, num_sequences)
    prompt_lens = rng.integers(1, seq_lens)
    starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    mask = np.arange(seq_lens.sum()) - starts >= np.repeat(prompt_lens, seq_lens)
    logprobs = -rng.exponential(1.0, mask.size)
    sampling = np.where(mask, logprobs + rng.normal(0.0, 0.3, mask.size), 0.0)
    advantages = np.where(mask, np.repeat(rng.normal(0.0, 1.0, num_sequences), seq_lens), 0.0)
    return (
        torch.tensor(logprobs, dtype=torch.float32),
        torch.tensor(sampling, dtype=torch.float32),
        torch.tensor(advantages, dtype=torch.float32),
        torch.from_numpy(mask),
        torch.from_numpy(seq_lens),
    )


def _call(
    name: str,
    batch: tuple[torch.Tensor, ...],
    *,
    fused: bool | None,
    reduction: str = "sum",
    with_gradient: bool = True,
    with_sampling_logprobs: bool = True,
    **config: float | None,
) -> tuple[float, torch.Tensor | None, dict[str, float]]:
    """(loss, d loss/d lp or None, metrics)."""
    logprobs, sampling, advantages, mask, seq_lens = batch
    leaf = logprobs.clone().requires_grad_(with_gradient)
    loss, metrics = losses.LOSSES[name](
        leaf,
        sampling if with_sampling_logprobs else None,
        advantages,
        mask=mask,
        seq_lens=seq_lens,
        reduction=reduction,
        norm_length=7.0 if reduction == "seq_mean_token_sum_norm" else None,
        fused=fused,
        **config,
    )
    if with_gradient:
        loss.backward()
    return loss.item(), leaf.grad, metrics


def _assert_same(
    actual: tuple[float, torch.Tensor | None, dict[str, float]],
    expected: tuple[float, torch.Tensor | None, dict[str, float]],
) -> None:
    """Equal up to float32 summation order."""
    (loss, gradient, metrics), (expected_loss, expected_gradient, expected_metrics) = (
        actual,
        expected,
    )
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-4)
    if expected_gradient is None:
        assert gradient is None
    else:
        assert gradient is not None
        torch.testing.assert_close(gradient, expected_gradient, rtol=1e-5, atol=1e-7)
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.usefixtures("compiler", "fallback_is_an_error")
@pytest.mark.parametrize("name", FUSED_KERNELS)
def test_compiled_form_matches_the_eager_kernel_at_any_batch_size(name: str) -> None:
    config = {"dual_clip": 3.0} if name == "ppo" else {}
    first, second = _batch(40, seed=1), _batch(57, seed=2)
    _assert_same(
        _call(name, first, fused=True, **config), _call(name, first, fused=False, **config)
    )
    # dynamic=True: a batch of another size reuses the compiled graph instead of compiling.
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _assert_same(
        _call(name, second, fused=True, **config), _call(name, second, fused=False, **config)
    )
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@pytest.mark.usefixtures("compiler", "fallback_is_an_error")
@pytest.mark.parametrize(
    ("name", "reduction", "with_gradient", "with_sampling_logprobs"),
    [
        ("ppo", "seq_mean_token_mean", True, True),  # one derivative per token
        ("cispo", "seq_mean_token_mean", True, True),
        ("ppo", "token_mean", False, True),  # forward only: no gradient written
    ],
)
def test_compiled_variants_match_the_eager_kernel(
    name: str, reduction: str, with_gradient: bool, with_sampling_logprobs: bool
) -> None:
    batch = _batch(40, seed=3)
    options = {
        "reduction": reduction,
        "with_gradient": with_gradient,
        "with_sampling_logprobs": with_sampling_logprobs,
    }
    _assert_same(
        _call(name, batch, fused=True, **options), _call(name, batch, fused=False, **options)
    )


@pytest.mark.slow
@pytest.mark.usefixtures("compiler", "fallback_is_an_error")
@pytest.mark.parametrize("name", FUSED_KERNELS)
def test_compiled_form_rejects_non_finite_masked_in_values_and_ignores_masked_out_ones(
    name: str,
) -> None:
    """The compiler keeps the total's NaN probe (0·x is not folded to 0): every non-finite
    masked-in value raises naming it; masked-out ones change nothing."""
    batch = _batch(40, seed=4)
    mask = batch[3]
    trained, untrained = mask.nonzero()[:, 0], (~mask).nonzero()[:, 0]
    clean = _call(name, batch, fused=True)
    for field, tensor_name in enumerate(("logprobs", "sampling_logprobs", "advantages")):
        for value in (math.nan, math.inf, -math.inf):
            poisoned = [tensor.clone() for tensor in batch]
            poisoned[field][untrained] = math.nan
            assert _call(name, tuple(poisoned), fused=True)[0] == clean[0]
            index = int(trained[len(trained) // 2])
            poisoned[field][index] = value
            with pytest.raises(ValueError, match=rf"^{tensor_name}\[{index}\] is {value} at"):
                _call(name, tuple(poisoned), fused=True)


@pytest.mark.slow
@pytest.mark.usefixtures("compiler", "fallback_is_an_error")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_form_computes_low_precision_inputs_in_float32(dtype: torch.dtype) -> None:
    logprobs, sampling, advantages, mask, seq_lens = _batch(40, seed=5)
    low = (logprobs.to(dtype), sampling.to(dtype), advantages.to(dtype), mask, seq_lens)
    rounded = tuple(tensor.float() if tensor.is_floating_point() else tensor for tensor in low)
    loss, gradient, metrics = _call("ppo", low, fused=True)
    expected_loss, expected_gradient, expected_metrics = _call("ppo", rounded, fused=True)
    assert loss == expected_loss
    assert gradient is not None and expected_gradient is not None
    assert gradient.dtype == dtype
    assert torch.equal(gradient, expected_gradient.to(dtype))
    assert metrics == expected_metrics


def _spy_on_compilation(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record which forms the kernels ask to compile (and run them uncompiled)."""
    asked: list[str] = []

    def record(form: Callable[..., FusedTerms]) -> Callable[..., FusedTerms]:
        asked.append(form.__name__)
        return form

    monkeypatch.setattr(compiled_losses, "_compiled_form", record)
    return asked


def test_auto_runs_the_fused_form_on_cpu_from_the_size_threshold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = _spy_on_compilation(monkeypatch)
    batch = _batch(40, seed=4)
    num_positions = batch[0].numel()
    monkeypatch.setattr(losses, "FUSED_MIN_TOKENS", num_positions + 1)
    _call("ppo", batch, fused=None)
    assert asked == []
    monkeypatch.setattr(losses, "FUSED_MIN_TOKENS", num_positions)
    _call("ppo", batch, fused=None)
    assert asked == ["fused_ppo"]
    _call("ppo", batch, fused=False)
    _call("gspo", batch, fused=None)  # sequence-level: no fused form, the eager kernel runs
    assert asked == ["fused_ppo"]


def test_an_empty_selection_runs_the_eager_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _spy_on_compilation(monkeypatch)
    logprobs, sampling, advantages, mask, seq_lens = _batch(5, seed=5)
    nothing = (logprobs, sampling, advantages, torch.zeros_like(mask), seq_lens)
    loss, gradient, metrics = _call("cispo", nothing, fused=True)
    assert asked == []
    assert loss == 0.0 and gradient is not None and not gradient.any()
    assert metrics["ratio_mean"] == 0.0


def test_fused_true_on_a_kernel_without_a_fused_form_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"'gspo' has no fused form.*fused=False"):
        _call("gspo", _batch(3, seed=6), fused=True)


def test_fused_must_be_none_true_or_false() -> None:
    with pytest.raises(ValueError, match="fused must be None"):
        _call("ppo", _batch(3, seed=7), fused="yes")  # type: ignore[arg-type]


def test_a_form_that_does_not_compile_warns_once_and_falls_back_to_the_eager_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts: list[str] = []

    def broken_compiler(form: Callable[..., FusedTerms]) -> Callable[..., FusedTerms]:
        def fail(*args: object, **kwargs: object) -> FusedTerms:
            attempts.append(form.__name__)
            raise RuntimeError("no C++ compiler found")

        return fail

    monkeypatch.setattr(compiled_losses, "_compiled_form", broken_compiler)
    monkeypatch.setattr(compiled_losses, "_UNCOMPILABLE_FORMS", set())
    batch = _batch(20, seed=8)
    with pytest.warns(RuntimeWarning, match=r"fused_cispo.*no C\+\+ compiler.*eager kernel"):
        result = _call("cispo", batch, fused=True)
    _assert_same(result, _call("cispo", batch, fused=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _call("cispo", batch, fused=True)  # no second attempt, no second warning
    assert attempts == ["fused_cispo"]


@pytest.mark.slow
@pytest.mark.usefixtures("compiler", "fallback_is_an_error")
def test_compiled_config_inputs_follow_each_call_and_survive_inference_mode() -> None:
    """The 0-d config inputs are made once per value: each call's thresholds take effect,
    and one first made under inference_mode serves a later call that needs a gradient."""
    batch = _batch(40, seed=5)
    clipped = []
    for high in (1.1, 1.05):
        with torch.inference_mode():
            forward_only = _call(
                "cispo", batch, fused=True, with_gradient=False, clip_high_threshold=high
            )
        eager = _call("cispo", batch, fused=False, clip_high_threshold=high)
        _assert_same(forward_only, (eager[0], None, eager[2]))
        _assert_same(_call("cispo", batch, fused=True, clip_high_threshold=high), eager)
        clipped.append(forward_only[2]["clip_high_fraction"])
    assert clipped[1] > clipped[0]  # the lower bound clipped more: it was not the cached 1.1


def test_a_config_input_made_under_a_tensor_mode_is_not_kept() -> None:
    """A fake tensor (tracing, export) cached as a threshold would poison every later call."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.device("cpu")
    with FakeTensorMode():
        fake = compiled_losses._scalar(0.625, torch.float32, cpu)
    assert type(fake) is not torch.Tensor
    real = compiled_losses._scalar(0.625, torch.float32, cpu)
    assert type(real) is torch.Tensor and real.item() == 0.625
    assert compiled_losses._scalar(0.625, torch.float32, cpu) is real  # kept once plain
