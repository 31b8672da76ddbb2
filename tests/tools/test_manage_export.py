"""`grpo runs`, `grpo checkpoints ...` on the local store, and `grpo export` round trips."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pytrio.types import ModelInput

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME, TINY_TOOLS_MODEL_NAME
from grpo.cli import main
from grpo.tools.export import export
from grpo.training.run.run_files import read_summary
from grpo.training.settings.config import TrainConfig
from tests import runs as tiny_runs

TINY = {**tiny_runs.TINY, "save_every": 1, "learning_rate": 5e-3}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished two-step run (two state checkpoints, final sampler weights)."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    tiny_runs.quiet_train(TrainConfig(**TINY, run_dir=str(run_dir)))
    return run_dir


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _logprobs_of_model(model: Any, tokens: list[int]) -> np.ndarray:
    """log p(token_t | tokens_<t) for t >= 1 under a Hugging Face causal LM."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])
    return picked[:, 0].numpy()


# --- management ----------------------------------------------------------------------------------


def test_runs_and_checkpoints_list_show_sizes_and_expiry(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = str(trained_run / "backend")
    runs = _cli(capsys, "runs", "--root", root)
    assert TINY_MODEL_NAME in runs and str(trained_run) in runs
    listed = _cli(capsys, "checkpoints", "list", "--root", root)
    lines = [line for line in listed.splitlines() if "local://" in line]
    summary = read_summary(trained_run)
    assert len(lines) == 3  # state step-000001, state final, sampler weights
    assert any(summary["sampler_path"] in line and line.startswith("sampler") for line in lines)
    assert all("never" in line for line in lines)  # local checkpoints carry no TTL here
    total = sum(
        file.stat().st_size
        for file in (trained_run / "backend").rglob("*")
        if file.is_file() and not file.name.startswith(".")
    )
    assert listed.splitlines()[-1].startswith("3 checkpoint(s), ")
    assert listed.splitlines()[-1].endswith(f"{total / 2**20:.1f} MiB")


def test_download_delete_and_cleanup_on_the_local_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "store"
    service = LocalServiceClient(root=root)
    training = service.create_lora_training_client(TINY_MODEL_NAME, rank=4, seed=0)
    kept = training.save_weights_for_sampler("kept").result().path
    temporary = training.save_weights_for_sampler("temp", ttl_seconds=3600).result().path
    state = training.save_state("state").result().path
    run_id = training.training_run_cuid
    listed = _cli(capsys, "checkpoints", "list", run_id, "--root", str(root))
    temp_line = next(line for line in listed.splitlines() if temporary in line)
    assert "never" not in temp_line  # the TTL's expiry is shown

    archive = tmp_path / "state.tar"
    _cli(capsys, "checkpoints", "download", state, "--out", str(archive), "--root", str(root))
    with tarfile.open(archive) as opened:
        assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= set(
            opened.getnames()
        )
    out = _cli(capsys, "checkpoints", "cleanup", run_id, "--root", str(root))
    assert out.startswith("deleted 1 sampler checkpoint(s)")
    remaining = _cli(capsys, "checkpoints", "list", "--root", str(root))
    assert temporary not in remaining and kept in remaining and state in remaining
    _cli(capsys, "checkpoints", "delete", kept, "--root", str(root))
    assert kept not in _cli(capsys, "checkpoints", "list", "--root", str(root))
    assert main(["checkpoints", "delete", kept, "--root", str(root)]) == 2
    assert "no match(es)" in capsys.readouterr().err
    assert main(["checkpoints", "cleanup", "no-such-run", "--root", str(root)]) == 2
    assert "no checkpoint of a run 'no-such-run' was found" in capsys.readouterr().err
    service.close()


# --- export ------------------------------------------------------------------------------------


def test_exported_adapter_and_merged_model_give_the_local_samplers_logprobs(
    trained_run: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo.backends.local.tiny import load_tiny_model

    summary = read_summary(trained_run)
    service = LocalServiceClient(root=tmp_path / "unused")
    sampler = service.create_sampling_client(TINY_MODEL_NAME, model_path=summary["sampler_path"])
    tokenizer = sampler.get_tokenizer()
    text = "<|im_start|>user\nWhat is 12+30?<|im_end|>\n<|im_start|>assistant\n42"
    tokens = tokenizer.encode(text)
    prompt = ModelInput.from_ints(tokens)
    # On a fresh service the first sampled batch once built the unembedding before the LoRA
    # was attached (fixed where the sampler builds its model inside sampling_weights); one
    # call first keeps this test about the export.
    sampler.compute_logprobs(prompt).result()
    expected = np.asarray(sampler.compute_logprobs(prompt).result()[1:])
    base_logprobs = np.asarray(
        service.create_sampling_client(TINY_MODEL_NAME)
        .compute_logprobs(ModelInput.from_ints(tokens))
        .result()[1:]
    )
    assert np.abs(expected - base_logprobs).max() > 1e-3, "the run did not move the weights"

    adapter_dir = export(str(trained_run), tmp_path / "adapter")
    assert sorted(path.name for path in adapter_dir.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    base, _ = load_tiny_model()
    adapted = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    np.testing.assert_allclose(_logprobs_of_model(adapted, tokens), expected, atol=2e-5)

    merged_dir = export(str(trained_run), tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True).eval()
    np.testing.assert_allclose(_logprobs_of_model(merged, tokens), expected, atol=1e-4)
    service.close()


def test_a_tool_model_run_exports_and_merges_onto_the_tool_model(tmp_path: Path) -> None:
    """--merge finds every built-in base by name, the tool model included (not the default)."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "tools-run"
    config = {**TINY, "base_model": TINY_TOOLS_MODEL_NAME, "steps": 1, "save_every": 0}
    tiny_runs.quiet_train(TrainConfig(**config, run_dir=str(run_dir)))
    service = LocalServiceClient(root=tmp_path / "unused")
    sampler = service.create_sampling_client(
        TINY_TOOLS_MODEL_NAME, model_path=read_summary(run_dir)["sampler_path"]
    )
    tokens = sampler.get_tokenizer().encode("<|im_start|>user\nWhat is 12+30?<|im_end|>\n")
    expected = np.asarray(sampler.compute_logprobs(ModelInput.from_ints(tokens)).result()[1:])
    merged_dir = export(str(run_dir), tmp_path / "merged", merge=True)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, local_files_only=True).eval()
    np.testing.assert_allclose(_logprobs_of_model(merged, tokens), expected, atol=1e-4)
    service.close()


def test_export_of_a_downloaded_archive_equals_the_checkpoint(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = read_summary(trained_run)["sampler_path"]
    archive = tmp_path / "weights.tar"
    root = str(trained_run / "backend")
    _cli(capsys, "checkpoints", "download", checkpoint, "--out", str(archive), "--root", root)
    _cli(capsys, "export", str(archive), "--out", str(tmp_path / "from-archive"))
    _cli(capsys, "export", checkpoint, "--out", str(tmp_path / "from-path"))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "from-archive" / name).read_bytes() == (
            tmp_path / "from-path" / name
        ).read_bytes()
    bogus = tmp_path / "bogus.tar"
    with tarfile.open(bogus, "w") as opened:
        opened.add(trained_run / "summary.json", arcname="summary.json")
    assert main(["export", str(bogus), "--out", str(tmp_path / "bogus")]) == 2
    assert "no PEFT adapter" in capsys.readouterr().err
