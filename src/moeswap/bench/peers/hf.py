"""The transformers peer: `KimiLinearForCausalLM` (eager) on a Kimi Linear checkpoint, on the device and in the
dtype the benchmark gives moeswap (`--device`, `--dtype`; "auto" as moeswap resolves it: fp32 on the CPU,
bf16 on a GPU).

On the CPU its KDA runs transformers' pure-PyTorch fallbacks (flash-linear-attention is CUDA-only); on CUDA
transformers takes flash-linear-attention's kernels where that is installed. Batches are
prompts of one length (the benchmarks use equal lengths), so no padding enters the comparison.
Entry points: `available()`, `TransformersRunner(model_dir, threads, device, dtype)`.
"""

from __future__ import annotations

import time


def available() -> tuple[bool, str]:
    try:
        import transformers
        from transformers import KimiLinearForCausalLM  # noqa: F401
    except Exception as err:
        return False, f"transformers with KimiLinearForCausalLM is not importable ({type(err).__name__}: {err})"
    return True, f"transformers {transformers.__version__}"


class TransformersRunner:
    def __init__(self, model_dir: str, threads: int, device: str = "cpu", dtype: str = "auto"):
        import torch
        from transformers import KimiLinearForCausalLM

        from moeswap.models.loader import resolve_dtype

        self.torch, self.device = torch, torch.device(device)
        torch.set_num_threads(threads)
        dt = resolve_dtype(dtype, device)
        self.model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=dt).to(self.device).eval()
        self.name = f"transformers KimiLinearForCausalLM (eager, {str(dt).removeprefix('torch.')}, {self.device.type})"

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy over a batch of equal-length prompts: one batched prefill, then one token per step."""
        torch = self.torch
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the transformers peer takes prompts of one length (no padding)")
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(torch.tensor(prompts, device=self.device), use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
            ttft = time.perf_counter() - t0
            outs = [[t] for t in nxt.tolist()]
            cache = out.past_key_values
            t1 = time.perf_counter()
            for _ in range(max_tokens - 1):
                out = self.model(nxt[:, None], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                nxt = out.logits[:, -1].argmax(-1)
                for o, t in zip(outs, nxt.tolist()):
                    o.append(t)
            decode_s = time.perf_counter() - t1
        return {"tokens": outs, "ttft_s": ttft, "decode_s": decode_s, "decoded": max_tokens - 1}
