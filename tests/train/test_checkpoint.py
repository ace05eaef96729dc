"""train/checkpoint.py and --resume: a run SIGKILLed after a checkpoint and resumed ends with the same
losses and the same weight or adapter bytes as one never stopped (full and lora mode); damaged checkpoints,
changed settings and misplaced resumes are clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import yaml

from moeswap import cli
from moeswap.lora import CONFIG_NAME, MOESWAP_NAME, WEIGHTS_NAME
from moeswap.train.checkpoint import CheckpointError, all_checkpoints
from moeswap.train.loop import train

KILLER = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    torch.set_num_threads(1)  # as the test process runs (tests/conftest.py): the same arithmetic
    from moeswap.train.config import TrainConfig
    from moeswap.train.loop import train

    def die(step, path):
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

    train(TrainConfig.from_dict(json.loads(sys.argv[1])), progress=False, on_checkpoint=die)
""")

# what full mode writes for the tiny base: one shard and its index (train/export.py)
MODEL_FILES = ("model-00001-of-00001.safetensors", "model.safetensors.index.json")


class Stop(Exception):
    pass


def stop_at(step: int):
    def hook(at, path):
        if at == step:
            raise Stop(path)
    return hook


def as_yaml(cfg, path):
    data = cfg.as_dict()
    data.update(data.pop("load"))
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(small_run, lora_settings, tmp_path, mode):
    settings = lora_settings if mode == "lora" else {}
    result = [WEIGHTS_NAME, CONFIG_NAME, MOESWAP_NAME] if mode == "lora" else [*MODEL_FILES, "config.json"]
    whole = train(small_run(output=str(tmp_path / "whole"), max_steps=6, eval_interval=3, **settings), progress=False)
    cfg = small_run(output=str(tmp_path / "killed"), max_steps=6, eval_interval=3, save_interval=2, **settings)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", KILLER, json.dumps(cfg.as_dict()), "4"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    out = tmp_path / "killed"
    assert [p.name for p in all_checkpoints(out)] == ["step-00000002", "step-00000004"]
    assert not any((out / name).exists() for name in result)

    resumed = train(cfg, resume=True, progress=False)
    assert resumed.losses == whole.losses and len(whole.losses) == 6
    assert resumed.manifest["eval"] == whole.manifest["eval"]
    for name in result:
        assert (out / name).read_bytes() == (whole.out_dir / name).read_bytes(), name
    assert [s["from_step"] for s in resumed.manifest["segments"]] == [0, 4]
    with pytest.raises(ValueError, match="this run has finished"):
        train(cfg, resume=True, progress=False)


def test_damaged_or_mismatched_checkpoints_are_refused(small_run, tmp_path, capsys):
    cfg = small_run(save_interval=1, keep_checkpoints=2)
    with pytest.raises(Stop):
        train(cfg, progress=False, on_checkpoint=stop_at(3))
    out = tmp_path / "out"
    assert [p.name for p in all_checkpoints(out)] == ["step-00000002", "step-00000003"]  # the older one removed
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # no staging left

    with pytest.raises(ValueError, match=r"checkpoint .*step-00000003 was made with lr=0\.01, this run has 0\.02"):
        train(cfg.replace(lr=0.02), resume=True, progress=False)
    newest = all_checkpoints(out)[-1]
    data = bytearray((newest / "params.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (newest / "params.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step-00000003 is damaged: params.safetensors does not match the "
                                              r"SHA-256 .*delete it to resume from an earlier checkpoint"):
        train(cfg, resume=True, progress=False)
    (newest / "state.json").write_text("{not json")
    capsys.readouterr()
    assert cli.main(["train", as_yaml(cfg, tmp_path / "c.yaml"), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeswap: error: checkpoint ") and "state.json is not valid JSON" in err
    assert "\n" not in err

    with pytest.raises(FileExistsError, match="exists and is not empty; pass --resume"):
        train(cfg, progress=False)
    with pytest.raises(ValueError, match="--resume: no checkpoint in"):
        train(cfg.replace(output=str(tmp_path / "fresh")), resume=True, progress=False)


def test_a_garbage_state_or_a_planted_pickle_is_named_in_one_line(small_run, tmp_path, capsys):
    """Hand-edited state.json fields and an optimizer.pt that is not a weights-only optimizer state (its
    hash updated too, as a planter would) are refused naming the file, not as an exception from deep inside."""
    import hashlib
    import pickle

    cfg = small_run(save_interval=2)
    with pytest.raises(Stop):
        train(cfg, progress=False, on_checkpoint=stop_at(2))
    out = tmp_path / "out"
    ckpt = all_checkpoints(out)[-1]
    good = json.loads((ckpt / "state.json").read_text())

    def resume_says(state=None) -> str:
        (ckpt / "state.json").write_text(json.dumps(state if state is not None else good))
        capsys.readouterr()
        assert cli.main(["train", as_yaml(cfg, tmp_path / "c.yaml"), "--resume", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"moeswap: error: checkpoint {ckpt} is damaged: ") and "\n" not in err, err
        return err

    assert "Python random-number state" in resume_says({**good, "rng": {"python": [3, [1, 2], None]}})
    assert "has step 'x'" in resume_says({**good, "step": "x"})
    assert "no 'history' dict" in resume_says({**good, "history": []})

    class Planted:
        def __reduce__(self):
            return (print, ("ran",))

    (ckpt / "optimizer.pt").write_bytes(pickle.dumps(Planted()))
    good["files"]["optimizer.pt"] = hashlib.sha256((ckpt / "optimizer.pt").read_bytes()).hexdigest()
    err = resume_says()
    assert "optimizer.pt is not an optimizer state this run can load" in err
    assert "ran" not in capsys.readouterr().out


def test_a_run_killed_while_staging_its_first_checkpoint_can_start_again(small_run, tmp_path):
    """SIGKILL while the first checkpoint is staged leaves a staging directory of a process that is gone:
    neither --resume nor a fresh run may need the user to delete files."""
    cfg = small_run(save_interval=2, max_steps=2)
    out = tmp_path / "out"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    from moeswap.atomic_dir import Owner

    owner = Owner(Owner.me().host, int(dead.stdout), 1)  # a pid that has exited: provably gone
    staging = out / "checkpoints" / f".step-00000002.staging-{owner.token()}.abc123"
    staging.mkdir(parents=True)
    (staging / "params.safetensors").write_bytes(b"half")
    with pytest.raises(ValueError, match="without --resume the run starts over"):
        train(cfg, resume=True, progress=False)
    assert not staging.exists()
    assert train(cfg, progress=False).losses  # a fresh run takes the output directory
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):  # the user's files are never taken over
        train(cfg.replace(output=str(tmp_path / "other")), progress=False)


@pytest.mark.parametrize("linked", ["state.json", "optimizer.pt", "params.safetensors", "checkpoint directory"])
def test_a_checkpoint_file_linked_out_of_the_output_is_refused_on_resume(small_run, tmp_path, capsys, linked):
    """A training output follows the model and adapter directories' rule: --resume reads nothing that
    resolves outside it, even the checkpoint's own valid file moved out and linked back."""
    import shutil

    cfg = small_run(save_interval=2)
    with pytest.raises(Stop):
        train(cfg, progress=False, on_checkpoint=stop_at(2))
    ckpt = all_checkpoints(tmp_path / "out")[-1]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = ckpt if linked == "checkpoint directory" else ckpt / linked
    shutil.move(moved, elsewhere / moved.name)
    moved.symlink_to(elsewhere / moved.name)
    capsys.readouterr()
    assert cli.main(["train", as_yaml(cfg, tmp_path / "c.yaml"), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moeswap: error: ") and "\n" not in err, err
    assert "is a link that resolves outside" in err, err
