"""Tinker's wire format in `grpo serve`: protobuf bodies, ``tinker://`` paths, loss checks.

The official ``tinker`` SDK sends ``forward_backward`` as a protobuf ``ForwardBackwardRequest``
and asks for ``ForwardBackwardOutput`` and ``SampleResponse`` results as protobuf
(``Accept: application/x-protobuf``); every other body is JSON. The messages are the SDK's own
(``tinker.proto.tinker_public_pb2``), so the Tinker route needs the ``tinker`` package on the
server (``pip install 'grpo[tinker]'``); without it a Tinker request is a 400 saying so.

Token ids and tensors are decoded and encoded with numpy over whole buffers: no per-token
Python loop. A sparse CSR tensor is densified the same way.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from pytrio.types import Datum, EncodedTextChunk, ModelInput, TensorData

from grpo.backends.local import checkpoint_directory, checkpoint_uri
from grpo.serve.wire import ServeError

PROTO_CONTENT_TYPE = "application/x-protobuf"
TINKER_SCHEME = "tinker://"
TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
"""Tinker's built-in losses that this route serves, with grpo's kernels' config keys."""
_GRPO_ONLY_KEYS = ("reduction", "norm_length")
_PATH = re.compile(r"tinker://([A-Za-z0-9_.:-]+)/(weights|sampler_weights)/([A-Za-z0-9_.-]+)")
_KIND = {"weights": "state", "sampler_weights": "sampler"}


def tinker_proto() -> ModuleType:
    """The SDK's protobuf messages; a 400 naming the fix when the server lacks ``tinker``."""
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise ServeError(
            400,
            "validation.tinker_unavailable",
            "this grpo serve has no `tinker` package, which Tinker's protobuf bodies need: "
            "pip install 'grpo[tinker]' where the server runs, then restart it",
        ) from None
    return tinker_public_pb2


def check_loss(loss_fn: str, config: dict[str, Any] | None) -> None:
    """400 unless `loss_fn` is one of Tinker's built-in losses served here with kernel keys;
    ``stable_reinforce`` is named and refused, never replaced."""
    if loss_fn == "stable_reinforce":
        raise ServeError(
            400,
            "validation.unsupported_loss",
            "loss_fn='stable_reinforce' is not served: its objective is not public; pass "
            "loss_fn=importance_sampling (in tinker-cookbook: loss_fn=importance_sampling)",
        )
    if loss_fn not in TINKER_LOSSES:
        raise ServeError(
            400,
            "validation.unsupported_loss",
            f"loss_fn {loss_fn!r:.80} is not served on the Tinker route; one of "
            f"{', '.join(TINKER_LOSSES)} (custom losses run client-side through "
            "forward_backward_custom)",
        )
    for key in config or {}:
        if key in _GRPO_ONLY_KEYS:
            raise ServeError(
                400,
                "validation.invalid_loss_config",
                f"loss_fn_config key {key!r} is not Tinker's: Tinker's built-in losses are "
                "sums over tokens; drop it (scale the advantages or weights instead)",
            )


def _array(tensor: Any, proto: ModuleType) -> tuple[np.ndarray, str]:
    """A proto Tensor as a dense numpy array and its TensorData dtype name."""
    if tensor.dtype == proto.DTYPE_INT64:
        dtype, name = np.dtype(np.int64), "int64"
    elif tensor.dtype == proto.DTYPE_FLOAT32:
        dtype, name = np.dtype(np.float32), "float32"
    else:
        raise ServeError(
            400, "validation.invalid_tensor", "loss_fn_inputs tensors must be float32 or int64"
        )
    shape = [int(size) for size in tensor.shape]
    if any(size < 0 for size in shape):
        raise ServeError(
            400,
            "validation.invalid_tensor",
            f"a loss_fn_inputs tensor's shape {str(shape)[:80]} has a negative size",
        )
    try:
        if tensor.HasField("sparse_csr"):
            csr = tensor.sparse_csr
            values = np.frombuffer(csr.values, dtype=dtype)
            crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
            cols = np.frombuffer(csr.col_indices, dtype=np.int64)
            rows = max(len(crow) - 1, 1)
            width = int(np.prod(shape)) // rows if shape else int(cols.max(initial=-1)) + 1
            dense = np.zeros((rows, width), dtype=dtype)
            row_of = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            dense[row_of, cols] = values
            array = dense.reshape(shape) if shape else dense.reshape(-1)
        else:
            array = np.frombuffer(tensor.dense, dtype=dtype)
            array = array.reshape(shape) if shape else array
    except (ValueError, IndexError) as error:
        raise ServeError(
            400, "validation.invalid_tensor", f"a loss_fn_inputs tensor is malformed: {error}"
        ) from None
    return array, name


def _datum(message: Any, proto: ModuleType, index: int) -> Datum:
    """The local backend's Datum from one proto Datum (text chunks only), built without
    pydantic's per-element re-validation: the arrays come typed from the wire and their
    shapes are checked here, so the result equals a validated construction."""
    parts = []
    for chunk in message.model_input:
        if chunk.WhichOneof("chunk") != "encoded_text":
            raise ServeError(
                400,
                "validation.image_unsupported",
                f"data[{index}].model_input: the local backend trains on text chunks only",
            )
        parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    inputs: dict[str, TensorData] = {}
    for key, tensor in message.loss_fn_inputs.items():
        array, name = _array(tensor, proto)
        inputs[key] = TensorData.model_construct(
            data=array.reshape(-1).tolist(), dtype=name, shape=list(array.shape)
        )
    chunk = EncodedTextChunk.model_construct(tokens=tokens.tolist(), type="encoded_text")
    return Datum.model_construct(
        model_input=ModelInput.model_construct(chunks=[chunk]), loss_fn_inputs=inputs
    )


def decode_forward_backward(body: bytes) -> dict[str, Any]:
    """A protobuf ``ForwardBackwardRequest`` as model_id, seq_id, loss_fn, loss_fn_config,
    forward_only and the local backend's datums; 400 naming what is malformed."""
    proto = tinker_proto()
    message = proto.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as error:  # noqa: BLE001 - protobuf's DecodeError and kin
        raise ServeError(
            400,
            "validation.invalid_request",
            f"body is not a protobuf ForwardBackwardRequest ({type(error).__name__}); send it "
            f"with Content-Type: {PROTO_CONTENT_TYPE}",
        ) from None
    config: dict[str, Any] = {key: float(value) for key, value in message.loss_fn_config.items()}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return {
        "model_id": message.model_id,
        "seq_id": int(message.seq_id),
        "loss_fn": message.loss_fn,
        "loss_fn_config": config or None,
        "forward_only": bool(message.forward_only),
        "data": [_datum(item, proto, index) for index, item in enumerate(message.data)],
    }


def encode_forward_output(output: Any) -> bytes:
    """A local ``ForwardBackwardOutput`` as a protobuf ``ForwardBackwardOutput``: per-datum
    ``logprobs`` in one batched float32 tensor, metrics as Tinker's ``loss:sum``."""
    proto = tinker_proto()
    arrays = [
        np.asarray(item["logprobs"].data, dtype=np.float32).reshape(-1)
        for item in output.loss_fn_outputs
    ]
    lengths = np.array([0, *(array.nbytes for array in arrays)], dtype=np.int64)
    record = proto.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
    batched = record.fields["logprobs"]
    batched.dtype = proto.DTYPE_FLOAT32
    batched.data = np.concatenate(arrays).tobytes() if arrays else b""
    batched.offsets = np.cumsum(lengths).tobytes()
    message = proto.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    message.loss_fn_outputs.append(record)
    message.metrics["loss:sum"] = float(output.metrics["loss_sum"])
    return message.SerializeToString()


def encode_sample(response: Any, prompt_logprobs: list[float | None] | None) -> bytes:
    """A local sample (its sequences, and the prompt's log-probs when asked) as a protobuf
    ``SampleResponse``; a missing prompt log-prob (the first token's) is NaN on the wire."""
    proto = tinker_proto()
    message = proto.SampleResponse()
    stop = {"stop": proto.STOP_REASON_STOP, "length": proto.STOP_REASON_LENGTH}
    for sequence in response.sequences if response is not None else ():
        item = message.sequences.add()
        item.stop_reason = stop[sequence.stop_reason]
        item.tokens = np.asarray(sequence.tokens, dtype=np.int32).tobytes()
        if sequence.logprobs is not None:
            item.logprobs = np.asarray(sequence.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        values = np.array(prompt_logprobs, dtype=object)
        values[values == None] = np.nan  # noqa: E711 - elementwise on an object array
        message.prompt_logprobs = values.astype(np.float32).tobytes()
    return message.SerializeToString()


def tinker_path(run: str, kind: str, name: str) -> str:
    """The ``tinker://RUN/weights/NAME`` (kind ``state``) or ``.../sampler_weights/NAME`` path."""
    return f"{TINKER_SCHEME}{run}/{'weights' if kind == 'state' else 'sampler_weights'}/{name}"


def local_uri(path: str, root: Path, field: str = "path") -> str:
    """The local store's ``local://`` URI of a ``tinker://RUN/weights|sampler_weights/NAME``
    path (one to one); 400 naming `field` for any other form."""
    found = _PATH.fullmatch(path)
    if found is None:
        raise ServeError(
            400,
            "validation.invalid_path",
            f"{field} {path!r:.200} is not a tinker://RUN/weights/NAME or "
            "tinker://RUN/sampler_weights/NAME path",
        )
    run, kind, name = found.groups()
    if {run, name} & {".", ".."}:
        raise ServeError(
            400,
            "validation.invalid_path",
            f"{field} {path!r:.200}: a run or checkpoint name may not be '.' or '..'",
        )
    return checkpoint_uri(checkpoint_directory(root, run, _KIND[kind], name))  # type: ignore[arg-type]
