"""The loss-normalization probe: which total a service divides a built-in loss's gradient by.

One throwaway LoRA training client (rank 4, separate from any run's), two tiny crafted
batches, a handful of calls, one deadline. Adam with beta1 = beta2 = 0 and a huge eps is
memoryless and moves the weights by (lr / eps) · g: plain gradient descent with step
size eta = lr / eps, so the change of a log-prob after a step measures the gradient's scale.

- X: one datum, 4 trained positions, advantage +1 on each (7 input tokens, the first 3
  targets ignored); Z: one datum, 12 trained positions, advantage 0 on each (no gradient
  under any convention, but they count as samples and active tokens).
- Batch 1 = [X]: S = 1, T = 4, T_A = 4. Batch 2 = [X⁻, X⁻, Z, Z], X⁻ = X with advantage −1:
  S = 4, T = 32, T_A = 8, and its summed gradient is −2 times batch 1's, so it walks back.
- Response of a batch: Σ over X's trained positions of (log-prob after − log-prob before)
  its step, divided by eta. The scale ratio (r2 / r1) / −2 is D1 / D2: 1 (``sum``),
  1/2 (``advantage_tokens``), 1/4 (``samples``), 1/8 (``active_tokens``); the decision is
  `grpo.core.normalization_probe.decide_convention`.

Before batch 1, eta is calibrated on batch 1 itself (memoryless steps make that free of
side effects on the measurement) so that its response is near `TARGET_CHANGE` nats: large
against rounding, small enough for the first-order (linear) regime. The sampling log-probs
of every datum are the current model's (a forward before each step), so every built-in
policy loss has ratio 1 and gradient −A per token. Docs: docs/FORMULAS.md, "Service
normalization", the probe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
from pytrio.client.training_batch import plan_training_batch
from pytrio.model.limits import TrainingLimits
from pytrio.types import AdamParams, Datum, ModelInput

from grpo.backends.datums import IGNORE_INDEX
from grpo.core.normalization import BatchTotals
from grpo.core.normalization_probe import DEFAULT_TOLERANCE, ProbeVerdict, decide_convention

PROBE_LOSSES = ("importance_sampling", "ppo", "cispo", "dro")
"""Built-in policy losses the probe may run (each has gradient −A per token at ratio 1)."""

DEFAULT_TIMEOUT_S = 120.0
PROBE_RANK = 4  # the smallest rank PyTRIO accepts
ADAM_EPS = 1e6  # far above any gradient entry: the update is (lr / eps) · g
INITIAL_STEP = 1e-6  # eta of the first calibration step
TARGET_CHANGE = 0.1  # nats summed over X's 4 positions that the calibrated step aims at
CHANGE_WINDOW = (0.02, 0.5)  # a first-batch change in this range is measured as is
MAX_CALIBRATION_STEPS = 4
MAX_RESCALE = 1e3  # eta changes by at most this factor per calibration step
GRADIENT_MULTIPLIER = -2.0  # batch 2's summed gradient over batch 1's
MAX_CALLS = 1 + 1 + 3 * MAX_CALIBRATION_STEPS + 3
"""The most calls a probe makes: the client, a forward, each calibration step's
forward_backward, optim_step and forward, and batch 2's."""

_X_INPUT = list(range(10, 17))
_X_TARGETS = [IGNORE_INDEX] * 3 + [21, 22, 23, 24]
_Z_INPUT = list(range(30, 43))
_Z_TARGETS = [IGNORE_INDEX] + list(range(50, 62))
_VOCAB_BOUND = 1 << 30  # pytrio's planner checks tokens against a vocab size; ours are < 62


class ProbeError(RuntimeError):
    """The probe could not measure (a call failed, the deadline passed, no usable step)."""


@attrs.frozen
class ProbeResult:
    """The probe's verdict and its evidence: the loss probed, both batches' totals, the step
    size eta, the two log-prob changes, the calls made and the seconds taken."""

    verdict: ProbeVerdict
    loss_fn: str
    first: BatchTotals
    second: BatchTotals
    step_size: float
    changes: tuple[float, float]
    calls: int
    elapsed_s: float

    def to_record(self) -> dict[str, Any]:
        """JSON-ready record (the run directory's service_probe.json)."""
        return {
            "convention": self.verdict.convention,
            "description": self.verdict.describe(),
            "measured_scale_ratio": self.verdict.measured,
            "expected_scale_ratios": dict(self.verdict.expected),
            "reason": self.verdict.reason,
            "loss_fn": self.loss_fn,
            "first_batch": attrs.asdict(self.first),
            "second_batch": attrs.asdict(self.second),
            "gradient_multiplier": GRADIENT_MULTIPLIER,
            "step_size": self.step_size,
            "logprob_changes": list(self.changes),
            "calls": self.calls,
            "elapsed_s": self.elapsed_s,
        }


def _datum(inputs: list[int], targets: list[int], logprobs: np.ndarray, advantage: float) -> Datum:
    """A policy datum: `advantage` on every trained position, the given sampling log-probs."""
    trained = np.asarray(targets) != IGNORE_INDEX
    return Datum(
        model_input=ModelInput.from_ints(inputs),
        loss_fn_inputs={
            "target_tokens": np.asarray(targets, dtype=np.int64),
            "logprobs": np.where(trained, logprobs, 0.0).astype(np.float32),
            "advantages": np.where(trained, advantage, 0.0).astype(np.float32),
        },
    )


def probe_batches(
    x_logprobs: np.ndarray, z_logprobs: np.ndarray
) -> tuple[list[Datum], list[Datum]]:
    """Batch 1 = [X] and batch 2 = [X⁻, X⁻, Z, Z] with these sampling log-probs."""
    x = _datum(_X_INPUT, _X_TARGETS, x_logprobs, 1.0)
    x_back = _datum(_X_INPUT, _X_TARGETS, x_logprobs, -1.0)
    z = _datum(_Z_INPUT, _Z_TARGETS, z_logprobs, 0.0)
    return [x], [x_back, x_back, z, z]


def batch_totals(data: Sequence[Datum], loss_fn: str) -> BatchTotals:
    """The totals pytrio 0.2.9's planner sends with `data` (its ``gradient_accumulation``)."""
    plan = plan_training_batch(
        list(data),
        loss_fn=loss_fn,
        auto_shift=False,
        limits=TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None),
        tokenizer_vocab_size=_VOCAB_BOUND,
    )
    totals = plan.totals
    return BatchTotals(
        samples=totals.total_samples,
        active_tokens=totals.total_active_tokens,
        advantage_tokens=totals.total_advantage_tokens,
    )


def probe_normalization(
    service_client: Any,
    base_model: str,
    *,
    loss_fn: str = "importance_sampling",
    seed: int = 0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    tolerance: float = DEFAULT_TOLERANCE,
) -> ProbeResult:
    """Measure which convention `service_client`'s trainer normalizes `loss_fn` with, on a
    fresh rank-4 LoRA of `base_model`; ProbeError if it cannot within `timeout_s` seconds."""
    if loss_fn not in PROBE_LOSSES:
        raise ValueError(f"the probe runs one of {', '.join(PROBE_LOSSES)}, got {loss_fn!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    # Every call's wait is bounded by the deadline; the thread also bounds a call that blocks
    # before it returns a future (pytrio's create_lora_training_client is synchronous).
    outcome: list[ProbeResult | BaseException] = []

    def measure() -> None:
        try:
            outcome.append(
                _measure(service_client, base_model, loss_fn, seed, timeout_s, tolerance)
            )
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(error)

    thread = threading.Thread(target=measure, name="grpo-normalization-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1.0)
    if not outcome:
        raise ProbeError(f"no answer within {timeout_s:g} s (a call to the service blocked)")
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _measure(
    service_client: Any,
    base_model: str,
    loss_fn: str,
    seed: int,
    timeout_s: float,
    tolerance: float,
) -> ProbeResult:
    """The probe's calls and measurements (on the probe's thread)."""
    started = time.monotonic()
    deadline = started + timeout_s
    calls = 0

    def wait(what: str, call: Callable[[], Any]) -> Any:
        nonlocal calls
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProbeError(f"no answer within {timeout_s:g} s (before {what})")
        calls += 1
        try:
            return call().result(timeout=remaining)
        except TimeoutError:
            raise ProbeError(f"{what} gave no answer within {timeout_s:g} s") from None
        except Exception as error:  # noqa: BLE001 - any service error ends the probe
            raise ProbeError(f"{what} failed: {type(error).__name__}: {error}") from error

    try:
        trainer = service_client.create_lora_training_client(
            base_model=base_model, rank=PROBE_RANK, seed=seed
        )
    except Exception as error:  # noqa: BLE001
        raise ProbeError(
            f"create_lora_training_client failed: {type(error).__name__}: {error}"
        ) from error
    calls += 1

    def logprobs() -> tuple[np.ndarray, np.ndarray]:
        """The current log-probs of X and Z (a forward, no gradient)."""
        data = [
            _datum(_X_INPUT, _X_TARGETS, np.zeros(len(_X_TARGETS)), 1.0),
            _datum(_Z_INPUT, _Z_TARGETS, np.zeros(len(_Z_TARGETS)), 0.0),
        ]
        outputs = wait("forward", lambda: trainer.forward(data, loss_fn)).loss_fn_outputs
        x_lp, z_lp = (np.asarray(out["logprobs"].to_numpy(), dtype=np.float64) for out in outputs)
        return x_lp, z_lp

    trained = np.asarray(_X_TARGETS) != IGNORE_INDEX

    def step(batch: int, eta: float, x_lp: np.ndarray, z_lp: np.ndarray) -> None:
        """Train batch 1 or 2 (sampling log-probs `x_lp`, `z_lp`) by one step of size eta."""
        data = probe_batches(x_lp, z_lp)[batch - 1]
        wait("forward_backward", lambda: trainer.forward_backward(data, loss_fn))
        adam = AdamParams(
            learning_rate=eta * ADAM_EPS,
            beta1=0.0,
            beta2=0.0,
            eps=ADAM_EPS,
            weight_decay=0.0,
            grad_clip_norm=0.0,
        )
        wait("optim_step", lambda: trainer.optim_step(adam))

    x_lp, z_lp = logprobs()
    eta = INITIAL_STEP
    low, high = CHANGE_WINDOW
    for attempt in range(MAX_CALIBRATION_STEPS):
        step(1, eta, x_lp, z_lp)
        new_x, new_z = logprobs()
        first_change = float((new_x - x_lp)[trained].sum())
        x_lp, z_lp = new_x, new_z
        if low <= first_change <= high and np.isfinite(first_change):
            break
        if attempt == MAX_CALIBRATION_STEPS - 1:
            raise ProbeError(
                f"no step size moved the log-probs by {low:g}..{high:g} nats in "
                f"{MAX_CALIBRATION_STEPS} steps (the last, eta {eta:.3g}, by {first_change:.4g})"
            )
        if not np.isfinite(first_change):
            raise ProbeError(f"the log-probs are not finite after a step of eta {eta:.3g}")
        if first_change <= 0 and abs(first_change) > low:
            eta /= MAX_RESCALE  # it overshot (left the linear regime)
        else:
            factor = TARGET_CHANGE / max(abs(first_change), TARGET_CHANGE / MAX_RESCALE)
            eta *= factor
    step(2, eta, x_lp, z_lp)
    final_x, _ = logprobs()
    second_change = float((final_x - x_lp)[trained].sum())
    first_batch, second_batch = probe_batches(x_lp, z_lp)
    first, second = batch_totals(first_batch, loss_fn), batch_totals(second_batch, loss_fn)
    verdict = decide_convention(
        first_change / eta,
        second_change / eta,
        first,
        second,
        GRADIENT_MULTIPLIER,
        tolerance,
    )
    return ProbeResult(
        verdict=verdict,
        loss_fn=loss_fn,
        first=first,
        second=second,
        step_size=eta,
        changes=(first_change, second_change),
        calls=calls,
        elapsed_s=time.monotonic() - started,
    )
