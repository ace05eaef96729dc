"""Expert parallelism on torch.distributed, applied from outside the model: placement (which rank owns which
routed expert), ep (the MoE blocks' exchange), dispatch (data-parallel attention), lora_shards and grads
(training), runtime (process group, start-up checks, heartbeat), cli (flags and rank 0's inputs), lockstep
(serving), launch (local ranks as torchrun starts them). Importing this package imports nothing else (the
CLI's parser reads cli.py without loading torch). Entry points: `ep.apply_expert_parallel`,
`runtime.init_expert_parallel`.
"""
