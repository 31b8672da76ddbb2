"""The embedded local backend: PyTRIO's client API on an in-process torch model.

``LocalServiceClient`` mirrors ``pytrio.ServiceClient`` (and its training and sampling
clients mirror PyTRIO's): same method names, arguments, return types (PyTRIO's own
``Datum``, ``SampleResponse``, ``ForwardBackwardOutput``, ``APIFuture`` ...) and the same
input validation, so the GRPO loop runs unchanged and offline on a CPU, with real
gradients and real sampling. Base models: the built-in ``grpo/tiny-qwen3-bpe``, or any
local Hugging Face directory (a downloaded Qwen), loaded with ``local_files_only=True``.

How it differs from the service, on purpose:

- Built-in losses (``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``,
  ``dro``) run the core kernels of ``grpo.core.losses``, so a built-in loss and the same
  kernel through ``forward_backward_custom`` give the same loss and gradients. Besides
  the kernel's keys, ``loss_fn_config`` may hold ``reduction`` (default ``"sum"``, the
  Tinker convention) and ``norm_length``.
- ``metrics`` holds PyTRIO's keys only: ``loss_sum``, ``loss_mean`` and ``token_count``
  (a whole number: the tokens the loss trains on, target ≠ −100 with a nonzero weight or
  advantage, the first one dropped under ``auto_shift``; PyTRIO's active-token count).
  ``LocalServiceClient(kernel_metrics=True)`` adds the kernel's metrics prefixed with the
  loss name (``"ppo/clip_fraction"``). Other kernels (``gspo``) run through
  ``forward_backward_custom`` only, as on the service.
- ``forward_backward_custom`` runs the user's loss on the worker thread (one forward,
  then the loss's gradient pushed through the same graph); the loss must not call back
  into this backend.
- ``optim_step`` is AdamW (decoupled weight decay) on the LoRA parameters; gradient
  clipping by global norm unless ``grad_clip_norm`` is 0. Its metrics: ``grad_norm``
  (before clipping), ``learning_rate``, ``optimizer_step``.
- ``save_weights_and_get_sampling_client`` copies the adapter tensors in memory (no
  file): the sampler keeps sampling those weights while training goes on.
- Numbers never poison the adapter (each refusal is a ``ValidationError`` whose code
  starts ``validation.non_finite_``, raised before anything changes): log-probs of the
  model that are NaN or ±inf (diverged weights), a built-in loss that overflows on finite
  inputs (``forward_backward``), a non-finite custom loss or custom-loss gradient, a
  non-finite gradient norm in ``optim_step`` (its gradients are dropped; the weights,
  optimizer state and step count stay), and ``save_state`` of weights that are not
  finite or give non-finite log-probs (one forward over 8 probe tokens per save).
- Beyond the loop's needs it has the rest of pytrio 0.2.9's surface:
  ``get_server_capabilities`` (the models' real context length), ``create_rest_client``
  (list and delete checkpoints, `_local_rest`), an ignored ``api_key``, and training
  clients' ``close()``/``close_async()`` as no-ops (older pytrio releases had them, and
  published scripts still call them).
- Checkpoints are PEFT adapter directories under ``root`` (see ``_local_checkpoint``),
  addressed as ``local://<directory>``; ``ttl_seconds`` is recorded, never enforced.
- Randomness: ``LocalServiceClient(seed=...)`` seeds a generator that supplies the LoRA
  seed when ``create_lora_training_client(seed=None)`` and the sampling seed of every
  request without ``SamplingParams.seed``. A request with an explicit seed samples the
  same tokens and log-probs whatever else it is batched with.

All torch work runs on one worker thread per service; calls return futures at once.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from pytrio.client.builders.training import build_trainer_save_payload
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import ValidationError
from pytrio.model.limits import TrainingLimits
from pytrio.types import (
    AdamParams,
    APIFuture,
    Datum,
    ForwardBackwardOutput,
    ImageChunk,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    TensorData,
)
from pytrio.types.server_capabilities import (
    GetServerCapabilitiesResponse,
    ModelOperationCapabilities,
    SupportedModel,
)
from torch import Tensor, nn

from grpo.backends.datums import IGNORE_INDEX, DatumArrays, datum_array, read_datums
from grpo.backends.local import checkpoint as checkpoints
from grpo.backends.local.model import AdapterWeights, LoraSpec, ModelHost, load_host
from grpo.backends.local.rest import LocalRestClient
from grpo.backends.local.sample_request import PendingSample, SampleSpec
from grpo.backends.local.sampler.loop import sample_batch
from grpo.backends.local.sampler.validation import validate_sample_request
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.backends.local.worker import Worker
from grpo.core.loss_spec import LossSpec

__all__ = ["LocalSamplingClient", "LocalServiceClient", "LocalTrainingClient", "default_root"]

_DEFAULT_SAMPLING_PARAMS = SamplingParams()
CustomLossFn = Callable[..., tuple[Tensor, dict[str, float]]]


SAMPLER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_root() -> Path:
    """Where checkpoints go without `root`: $XDG_CACHE_HOME/grpo/local (~/.cache/grpo/local)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "grpo" / "local"


class _Engine:
    """What a service and all its clients share: the worker, loaded models, seeds, root."""

    def __init__(
        self,
        root: Path,
        seed: int,
        kernel_metrics: bool,
        sampler_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.root = root
        self.kernel_metrics = kernel_metrics
        self.sampler_dtype = sampler_dtype
        self.worker = Worker(name=f"grpo-local-{uuid.uuid4().hex[:6]}")
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self._hosts: dict[str, ModelHost] = {}
        weakref.finalize(self, self.worker.close)

    def draw_seed(self) -> int:
        """The next seed from the service's seeded generator (thread-safe)."""
        with self._rng_lock:
            return int(self._rng.integers(0, 2**31 - 1))

    def host(self, base_model: str) -> ModelHost:
        """The loaded base model (loaded on first use); call on the worker."""
        key = (
            base_model
            if base_model == TINY_MODEL_NAME
            else str(Path(base_model).expanduser().resolve())
        )
        if key not in self._hosts:
            self._hosts[key] = load_host(base_model)
        return self._hosts[key]

    def run(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the worker and wait for it."""
        return self.worker.call(function).result()


class LocalServiceClient:
    """In-process stand-in for `pytrio.ServiceClient`: creates local training and sampling clients.

    Args:
        api_key: accepted for PyTRIO's signature and ignored (nothing to authenticate).
        root: directory for checkpoints (default: `default_root()`).
        seed: seeds LoRA initialisation and sampling when a call gives no seed.
        kernel_metrics: also report the loss kernel's metrics from forward/forward_backward.
        sampler_dtype: ``"float32"`` (default: the sampler's log-probs are the trainer's) or
            ``"bfloat16"``: sampling runs its matmuls in bfloat16 (CPU autocast) while
            training stays float32, the usual source of a real service's sampler-trainer
            mismatch, reproduced offline (docs/FORMULAS.md, "Sampler–trainer mismatch").
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        root: str | Path | None = None,
        seed: int = 0,
        kernel_metrics: bool = False,
        sampler_dtype: str = "float32",
    ) -> None:
        del api_key
        if sampler_dtype not in SAMPLER_DTYPES:
            raise ValueError(
                f"sampler_dtype must be one of {', '.join(SAMPLER_DTYPES)}, got {sampler_dtype!r}"
            )
        root_path = Path(root) if root is not None else default_root()
        self._engine = _Engine(root_path, seed, kernel_metrics, SAMPLER_DTYPES[sampler_dtype])

    def close(self) -> None:
        """Stop the worker thread once queued work is done (clients stop working)."""
        self._engine.worker.close()

    def __enter__(self) -> LocalServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_supported_models(self) -> list[str]:
        """Named models (a local Hugging Face model directory works too)."""
        return [TINY_MODEL_NAME]

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The named models' real limits: context length = max sequence length = model positions."""
        models = []
        for name in self.get_supported_models():
            host = self._engine.run(functools.partial(self._engine.host, name))
            limits = ModelOperationCapabilities(
                available=True,
                max_batch_size=None,
                max_tokens_per_request=None,
                max_seq_len=host.max_positions,
            )
            models.append(
                SupportedModel(
                    model_name=name,
                    max_context_length=host.max_positions,
                    training=limits,
                    sampling=limits,
                )
            )
        return GetServerCapabilitiesResponse(supported_models=models)

    async def get_server_capabilities_async(self) -> GetServerCapabilitiesResponse:
        """Async twin of `get_server_capabilities`."""
        return await asyncio.to_thread(self.get_server_capabilities)

    def create_rest_client(self) -> LocalRestClient:
        """Checkpoint listing and deletion under this service's root (pytrio's RestClient API)."""
        return LocalRestClient(self._engine.root)

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> LocalTrainingClient:
        """A training client on a fresh LoRA (alpha 32, A seeded by `seed`, B zero)."""
        spec = LoraSpec(
            rank=rank,
            seed=self._engine.draw_seed() if seed is None else seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        host = self._engine.run(lambda: self._engine.host(base_model))
        return LocalTrainingClient(self._engine, host, spec)

    async def create_lora_training_client_async(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> LocalTrainingClient:
        """Async twin of `create_lora_training_client`."""
        return await asyncio.to_thread(
            self.create_lora_training_client,
            base_model,
            rank,
            seed,
            train_mlp,
            train_attn,
            train_unembed,
        )

    def create_sampling_client(
        self, base_model: str, model_path: str | None = None
    ) -> LocalSamplingClient:
        """A sampler of the base model, or of LoRA weights saved at `model_path`."""
        host = self._engine.run(lambda: self._engine.host(base_model))
        weights = None if model_path is None else _read_sampler_weights(model_path, host)
        return LocalSamplingClient(self._engine, host, weights)

    async def create_sampling_client_async(
        self, base_model: str, model_path: str | None = None
    ) -> LocalSamplingClient:
        """Async twin of `create_sampling_client`."""
        return await asyncio.to_thread(self.create_sampling_client, base_model, model_path)

    def create_training_client_from_state(self, path: str) -> LocalTrainingClient:
        """A training client with the checkpoint's LoRA config and weights (fresh optimizer)."""
        return self._from_state(path, with_optimizer=False)

    async def create_training_client_from_state_async(self, path: str) -> LocalTrainingClient:
        """Async twin of `create_training_client_from_state`."""
        return await asyncio.to_thread(self.create_training_client_from_state, path)

    def create_training_client_from_state_with_optimizer(self, path: str) -> LocalTrainingClient:
        """A training client with the checkpoint's weights and optimizer state."""
        return self._from_state(path, with_optimizer=True)

    async def create_training_client_from_state_with_optimizer_async(
        self, path: str
    ) -> LocalTrainingClient:
        """Async twin of `create_training_client_from_state_with_optimizer`."""
        return await asyncio.to_thread(self.create_training_client_from_state_with_optimizer, path)

    def _from_state(self, path: str, *, with_optimizer: bool) -> LocalTrainingClient:
        directory = checkpoints.resolve(path)
        metadata = checkpoints.read_metadata(directory)
        base_model = str(metadata["base_model"])
        host = self._engine.run(lambda: self._engine.host(base_model))
        client = LocalTrainingClient(self._engine, host, checkpoints.spec_from(metadata))
        client._restore(directory, metadata, with_optimizer=with_optimizer)
        return client


def _read_sampler_weights(model_path: str, host: ModelHost) -> AdapterWeights:
    directory = checkpoints.resolve(model_path)
    metadata = checkpoints.read_metadata(directory)
    if metadata["base_model"] != host.model_id:
        raise ValidationError(
            f"checkpoint {model_path!r} was trained on {metadata['base_model']!r}, not "
            f"{host.model_id!r}; create the sampling client with that base model",
            code="validation.checkpoint_config_mismatch",
        )
    return checkpoints.read_weights(directory, checkpoints.spec_from(metadata))


# --- training ------------------------------------------------------------------------------


@attrs.frozen
class _LossBatch:
    """A validated forward/forward_backward request: the loss and the datums as flat arrays."""

    spec: LossSpec
    auto_shift: bool
    inputs: list[list[int]]
    arrays: DatumArrays


class LocalTrainingClient:
    """In-process stand-in for `pytrio.TrainingClient` on one LoRA adapter."""

    def __init__(self, engine: _Engine, host: ModelHost, spec: LoraSpec) -> None:
        self._engine = engine
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

    async def forward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Async twin of `forward`."""
        return self.forward(data, loss_fn, loss_fn_config, auto_shift)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Loss of `data` and its gradient, added to the gradients since the last optim_step."""
        batch = self._prepare(data, loss_fn, loss_fn_config, auto_shift)
        self._started = True
        return self._engine.worker.call(lambda: self._run_loss(batch, backward=True))

    async def forward_backward_async(
        self,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, object] | None = None,
        auto_shift: bool = False,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Async twin of `forward_backward`."""
        return self.forward_backward(data, loss_fn, loss_fn_config, auto_shift)

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
        plan_training_batch(
            data,
            loss_fn="cross_entropy",
            auto_shift=False,
            limits=self._limits,
            tokenizer_vocab_size=self._host.vocab_size,
        )
        _reject_images(data)
        inputs = [datum.model_input.to_ints() for datum in data]
        targets = [datum_array(datum, "target_tokens", np.int64) for datum in data]
        self._started = True
        return self._engine.worker.call(
            lambda: self._run_custom(data, inputs, targets, loss_fn, loss_fn_config)
        )

    async def forward_backward_custom_async(
        self,
        data: list[Datum],
        loss_fn: CustomLossFn,
        loss_fn_config: dict[str, object] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Async twin of `forward_backward_custom`."""
        return self.forward_backward_custom(data, loss_fn, loss_fn_config)

    def _prepare(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_fn_config: dict[str, object] | None,
        auto_shift: bool,
    ) -> _LossBatch:
        """PyTRIO's validation, then the loss config, then flat arrays; all before any compute."""
        plan_training_batch(
            data,
            loss_fn=loss_fn,
            auto_shift=auto_shift,
            limits=self._limits,
            tokenizer_vocab_size=self._host.vocab_size,
        )
        _reject_images(data)
        try:
            spec = LossSpec.from_loss_fn_config(loss_fn, loss_fn_config)
        except ValueError as error:
            raise ValidationError(
                f"invalid loss_fn_config for {loss_fn!r}: {error}",
                code="validation.invalid_loss_config",
            ) from None
        # One reader and masking rule for built-in and custom losses: grpo.backends.datums.
        # Cross-entropy weights are optional (absent means 1), and it reports no ratios.
        cross_entropy = spec.name == "cross_entropy"
        try:
            arrays = read_datums(
                data,
                weight_input=spec.kernel.weight_input,
                with_sampling_logprobs=not cross_entropy,
                weights_optional=cross_entropy,
            )
        except ValueError as error:
            raise ValidationError(str(error), code="validation.invalid_datum") from None
        if auto_shift:  # the first label predicts nothing (PyTRIO drops it)
            arrays.mask_N[np.cumsum(arrays.seq_lens_B) - arrays.seq_lens_B] = False
        return _LossBatch(
            spec=spec,
            auto_shift=auto_shift,
            inputs=[datum.model_input.to_ints() for datum in data],
            arrays=arrays,
        )

    def _run_loss(self, batch: _LossBatch, *, backward: bool) -> ForwardBackwardOutput:
        """The kernel on the model's log-probs (worker thread); backward accumulates gradients."""
        self._host.activate_training(self._adapter)
        arrays, spec = batch.arrays, batch.spec
        sampling = (
            None
            if arrays.sampling_logprobs_N is None
            else torch.from_numpy(arrays.sampling_logprobs_N)
        )
        weights, mask = torch.from_numpy(arrays.weights_N), torch.from_numpy(arrays.mask_N)

        def evaluate(logprobs: Tensor, loss: LossSpec) -> tuple[Tensor, dict[str, float]]:
            return loss(logprobs, sampling, weights, mask=mask, seq_lens=arrays.seq_lens_B)

        with torch.enable_grad() if backward else torch.no_grad():
            logprobs_list = self._host.target_logprobs(
                batch.inputs, arrays.target_tokens_B, auto_shift=batch.auto_shift
            )
            logprobs = torch.cat(logprobs_list)
            _require_finite_logprobs(logprobs, arrays.seq_lens_B)
            loss, kernel_metrics = evaluate(logprobs, spec)
            if backward:
                if not bool(torch.isfinite(loss.detach())):
                    raise _non_finite_loss(batch, logprobs.detach(), float(loss.detach()))
                loss.backward()
        if spec.reduction == "sum":
            loss_sum = float(loss.detach())
        else:
            with torch.no_grad():
                loss_sum = float(
                    evaluate(
                        logprobs.detach(), attrs.evolve(spec, reduction="sum", norm_length=None)
                    )[0]
                )
        token_count = int(arrays.mask_N.sum())
        metrics: dict[str, float] = {
            "loss_sum": loss_sum,
            "loss_mean": loss_sum / token_count if token_count else 0.0,
            "token_count": token_count,
        }
        if self._engine.kernel_metrics:
            prefix = spec.name
            metrics.update({f"{prefix}/{key}": value for key, value in kernel_metrics.items()})
        return ForwardBackwardOutput(loss_fn_outputs=_outputs(logprobs_list), metrics=metrics)

    def _run_custom(
        self,
        data: list[Datum],
        inputs: list[list[int]],
        targets: list[np.ndarray],
        loss_fn: CustomLossFn,
        loss_fn_config: dict[str, object] | None,
    ) -> ForwardBackwardOutput:
        """Custom loss on log-prob leaves, their gradients pushed through the model (worker)."""
        self._host.activate_training(self._adapter)
        with torch.enable_grad():
            logprobs_list = self._host.target_logprobs(inputs, targets, auto_shift=False)
            _require_finite_logprobs(
                torch.cat([logprobs.detach() for logprobs in logprobs_list]),
                [len(target) for target in targets],
            )
            leaves = [logprobs.detach().clone().requires_grad_(True) for logprobs in logprobs_list]
            loss, custom_metrics = _call_custom_loss(loss_fn, data, leaves, loss_fn_config)
            if isinstance(loss, Tensor) and not bool(torch.isfinite(loss.detach()).all()):
                shown = loss.item() if loss.numel() == 1 else loss.detach().flatten()[:4].tolist()
                raise ValidationError(
                    f"the custom loss is {shown}, not finite; no gradient was applied: check "
                    "loss_fn for a log of 0, a division by 0 or an overflowing exp",
                    code="validation.non_finite_custom_loss",
                )
            loss.backward()
            gradients = []
            for leaf, target in zip(leaves, targets, strict=True):
                if leaf.grad is None:
                    raise ValidationError(
                        "Custom loss output has no gradients. "
                        "Ensure loss_fn returns a tensor with gradients.",
                        code="validation.missing_custom_loss_gradient",
                    )
                # The service trains ignored targets on nothing, whatever the gradient.
                gradients.append(
                    torch.where(torch.from_numpy(target) == IGNORE_INDEX, 0.0, leaf.grad)
                )
            for index, gradient in enumerate(gradients):
                bad = ~torch.isfinite(gradient)
                if bool(bad.any()):
                    position = int(bad.nonzero()[0, 0])
                    raise ValidationError(
                        f"the custom loss's gradient w.r.t. the log-prob of datum {index}, "
                        f"position {position} is {float(gradient[position])}; no gradient was "
                        "applied: check loss_fn where it is not differentiable (sqrt or log at 0)",
                        code="validation.non_finite_custom_loss_gradient",
                    )
            torch.autograd.backward(logprobs_list, gradients)
        # PyTRIO reports its linear surrogate: cross entropy with weights -grad.
        gradient, logprobs = torch.cat(gradients), torch.cat([lp.detach() for lp in logprobs_list])
        loss_sum = float((gradient * logprobs).sum())
        token_count = int((gradient != 0).sum())
        metrics = {
            "loss_sum": loss_sum,
            "loss_mean": loss_sum / token_count if token_count else 0.0,
            "token_count": token_count,
        }
        return ForwardBackwardOutput(
            loss_fn_outputs=_outputs(logprobs_list), metrics={**metrics, **custom_metrics}
        )

    # --- optimizer ---------------------------------------------------------------------

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """One AdamW step on the accumulated gradients, then zero them."""
        _validate_adam(adam_params)
        self._started = True
        return self._engine.worker.call(lambda: self._step(adam_params))

    async def optim_step_async(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        """Async twin of `optim_step`."""
        return self.optim_step(adam_params)

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

    async def save_state_async(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> APIFuture[SaveWeightsResponse]:
        """Async twin of `save_state`."""
        return self.save_state(name, ttl_seconds, overwrite)

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

    async def save_weights_for_sampler_async(
        self, name: str, ttl_seconds: int | None = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Async twin of `save_weights_for_sampler`."""
        return self.save_weights_for_sampler(name, ttl_seconds)

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

    async def load_state_async(self, path: str) -> APIFuture[dict[str, object]]:
        """Async twin of `load_state`."""
        return await asyncio.to_thread(self.load_state, path)

    def load_state_with_optimizer(self, path: str) -> APIFuture[dict[str, object]]:
        """Load LoRA weights and optimizer state; only before the first training operation."""
        self._load(path, with_optimizer=True)
        return APIFuture.completed({})

    async def load_state_with_optimizer_async(self, path: str) -> APIFuture[dict[str, object]]:
        """Async twin of `load_state_with_optimizer`."""
        return await asyncio.to_thread(self.load_state_with_optimizer, path)

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
        mismatches = [
            f"{field} (target={target!r}, source={value!r})"
            for field, target, value in (
                ("base_model", self.model_id, metadata["base_model"]),
                ("lora_rank", self.lora.rank, source.rank),
                ("train_mlp", self.lora.train_mlp, source.train_mlp),
                ("train_attn", self.lora.train_attn, source.train_attn),
                ("train_unembed", self.lora.train_unembed, source.train_unembed),
            )
            if target != value
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

    async def save_weights_and_get_sampling_client_async(self) -> LocalSamplingClient:
        """Async twin of `save_weights_and_get_sampling_client`."""
        return await asyncio.to_thread(self.save_weights_and_get_sampling_client)

    def create_sampling_client(self, model_path: str) -> LocalSamplingClient:
        """A sampler of LoRA weights saved at `model_path` (same base model)."""
        return LocalSamplingClient(
            self._engine, self._host, _read_sampler_weights(model_path, self._host)
        )

    async def create_sampling_client_async(self, model_path: str) -> LocalSamplingClient:
        """Async twin of `create_sampling_client`."""
        return await asyncio.to_thread(self.create_sampling_client, model_path)

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


def _reject_images(data: Sequence[Datum]) -> None:
    for index, datum in enumerate(data):
        if any(isinstance(chunk, ImageChunk) for chunk in datum.model_input.chunks):
            raise ValidationError(
                f"datum {index} has image chunks; the local backend trains on text only",
                code="validation.image_unsupported",
            )


def _outputs(logprobs_list: Sequence[Tensor]) -> list[dict[str, TensorData]]:
    return [{"logprobs": TensorData.from_torch(logprobs.detach())} for logprobs in logprobs_list]


def _datum_position(flat: int, seq_lens: Sequence[int] | np.ndarray) -> tuple[int, int]:
    """(datum, position within it) of an index into the concatenated per-datum values."""
    ends = np.cumsum(seq_lens)
    index = int(np.searchsorted(ends, flat, side="right"))
    return index, flat - (int(ends[index - 1]) if index else 0)


def _require_finite_logprobs(logprobs: Tensor, seq_lens: Sequence[int] | np.ndarray) -> None:
    """ValidationError at the first non-finite model log-prob (its datum and position)."""
    values = logprobs.detach()
    bad = ~torch.isfinite(values)
    if not bool(bad.any()):
        return
    flat = int(bad.nonzero()[0, 0])
    index, position = _datum_position(flat, seq_lens)
    raise ValidationError(
        f"the model's log-prob of datum {index}, position {position} is "
        f"{float(values[flat])}: the LoRA weights have diverged (a learning rate too high?). "
        "Nothing was trained; resume from the last good checkpoint with a lower learning rate",
        code="validation.non_finite_logprobs",
    )


SAMPLE_MEMORY_LIMIT_BYTES = int(os.environ.get("GRPO_LOCAL_SAMPLE_MEMORY_GB", "8")) * 2**30
"""The most memory one local sample request may need (KV cache + logits), refused above it;
``GRPO_LOCAL_SAMPLE_MEMORY_GB`` changes it (default 8)."""


def sample_memory_bytes(host: ModelHost, num_samples: int, prompt_len: int, max_tokens: int) -> int:
    """Float32 bytes of a request's KV cache (2 x layers x KV heads x head dim per position of
    every sequence) plus one step's logits (vocab per sequence), an estimate within ~2x."""
    config = host.model.config
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_position = 2 * config.num_hidden_layers * heads * head_dim
    positions = prompt_len + max_tokens
    return 4 * num_samples * (per_position * positions + host.vocab_size)


def _check_sample_memory(
    host: ModelHost, num_samples: int, prompt_len: int, max_tokens: int
) -> None:
    needed = sample_memory_bytes(host, num_samples, prompt_len, max_tokens)
    if needed > SAMPLE_MEMORY_LIMIT_BYTES:
        raise ValidationError(
            f"sampling {num_samples} x {prompt_len + max_tokens} positions needs about "
            f"{needed / 2**30:.1f} GiB, over the local backend's limit of "
            f"{SAMPLE_MEMORY_LIMIT_BYTES / 2**30:.0f} GiB; lower num_samples or max_tokens "
            "(or raise GRPO_LOCAL_SAMPLE_MEMORY_GB)",
            code="validation.sample_too_large",
        )


def _non_finite_loss(batch: _LossBatch, logprobs: Tensor, value: float) -> ValidationError:
    """The error for a built-in loss that overflowed on finite inputs: the largest log-ratio."""
    culprit = ""
    arrays = batch.arrays
    if arrays.sampling_logprobs_N is not None and arrays.mask_N.any():
        gaps = np.where(arrays.mask_N, logprobs.numpy() - arrays.sampling_logprobs_N, 0.0)
        flat = int(np.argmax(np.abs(gaps)))
        index, position = _datum_position(flat, arrays.seq_lens_B)
        culprit = (
            f"; its largest log-ratio lp − lp_old is {gaps[flat]:.4g} (datum {index}, position "
            f"{position}), and exp(lp − lp_old) overflows float32 above 88"
        )
    return ValidationError(
        f"the {batch.spec.name} loss is {value} on finite inputs{culprit}; no gradient was "
        "applied: use a clipped loss (ppo, cispo) or check that the sampling log-probs come "
        "from the model being trained",
        code="validation.non_finite_loss",
    )


def _call_custom_loss(
    loss_fn: CustomLossFn,
    data: list[Datum],
    logprobs: list[Tensor],
    config: dict[str, object] | None,
) -> tuple[Tensor, dict[str, float]]:
    """PyTRIO's rule: pass `config` only when given and the function accepts a third argument."""
    if config is None:
        return loss_fn(data, logprobs)
    try:
        inspect.signature(loss_fn).bind(data, logprobs, config)
    except (TypeError, ValueError):
        return loss_fn(data, logprobs)
    return loss_fn(data, logprobs, config)


def _validate_adam(params: AdamParams) -> None:
    checks = (
        ("learning_rate", params.learning_rate, params.learning_rate >= 0, ">= 0"),
        ("beta1", params.beta1, 0 <= params.beta1 < 1, "in [0, 1)"),
        ("beta2", params.beta2, 0 <= params.beta2 < 1, "in [0, 1)"),
        ("eps", params.eps, params.eps > 0, "> 0"),
        ("weight_decay", params.weight_decay, params.weight_decay >= 0, ">= 0"),
        ("grad_clip_norm", params.grad_clip_norm, params.grad_clip_norm >= 0, ">= 0 (0 = off)"),
    )
    for field, value, ok, rule in checks:
        if not (np.isfinite(value) and ok):
            raise ValidationError(
                f"adam_params.{field} must be finite and {rule}, got {value!r}",
                code="validation.invalid_adam_params",
            )


# --- sampling ------------------------------------------------------------------------------


class LocalSamplingClient:
    """In-process stand-in for `pytrio.SamplingClient`: the base model or frozen LoRA weights."""

    def __init__(self, engine: _Engine, host: ModelHost, weights: AdapterWeights | None) -> None:
        self._engine = engine
        self._host = host
        self._weights = weights
        self.model_id = host.model_id
        self.sampling_run_cuid = f"sampler-{uuid.uuid4().hex[:12]}"
        self._run = functools.partial(
            sample_batch, host, weights, stopping=engine.worker.stopping, dtype=engine.sampler_dtype
        )

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = _DEFAULT_SAMPLING_PARAMS,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> APIFuture[SampleResponse]:
        """`num_samples` completions of `prompt` (validated now, sampled on the worker)."""
        spec = validate_sample_request(
            prompt,
            num_samples=num_samples,
            sampling_params=sampling_params,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            return_text=return_text,
            vocab_size=self._host.vocab_size,
            max_positions=self._host.max_positions,
            draw_seed=self._engine.draw_seed,
        )
        _check_sample_memory(
            self._host, num_samples, len(prompt.to_ints()), sampling_params.max_tokens
        )
        return self._submit(spec)

    async def sample_async(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams = _DEFAULT_SAMPLING_PARAMS,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        return_text: bool = True,
    ) -> SampleResponse:
        """Async twin of `sample` (returns the response, as PyTRIO's does)."""
        return await self.sample(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs,
            topk_prompt_logprobs,
            return_text,
        )

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        """log p(token_t | tokens_<t) for each prompt token (None for the first)."""
        spec = validate_sample_request(
            prompt,
            num_samples=1,
            sampling_params=SamplingParams(max_tokens=1, seed=0),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=0,
            return_text=False,
            vocab_size=self._host.vocab_size,
            max_positions=self._host.max_positions,
            draw_seed=self._engine.draw_seed,
            generate=False,
        )
        return self._submit(spec).map(lambda response: response.prompt_logprobs)

    async def compute_logprobs_async(self, prompt: ModelInput) -> list[float | None]:
        """Async twin of `compute_logprobs` (returns the list)."""
        return await self.compute_logprobs(prompt)

    def _submit(self, spec: SampleSpec) -> APIFuture[SampleResponse]:
        key = self._weights if self._weights is not None else self._host
        return self._engine.worker.sample(key, self._run, PendingSample(spec, future=Future()))

    def get_tokenizer(self) -> Any:
        """The base model's tokenizer."""
        return self._host.tokenizer
