"""``grpo serve``: the PyTRIO service on localhost, backed by the embedded local backend.

pytrio 0.2.9's own, unchanged client (and so any PyTRIO program) runs against it offline
(clients 0.2.0, 0.2.1, 0.2.3 and 0.2.8 too: docs/serve.md, "pytrio client versions"):
start ``grpo serve``, then run the program with ``PYTRIO_BASE_URL`` and ``PYTRIO_API_KEY``
set as it prints. The wire protocol is the part of PyTRIO's that the SDK's
``ServiceClient``, ``TrainingClient``, ``SamplingClient`` and ``RestClient`` use:

- Control API, JSON under ``<base>/api/``: API-key verify, SDK bootstrap, the model
  catalogue, service sessions, training and sampling runs (create, get, list, renew,
  restore binding), checkpoints (list, download URL, delete); telemetry is accepted and
  dropped.
- Actor API under ``<base>/actor/``: ``POST v1/events`` (msgpack envelopes),
  ``GET v1/events/{id}`` (long-polled, ``Prefer: wait=N``), ``POST v1/client/heartbeat``
  and ``POST v1/sampling-runs/{id}/sample`` (JSON).
- OpenAI-compatible API under ``<base>/v1/``: ``POST chat/completions``, ``POST completions``
  and ``GET models`` (JSON, OpenAI's wire format), for evaluation harnesses and agents.

Training and sampling run on one `LocalServiceClient`, so a run through the server
computes what the same calls compute in process. The modules, one job each:

- ``command``: the ``grpo serve`` CLI (options, serve until Ctrl-C);
- ``server``: start a server, serve it on a thread, stop it (``serve_in_thread``);
- ``client``: pytrio pointed at a server for a block (``configured_pytrio``);
- ``handler``: the HTTP shell (dispatch, authentication, bounds, fault injection, statuses);
- ``access``: the API key check and the per-checkpoint download tokens; ``limits``: the
  bounds on bodies, fields and connections;
- ``routes``: the route table of `Route` records; ``endpoints``: one function per operation;
- ``messages``: a request and its reply;
- ``registry``: sessions, training and sampling runs, checkpoints; ``models``: the served
  models and their ids;
- ``events``: trainer events and their long polls; ``sampling``: one sample request;
- ``openai_endpoints``: the OpenAI-compatible API (``/v1/chat/completions``,
  ``/v1/completions``, ``/v1/models``) on any served model or sampler weights, with the
  same API key and bounds; ``openai_wire``: its requests checked and its response bodies;
- ``wire``: the error type, run records and wire conversions; ``faults``: fault injection;
- ``compat``: pytrio 0.2.0-0.2.3's request bodies upgraded to 0.2.9's, and the served
  tokenizers in the hub-cache layouts those clients' ``get_tokenizer`` reads offline.
"""
