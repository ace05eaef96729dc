"""`moeswap generate --json` / `--stats` name the paths that ran: the MoE blocks' expert executor
(experts/executors.py) and the decode step (EngineStats.decode_step)."""

from __future__ import annotations

import pytest
import torch

from moeswap.cli import main
from moeswap.lora import LoRAConfig, attach_lora, fingerprint, save_adapter
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels

PROMPT = "the quick brown fox"
needs_kernel = pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel (the native step needs it)")


def generate(capsys, strict_json, model, *flags: str) -> dict:
    code = main(["generate", str(model), "--prompt", PROMPT, "--max-tokens", "4", "--ignore-eos", "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return strict_json(out.strip())


@needs_kernel
def test_default_cpu_run_names_the_resident_table_and_the_native_step(capsys, strict_json, tiny_k3_dir):
    got = generate(capsys, strict_json, tiny_k3_dir)
    assert got["expert_executor"] == "resident-table"
    assert got["decode_step"] == "native-c" and got["native_decode_steps"] == 3


def test_reference_step_names_the_modules(capsys, strict_json, tiny_k3_dir):
    got = generate(capsys, strict_json, tiny_k3_dir, "--reference-step")
    assert got["expert_executor"] == "resident-table"
    assert got["decode_step"] == "reference" and got["native_decode_steps"] == 0


def test_one_token_runs_no_decode_step(capsys, strict_json, tiny_k3_dir):
    got = generate(capsys, strict_json, tiny_k3_dir, "--max-tokens", "1")
    assert got["decode_step"] is None and got["expert_executor"] == "resident-table"


@needs_kernel
def test_an_expert_memory_budget_keeps_the_table_and_the_native_step(capsys, strict_json, tiny_k3_dir):
    got = generate(capsys, strict_json, tiny_k3_dir, "--expert-memory", "64KiB")
    assert got["expert_store"]["tiers"]["fast"]["evictions"] > 0  # the budget is below the experts
    assert got["expert_executor"] == "resident-table" and got["decode_step"] == "native-c"


def test_expert_lora_runs_served_and_the_modules_decode(capsys, strict_json, tiny_k3_dir, tmp_path):
    model, _ = load_model(tiny_k3_dir, LoadOptions())
    attach_lora(model, LoRAConfig(r=4, alpha=8, target_modules=("q_proj", "w1", "w3")),
                generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    adapter = save_adapter(model, tmp_path / "adapter", base_fingerprint=fingerprint(tiny_k3_dir))
    got = generate(capsys, strict_json, tiny_k3_dir, "--lora", str(adapter))
    assert got["expert_executor"] == "served-lora(resident-table)"
    assert got["decode_step"] == "reference" and got["native_decode_steps"] == 0


def test_stats_line_names_them(capsys, tiny_k3_dir):
    code = main(["generate", str(tiny_k3_dir), "--prompt", PROMPT, "--max-tokens", "3", "--stats",
                 "--reference-step"])
    _, err = capsys.readouterr()
    assert code == 0
    assert "expert executor resident-table, last decode step reference" in err
