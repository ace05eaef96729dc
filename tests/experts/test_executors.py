"""Expert executors (experts/executors.py) as a contract over the registry: every registered executor, on the
same routed inputs, gives the reference executor's output (each expert's format reference, summed in fp32)
within fp32 rounding: BOUND of the output's largest magnitude. And `choose` picks the executor from what is
set on the block, again whenever that changes."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from moeswap.experts import executors
from moeswap.experts.executors import EXECUTORS, ReferenceExecutor
from moeswap.lora.multi import AdapterRows
from moeswap.models.layers.expert_lora import ExpertLoRA
from moeswap.models.loader import LoadOptions, load_model
from moeswap.train.experts import make_experts_trainable

BOUND = 1e-5  # the kernels and the reference sum the same fp32 products in other orders


def _served(model, block):
    """Served adapters with routed-expert LoRA (B zero: the base experts' output) in slot 1; returns use(T), the
    rows' context: odd rows through the adapter (the torch path), even rows on the kernels."""
    rows = AdapterRows(1)
    lora = ExpertLoRA(block.num_experts, block.expert_shapes, 4, 8.0, generator=torch.Generator().manual_seed(0))
    block.serve_expert_lora(rows).add(1, lora)
    return lambda T: rows.use(tuple(i % 2 for i in range(T)))


def _trainable(model, block):
    make_experts_trainable(model)
    return None


def _hybrid(model, block):
    """The fast tier filled with other layers' experts first, so that this step's come from host memory."""
    for other in model.moe_blocks():
        if other is not block:
            list(other.store.hybrid.fetch(other.layer_idx, range(other.num_experts), tokens=1))


def _hybrid_options(expert_bytes: int) -> dict:
    return {"expert_memory": expert_bytes // 4, "expert_compute": "cpu"}  # a quarter: some experts from the host


# what a kind needs set on the model before cls(block) (may return a per-call context); OPTIONS: its load
# options. A kind without entries is made from the block as loaded.
SETUP = {"served-lora": _served, "trainable-parameters": _trainable, "hybrid": _hybrid}
OPTIONS = {"hybrid": _hybrid_options}


def _inputs(model, block, T: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, model.config.hidden_size, generator=gen)
    with torch.no_grad():
        ids_TK, w_TK = block.gate(x_TD)
    return torch.randn(T, block.expert_width, generator=gen), ids_TK, w_TK


@pytest.fixture(scope="module")
def all_bytes(tiny_k3_dir) -> int:
    """The tiny K3's expert bytes in the fast tier."""
    _, probe = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    probe.close()
    return sum(probe.fast.cost(k) for k in probe.index.entries)


@pytest.mark.parametrize("kind", sorted(EXECUTORS))
@pytest.mark.parametrize("T", [3, 40])  # a decode step (the resident table takes it), a prefill step (GEMM path)
def test_every_executor_gives_the_reference_output(kind, T, tiny_k3_dir, all_bytes):
    options = OPTIONS.get(kind, lambda _: {})(all_bytes)
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32", **options))
    block = model.moe_blocks()[1]
    h_TI, ids_TK, w_TK = _inputs(model, block, T, seed=T)
    with torch.no_grad():
        use = SETUP[kind](model, block) if kind in SETUP else None
        executor = EXECUTORS[kind](block)
        gots = []
        for _ in range(2):  # the second time the experts are resident (tables filled)
            with use(T) if use is not None else nullcontext():
                gots.append(executor(h_TI, ids_TK, w_TK))
        want = ReferenceExecutor(block)(h_TI, ids_TK, w_TK)  # after: its fetches would make every expert resident
    for attempt, got in enumerate(gots):
        torch.testing.assert_close(got, want, rtol=0, atol=BOUND * want.abs().max().item(),
                                   msg=lambda m, attempt=attempt: f"{executor.name}, call {attempt}: {m}")


def test_the_resident_table_and_the_host_split_really_run(tiny_k3_dir, all_bytes, monkeypatch):
    """The contract above is not met by falling back: the table serves a decode step once its experts are
    resident, and the hybrid executor computes host experts apart (OnHost) when forced to run apart."""
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    block = model.moe_blocks()[1]
    h_TI, ids_TK, w_TK = _inputs(model, block, 3, seed=1)
    table_runs = []
    real = executors.ResidentTable.run
    monkeypatch.setattr(executors.ResidentTable, "run", lambda self, *a: table_runs.append(real(self, *a))
                        or table_runs[-1])
    with torch.no_grad():
        block.run_experts(h_TI, ids_TK, w_TK)
        block.run_experts(h_TI, ids_TK, w_TK)
    assert block.executor.name == "resident-table" and table_runs[-1] is True
    monkeypatch.setattr(executors, "runs_apart", lambda device: True)  # as on an accelerator
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32", **_hybrid_options(all_bytes)))
    finished = []
    real_finish = executors.OnHost.finish
    monkeypatch.setattr(executors.OnHost, "finish", lambda self, out: finished.append(1) or real_finish(self, out))
    blocks = model.moe_blocks()
    assert {b.executor.name for b in blocks} == {"hybrid"}
    with torch.no_grad():
        for block in blocks:  # the quarter fills up with the first layers' experts; later ones come from the host
            h_TI, ids_TK, w_TK = _inputs(model, block, 3, seed=2)
            got = block.run_experts(h_TI, ids_TK, w_TK)  # first: the reference's fetch would load them all
            want = ReferenceExecutor(block)(h_TI, ids_TK, w_TK)
            torch.testing.assert_close(got, want, rtol=0, atol=BOUND * want.abs().max().item())
    assert finished and store.stats.hybrid.cpu_steps == len(finished)


def test_choose_follows_what_is_set_on_the_block(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    block = model.moe_blocks()[0]
    assert block.executor.name == "resident-table"
    block.attach_expert_lora(4, 8.0)
    assert block.executor.name == "torch-autograd"
    block.detach_expert_lora()
    assert block.executor.name == "resident-table"
    block.serve_expert_lora(AdapterRows(1))
    assert block.executor.name == "served-lora(resident-table)"
    del block.served_lora
    block.store = None
    assert block.executor.name == "no-store"
    with pytest.raises(RuntimeError, match="no expert store attached"):
        block.run_experts(*_inputs(model, block, 2, seed=0))
    block.store = store
    assert block.executor.name == "resident-table"
    make_experts_trainable(model)
    assert {b.executor.name for b in model.moe_blocks()} == {"trainable-parameters"}


def test_a_wrapper_survives_a_new_choice(tiny_k3_dir):
    """Expert parallelism wraps the block's executor (MoE.wrap_executor): attaching LoRA later is wrapped too."""
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    block = model.moe_blocks()[0]

    class Named(executors.ExpertExecutor):
        def __init__(self, inner):
            self.inner, self.name = inner, f"wrapped({inner.name})"

    block.wrap_executor(Named)
    assert block.executor.name == "wrapped(resident-table)"
    block.attach_expert_lora(4, 8.0)
    assert block.executor.name == "wrapped(torch-autograd)"


def test_a_call_that_wants_gradients_runs_as_torch_ops(tiny_k3_dir):
    """The one per-call decision: inputs that want gradients take the torch path (autograd sees the experts)."""
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    block = model.moe_blocks()[0]
    h_TI, ids_TK, w_TK = _inputs(model, block, 3, seed=3)
    h_TI.requires_grad_()
    assert block.executor.in_torch(h_TI, w_TK)
    out = block.run_experts(h_TI, ids_TK, w_TK)
    out.sum().backward()
    assert h_TI.grad is not None and h_TI.grad.abs().sum() > 0
    with torch.no_grad():
        assert not block.executor.in_torch(h_TI, w_TK)
        torch.testing.assert_close(block.run_experts(h_TI, ids_TK, w_TK), out.detach(), rtol=0,
                                   atol=BOUND * out.abs().max().item())
