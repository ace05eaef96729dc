"""The sizes init-tiny writes, by name (torch-free: the CLI takes its --size choices from here)."""

SIZES = {
    # tests: every feature on, seconds to write
    "tiny": dict(hidden=64, layers=6, vocab=512, heads=2, head_dim=32, kv_lora=32, q_lora=32, nope=16, rope=8,
                 experts=16, top_k=4, expert_dim=64, latent=32, dense=128, res_block=2),
    # `make demo`: a few tens of MB
    "small": dict(hidden=256, layers=8, vocab=2048, heads=4, head_dim=32, kv_lora=64, q_lora=64, nope=32, rope=16,
                  experts=64, top_k=8, expert_dim=256, latent=128, dense=512, res_block=4),
    # the trained default model (stdlib_model/): 30.5 M parameters (22 M in 32 routed experts a layer), ~10 M
    # active a token; vocab from its own BPE
    "stdlib": dict(hidden=256, layers=8, vocab=4096, heads=4, head_dim=64, kv_lora=64, q_lora=96, nope=32, rope=16,
                   experts=32, top_k=4, expert_dim=256, latent=128, dense=768, res_block=4),
    # benchmarks and memory checks: ~0.96 B parameters (the engine benchmark's 0.3-1 B), 0.45 GB of MXFP4 experts;
    # an architecture may take other widths from these (archs/deepseek_v3.py: full-width experts)
    "bench": dict(hidden=1024, layers=12, vocab=4096, heads=8, head_dim=64, kv_lora=128, q_lora=256, nope=64, rope=32,
                  experts=48, top_k=8, expert_dim=1024, latent=512, dense=2048, res_block=4),
    # Kimi K3's own widths (its published config: tests/test_k3_slice.py), cut to its first layers and fewer experts a
    # layer: --layers / --experts pick the cut. 4 layers are K3's first four (dense KDA, KDA, KDA, MLA), 3 MoE
    # layers x 304 experts x 17.55 MB = 16.0 GB of MXFP4 experts (+ 10.4 GB bf16: the embedding and lm_head are
    # 2.35 GB each, the dense MLP 1.45 GB). Written by k3_slice.py, a tensor at a time.
    "k3-slice": dict(hidden=7168, layers=4, vocab=163840, heads=96, head_dim=128, kv_lora=512, q_lora=1536, nope=128,
                     rope=64, experts=304, top_k=16, expert_dim=3072, latent=3584, dense=33792, res_block=12),
}


def dims_for(size: str, layers: int | None = None, experts: int | None = None) -> dict[str, int]:
    """SIZES[size] with its layer count and routed experts a layer changed (init-tiny --layers / --experts)."""
    dims = dict(SIZES[size])
    if layers is not None:
        if layers < 2:
            raise ValueError(f"--layers {layers}: at least 2 (the first layer is dense; routed experts need a second)")
        dims["layers"] = layers
    if experts is not None:
        if experts < dims["top_k"]:
            raise ValueError(f"--experts {experts}: at least the {dims['top_k']} experts a token is routed to")
        dims["experts"] = experts
    return dims
