"""Fine-tuning through the same model and expert store inference uses: `moeswap train CONFIG.yaml`.

config.py (TrainConfig, YAML + flags), data.py (JSONL -> token rows with loss masks), targets.py (what
trains: LoRA through moeswap.lora, routed experts included, or full parameters), loop.py (AdamW,
schedule, eval, progress), checkpoint.py (atomic checkpoints, --resume), manifest.py (the run's record, --reproduce), cli.py.
"""
