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
}
