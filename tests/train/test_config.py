"""train/config.py: one TrainConfig from CONFIG.yaml and flags (a given flag wins, a default does not),
the load options among them, typed and checked values, unknown keys named with the closest valid one,
and the resolved config's round trip through the manifest's JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import pytest

from moeswap import cli
from moeswap.options import LoadOptions
from moeswap.train.config import TrainConfig, add_train_flags, read_yaml, resolve


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("config", nargs="?")
    add_train_flags(p)
    return p.parse_args(list(argv))


def test_every_field_is_a_flag_and_a_yaml_key(tmp_path):
    own = [f for f in fields(TrainConfig) if f.name != "load"]
    ns = parse()
    assert not any(hasattr(ns, f.name) for f in own)  # absent flags say nothing
    load_names = [f.name for f in fields(LoadOptions) if f.metadata["flag"]]
    assert not any(hasattr(ns, n) for n in load_names)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    for name in [f.name for f in own] + load_names:
        assert "--" + name.replace("_", "-") in help_text, name


def test_yaml_then_flags_flag_wins_paths_resolved(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    cfg_file = tmp_path / "cfg" / "run.yaml"
    cfg_file.write_text("model: ../models/k3\ntrain_data: data/train.jsonl\nlr: 3.0e-4\nrank: 8\n"
                        "target_modules: [q_proj, o_proj]\nbetas: [0.9, 0.95]\nexpert_memory: 64MiB\n"
                        "gradient_checkpointing: true\noutput: out\n")
    monkeypatch.chdir(tmp_path)
    cfg = resolve(str(cfg_file), parse("--rank", "4", "--no-gradient-checkpointing", "--expert-memory", "1GiB",
                                       "--output", "elsewhere", "--target-modules", "kv_b_proj"))
    assert cfg.model == str(tmp_path / "models" / "k3")  # a file's paths: against its directory
    assert cfg.train_data == str(tmp_path / "cfg" / "data" / "train.jsonl")
    assert cfg.output == str(tmp_path / "elsewhere")  # a flag's: against the working directory
    assert (cfg.lr, cfg.rank, cfg.betas, cfg.gradient_checkpointing) == (3e-4, 4, (0.9, 0.95), False)
    assert cfg.target_modules == ("kv_b_proj",)
    assert cfg.load.expert_memory == 1 << 30 and cfg.load.expert_policy == LoadOptions().expert_policy
    assert resolve(str(cfg_file)).load.expert_memory == 64 << 20


def test_the_resolved_config_round_trips_through_json(tmp_path):
    cfg = TrainConfig(model="/m", train_data="/d.jsonl", output="/o", target_modules=("q_proj",), betas=(0.8, 0.9),
                      load=LoadOptions(expert_memory=123456, prefetch="next-layer"))
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.as_dict())))
    assert again == cfg


@pytest.mark.parametrize("text, message", [
    ("learning_rate: 0.1\n", "unknown key 'learning_rate' (closest valid key: 'lr')"),  # transformers' name
    ("warmup_step: 3\n", "unknown key 'warmup_step' (closest valid key: 'warmup_steps')"),
    ("micro_bach: 2\n", "unknown key 'micro_bach' (closest valid key: 'micro_batch')"),
    ("expert_memry: 1GiB\n", "closest valid key: 'expert_memory'"),
    ("rank: 2.5\n", "rank: expected an integer, found 2.5"),
    ("lr: fast\n", "lr: expected a number, found 'fast'"),
    ("shared_a: 1\n", "shared_a: expected true or false"),
    ("betas: [0.9]\n", "betas: expected two numbers"),
    ("expert_memory: lots\n", "expert_memory: 'lots' is not a size"),
    ("mode: half\n", "--mode 'half': expected one of lora, full"),
    ("lr: 0\n", "--lr must be > 0"),
    ("eval_split: 1.0\n", "--eval-split must be in [0, 1)"),
    ("router_bias_rate: -0.001\n", "--router-bias-rate must be >= 0"),
    ("log_interval: -1\n", "--log-interval must be >= 0"),
    ("expert_compute: cpu\n", "--expert-compute cpu: training computes every expert where the model runs"),
    ("- a\n- b\n", "expected a mapping of settings"),
    ("rank: [\n", "not valid YAML"),
])
def test_bad_yaml_is_one_clear_error(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        resolve(str(path))
    assert message in str(e.value)
    assert str(path) in str(e.value) or message.startswith("--")


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("micro_bach: 2\n")
    assert cli.main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeswap: error: ") and err.count("\n") == 1 and "micro_batch" in err
    with pytest.raises(SystemExit) as e:  # argparse's own errors exit from the parser
        cli.main(["train", "--lr", "abc"])
    assert e.value.code == 2 and "--lr: 'abc' is not a number" in capsys.readouterr().err
    assert cli.main(["train", "--output", str(tmp_path / "o")]) == 2  # no model, no data
    assert "no model: give the base model directory" in capsys.readouterr().err


def test_yaml_file_problems(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_yaml(tmp_path / "missing.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert read_yaml(tmp_path / "empty.yaml") == {}
    (tmp_path / "bad.yaml").write_bytes(b"lr: \xff\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        read_yaml(tmp_path / "bad.yaml")
    assert isinstance(read_yaml(Path(tmp_path / "empty.yaml")), dict)
