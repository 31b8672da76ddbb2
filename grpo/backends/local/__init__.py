"""The embedded local backend: PyTRIO's client API on an in-process torch model.

The public face: ``LocalServiceClient`` (what ``grpo.backends.pytrio.make_service_client``
returns for ``--backend local``), the training and sampling clients it creates, and
``default_root`` (where a backend keeps its checkpoints), the checkpoint readers
``grpo serve`` needs (``resolve_checkpoint``, ``read_checkpoint_metadata``,
``checkpoint_lora_spec``), where a run's named checkpoint lives and its URI
(``checkpoint_directory``, ``checkpoint_uri``), and the LoRA fields' one definition:
``LoraSpec`` (with its
``to_wire``/``from_wire`` under PyTRIO's names, which checkpoint metadata uses too) and
``lora_wire_fields`` (a request's LoRA fields, unvalidated). A logical batch's totals
(``gradient_accumulation``) and the gradient scales a trainer applies to them are
``grpo.core.normalization``'s ``BatchTotals`` and ``NORMALIZATIONS``. Everything else in
this package is internal (see ``docs/DESIGN.md``).
"""

from grpo.backends.local.checkpoint import checkpoint_directory
from grpo.backends.local.checkpoint import read_metadata as read_checkpoint_metadata
from grpo.backends.local.checkpoint import resolve as resolve_checkpoint
from grpo.backends.local.checkpoint import spec_from as checkpoint_lora_spec
from grpo.backends.local.checkpoint import to_uri as checkpoint_uri
from grpo.backends.local.model import LoraSpec, lora_wire_fields
from grpo.backends.local.sampling_client import LocalSamplingClient
from grpo.backends.local.service import LocalServiceClient, default_root
from grpo.backends.local.tiny import build_tokenizer as builtin_tokenizer
from grpo.backends.local.training import LocalTrainingClient

__all__ = [
    "LocalSamplingClient",
    "LocalServiceClient",
    "LocalTrainingClient",
    "LoraSpec",
    "builtin_tokenizer",
    "checkpoint_directory",
    "checkpoint_lora_spec",
    "checkpoint_uri",
    "default_root",
    "lora_wire_fields",
    "read_checkpoint_metadata",
    "resolve_checkpoint",
]
