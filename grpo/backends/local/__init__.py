"""The embedded local backend: PyTRIO's client API on an in-process torch model.

The public face: ``LocalServiceClient`` (what ``grpo.backends.pytrio.make_service_client``
returns for ``--backend local``), the training and sampling clients it creates, and
``default_root`` (where a backend keeps its checkpoints), and the checkpoint readers
``grpo serve`` needs (``resolve_checkpoint``, ``read_checkpoint_metadata``,
``checkpoint_lora_spec``). Everything else in this package
is internal (see ``docs/DESIGN.md``).
"""

from grpo.backends.local.checkpoint import read_metadata as read_checkpoint_metadata
from grpo.backends.local.checkpoint import resolve as resolve_checkpoint
from grpo.backends.local.checkpoint import spec_from as checkpoint_lora_spec
from grpo.backends.local.sampling_client import LocalSamplingClient
from grpo.backends.local.service import LocalServiceClient, default_root
from grpo.backends.local.training import LocalTrainingClient

__all__ = [
    "LocalSamplingClient",
    "LocalServiceClient",
    "LocalTrainingClient",
    "checkpoint_lora_spec",
    "default_root",
    "read_checkpoint_metadata",
    "resolve_checkpoint",
]
