"""The `grpo serve` command: its options, and serving until Ctrl-C (or SIGTERM).

It prints the URL and the environment variables (``PYTRIO_BASE_URL``,
``PYTRIO_API_KEY``) a PyTRIO program needs to run against the server, and, for pytrio
0.2.0-0.2.3, the ``trio login`` line and the tokenizer caches (`grpo.serve.compat`).
"""

from __future__ import annotations

import argparse
import inspect
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.backends.local import default_root
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION, NORMALIZATIONS
from grpo.serve.compat import HUB_CACHE_DIRECTORY, hub_cache_exports
from grpo.serve.faults import FaultPlan, parse_fault
from grpo.serve.limits import MAX_CONNECTIONS, MAX_REQUEST_BYTES, REQUEST_TIMEOUT_S
from grpo.serve.routes import OPERATIONS
from grpo.serve.server import LOOPBACK_HOSTS, ServeHandle, start_server
from grpo.serve.tinker_routes import tinker_exports
from grpo.serve.tinker_service import SESSION_EXPIRY_S

DEFAULT_PORT = 8765


def _port(text: str) -> int:
    """A TCP port, 0-65535 (argparse names the flag and the value otherwise)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: give 0-65535 (0 = any free one)")
    return port


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The `grpo serve` options."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: loopback only)"
    )
    parser.add_argument(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        help=f"port (0 picks a free one; default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--root", default=None, help=f"checkpoint directory (default: {default_root()})"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require this API key (default: accept any key, on loopback only); also read "
        "from $GRPO_SERVE_API_KEY so that it stays out of the process list; an empty key is "
        "an error",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=MAX_REQUEST_BYTES,
        help=f"refuse larger request bodies with 413, unread (default {MAX_REQUEST_BYTES})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help="connections served at once; more get 503 with Retry-After "
        f"(default {MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=REQUEST_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a connection may stay silent before it is closed "
        f"(default {REQUEST_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seeds LoRA init / sampling when a call gives none"
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="OP:ACTION[:WHEN]",
        help="inject a transient fault, e.g. sample:503:first=2 or forward_backward:"
        "delay=0.5:every=3 (WHEN: first=N, every=K, calls=1,4, p=0.25); operations: "
        + ", ".join(OPERATIONS)
        + ", or * for all",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME=MODEL",
        help="serve MODEL (e.g. grpo's built-in one) under NAME too, so that a program asking "
        "for NAME (e.g. Qwen/Qwen3.5-4B) runs unchanged; repeatable",
    )
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of p=... faults")
    parser.add_argument(
        "--sampler-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="sample in this precision while training stays float32 (bfloat16 reproduces a "
        "real service's sampler-trainer mismatch; default float32)",
    )
    parser.add_argument(
        "--service-normalization",
        choices=NORMALIZATIONS,
        default=DEFAULT_SERVICE_NORMALIZATION,
        help="what the trainer divides a loss's gradient by: the logical batch's samples "
        f"(default {DEFAULT_SERVICE_NORMALIZATION}, the real service's per-request mean), "
        "active tokens or advantage tokens, as pytrio 0.2.9 sends them, or nothing (sum) "
        "(docs/FORMULAS.md, 'Service normalization')",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=None,
        help="advertise this trainer limit: pytrio 0.2.9 splits a larger forward_backward "
        "into micro-batches (default: none)",
    )
    parser.add_argument(
        "--max-tokens-per-request",
        type=int,
        default=None,
        help="advertise this trainer limit on a micro-batch's input tokens (default: none)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads of the backend's worker (0 = auto: 1 for small models "
        "such as the built-in one, every core for large ones; OMP_NUM_THREADS or "
        "torch.set_num_threads, when set, are left alone; grpo/backends/local/threads.py)",
    )
    parser.add_argument(
        "--tinker-session-expiry",
        dest="tinker_session_expiry_s",
        type=float,
        default=SESSION_EXPIRY_S,
        metavar="SECONDS",
        help="free a Tinker session (its training and sampling clients) after this many "
        "seconds without a heartbeat or request; the SDK heartbeats every 10 s "
        f"(default {SESSION_EXPIRY_S:g})",
    )
    parser.add_argument("--log-requests", action="store_true", help="log every request to stderr")


def _parse_alias(spec: str) -> tuple[str, str]:
    alias, separator, name = spec.partition("=")
    if not (alias and separator and name):
        raise ValueError(
            f"--model-alias {spec!r}: expected NAME=MODEL, e.g. Qwen/Qwen3.5-4B=grpo/..."
        )
    return alias, name


BUILT_OPTIONS = ("api_key", "faults", "aliases")
"""The parameters of `start_server` that `run_serve` builds: the key (--api-key, else
$GRPO_SERVE_API_KEY), the fault plan (--fault, --fault-seed) and the aliases (--model-alias);
each other parameter is the flag whose destination is its name."""


def served_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The flags passed to `start_server` as they are, by their parameter's name."""
    return {
        name: getattr(args, name)
        for name in inspect.signature(start_server).parameters
        if name not in BUILT_OPTIONS
    }


def run_serve(args: argparse.Namespace, *, echo: Callable[[str], None] = print) -> int:
    """Serve until Ctrl-C (or SIGTERM); prints the URL and the environment variables to set."""
    import os

    api_key = args.api_key if args.api_key is not None else os.environ.get("GRPO_SERVE_API_KEY")
    try:
        faults = FaultPlan([parse_fault(spec) for spec in args.fault], seed=args.fault_seed)
        aliases = dict(_parse_alias(spec) for spec in args.model_alias)
        server, local = start_server(
            **served_flags(args), api_key=api_key, faults=faults, aliases=aliases
        )
    except ValueError as error:
        echo(f"grpo serve: {error}")
        return 2
    except OSError as error:
        echo(
            f"grpo serve: cannot listen on {args.host}:{args.port}: {error}; "
            "pick another --port (0 = any)"
        )
        return 1
    handle = ServeHandle(server, local, None)
    key_hint = (
        "<the key given to --api-key>" if api_key else "local   # any non-empty key is accepted"
    )
    echo(
        f"grpo serve: PyTRIO service on {handle.url} "
        f"(local backend; checkpoints in {handle.state.registry.root})"
    )
    if args.host not in LOOPBACK_HOSTS:
        echo(
            f"grpo serve: warning: bound to {args.host}, reachable from other machines: every "
            "route (training, sampling, checkpoint downloads) needs the key, and the traffic "
            "is plain HTTP; put a TLS proxy in front (docs/RELIABILITY.md)"
        )
    for alias, name in aliases.items():
        echo(f"grpo serve: serving {name} as {alias!r} too")
    for spec in args.fault:
        echo(f"grpo serve: injecting fault {spec}")
    echo("In the shell that runs your PyTRIO program:")
    echo(f"  export PYTRIO_BASE_URL={handle.url}")
    echo(f"  export PYTRIO_API_KEY={key_hint}")
    hub = Path(handle.state.registry.root) / HUB_CACHE_DIRECTORY
    echo(
        "pytrio 0.2.0-0.2.3 read neither: log in with `trio login --api-key KEY --base-url "
        f"{handle.url}`, and let get_tokenizer find the served tokenizers offline with:"
    )
    for line in hub_cache_exports(hub):
        echo(f"  {line}")
    echo(
        f"OpenAI-compatible API (chat/completions, completions, models): {handle.url}/v1 "
        "(OPENAI_BASE_URL), the same key (OPENAI_API_KEY)"
    )
    echo("In the shell that runs your Tinker program (the tinker SDK, tinker-cookbook):")
    for line in tinker_exports(handle.url, hub, keyed=api_key is not None):
        echo(f"  {line}")
    echo("Ctrl-C stops the server.")
    # Ctrl-C and SIGTERM stop it, even when started in the background (SIGINT ignored there).
    previous = {
        number: signal.signal(number, signal.default_int_handler)
        for number in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        echo("grpo serve: stopping")
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        handle.close()
    return 0
