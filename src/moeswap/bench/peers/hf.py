"""The transformers peer: `KimiLinearForCausalLM` (eager, CPU, fp32) on a Kimi Linear checkpoint.

Its KDA runs transformers' pure-PyTorch fallbacks (flash-linear-attention is CUDA-only). Batches are
prompts of one length (the benchmarks use equal lengths), so no padding enters the comparison.
Entry points: `available()`, `TransformersRunner(model_dir, threads)`.
"""

from __future__ import annotations

import time

NAME = "transformers KimiLinearForCausalLM (eager, fp32)"


def available() -> tuple[bool, str]:
    try:
        import transformers
        from transformers import KimiLinearForCausalLM  # noqa: F401
    except Exception as err:
        return False, f"transformers with KimiLinearForCausalLM is not importable ({type(err).__name__}: {err})"
    return True, f"transformers {transformers.__version__}"


class TransformersRunner:
    name = NAME

    def __init__(self, model_dir: str, threads: int):
        import torch
        from transformers import KimiLinearForCausalLM

        self.torch = torch
        torch.set_num_threads(threads)
        self.model = KimiLinearForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy over a batch of equal-length prompts: one batched prefill, then one token per step."""
        torch = self.torch
        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the transformers peer takes prompts of one length (no padding)")
        with torch.no_grad():
            t0 = time.perf_counter()
            out = self.model(torch.tensor(prompts), use_cache=True, logits_to_keep=1)
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
