"""Data-parallel `moeswap train` under torchrun (--ep-mode data-parallel, the default there) with 2 ranks on
gloo, launched on loopback: micro-batch k of each step on rank k mod 2, each rank's tokens dispatched to the
routed experts' owners and their gradients sent back, the replicated adapters' gradients summed over the
ranks in micro-batch order. Oracle: one process with the same global batch (micro_batch x grad_accum rows
per step). The bits are equal, not merely close: every micro-batch's forward and backward run the rows
and shapes one process runs, each owner backpropagates the sources' rows source by source (the order one
process accumulates its micro-batches' expert-LoRA gradients in), and distributed/grads.py adds the other
gradients in micro-batch order; only an all_reduce of each rank's partial sum would reorder the additions.
With 3 micro-batches on 2 ranks, rank 1 has none of its own in the second round and serves its experts to
rank 0, forward and backward."""

from __future__ import annotations

import pytest
import torch

# arch_dir is a fixture: imported, pytest finds it here too
from distributed.ep_worker import MICRO_BATCHES, dp_lora_gradients
from distributed.test_expert_parallel import arch_dir, launch  # noqa: F401
from distributed.test_train_ep import train_alone_and_under_torchrun
from moeswap.lora import CONFIG_NAME, WEIGHTS_NAME
from moeswap.train.checkpoint import OPTIMIZER, PARAMS, checkpoint_dir

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_torchrun_data_parallel_training_equals_one_process_with_the_global_batch(tiny_k3_dir, tmp_path):
    m1, m2, _ = train_alone_and_under_torchrun(tiny_k3_dir, tmp_path, grad_accum=3)
    assert m1["expert_parallel"] is None
    par = m2["expert_parallel"]
    assert (par["world_size"], par["mode"], par["placement"]) == (2, "data-parallel", "contiguous")
    # every step's 3 micro-batches went through the exchanges forward and backward, not the replicated path
    assert par["rank0"]["backward_exchanges"] > 0 and par["rank0"]["dispatch_bytes_received"] > 0
    assert m2["config"]["ep_mode"] == "data-parallel"
    for key in ("loss", "grad_norm", "tokens", "lr"):
        assert [c[key] for c in m1["curve"]] == [c[key] for c in m2["curve"]], key
    assert m1["eval"] == m2["eval"] and m1["tokens"] == m2["tokens"]
    for name in (WEIGHTS_NAME, CONFIG_NAME):  # one PEFT file, routed experts' adapters included, from rank 0
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    ck = [checkpoint_dir(tmp_path / d, 2) for d in ("one", "two")]  # in one process's layout
    assert (ck[0] / PARAMS).read_bytes() == (ck[1] / PARAMS).read_bytes()
    opt = [torch.load(c / OPTIMIZER, weights_only=True)["optimizer"] for c in ck]
    assert opt[0]["state"].keys() == opt[1]["state"].keys()
    for i, st in opt[0]["state"].items():
        assert all(torch.equal(v, opt[1]["state"][i][k]) for k, v in st.items()), i


def test_data_parallel_lora_step_equals_one_process_with_and_without_checkpointing(arch_dir, tmp_path):
    """One step of 3 micro-batches with LoRA on every target kind: each micro-batch's loss and every
    gradient (the experts' gathered whole from their owners) equal one process's; gradient checkpointing
    recomputes each layer, exchange included, on every rank with tokens, and backward still runs through
    the owners' graphs of the first pass (none is left over)."""
    targets = None if arch_dir.name == "tiny_k3" else ["q_proj", "k_proj", "o_proj", "w1", "w2", "w3"]
    want_losses, want, _ = dp_lora_gradients(str(arch_dir), 1 << 30, False, targets=targets)
    results, codes, _ = launch({"model": str(arch_dir), "dp_train": True, "budget": 1 << 30,
                                "checkpointing": [False, True], "targets": targets}, tmp_path, wait_s=400)
    assert codes == [0, 0], [r.get("error") for r in results]
    for res in results:
        for run in res["runs"]:
            assert run["losses"] == want_losses, run["checkpointing"]
            assert run["grads"].keys() == want.keys()
            for name, g in want.items():
                assert torch.equal(run["grads"][name], g), (run["checkpointing"], name)
            assert run["graphs_left"] == 0
            assert run["dispatch"]["backward_exchanges"] > 0
    assert len(want_losses) == MICRO_BATCHES and any("expert_lora" in n and g.abs().sum() > 0 for n, g in want.items())


def test_a_rank_lost_before_its_backward_is_named_and_the_other_exits(tiny_k3_dir, tmp_path):
    results, codes, elapsed = launch({"model": str(tiny_k3_dir), "dp_train": True, "budget": 1 << 30,
                                      "checkpointing": [False], "die": 1, "timeout": 30}, tmp_path, wait_s=120)
    assert codes == [3, 17]
    assert elapsed < 120  # rank 0 exited on its own: launch kills only at wait_s
    error = results[0]["error"]
    assert error.startswith("PeerLost: rank 0: the expert exchange of layer") and "rank 1 has stopped" in error, error


def test_bf16_autocast_is_refused_in_data_parallel_mode(tiny_k3_dir, monkeypatch):
    from moeswap.train.config import TrainConfig
    from moeswap.train.loop import _join_expert_parallel

    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; refused before joining any process group
    cfg = TrainConfig(model=str(tiny_k3_dir), precision="bf16")
    with pytest.raises(ValueError) as err:
        _join_expert_parallel(None, cfg, cfg.load)
    assert str(err.value) == ("--precision bf16 is not supported with --ep-mode data-parallel yet (an owner computing "
                              "other ranks' tokens outside their forward would miss its autocast); use fp32 or "
                              "--ep-mode replicated")
