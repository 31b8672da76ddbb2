"""The local backend's training client: PyTRIO's ``TrainingClient`` on one LoRA adapter.

``LocalTrainingClient`` queues every call on the service's worker and returns a future:
forward and forward_backward (built-in losses) and forward_backward_custom (executed by
``loss_execution.py``), AdamW steps with gradient clipping (refused on a non-finite
gradient norm), checkpoints saved and loaded through ``checkpoint.py`` (``save_state``
refused on diverged weights), and sampling clients frozen at the current weights.
"""

from __future__ import annotations

import uuid
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pytrio.client.builders.training import build_trainer_save_payload
from pytrio.errors.base import ValidationError
from pytrio.model.limits import TrainingLimits
from pytrio.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    OptimStepResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)
from torch import nn

from grpo.backends.local import checkpoint as checkpoints
from grpo.backends.local.engine import Engine
from grpo.backends.local.loss_execution import (
    CustomLossFn,
    LossBatch,
    prepare_custom_batch,
    prepare_loss_batch,
    run_custom_loss,
    run_loss,
    validate_adam,
)
from grpo.backends.local.model import AdapterWeights, LoraSpec, ModelHost
from grpo.backends.local.sampling_client import LocalSamplingClient, read_sampler_weights
from grpo.backends.local.twins import in_thread, returning_future
from grpo.backends.local.worker import Worker
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION, BatchTotals


class LocalTrainingClient:
    """In-process stand-in for `pytrio.TrainingClient` on one LoRA adapter."""

    def __init__(
        self,
        engine: Engine,
        host: ModelHost,
        spec: LoraSpec,
        normalization: str = DEFAULT_SERVICE_NORMALIZATION,
    ) -> None:
        self._engine = engine
        self._normalization = normalization  # the gradient scale: one of core NORMALIZATIONS
        self._host = host
        self.lora = spec
        self.model_id = host.model_id
        self.training_run_cuid = f"run-{uuid.uuid4().hex[:12]}"
        self._limits = TrainingLimits(
            max_batch_size=None, max_tokens_per_request=None, max_seq_len=host.max_positions
        )
        self._started = False
        self._optimizer_steps = 0
        self._adapter, self._parameters, self._optimizer = engine.run(self._attach)
        release = weakref.finalize(self, _release_adapter, engine.worker, host, self._adapter)
        release.atexit = False  # nothing to free when the process ends

    def _attach(self) -> tuple[str, list[nn.Parameter], torch.optim.AdamW]:
        adapter = self._host.add_adapter(self.lora)
        parameters = list(self._host.adapter_parameters(adapter).values())
        defaults = AdamParams()
        optimizer = torch.optim.AdamW(
            parameters,
            lr=defaults.learning_rate,
            betas=(defaults.beta1, defaults.beta2),
            eps=defaults.eps,
            weight_decay=defaults.weight_decay,
        )
        return adapter, parameters, optimizer

    # --- forward / backward ------------------------------------------------------------

    def forward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Log-probs and loss of `data` under the current weights; no gradient."""
        batch = self._prepare(data, loss_fn, loss_fn_config, auto_shift)
        self._started = True
        return self._engine.worker.call(lambda: self._run_loss(batch, backward=False))

    forward_async = returning_future(forward)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
        *,
        gradient_accumulation: BatchTotals | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Loss of `data` and its gradient, added to the gradients since the last optim_step;
        the gradient scaled by the service normalization of `gradient_accumulation` (the
        logical batch's totals when `data` is one micro-batch of it; default: `data`'s own)."""
        batch = self._prepare(data, loss_fn, loss_fn_config, auto_shift)
        self._started = True
        return self._engine.worker.call(
            lambda: self._run_loss(batch, backward=True, totals=gradient_accumulation)
        )

    forward_backward_async = returning_future(forward_backward)

    def forward_backward_custom(
        self,
        data: list[Datum],
        loss_fn: CustomLossFn,
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Run `loss_fn(data, logprobs[, loss_fn_config])` on per-datum log-prob leaves; train on
        its gradient.

        The gradient of the custom loss with respect to each log-prob is pushed through the
        model exactly (PyTRIO sends it as cross-entropy weights; the parameter gradient is the
        same). Metrics: PyTRIO's linear-surrogate ``loss_sum``/``loss_mean``/``token_count``
        merged with the custom metrics.
        """
        inputs, targets = prepare_custom_batch(
            data, limits=self._limits, vocab_size=self._host.vocab_size
        )
        self._started = True
        return self._engine.worker.call(
            lambda: run_custom_loss(
                self._host,
                self._adapter,
                data,
                inputs,
                targets,
                loss_fn,
                loss_fn_config,
                self._normalization,
            )
        )

    forward_backward_custom_async = returning_future(forward_backward_custom)

    def _prepare(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, object] | None,
        auto_shift: bool,
    ) -> LossBatch:
        return prepare_loss_batch(
            data,
            loss_fn,
            loss_fn_config,
            auto_shift,
            limits=self._limits,
            vocab_size=self._host.vocab_size,
        )

    def _run_loss(
        self, batch: LossBatch, *, backward: bool, totals: BatchTotals | None = None
    ) -> ForwardBackwardOutput:
        return run_loss(
            self._host,
            self._adapter,
            batch,
            backward=backward,
            with_kernel_metrics=self._engine.kernel_metrics,
            normalization=self._normalization,
            totals=totals,
        )

    # --- optimizer ---------------------------------------------------------------------

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradients, then zero them."""
        validate_adam(adam_params)
        self._started = True
        return self._engine.worker.call(lambda: self._step(adam_params))

    optim_step_async = returning_future(optim_step)

    def _step(self, adam_params: AdamParams) -> OptimStepResponse:
        gradients = [parameter.grad for parameter in self._parameters if parameter.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(gradients) if gradients else torch.zeros(())
        if not bool(torch.isfinite(grad_norm)):
            self._optimizer.zero_grad(set_to_none=True)
            raise ValidationError(
                f"optimizer step {self._optimizer_steps + 1} refused: the gradient norm is "
                f"{float(grad_norm)}; the weights, optimizer state and step count are unchanged "
                "and the accumulated gradients were dropped. Lower the learning rate or check "
                "the loss for NaN or inf",
                code="validation.non_finite_gradient",
            )
        group = self._optimizer.param_groups[0]
        group.update(
            lr=adam_params.learning_rate,
            betas=(adam_params.beta1, adam_params.beta2),
            eps=adam_params.eps,
            weight_decay=adam_params.weight_decay,
        )
        if adam_params.grad_clip_norm > 0 and gradients:
            torch.nn.utils.clip_grads_with_norm_(
                self._parameters, adam_params.grad_clip_norm, grad_norm
            )
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._optimizer_steps += 1
        return OptimStepResponse(
            metrics={
                "grad_norm": float(grad_norm),
                "learning_rate": adam_params.learning_rate,
                "optimizer_step": float(self._optimizer_steps),
            }
        )

    # --- checkpoints -------------------------------------------------------------------

    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        """Save LoRA weights and optimizer state (atomically) under `name`."""
        payload = build_trainer_save_payload(name, ttl_seconds, overwrite=overwrite)
        self._started = True
        return self._engine.worker.call(
            lambda: self._save("state", payload.name, ttl_seconds, overwrite=overwrite)
        )

    save_state_async = returning_future(save_state)

    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save LoRA weights (no optimizer) for `create_sampling_client(model_path)`; replaces a
        save of the same name."""
        payload = build_trainer_save_payload(name, ttl_seconds)
        self._started = True
        return self._engine.worker.call(
            lambda: self._save("sampler", payload.name, ttl_seconds, overwrite=True)
        )

    save_weights_for_sampler_async = returning_future(save_weights_for_sampler)

    def _save(
        self,
        kind: checkpoints.CheckpointKind,
        name: str,
        ttl_seconds: int | None,
        *,
        overwrite: bool,
    ) -> Any:
        directory = checkpoints.checkpoint_directory(
            self._engine.root, self.training_run_cuid, kind, name
        )
        weights = self._host.snapshot(self._adapter, self.lora)
        if kind == "state":
            self._require_sound_weights(name, weights)
        metadata = checkpoints.metadata_for(
            kind=kind,
            base_model=self.model_id,
            spec=self.lora,
            run_id=self.training_run_cuid,
            name=name,
            ttl_seconds=ttl_seconds,
            optimizer_steps=self._optimizer_steps,
        )
        size = checkpoints.write(
            directory,
            host=self._host,
            weights=weights,
            metadata=metadata,
            optimizer_state=self._optimizer.state_dict() if kind == "state" else None,
            overwrite=overwrite,
        )
        response_type = SaveWeightsResponse if kind == "state" else SaveWeightsForSamplerResponse
        return response_type(path=checkpoints.to_uri(directory), model=self.model_id, size=size)

    def _require_sound_weights(self, name: str, weights: AdapterWeights) -> None:
        """ValidationError unless every adapter tensor is finite and so are the model's
        log-probs on a short probe (weights of 1e30 are finite, yet give NaN logits)."""
        message = (
            f"save_state({name!r}) refused after optimizer step {self._optimizer_steps}: "
            "{problem}; the weights have diverged (a learning rate too high?) and would not "
            "resume. The previous checkpoints are untouched: resume from the last one with a "
            "lower learning rate"
        )
        for key, tensor in weights.tensors.items():
            if not bool(torch.isfinite(tensor).all()):
                raise ValidationError(
                    message.format(problem=f"LoRA tensor {key} holds NaN or inf"),
                    code="validation.non_finite_weights",
                )
        probe = [list(range(1, min(self._host.vocab_size, 9)))]
        self._host.activate_training(self._adapter)
        with torch.no_grad():
            (logprobs,) = self._host.target_logprobs(probe, [np.asarray(probe[0])], auto_shift=True)
        if not bool(torch.isfinite(logprobs).all()):
            raise ValidationError(
                message.format(problem="the model's log-probs under them are NaN or inf"),
                code="validation.non_finite_weights",
            )

    def load_state(self, path: str) -> APIFuture[dict[str, object]]:
        """Load LoRA weights from a checkpoint; only before the first training operation."""
        self._load(path, with_optimizer=False)
        return APIFuture.completed({})

    load_state_async = in_thread(load_state)

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict[str, object]]:
        """Load LoRA weights and optimizer state; only before the first training operation."""
        self._load(path, with_optimizer=True)
        return APIFuture.completed({})

    load_state_with_optimizer_async = in_thread(load_state_with_optimizer)

    def _load(self, path: str, *, with_optimizer: bool) -> None:
        if self._started:
            raise ValidationError(
                "load_state cannot be called after training has started. "
                "Call load_state before the first training operation.",
                code="validation.already_initialized",
            )
        directory = checkpoints.resolve(path)
        metadata = checkpoints.read_metadata(directory)
        source = checkpoints.spec_from(metadata)
        # Every LoRA field but the seed (which only draws the initial weights) must match.
        target_fields = {"base_model": self.model_id, **self.lora.to_wire()}
        source_fields = {"base_model": metadata["base_model"], **source.to_wire()}
        mismatches = [
            f"{field} (target={target!r}, source={source_fields[field]!r})"
            for field, target in target_fields.items()
            if field != "seed" and target != source_fields[field]
        ]
        if mismatches:
            raise ValidationError(
                f"Checkpoint configuration is incompatible: {', '.join(mismatches)}.",
                code="validation.checkpoint_config_mismatch",
            )
        self._restore(directory, metadata, with_optimizer=with_optimizer)

    def _restore(
        self, directory: Path, metadata: dict[str, object], *, with_optimizer: bool
    ) -> None:
        weights = checkpoints.read_weights(directory, self.lora)
        optimizer_state = checkpoints.read_optimizer(directory) if with_optimizer else None

        def restore() -> None:
            self._host.load_adapter(self._adapter, weights)
            if optimizer_state is not None:
                self._optimizer.load_state_dict(optimizer_state)
                self._optimizer_steps = int(metadata["optimizer_steps"])  # type: ignore[arg-type]

        self._engine.run(restore)
        self._started = True

    # --- samplers ----------------------------------------------------------------------

    def save_weights_and_get_sampling_client(self) -> LocalSamplingClient:
        """A sampler frozen at the current weights (an in-memory copy of the adapter)."""
        self._started = True
        weights = self._engine.run(lambda: self._host.snapshot(self._adapter, self.lora))
        return LocalSamplingClient(self._engine, self._host, weights)

    save_weights_and_get_sampling_client_async = in_thread(save_weights_and_get_sampling_client)

    def create_sampling_client(self, model_path: str) -> LocalSamplingClient:
        """A sampler of LoRA weights saved at `model_path` (same base model)."""
        return LocalSamplingClient(
            self._engine, self._host, read_sampler_weights(model_path, self._host)
        )

    create_sampling_client_async = in_thread(create_sampling_client)

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer."""
        return self._host.tokenizer

    def close(self) -> None:
        """A no-op: older PyTRIO releases had `close()` and published scripts still call it."""

    async def close_async(self) -> None:
        """Async twin of `close` (a no-op)."""


def _release_adapter(worker: Worker, host: ModelHost, adapter: str) -> None:
    try:
        worker.call(lambda: host.delete_adapter(adapter))
    except RuntimeError:  # the service is closed: nothing left to free
        pass
