"""train/manifest.py: the run's record (strict JSON, loss.csv, loss.png) says what went in and came out;
`moeswap train --reproduce` reruns a manifest and checks the curve."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil

import pytest

from moeswap import cli
from moeswap.experts.stats import StoreStats, TierStats
from moeswap.lora import WEIGHTS_NAME, fingerprint
from moeswap.procfs import peak_rss_bytes
from moeswap.train.loop import train
from moeswap.train.manifest import LOSS_CSV, LOSS_PNG, MANIFEST, check_reproduction

# what full mode writes for the tiny base: one shard and its index (train/export.py)
MODEL_FILES = ("model-00001-of-00001.safetensors", "model.safetensors.index.json")


def test_manifest_records_inputs_environment_and_results(learned, strict_json):
    out = learned.out_dir
    m = strict_json((out / MANIFEST).read_text())
    assert m == learned.manifest
    cfg = m["config"]
    data = m["data"]
    assert data["files"][0]["sha256"] == hashlib.sha256(open(cfg["train_data"], "rb").read()).hexdigest()
    assert (data["train_samples"], data["eval_samples"], data["eval_from"]) == (64, 16, "split")
    assert data["files"][0]["samples"] == 80 and data["files"][0]["formats"] == {"text": 80, "chat": 0}
    assert m["base"]["fingerprint"] == fingerprint(cfg["model"])  # the one adapters record (tested in tests/lora)
    assert m["seed"] == cfg["seed"] == 0 and cfg["max_steps"] == 20 and cfg["load"]["expert_memory"] == 1 << 30
    assert m["environment"]["packages"]["torch"] == __import__("torch").__version__
    assert m["environment"]["hardware"]["torch_threads"] == 1
    assert m["environment"]["hardware"]["cores"] == os.cpu_count()
    assert [p["step"] for p in m["curve"]] == list(range(1, 21))
    assert m["tokens"] == sum(p["tokens"] for p in m["curve"])
    assert m["tokens_per_s"] == pytest.approx(m["tokens"] / m["train_s"]) and m["train_s"] <= m["wall_s"]
    assert 50 << 20 < m["peak_rss_bytes"] <= peak_rss_bytes()  # this process's high-water mark, read earlier
    assert m["expert_store"].keys() == StoreStats({"fast": TierStats()}).as_dict().keys()
    fast = next(iter(m["expert_store"]["tiers"].values()))
    assert m["expert_store"]["hit_rate"] == pytest.approx(fast["hits"] / max(1, fast["hits"] + fast["misses"]))
    assert (m["eval_loss_before"], m["eval_loss_after"]) == (m["eval"][0]["loss"], m["eval"][-1]["loss"])
    assert sorted(m["files"]) == sorted([*MODEL_FILES, "config.json", "generation_config.json", "tokenizer.json",
                                      "tokenizer_config.json", LOSS_CSV, LOSS_PNG, MANIFEST])

    rows = list(csv.DictReader((out / LOSS_CSV).read_text().splitlines()))
    assert rows[0] == {"step": "0", "lr": "", "loss": "", "tokens": "", "eval_loss": repr(m["eval"][0]["loss"])}
    assert [float(r["loss"]) for r in rows[1:]] == [p["loss"] for p in m["curve"]]
    assert [r["eval_loss"] != "" for r in rows[1:]] == [p["step"] in (10, 20) for p in m["curve"]]
    assert (out / LOSS_PNG).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reproduce_reruns_a_manifest_and_checks_the_curve(small_run, lora_settings, tmp_path, capsys):
    first = train(small_run(**lora_settings), progress=False)  # lora mode, routed experts included
    manifest = first.out_dir / MANIFEST
    capsys.readouterr()
    assert cli.main(["train", "--reproduce", str(manifest), "--output", str(tmp_path / "again"),
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == "reproduced: 4 steps and 2 evals reproduced exactly"
    assert (tmp_path / "again" / WEIGHTS_NAME).read_bytes() == (first.out_dir / WEIGHTS_NAME).read_bytes()

    tampered = json.loads(manifest.read_text())
    tampered["curve"][2]["loss"] += 1e-6
    (tmp_path / "tampered.json").write_text(json.dumps(tampered))
    assert cli.main(["train", "--reproduce", str(tmp_path / "tampered.json"), "--output", str(tmp_path / "third"),
                     "--no-progress"]) == 1
    assert "NOT reproduced: step 3 loss: recorded" in capsys.readouterr().err

    # the first 3 steps only: step 3's curve point is the tampered one; the first 2 and the step-0 eval match
    assert cli.main(["train", "--reproduce", str(tmp_path / "tampered.json"), "--first-steps", "2", "--output",
                     str(tmp_path / "prefix"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == "reproduced: 2 steps and 1 evals reproduced exactly"
    assert not (tmp_path / "prefix" / WEIGHTS_NAME).exists()
    assert cli.main(["train", "--reproduce", str(tmp_path / "tampered.json"), "--first-steps", "3", "--output",
                     str(tmp_path / "prefix3"), "--no-progress"]) == 1
    assert "NOT reproduced: step 3 loss: recorded" in capsys.readouterr().err
    for bad in (["--first-steps", "5"], ["--first-steps", "0"]):
        assert cli.main(["train", "--reproduce", str(manifest), *bad, "--output", str(tmp_path / "z")]) == 2
        assert "--first-steps must be between 1 and the recorded run's 4 steps" in capsys.readouterr().err
    assert cli.main(["train", "--reproduce", str(manifest), "--lr", "0.5", "--output", str(tmp_path / "x")]) == 2
    assert "--lr cannot be given with it" in capsys.readouterr().err
    data = json.loads(manifest.read_text())["config"]["train_data"]
    shutil.copy(data, tmp_path / "orig.jsonl")
    with open(data, "a") as f:
        f.write('{"text": "one more line"}\n')
    try:
        assert cli.main(["train", "--reproduce", str(manifest), "--output", str(tmp_path / "y")]) == 2
        assert "is not the recorded data (its SHA-256 differs)" in capsys.readouterr().err
    finally:
        shutil.copy(tmp_path / "orig.jsonl", data)


def test_check_reproduction_tolerance():
    old = {"curve": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], "eval": [{"step": 2, "loss": 1.5}]}
    new = {"curve": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0 + 1e-5}], "eval": [{"step": 2, "loss": 1.5}]}
    assert check_reproduction(old, old) == (True, "2 steps and 1 evals reproduced exactly")
    ok, message = check_reproduction(old, new)
    assert not ok and message.startswith("step 2 loss: recorded 1.0, now 1.00001")
    assert check_reproduction(old, new, tolerance=1e-4)[0]
    assert not check_reproduction(old, {**new, "curve": new["curve"][:1]})[0]
