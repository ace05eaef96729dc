"""Expert parallelism as one more executor (distributed/ep.py ExpertParallelExecutor), in one process (a gloo
group of one rank): it wraps each block's own executor, names it, keeps the single process's bits, wraps a
later choice too, and refuses what it cannot split."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeswap.distributed.ep import apply_expert_parallel
from moeswap.lora.multi import AdapterRows
from moeswap.models.loader import LoadOptions, load_model

PROMPT = torch.tensor([[5, 17, 300, 42, 8, 99, 3]])


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("data_parallel,name", [(False, "expert-parallel"), (True, "token-dispatch")])
def test_it_wraps_the_blocks_executor_and_keeps_the_bits(tiny_k3_dir, one_rank, data_parallel, name):
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    with torch.no_grad():
        want = model(PROMPT)
    apply_expert_parallel(model, data_parallel=data_parallel)
    blocks = model.moe_blocks()
    assert {b.executor.name for b in blocks} == {f"{name}(resident-table)"}
    assert all(b.resident_table() is None for b in blocks)  # the native step must not run every expert itself
    with torch.no_grad():
        assert torch.equal(model(PROMPT), want)
    blocks[0].attach_expert_lora(4, 8.0)  # a later choice is wrapped too
    assert blocks[0].executor.name == f"{name}(torch-autograd)"
    with torch.no_grad():
        assert torch.allclose(model(PROMPT), want, rtol=0, atol=1e-4 * want.abs().max().item())  # B zero


def test_served_expert_lora_is_refused(tiny_k3_dir, one_rank):
    model, _ = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))
    apply_expert_parallel(model)
    block = model.moe_blocks()[0]
    block.serve_expert_lora(AdapterRows(1))
    assert block.executor.name == "expert-parallel(served-lora(resident-table))"
    with pytest.raises(NotImplementedError, match="served expert LoRA .* not supported under expert parallelism"):
        with torch.no_grad():
            model(PROMPT)
