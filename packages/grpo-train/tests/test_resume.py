"""Resume from damaged, planted or re-configured checkpoints, on a real tiny policy checkpoint (no Ray).

The checkpoints are written the way a run writes them: `PolicyWorker.save` into the folder that
`CheckpointManager.save` publishes, plus the driver's state files (dataloader, RNG). Each test
damages them the way the world does (a flipped bit, an edited JSON file, a planted pickle) and
checks what resume does against what a person expects, not against the code's own output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_train.checkpoint import CheckpointManager, load_rng_state, save_rng_state
from grpo_train.config.schema import GRPOMasterConfig, LossConfig, PolicyConfig
from grpo_train.policy.worker import PolicyWorker
from grpo_train.run import EXIT_OK, EXIT_STARTUP, choose_resume_point, train
from grpo_train.setup import StartupError
from grpo_train.state_io import StateFileError, load_state, save_state, write_manifest

MARKER_ENV = "GRPO_TEST_PICKLE_MARKER"


def policy_cfg(lr: float = 1e-2, scheduler: list | None = None) -> PolicyConfig:
    return PolicyConfig(
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=4,
        logprob_batch_size=4,
        max_grad_norm=None,
        optimizer={"name": "torch.optim.AdamW", "kwargs": {"lr": lr}},
        scheduler=scheduler or [],
    )


def make_batch(seed: int = 0, B: int = 4, S: int = 9, vocab: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab, (B, S), generator=g)
    attention_mask = torch.ones(B, S, dtype=torch.long)
    token_mask = attention_mask.float().clone()
    token_mask[:, :3] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "gen_logprobs": -torch.rand(B, S, generator=g) * token_mask,
        "advantages": torch.randn(B, 1, generator=g) * token_mask,
        "sample_mask": torch.ones(B),
    }


def trained_worker(model_dir: str, cfg: PolicyConfig, steps: int = 1) -> PolicyWorker:
    worker = PolicyWorker(model_dir, cfg, LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    for step in range(steps):
        batch = make_batch(step)
        batch["prev_logprobs"] = worker.logprobs(batch)
        worker.train(batch)
    return worker


def save_run_checkpoint(manager: CheckpointManager, worker: PolicyWorker, step: int) -> Path:
    def write(folder: Path) -> None:
        worker.save(str(folder / "policy"))
        save_state({"epoch": 0, "batches_in_epoch": step, "loader": None}, folder, "dataloader")
        save_rng_state(folder)

    return manager.save(step, write, {"step": step, "weight_version": step}, metrics={"val_accuracy": 0.1 * step})


@pytest.fixture(scope="module")
def worker(tiny_qwen2_dir):
    return trained_worker(tiny_qwen2_dir, policy_cfg())


@pytest.fixture
def two_checkpoints(tmp_path, worker):
    manager = CheckpointManager(tmp_path / "checkpoints")
    for step in (2, 4):
        save_run_checkpoint(manager, worker, step)
    return manager


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def tensor_data_offset(path: Path) -> int:
    """First byte of a safetensors file's tensor data (after the 8-byte length and the JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


# --------------------------------------------------------------------------- bit rot
@pytest.mark.parametrize(
    "victim",
    ["policy/model/model.safetensors", "policy/optimizer.safetensors", "trainer_state.json", "dataloader.json"],
)
def test_a_flipped_bit_falls_back_to_the_newest_intact_checkpoint(two_checkpoints, victim):
    manager = two_checkpoints
    path = manager.step_dir(4) / victim
    if path.suffix == ".safetensors":
        flip_byte(path, tensor_data_offset(path) + 5)  # inside a tensor: the file still loads
        assert load_file(path)  # what resumed silently before: no error from the loader itself
    else:
        text = path.read_text()
        path.write_text(text.replace("4", "3", 1))  # an edit that is still valid JSON
        json.loads(path.read_text())
    said: list[str] = []
    assert manager.newest_intact(said.append) == manager.step_dir(2)
    assert len(said) == 1 and "step_4" in said[0] and victim in said[0] and "resuming from step_2" in said[0]
    # The damaged one is kept for a person, out of the way of resume and pruning.
    assert manager.all_steps() == [2] and (manager.root / "step_4.damaged" / victim).is_file()


def test_none_intact_raises_one_line_and_renames_nothing(two_checkpoints):
    manager = two_checkpoints
    (manager.step_dir(4) / "rng.safetensors").unlink()
    path = manager.step_dir(2) / "policy" / "scheduler.json"
    path.write_text(path.read_text()[:-3])
    said: list[str] = []
    with pytest.raises(Exception) as info:
        manager.newest_intact(said.append)
    message = str(info.value)
    assert "\n" not in message and "no intact checkpoint" in message
    assert "rng.safetensors is missing" in message and "policy/scheduler.json: size" in message
    assert (
        manager.all_steps() == [2, 4] and not said
    )  # nothing renamed: a rerun meets the same stop, never a fresh start


def no_ray(*args, **kwargs):
    raise AssertionError("Ray must not start before the checkpoints are checked")


def test_none_intact_stops_the_run_with_one_line_before_ray(tmp_path, worker, tiny_qwen2_dir, capsys, monkeypatch):
    monkeypatch.setattr("grpo_train.setup.init_ray", no_ray)
    run_dir = tmp_path / "run"
    cfg = GRPOMasterConfig(policy={"model_name": tiny_qwen2_dir, "precision": "float32", "train_global_batch_size": 32})
    manager = CheckpointManager(run_dir / "checkpoints", run_config=cfg.model_dump(mode="json"))
    folder = save_run_checkpoint(manager, worker, 3)
    flip_byte(
        folder / "policy" / "model" / "model.safetensors",
        tensor_data_offset(folder / "policy" / "model" / "model.safetensors"),
    )
    capsys.readouterr()
    assert train(cfg, {}, "t", run_dir=str(run_dir)) == EXIT_STARTUP
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no intact checkpoint" in err[0] and "model.safetensors: content hash mismatch" in err[0]


def test_a_finished_run_says_so_before_ray(tmp_path, worker, tiny_qwen2_dir, capsys, monkeypatch):
    # Rerunning a finished run once started Ray, vLLM and every worker to print this line.
    monkeypatch.setattr("grpo_train.setup.init_ray", no_ray)
    run_dir = tmp_path / "run"
    cfg = GRPOMasterConfig(
        policy={"model_name": tiny_qwen2_dir, "precision": "float32", "train_global_batch_size": 32},
        grpo={"max_num_steps": 3},
    )
    save_run_checkpoint(CheckpointManager(run_dir / "checkpoints", run_config=cfg.model_dump(mode="json")), worker, 3)
    capsys.readouterr()
    assert train(cfg, {}, "t", run_dir=str(run_dir)) == EXIT_OK
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["grpo: this run already finished 3 steps; pass --run-dir to start a new run"]


def test_a_checkpoint_without_a_manifest_is_not_resumed(two_checkpoints):
    manager = two_checkpoints
    for step in (2, 4):
        (manager.step_dir(step) / "manifest.json").unlink()
    with pytest.raises(Exception, match="no manifest.json"):
        manager.newest_intact(print)


# ---------------------------------------------------------------------- planted pickles
class Planted:
    """Writes a marker file when unpickled: what an attacker's file in a checkpoint would do."""

    def __reduce__(self):
        return (Path(os.environ[MARKER_ENV]).write_text, ("pwned",))


def test_planted_pickles_in_every_state_file_do_not_run(tmp_path, worker, tiny_qwen2_dir, monkeypatch):
    marker = tmp_path / "marker"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    manager = CheckpointManager(tmp_path / "checkpoints")
    folder = save_run_checkpoint(manager, worker, 1)
    for stem in ("replay_buffer", "collector"):
        save_state({"entries": []}, folder, stem)
    stems = [folder / "policy" / s for s in ("optimizer", "scheduler", "torch_rng")]
    stems += [folder / s for s in ("dataloader", "rng", "replay_buffer", "collector")]
    # The plant is live: loading it the old way (weights_only=False) runs it.
    torch.save(Planted(), tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert marker.read_text() == "pwned"
    marker.unlink()
    for stem in stems:
        for suffix in (".json", ".safetensors", ".pt"):  # .pt: the old names, never read any more
            torch.save(Planted(), stem.with_suffix(suffix))
    write_manifest(folder)  # an attacker who can write files can rewrite the manifest too
    assert manager.newest_intact(print) == folder

    fresh = PolicyWorker(tiny_qwen2_dir, policy_cfg(), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    with pytest.raises(StateFileError):
        fresh.load(str(folder / "policy"))
    for stem in stems:
        with pytest.raises(StateFileError):
            load_state(stem.parent, stem.name)
    with pytest.raises(StateFileError):
        load_rng_state(folder)
    assert not marker.exists()


# ------------------------------------------------------------------- changed config
def test_a_changed_lr_is_applied_to_the_restored_optimizer_and_schedule(tmp_path, tiny_qwen2_dir):
    # LinearLR from 0.5 to 1.0 over 4 steps: after step k the factor is 0.5 + 0.125 k (closed form).
    warmup = [{"name": "torch.optim.lr_scheduler.LinearLR", "kwargs": {"start_factor": 0.5, "total_iters": 4}}]
    old = trained_worker(tiny_qwen2_dir, policy_cfg(lr=3e-5, scheduler=warmup), steps=1)
    assert old.optimizer.param_groups[0]["lr"] == pytest.approx(3e-5 * 0.625)
    old.save(str(tmp_path / "policy"))
    new = PolicyWorker(
        tiny_qwen2_dir, policy_cfg(lr=1e-4, scheduler=warmup), LossConfig(reference_policy_kl_penalty=0.0), seed=0
    )
    new.load(str(tmp_path / "policy"))
    group = new.optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-4 * 0.625, rel=1e-12) and group["initial_lr"] == 1e-4
    assert torch.equal(
        new.optimizer.state[group["params"][0]]["exp_avg"],
        old.optimizer.state[old.optimizer.param_groups[0]["params"][0]]["exp_avg"],
    )  # moments kept
    batch = make_batch(1)
    batch["prev_logprobs"] = new.logprobs(batch)
    metrics = new.train(batch)
    assert metrics["lr"] == pytest.approx(1e-4 * 0.625, rel=1e-12)  # the lr that step trained with
    assert group["lr"] == pytest.approx(1e-4 * 0.75, rel=1e-12)  # and the schedule goes on at the new scale


def test_constant_lr_change_is_exact(tmp_path, tiny_qwen2_dir):
    trained_worker(tiny_qwen2_dir, policy_cfg(lr=3e-5)).save(str(tmp_path / "policy"))
    new = PolicyWorker(tiny_qwen2_dir, policy_cfg(lr=1e-4), LossConfig(reference_policy_kl_penalty=0.0), seed=0)
    new.load(str(tmp_path / "policy"))
    assert [g["lr"] for g in new.optimizer.param_groups] == [1e-4]


def resolved(tiny_qwen2_dir: str, **grpo) -> dict:
    return GRPOMasterConfig(
        grpo=grpo, policy={"model_name": tiny_qwen2_dir, "precision": "float32", "train_global_batch_size": 32}
    ).model_dump(mode="json")


def test_resume_applies_allowed_changes_and_refuses_the_rest_by_key(tmp_path, worker, tiny_qwen2_dir, capsys):
    saved = resolved(tiny_qwen2_dir, num_generations_per_prompt=4)
    manager = CheckpointManager(tmp_path, run_config=saved)
    folder = save_run_checkpoint(manager, worker, 1)
    capsys.readouterr()
    assert choose_resume_point(manager, saved) == folder
    assert capsys.readouterr().err == ""

    allowed = resolved(tiny_qwen2_dir, num_generations_per_prompt=4, max_num_steps=7)
    allowed["policy"]["optimizer"]["kwargs"]["lr"] = 1e-4
    assert choose_resume_point(manager, allowed) == folder
    err = capsys.readouterr().err
    assert "(applied)" in err and "policy.optimizer.kwargs.lr (5e-06 -> 0.0001)" in err and "grpo.max_num_steps" in err

    refused = resolved(tiny_qwen2_dir, num_generations_per_prompt=8, seed=1)
    refused["policy"]["optimizer"]["kwargs"]["lr"] = 1e-4
    with pytest.raises(StartupError) as info:
        choose_resume_point(manager, refused)
    message = str(info.value)
    assert "\n" not in message
    assert "grpo.num_generations_per_prompt (4 -> 8)" in message and "grpo.seed (42 -> 1)" in message
    assert "policy.optimizer.kwargs.lr (" not in message  # allowed keys are not named as refused


def test_a_refused_change_stops_train_with_one_line_and_keeps_the_saved_config(
    tmp_path, worker, tiny_qwen2_dir, capsys, monkeypatch
):
    monkeypatch.setattr("grpo_train.setup.init_ray", no_ray)
    run_dir = tmp_path / "run"
    cfg = GRPOMasterConfig(
        grpo={"num_generations_per_prompt": 4},
        policy={"model_name": tiny_qwen2_dir, "precision": "float32", "train_global_batch_size": 32},
    )
    manager = CheckpointManager(run_dir / "checkpoints", run_config=cfg.model_dump(mode="json"))
    save_run_checkpoint(manager, worker, 2)
    (run_dir / "config.yaml").write_text("grpo: {num_generations_per_prompt: 4}\n")
    capsys.readouterr()
    changed = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"num_generations_per_prompt": 2})})
    assert train(changed, {"grpo": {"num_generations_per_prompt": 2}}, "t", run_dir=str(run_dir)) == EXIT_STARTUP
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grpo.num_generations_per_prompt (4 -> 2)" in err[0]
    assert (run_dir / "config.yaml").read_text() == "grpo: {num_generations_per_prompt: 4}\n"


def test_every_changeable_pattern_names_real_config_keys():
    from fnmatch import fnmatchcase

    from grpo_train.resume_config import APPLIED_ON_RESUME, flatten

    keys = flatten(GRPOMasterConfig(ppo={}).model_dump(mode="json"))
    for pattern in APPLIED_ON_RESUME:
        assert any(fnmatchcase(k, pattern) for k in keys), pattern
