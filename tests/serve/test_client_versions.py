"""Every supported pytrio client version, unchanged, drives `grpo serve` (docs/serve.md table).

Each version's wheel is fetched once into a cache (``GRPO_PYTRIO_WHEELS``, default
``~/.cache/grpo/pytrio-wheels``) with ``pip download --no-deps``, installed alone with
``pip install --no-deps --target`` and put first on a subprocess's ``sys.path``; the
subprocess (``client_driver.py``, ``article_sync_flow.py``) logs in with the client's own
``ensure_login`` and runs the flow against a server in this process, offline: the older
clients find the tokenizer through ``MODELSCOPE_CACHE`` / ``HF_HUB_CACHE`` set to the
server's ``hub-cache`` (`grpo.serve.compat`), as ``grpo serve`` prints. A version whose
wheel cannot be fetched (no registry) is skipped, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.serve.compat import HUB_CACHE_DIRECTORY, LEGACY_CLIENTS

HERE = Path(__file__).parent
KEY = "client-versions-key"
VERSIONS = (*LEGACY_CLIENTS, "0.2.8", "0.2.9")
RUN_TIMEOUT_S = 300
pytestmark = pytest.mark.slow


def _wheel(version: str) -> Path:
    cache = Path(os.environ.get("GRPO_PYTRIO_WHEELS", Path.home() / ".cache/grpo/pytrio-wheels"))
    found = sorted(cache.glob(f"pytrio-{version}-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache)]
        + [f"pytrio=={version}"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    found = sorted(cache.glob(f"pytrio-{version}-*.whl"))
    if done.returncode != 0 or not found:
        pytest.skip(
            f"pytrio {version}'s wheel is not in {cache} and the package registry is "
            f"unreachable (pip download: {done.stderr.strip()[-200:]})"
        )
    return found[0]


@pytest.fixture(scope="module")
def clients(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """version -> a directory holding that pytrio client alone (installed on first use)."""
    return {"root": tmp_path_factory.mktemp("pytrio-clients")}


def _client(clients: dict[str, Path], version: str) -> Path:
    target = clients["root"] / version
    if not (target / "pytrio").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target)]
            + [str(_wheel(version))],
            check=True,
            capture_output=True,
            timeout=180,
        )
    return target


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """One `grpo serve` (API key required) for the module's clients."""
    from grpo.serve.server import serve_in_thread

    root = tmp_path_factory.mktemp("served")
    with serve_in_thread(root=root, api_key=KEY) as handle:
        yield handle


def _run(
    script: str,
    client: Path,
    server,
    tmp_path: Path,
    *extra: str,
    path: list[Path] = (),
    model: str = TINY_MODEL_NAME,
) -> list[str]:
    """Run `script` with `client` first on sys.path, offline; its stdout lines (must end DONE)."""
    hub = server.state.registry.root / HUB_CACHE_DIRECTORY
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {
        **os.environ,
        "HOME": str(home),
        "PYTHONPATH": os.pathsep.join(str(p) for p in [*path, client]),
        "MODELSCOPE_CACHE": str(hub / "modelscope"),
        "HF_HUB_CACHE": str(hub / "huggingface"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    env.pop("PYTRIO_BASE_URL", None)
    env.pop("PYTRIO_API_KEY", None)
    done = subprocess.run(
        [sys.executable, str(HERE / script), server.url, KEY, model, *extra],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done.stdout.splitlines()


def _steps(lines: list[str]) -> dict[str, object]:
    return {
        line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
        for line in lines
        if line.startswith("STEP ")
    }


@pytest.mark.parametrize("version", VERSIONS)
def test_client_version_drives_the_whole_flow(clients, server, tmp_path, version):
    client = _client(clients, version)
    lines = _run("client_driver.py", client, server, tmp_path)
    assert lines[-1] == "DONE"
    steps = _steps(lines)
    assert steps["client"]["version"] == version
    assert steps["client"]["file"].startswith(str(client))  # that client, not the venv's
    assert steps["sample"] == [6, 6] or all(0 < n <= 6 for n in steps["sample"])
    assert steps["forward_backward"]["token_count"] > 0
    assert steps["sample_saved"] == 1
    assert steps["archive"]["bytes"] > 0
    loaded = steps["load_state"]
    assert loaded["loaded"] == pytest.approx(loaded["trained"], rel=1e-5, abs=1e-5)
    resumed = steps["from_state"]  # pytrio 0.2.3 was refused: "Model <tokenizer dir> is not
    for kind in ("weights", "optimizer"):  # supported by the server"
        assert resumed[kind] == pytest.approx(resumed["trained"], rel=1e-5, abs=1e-5)
    assert ("close" in steps) == (version in ("0.2.0", "0.2.1"))


def test_old_client_finds_the_tokenizer_with_transformers_alone(clients, server, tmp_path):
    """Without modelscope, pytrio falls back to transformers: HF_HUB_CACHE's copy serves."""
    blocker = tmp_path / "no-modelscope"
    (blocker / "modelscope").mkdir(parents=True)
    (blocker / "modelscope" / "__init__.py").write_text("raise ImportError('blocked')\n")
    lines = _run(
        "client_driver.py",
        _client(clients, "0.2.1"),
        server,
        tmp_path,
        "--tokenizer-only",
        path=[blocker],
    )
    assert lines[-1] == "DONE" and _steps(lines)["tokenizer"]["prompt_tokens"] > 0


def test_article_sync_flow_runs_to_its_last_line_on_pytrio_0_2_1(clients, server, tmp_path):
    lines = _run("article_sync_flow.py", _client(clients, "0.2.1"), server, tmp_path)
    assert lines[-1] == "# all done"
    saved = [line for line in lines if line.startswith("Saved weights path: local://")]
    assert saved and int(saved[0].rsplit(" ", 1)[1]) >= 1  # at least one step trained
    assert sum(line.startswith("Step ") for line in lines) == 2


def test_old_client_finds_an_aliased_dotted_name_offline(clients, tmp_path):
    """The article's default model name, served by alias: the ModelScope copy sits under
    ``Qwen/Qwen3___5-4B`` (dots as ``___``), where modelscope looks for it."""
    from grpo.serve.server import serve_in_thread

    alias = "Qwen/Qwen3.5-4B"
    with serve_in_thread(
        root=tmp_path / "served", api_key=KEY, aliases={alias: TINY_MODEL_NAME}
    ) as handle:
        lines = _run(
            "client_driver.py",
            _client(clients, "0.2.3"),
            handle,
            tmp_path,
            "--tokenizer-only",
            model=alias,
        )
    assert lines[-1] == "DONE"
    assert (
        tmp_path / "served" / HUB_CACHE_DIRECTORY / "modelscope/models/Qwen/Qwen3___5-4B"
    ).is_dir()
