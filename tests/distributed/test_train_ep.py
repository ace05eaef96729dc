"""`moeswap train --ep-mode replicated` under torchrun with 2 ranks (gloo, loopback): a LoRA run with adapters on
attention, the routed experts and the head gives the single-process run's loss curve and writes the same adapter
file, byte for byte, from rank 0 alone, and the same checkpoint (the routed experts' LoRA and AdamW state,
split by owner during the run, gathered whole), which 2 ranks resume from one process's checkpoint; each
rank holds only its experts' LoRA rows and moments."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from moeswap.distributed.launch import free_port
from moeswap.lora import CONFIG_NAME, WEIGHTS_NAME
from moeswap.text.tokenizer import load_tokenizer
from moeswap.train.checkpoint import CHECKPOINTS, OPTIMIZER, PARAMS, checkpoint_dir
from train.conftest import LORA_RUN, write_chains

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

SRC = Path(__file__).resolve().parents[2] / "src"


def train_alone_and_under_torchrun(model_dir, tmp_path, **settings):
    """A 3-step LoRA run (LORA_RUN, `settings` on top) as one process into tmp_path/one and under torchrun on 2
    ranks into tmp_path/two: their manifests, and `torchrun(output, *flags)` that runs the same command again on 2
    ranks. Rank 0 alone reports."""
    data = write_chains(tmp_path / "chains.jsonl", load_tokenizer(model_dir), samples=40)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"model": str(model_dir), "train_data": str(data), "eval_split": 0.2,
                                      "max_steps": 3, "micro_batch": 2, "seq_len": 32, "save_interval": 2,
                                      **{k: list(v) if isinstance(v, tuple) else v for k, v in LORA_RUN.items()},
                                      **settings}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    args = ["-m", "moeswap", "train", str(config), "--no-progress"]
    one = subprocess.run([sys.executable, *args, "--output", str(tmp_path / "one")], env=env, capture_output=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr.decode()[-2000:]

    def torchrun(output, *flags):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                              str(free_port()), *args, "--output", str(output), *flags], env=env, capture_output=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr.decode()[-3000:]
        return run

    assert torchrun(tmp_path / "two").stdout.decode().count("trained 3 steps") == 1  # rank 0 reports
    one, two = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in ("one", "two"))
    return one, two, torchrun


def test_torchrun_lora_training_equals_one_process(tiny_k3_dir, tmp_path):
    *manifests, torchrun = train_alone_and_under_torchrun(tiny_k3_dir, tmp_path, ep_mode="replicated")
    assert (manifests[1]["expert_parallel"]["world_size"], manifests[1]["expert_parallel"]["mode"]) == (2, "replicated")
    assert [c["loss"] for c in manifests[0]["curve"]] == [c["loss"] for c in manifests[1]["curve"]]
    assert [c["grad_norm"] for c in manifests[0]["curve"]] == [c["grad_norm"] for c in manifests[1]["curve"]]
    assert manifests[0]["eval"] == manifests[1]["eval"]
    for name in (WEIGHTS_NAME, CONFIG_NAME):  # one PEFT file, routed experts' adapters included
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    # the step-2 checkpoint: expert LoRA and its AdamW moments gathered from their owners into one
    # process's layout
    ck = [checkpoint_dir(tmp_path / d, 2) for d in ("one", "two")]
    assert (ck[0] / PARAMS).read_bytes() == (ck[1] / PARAMS).read_bytes()
    opt = [torch.load(c / OPTIMIZER, weights_only=True)["optimizer"] for c in ck]
    assert opt[0]["param_groups"] == opt[1]["param_groups"] and opt[0]["state"].keys() == opt[1]["state"].keys()
    for i, st in opt[0]["state"].items():
        assert all(torch.equal(v, opt[1]["state"][i][k]) for k, v in st.items()), i
    # one process's checkpoint resumed on 2 ranks (split again there) ends with one process's adapter
    # (a run resumes in its own --output: one's results moved aside, its checkpoints left in place)
    reference = (tmp_path / "one" / WEIGHTS_NAME).read_bytes()
    for entry in (tmp_path / "one").iterdir():
        if entry.name != CHECKPOINTS:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    torchrun(tmp_path / "one", "--resume")
    resumed = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert [c["loss"] for c in resumed["curve"]] == [c["loss"] for c in manifests[0]["curve"]]
    assert (tmp_path / "one" / WEIGHTS_NAME).read_bytes() == reference


def test_expert_lora_and_its_optimizer_state_live_on_the_owner_only(tiny_k3_dir, tmp_path):
    """Two clipped AdamW steps with the routed experts' LoRA split by owner (distributed/lora_shards.py):
    each rank holds E/N experts' rows of every expert-LoRA tensor and of their AdamW moments, and the
    gradient norms, parameters and optimizer state gathered whole are one process's, bit for bit."""
    from distributed.ep_worker import lora_step_inputs
    from distributed.test_expert_parallel import launch
    from moeswap.train.loop import make_optimizer

    model, store, cfg, params, tokens, weights = lora_step_inputs(str(tiny_k3_dir), 1 << 30)
    try:
        optimizer = make_optimizer(params, cfg)
        norms = []
        for _ in range(2):
            (model(tokens).double() * weights).sum().backward()
            norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in params if p.grad is not None], 1e-3).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        want = {n: p.detach() for n, p in params}
        want_opt = optimizer.state_dict()
    finally:
        store.close()
    E = model.config.moe.num_experts
    results, codes, _ = launch({"model": str(tiny_k3_dir), "split_lora": True, "budget": 1 << 30}, tmp_path)
    assert codes == [0, 0], [r.get("error") for r in results]
    for res in results:
        assert res["held"] and all(shape[0] == E // 2 for shape in res["held"].values())
        assert res["state_shapes"] and all(shape[0] == E // 2 for shape in res["state_shapes"])
        assert res["norms"] == norms
        assert res["params"].keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(res["params"][name], value), name
        assert res["optimizer"]["param_groups"] == want_opt["param_groups"]
        assert res["optimizer"]["state"].keys() == want_opt["state"].keys()
        for i, st in want_opt["state"].items():
            for k, v in st.items():
                assert torch.equal(res["optimizer"]["state"][i][k], v), (i, k)


def test_under_torchrun_each_rank_builds_only_its_own_experts_lora_rows(tiny_k3_dir, tmp_path):
    """`moeswap train` under torchrun builds each rank's routed-expert LoRA with only the rows of the experts
    it owns (ExpertLoRA's `experts`; distributed/lora_shards.py then keeps it as it is): no rank ever holds
    another rank's rows at start-up. (The runs above check the values are one process's, bit for bit.)"""
    from distributed.test_expert_parallel import launch
    from moeswap.distributed.placement import contiguous
    from moeswap.models.loader import LoadOptions, load_model

    data = write_chains(tmp_path / "chains.jsonl", load_tokenizer(tiny_k3_dir), samples=20)
    config = {"model": str(tiny_k3_dir), "train_data": str(data), "eval_split": 0.2, "max_steps": 1,
              "micro_batch": 2, "seq_len": 32, "ep_mode": "replicated", "output": str(tmp_path / "run"),
              **{k: list(v) if isinstance(v, tuple) else v for k, v in LORA_RUN.items()}}
    results, codes, _ = launch({"train_rows": True, "config": config}, tmp_path, wait_s=400)
    assert codes == [0, 0], [r.get("error") for r in results]
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    store.close()
    placement = contiguous(model.config, 2)
    layers = [b.layer_idx for b in model.moe_blocks()]
    E = model.config.moe.num_experts
    for rank, res in enumerate(results):
        assert [b[2] for b in res["built"]] == [tuple(placement.owned(rank, layer)) for layer in layers]
        assert all(n == E and rows == [E // 2] for n, rows, _ in res["built"])
    assert (tmp_path / "run" / WEIGHTS_NAME).exists()
