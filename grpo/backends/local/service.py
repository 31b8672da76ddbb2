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
  (list and delete checkpoints, ``rest.py``), an ignored ``api_key``, and training
  clients' ``close()``/``close_async()`` as no-ops (older pytrio releases had them, and
  published scripts still call them).
- Checkpoints are PEFT adapter directories under ``root`` (see ``checkpoint.py``),
  addressed as ``local://<directory>``; ``ttl_seconds`` is recorded, never enforced.
- Randomness: ``LocalServiceClient(seed=...)`` seeds a generator that supplies the LoRA
  seed when ``create_lora_training_client(seed=None)`` and the sampling seed of every
  request without ``SamplingParams.seed``. A request with an explicit seed samples the
  same tokens and log-probs whatever else it is batched with.

All torch work runs on one worker thread per service; calls return futures at once. Its
intra-op thread count follows ``threads.py`` (``threads=0``: sized to the model, the
user's own setting respected).
The clients live in ``service.py`` (this one), ``training.py`` (with the loss execution
in ``loss_execution.py``) and ``sampling_client.py``; what they share in ``engine.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from pytrio.types.server_capabilities import (
    GetServerCapabilitiesResponse,
    ModelOperationCapabilities,
    SupportedModel,
)

from grpo.backends.local import checkpoint as checkpoints
from grpo.backends.local.engine import Engine
from grpo.backends.local.model import LoraSpec
from grpo.backends.local.rest import LocalRestClient
from grpo.backends.local.sampling_client import LocalSamplingClient, read_sampler_weights
from grpo.backends.local.training import LocalTrainingClient
from grpo.backends.local.twins import in_thread
from grpo.backends.names import BUILTIN_MODEL_NAMES
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION, BatchTotals

SAMPLER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_root() -> Path:
    """Where checkpoints go without `root`: $XDG_CACHE_HOME/grpo/local (~/.cache/grpo/local)."""
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "grpo" / "local"


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
        threads: torch intra-op threads of the worker (0 = auto: 1 for small models such as
            the built-in one, every core for large ones, and whatever the user set through
            ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` left alone; see ``threads.py``).
        service_normalization: the gradient scale of built-in and custom losses, one of
            ``grpo.core.normalization.NORMALIZATIONS``: the loss divided by the logical
            batch's ``"samples"`` (default: the real service's per-request mean), active
            tokens or advantage tokens, or ``"sum"`` (unscaled) (docs/FORMULAS.md, "Service
            normalization").
    """

    def __init__(
        self,
        api_key: str | None = None,
        *,
        root: str | Path | None = None,
        seed: int = 0,
        kernel_metrics: bool = False,
        sampler_dtype: str = "float32",
        threads: int = 0,
        service_normalization: str = DEFAULT_SERVICE_NORMALIZATION,
    ) -> None:
        del api_key
        BatchTotals(1, 0, 0).gradient_scale(service_normalization)  # ValueError if unknown
        self._normalization = service_normalization
        if sampler_dtype not in SAMPLER_DTYPES:
            raise ValueError(
                f"sampler_dtype must be one of {', '.join(SAMPLER_DTYPES)}, got {sampler_dtype!r}"
            )
        root_path = Path(root) if root is not None else default_root()
        self._engine = Engine(
            root_path, seed, kernel_metrics, SAMPLER_DTYPES[sampler_dtype], threads
        )

    @property
    def service_normalization(self) -> str:
        """What this trainer divides a loss's gradient by (one of core ``NORMALIZATIONS``);
        pytrio's ServiceClient has no such attribute (a loop learns it from the probe)."""
        return self._normalization

    def close(self) -> None:
        """Stop the worker thread once queued work is done (clients stop working)."""
        self._engine.worker.close()

    def __enter__(self) -> LocalServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_supported_models(self) -> list[str]:
        """The built-in models by name, the default one first (a local Hugging Face model
        directory works too)."""
        return list(BUILTIN_MODEL_NAMES)

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """The named models' real limits: context length = max sequence length = model positions."""
        models = []
        for name in self.get_supported_models():
            host = self._engine.load(name)
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

    get_server_capabilities_async = in_thread(get_server_capabilities)

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
        *,
        service_normalization: str | None = None,
    ) -> LocalTrainingClient:
        """A training client on a fresh LoRA (alpha 32, A seeded by `seed`, B zero); its
        gradient scale is `service_normalization` (default: this service's)."""
        spec = LoraSpec(
            rank=rank,
            seed=self._engine.draw_seed() if seed is None else seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        normalization = service_normalization or self._normalization
        BatchTotals(1, 0, 0).gradient_scale(normalization)  # ValueError if unknown
        host = self._engine.load(base_model)
        return LocalTrainingClient(self._engine, host, spec, normalization)

    create_lora_training_client_async = in_thread(create_lora_training_client)

    def create_sampling_client(
        self, base_model: str, model_path: str | None = None
    ) -> LocalSamplingClient:
        """A sampler of the base model, or of LoRA weights saved at `model_path`."""
        host = self._engine.load(base_model)
        weights = None if model_path is None else read_sampler_weights(model_path, host)
        return LocalSamplingClient(self._engine, host, weights)

    create_sampling_client_async = in_thread(create_sampling_client)

    def create_training_client_from_state(self, path: str) -> LocalTrainingClient:
        """A training client with the checkpoint's LoRA config and weights (fresh optimizer)."""
        return self._from_state(path, with_optimizer=False)

    create_training_client_from_state_async = in_thread(create_training_client_from_state)

    def create_training_client_from_state_with_optimizer(self, path: str) -> LocalTrainingClient:
        """A training client with the checkpoint's weights and optimizer state."""
        return self._from_state(path, with_optimizer=True)

    create_training_client_from_state_with_optimizer_async = in_thread(
        create_training_client_from_state_with_optimizer
    )

    def _from_state(self, path: str, *, with_optimizer: bool) -> LocalTrainingClient:
        directory = checkpoints.resolve(path)
        metadata = checkpoints.read_metadata(directory)
        base_model = str(metadata["base_model"])
        host = self._engine.load(base_model)
        client = LocalTrainingClient(
            self._engine, host, checkpoints.spec_from(metadata), self._normalization
        )
        client._restore(directory, metadata, with_optimizer=with_optimizer)
        return client
