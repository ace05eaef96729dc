"""Expert parallelism on torch.distributed, applied from outside the model: placement.py (which rank owns
which routed expert), ep.py (the MoE blocks' exchange: `apply_expert_parallel(model, group, placement)`),
dispatch.py (data-parallel attention: each rank's own tokens sent to the experts' owners and back),
lora_shards.py (training: each routed expert's LoRA and optimizer state on its owner only), grads.py
(data-parallel training: the replicated parameters' gradients of every rank's micro-batches, summed in order),
runtime.py (process group from torchrun's environment, start-up checks, heartbeat:
`init_expert_parallel`), cli.py (flags and rank 0's inputs for the commands), lockstep.py (serve: the other
ranks step a copy of rank 0's scheduler), launch.py (local ranks as torchrun starts them). Importing this package
imports nothing else (the CLI's parser reads cli.py without loading torch)."""
