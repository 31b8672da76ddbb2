"""`grpo runs` and `grpo checkpoints list | download | delete | cleanup`: where the weights are.

Both go through pytrio's `RestClient` API: on PyTRIO (and `grpo serve`, through
`PYTRIO_BASE_URL`) the SDK's own client; on the local backend one `LocalRestClient` per
local store (each run directory's `backend/` and the default store), which reads the
checkpoint directories on disk. A checkpoint is named by its path (`local://...`, or the
service's URI) or its id, as `grpo checkpoints list` prints them.

What they remove or write is bounded: `delete` and `cleanup` act on one store (a `cp -r`
copy of a run directory holds the same run ids: they refuse to choose between stores
unless `--root` names the ones to act on), and `delete` refuses the checkpoint a run
directory resumes from unless `--force`. `download --out` is checked by
`grpo.tools.paths.check_out` (never inside the checkpoint it reads).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import attrs

from grpo.tools import paths
from grpo.training.run import run_files
from grpo.training.run.inputs import read_paths
from grpo.training.settings.config import BACKENDS, ConfigError

PAGE = 100


@attrs.frozen
class Store:
    """One place checkpoints live: a RestClient and, for a local store, its root."""

    rest: Any
    root: Path | None = None

    @property
    def run_dir(self) -> str:
        """The grpo run directory a local store belongs to (`<run dir>/backend`), else ''."""
        if self.root is not None and self.root.name == run_files.BACKEND_DIR:
            return str(self.root.parent)
        return ""


def _local_roots(roots: Sequence[str]) -> list[Path]:
    if roots:
        return [Path(root) for root in roots]
    from grpo.backends.local import default_root

    found = sorted(Path("runs").glob(f"*/{run_files.BACKEND_DIR}"))
    return [*found, default_root()]


def stores(backend: str, roots: Sequence[str] = ()) -> list[Store]:
    """The stores to look in: every local root (see `_local_roots`), or the PyTRIO service's."""
    if backend == "local":
        from grpo.backends.local.rest import LocalRestClient

        return [Store(LocalRestClient(root), root) for root in _local_roots(roots) if root.is_dir()]
    from grpo.backends.pytrio import make_service_client

    return [Store(make_service_client("pytrio").create_rest_client())]


def _paged(call: Any, items: str) -> list[Any]:
    found: list[Any] = []
    while True:
        page = call(limit=PAGE, offset=len(found)).result()
        found += getattr(page, items)
        if page.cursor is None or len(found) >= page.cursor.total_count or not getattr(page, items):
            return found


def list_runs(found: Iterable[Store]) -> list[tuple[Store, Any]]:
    """Every training run of every store, with its store."""
    return [
        (store, run)
        for store in found
        for run in _paged(store.rest.list_training_runs, "training_runs")
    ]


@attrs.frozen
class Listed:
    """A checkpoint as listed: its store and training run."""

    store: Store
    run_id: str
    checkpoint: Any


def list_checkpoints(found: Iterable[Store], run_id: str | None = None) -> list[Listed]:
    """The checkpoints of one training run, or of every run, in every store."""
    listed = []
    for store in found:
        run_ids = (
            [run_id]
            if run_id is not None
            else [run.training_run_id for _store, run in list_runs([store])]
        )
        for one in run_ids:
            response = store.rest.list_checkpoints(one).result()
            listed += [Listed(store, one, checkpoint) for checkpoint in response.checkpoints]
    return listed


def find_checkpoint(found: Sequence[Store], name: str) -> Listed:
    """The one checkpoint whose path or id is `name`; ConfigError naming the fix otherwise."""
    matches = [
        listed
        for listed in list_checkpoints(found)
        if name in (listed.checkpoint.path, listed.checkpoint.checkpoint_id)
    ]
    if not matches:
        raise ConfigError(
            f"checkpoint {name!r}: no match(es) in {len(found)} store(s); pass a path or id "
            "from `grpo checkpoints list`"
        )
    if len(matches) > 1:
        raise ConfigError(
            f"checkpoint {name!r}: {len(matches)} matches, in {_store_names(matches)} (copies "
            "of one run share its ids); pass its full path from `grpo checkpoints list`, or "
            "--root DIR for the one store to act on"
        )
    return matches[0]


def _store_names(listed: Iterable[Listed]) -> str:
    names = dict.fromkeys(str(item.store.root or "the service") for item in listed)
    return ", ".join(names)


def one_store(listed: Sequence[Listed], run_id: str) -> list[Listed]:
    """`listed` when it comes from one store; ConfigError naming the stores otherwise."""
    roots = {item.store.root for item in listed}
    if len(roots) > 1:
        raise ConfigError(
            f"training run {run_id!r} is in {len(roots)} stores: {_store_names(listed)} (a "
            "copy of a run directory keeps its run id); pass --root DIR for the one to act "
            "on (repeat --root to act on several)"
        )
    return list(listed)


def resumed_from(item: Listed) -> Path | None:
    """The run directory whose `checkpoint.json` resumes from `item`, if its store has one."""
    if not item.store.run_dir:
        return None
    run_dir = Path(item.store.run_dir)
    checkpoint = run_files.read_checkpoint(run_dir)
    if checkpoint is None:
        return None
    same = (
        paths.local_path(checkpoint.state_path).resolve()
        == paths.local_path(item.checkpoint.path).resolve()
    )
    return run_dir if same else None


def human_size(size: int | None) -> str:
    """Bytes as B/KiB/MiB/GiB."""
    if size is None:
        return "?"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _when(moment: datetime | None) -> str:
    return "never" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]


def runs_lines(runs: Sequence[tuple[Store, Any]]) -> list[str]:
    """`grpo runs`: one line per training run."""
    rows = [
        (
            run.training_run_id,
            run.base_model,
            str(run.lora_rank or "-"),
            _when(run.last_request_time),
            run.last_checkpoint.path if run.last_checkpoint else "-",
            store.run_dir or "-",
        )
        for store, run in runs
    ]
    header = ("training run", "base model", "rank", "last saved", "last state", "run dir")
    return _table(header, rows) if rows else ["no training runs"]


def checkpoint_lines(listed: Sequence[Listed]) -> list[str]:
    """`grpo checkpoints list`: one line per checkpoint, with size and expiry."""
    rows = [
        (
            item.checkpoint.checkpoint_type,
            human_size(item.checkpoint.size_bytes),
            _when(item.checkpoint.time),
            _when(item.checkpoint.expires_at),
            item.checkpoint.path,
        )
        for item in listed
    ]
    total = sum(item.checkpoint.size_bytes or 0 for item in listed)
    if not rows:
        return ["no checkpoints"]
    lines = _table(("type", "size", "created", "expires", "path"), rows)
    return [*lines, f"{len(rows)} checkpoint(s), {human_size(total)}"]


def delete(item: Listed) -> None:
    """Delete one checkpoint through its store's RestClient."""
    item.store.rest.delete_checkpoint(item.run_id, item.checkpoint.checkpoint_id).result()


def temporary_samplers(listed: Sequence[Listed], *, all_samplers: bool) -> list[Listed]:
    """A run's sampler weights that expire (all of them with `all_samplers`)."""
    return [
        item
        for item in listed
        if item.checkpoint.checkpoint_type == "sampler"
        and (all_samplers or item.checkpoint.expires_at is not None)
    ]


# --- the commands ------------------------------------------------------------------------------


def _add_store_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default="local", help=f"one of {', '.join(BACKENDS)} (default: local)"
    )
    parser.add_argument(
        "--root",
        action="append",
        default=[],
        metavar="DIR",
        help="a local store (repeatable; default: every runs/*/backend and the default store)",
    )


def _stores(args: argparse.Namespace) -> list[Store]:
    if args.backend not in BACKENDS:
        raise ConfigError(f"--backend {args.backend!r} is not one of {', '.join(BACKENDS)}")
    return stores(args.backend, args.root)


def add_runs_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo runs`."""
    _add_store_arguments(parser)


def run_runs(args: argparse.Namespace) -> int:
    """`grpo runs`: the training runs of the store(s) and their last checkpoints."""
    for line in runs_lines(list_runs(_stores(args))):
        print(line)
    return 0


def add_checkpoints_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo checkpoints list | download | delete | cleanup`."""
    actions = parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="checkpoints with size and expiry")
    listing.add_argument("run_id", nargs="?", default=None, help="one training run's only")
    listing.set_defaults(action_handler=_list)
    download = actions.add_parser("download", help="a checkpoint as an archive file")
    download.add_argument("checkpoint", help="path or id from `grpo checkpoints list`")
    download.add_argument("--out", required=True, metavar="FILE", help="the archive to write")
    paths.add_force_argument(download, "--out file")
    download.set_defaults(action_handler=_download)
    remove = actions.add_parser("delete", help="delete checkpoints")
    remove.add_argument("checkpoints", nargs="+", help="paths or ids")
    remove.add_argument(
        "--force",
        action="store_true",
        help="delete a checkpoint even when a run directory resumes from it",
    )
    remove.set_defaults(action_handler=_delete)
    cleanup = actions.add_parser(
        "cleanup", help="delete a training run's temporary (expiring) sampler weights"
    )
    cleanup.add_argument("run_id", help="the training run (see `grpo runs`)")
    cleanup.add_argument(
        "--all-samplers", action="store_true", help="every sampler weights of the run, too"
    )
    cleanup.set_defaults(action_handler=_cleanup)
    for action in (listing, download, remove, cleanup):
        _add_store_arguments(action)


def run_checkpoints(args: argparse.Namespace) -> int:
    """`grpo checkpoints ACTION`: run the action's handler."""
    return int(args.action_handler(args))


def _list(args: argparse.Namespace) -> int:
    for line in checkpoint_lines(list_checkpoints(_stores(args), args.run_id)):
        print(line)
    return 0


def _download(args: argparse.Namespace) -> int:
    item = find_checkpoint(_stores(args), args.checkpoint)
    read = read_paths("CHECKPOINT", item.checkpoint.path) if item.store.root is not None else []
    paths.check_out(Path(args.out), force=args.force, reads=read)
    result = item.store.rest.download_checkpoint(item.checkpoint.checkpoint_id, args.out).result()
    print(f"{item.checkpoint.path} -> {result.path} ({human_size(result.file_size_bytes)})")
    return 0


def _delete(args: argparse.Namespace) -> int:
    found = _stores(args)
    chosen = [find_checkpoint(found, name) for name in args.checkpoints]
    for item in chosen:
        run_dir = resumed_from(item)
        if run_dir is not None and not args.force:
            raise ConfigError(
                f"{item.checkpoint.path} is the checkpoint {run_dir} resumes from (its "
                f"{run_files.CHECKPOINT_FILE}); nothing was deleted. Keep it, or pass --force "
                "to delete it (that run can then not resume from it)"
            )
    for item in chosen:
        delete(item)
        print(f"deleted {item.checkpoint.path} ({human_size(item.checkpoint.size_bytes)})")
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    listed = list_checkpoints(_stores(args), args.run_id)
    if not listed:
        raise ConfigError(
            f"no checkpoint of a run {args.run_id!r} was found, so nothing was deleted; "
            "check the id with `grpo checkpoints list`"
        )
    if not args.root:  # found by discovery: a backup copy must not be cleaned along
        listed = one_store(listed, args.run_id)
    chosen = temporary_samplers(listed, all_samplers=args.all_samplers)
    for item in chosen:
        delete(item)
    freed = sum(item.checkpoint.size_bytes or 0 for item in chosen)
    print(f"deleted {len(chosen)} sampler checkpoint(s) of {args.run_id}, {human_size(freed)}")
    return 0
