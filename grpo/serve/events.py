"""Trainer events of `grpo serve`: PyTRIO's Actor API events run on a registered training run.

``trainer.init_run`` creates the run's `LocalTrainingClient` (and loads the checkpoint the
run was created from), ``trainer.end_run`` (``TrainingClient.close`` of pytrio 0.2.0/0.2.1)
ends it; older clients' forward payloads are upgraded first (`grpo.serve.compat`). Other
events call its methods in arrival order, which is PyTRIO's
submission order. An event is answered with its result when it finishes within a few
milliseconds (an optimizer step, a save), else ``running``, and then resolved by long
polls (``Prefer: wait=N``, at most 20 s, cut short when the server stops). A refused
event (bad loss config, unknown checkpoint ...) is a ``failed`` event with the local
backend's ``validation.*`` code: a 4xx on an event submit would break the SDK's run.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import msgpack
from pytrio.errors.base import PyTrioError
from pytrio.protocol.actor.events.event import EVENT_PROTOCOL_VERSION, EventEnvelope, EventType
from pytrio.protocol.actor.events.trainer.forward import TrainerForwardBackwardPayload
from pytrio.protocol.actor.events.trainer.init_run import TrainerInitRunPayload
from pytrio.protocol.actor.events.trainer.optimize_step import TrainerOptimizeStepPayload
from pytrio.protocol.actor.events.trainer.save import TrainerSavePayload
from pytrio.types import AdamParams

from grpo.backends.local import LocalTrainingClient
from grpo.core.normalization import BatchTotals
from grpo.serve.compat import upgrade_forward_payload
from grpo.serve.limits import check_event_size
from grpo.serve.registry import MEMORY_SCHEME, RunRegistry
from grpo.serve.wire import (
    CheckpointRecord,
    Event,
    ServeError,
    TrainingRun,
    chain,
    datum_from_wire,
    error_code,
    forward_result,
    not_found,
    now_iso,
)

MAX_LONG_POLL_S = 20.0
SUBMIT_WAIT_S = 0.005
_EVENTS_KEPT = 4096
EVENT_OPERATIONS = {
    EventType.TRAINER_INIT_RUN: "init_run",
    EventType.TRAINER_FORWARD: "forward",
    EventType.TRAINER_FORWARD_BACKWARD: "forward_backward",
    EventType.TRAINER_OPTIMIZE_STEP: "optimize_step",
    EventType.TRAINER_SAVE_STATE: "save_state",
    EventType.TRAINER_SAVE_WEIGHTS: "save_weights",
    EventType.TRAINER_END_RUN: "end_run",
}
"""The fault-injection name of each trainer event."""


def event_operation(body: bytes) -> str:
    """The fault-injection name of a submitted event (`forward_backward`, ...), or `submit`."""
    try:
        kind = msgpack.unpackb(body, raw=False).get("type")
        return EVENT_OPERATIONS[EventType(kind)]
    except Exception:  # noqa: BLE001 - a malformed body is refused later, with a 400
        return "submit"


def event_response(event: Event) -> dict[str, Any]:
    """The `EventResponse` of an event: running, succeeded with its result, or failed."""
    base = {"version": EVENT_PROTOCOL_VERSION, "event_id": event.event_id, "type": event.type.value}
    if not event.future.done():
        return {**base, "status": "running"}
    error = event.future.exception()
    usage = {"input_tokens": event.input_tokens, "output_tokens": 0, "train_tokens": 0}
    if error is not None:
        message = error.message if isinstance(error, (PyTrioError, ServeError)) else str(error)
        code = error.code if isinstance(error, ServeError) else error_code(error)
        return {
            **base,
            "status": "failed",
            "error": {"code": code, "message": message},
            "usage": usage,
        }
    result = event.future.result()
    if event.type == EventType.TRAINER_FORWARD_BACKWARD:
        usage["train_tokens"] = result["metrics"]["token_count"]
    return {**base, "status": "succeeded", "result": result, "usage": usage}


class TrainerEvents:
    """The submitted trainer events of a registry's training runs (all methods thread-safe)."""

    def __init__(self, registry: RunRegistry, stopping: threading.Event) -> None:
        self.registry = registry
        self.stopping = stopping  # set when the server stops: long polls answer at once
        self._lock = threading.Lock()
        self._events: collections.OrderedDict[str, Event] = collections.OrderedDict()
        self.log: list[tuple[str, str]] = []  # (training run, event type) in arrival order

    def submit(self, envelope: EventEnvelope) -> dict[str, Any]:
        """The `EventResponse` of a newly submitted event, finished if it takes milliseconds."""
        event = self._submit_event(envelope)
        # A quick event (optim_step, a save) answers with its result: one round trip, not two.
        concurrent.futures.wait([event.future], timeout=SUBMIT_WAIT_S)
        return event_response(event)

    def poll(self, event_id: str, wait_s: float) -> dict[str, Any]:
        """The `EventResponse` of an event once done, or after `wait_s` (<= 20 s), or at stop."""
        event = self._event(event_id)
        deadline = time.monotonic() + min(wait_s, MAX_LONG_POLL_S)
        while not event.future.done() and not self.stopping.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            concurrent.futures.wait([event.future], timeout=min(remaining, 0.5))
        return event_response(event)

    def _submit_event(self, envelope: EventEnvelope) -> Event:
        """Start one trainer event (in arrival order); a duplicate event id is a 409."""
        run = self.registry.training_run(envelope.metadata.run_id)
        with self._lock:
            if envelope.event_id in self._events:
                raise ServeError(
                    409, "event_exists", f"event {envelope.event_id} was already submitted"
                )
        event = Event(event_id=envelope.event_id, type=envelope.type, future=Future())
        try:
            self._start(run, envelope, event)
        except Exception as error:  # noqa: BLE001 - a refused event is a failed event
            if not event.future.done():
                event.future.set_exception(error)
        with self._lock:
            self._events[event.event_id] = event
            while len(self._events) > _EVENTS_KEPT:
                self._events.popitem(last=False)
            self.log.append((run.cuid, envelope.type.value))
            run.updated_at = now_iso()
        return event

    def _event(self, event_id: str) -> Event:
        with self._lock:
            if event_id not in self._events:
                raise not_found("event", event_id)
            return self._events[event_id]

    def _start(self, run: TrainingRun, envelope: EventEnvelope, event: Event) -> None:
        kind = envelope.type
        if kind == EventType.TRAINER_INIT_RUN:
            event.future.set_result(
                self._init_run(run, TrainerInitRunPayload.model_validate(envelope.payload))
            )
            return
        if run.ended:
            raise ServeError(
                409,
                "validation.run_ended",
                f"run {run.cuid} was ended (TrainingClient.close); create a new training client",
            )
        if kind == EventType.TRAINER_END_RUN:
            run.ended, run.client = True, None  # its trainer's memory is freed
            event.future.set_result({})
            return
        client = run.client
        if client is None:
            raise ServeError(
                409, "validation.not_initialized", "the run got an event before trainer.init_run"
            )
        if kind in (EventType.TRAINER_FORWARD, EventType.TRAINER_FORWARD_BACKWARD):
            payload = TrainerForwardBackwardPayload.model_validate(
                upgrade_forward_payload(envelope.payload)
            )
            datums = [datum_from_wire(item) for item in payload.data]
            event.input_tokens = sum(len(datum.model_input) for datum in datums)
            check_event_size(len(datums), event.input_tokens)
            config = dict(payload.loss.config) or None
            args = (datums, payload.loss.type, config, payload.auto_shift)
            if kind == EventType.TRAINER_FORWARD:
                future = client.forward(*args)
            else:  # one micro-batch: its gradient is scaled by the logical batch's totals
                spec = payload.gradient_accumulation
                future = client.forward_backward(
                    *args,
                    gradient_accumulation=BatchTotals(
                        samples=spec.total_samples,
                        active_tokens=spec.total_active_tokens,
                        advantage_tokens=spec.total_advantage_tokens,
                    ),
                )
            chain(future, event.future, forward_result)
        elif kind == EventType.TRAINER_OPTIMIZE_STEP:
            adam = TrainerOptimizeStepPayload.model_validate(envelope.payload).adam_params
            chain(
                client.optim_step(AdamParams(**adam.model_dump())),
                event.future,
                lambda response: {"metrics": dict(response.metrics)},
            )
        elif kind == EventType.TRAINER_SAVE_STATE:
            save = TrainerSavePayload.model_validate(envelope.payload)
            future = client.save_state(save.name, save.ttl_seconds, save.overwrite)
            chain(
                future, event.future, lambda response: self._saved(run, save, "TRAINING", response)
            )
        elif kind == EventType.TRAINER_SAVE_WEIGHTS:
            save = TrainerSavePayload.model_validate(envelope.payload)
            if save.visibility == "TEMPORARY":
                event.future.set_result(self._save_in_memory(run, client, save.name))
            else:
                future = client.save_weights_for_sampler(save.name, save.ttl_seconds)
                chain(
                    future,
                    event.future,
                    lambda response: self._saved(run, save, "SAMPLER", response),
                )
        else:
            raise ServeError(
                400, "validation.unsupported_event", f"{kind.value} is not served here"
            )

    def _init_run(self, run: TrainingRun, payload: TrainerInitRunPayload) -> dict[str, Any]:
        if run.client is not None:
            raise ServeError(
                409, "validation.already_initialized", f"run {run.cuid} is already initialized"
            )
        lora = payload.lora_config
        client = self.registry.local.create_lora_training_client(
            run.base_model,
            rank=lora.rank,
            seed=lora.seed,
            train_mlp=lora.train_mlp,
            train_attn=lora.train_attn,
            train_unembed=lora.train_unembed,
        )
        if payload.checkpoint_uri:
            load = client.load_state_with_optimizer if payload.load_optimizer else client.load_state
            load(payload.checkpoint_uri).result()
        run.client = client
        return {}

    def _saved(
        self, run: TrainingRun, save: TrainerSavePayload, kind: str, response: Any
    ) -> dict[str, Any]:
        checkpoint = CheckpointRecord(
            cuid=f"ckpt-{uuid.uuid4().hex[:12]}",
            run=run.cuid,
            name=save.name,
            checkpoint_type=kind,
            uri=response.path,
            size_bytes=int(response.size),
            created_at=now_iso(),
            ttl_seconds=save.ttl_seconds,
        )
        self.registry.add_checkpoint(checkpoint)
        return {
            "checkpoint": {
                "uri": response.path,
                "model_id": run.model_id,
                "size_bytes": checkpoint.size_bytes,
                "checkpoint_cuid": checkpoint.cuid,
            }
        }

    def _save_in_memory(
        self, run: TrainingRun, client: LocalTrainingClient, name: str
    ) -> dict[str, Any]:
        sampler = client.save_weights_and_get_sampling_client()
        uri = f"{MEMORY_SCHEME}{run.cuid}/{name}"
        self.registry.keep_sampler(uri, sampler)
        return {"checkpoint": {"uri": uri, "model_id": run.model_id, "size_bytes": 0}}
