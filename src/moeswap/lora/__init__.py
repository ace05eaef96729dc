"""LoRA adapters on moeswap models: the wrapper (layer.py), target selection and attaching (targets.py),
PEFT's adapter format (config.py, peft_io.py), the base fingerprint (fingerprint.py) and merging into a
checkpoint (merge.py, `moeswap merge`); several adapters served at once, per request (multi.py, serving.py:
`moeswap serve --lora`). Training loops live in moeswap.train and use the entry points here.
"""

from moeswap.lora.config import CONFIG_NAME, MOESWAP_NAME, WEIGHTS_NAME, LoRAConfig
from moeswap.lora.fingerprint import check_same_base, fingerprint
from moeswap.lora.layer import LoRALinear
from moeswap.lora.peft_io import adapter_state_dict, load_adapter, read_adapter, save_adapter, write_adapter
from moeswap.lora.targets import attach_lora, detach_lora, lora_modules, resolve_targets, trainable_parameters

__all__ = ["CONFIG_NAME", "MOESWAP_NAME", "WEIGHTS_NAME", "LoRAConfig", "LoRALinear", "adapter_state_dict",
           "attach_lora", "check_same_base", "detach_lora", "fingerprint", "load_adapter", "lora_modules",
           "read_adapter", "resolve_targets", "save_adapter", "trainable_parameters", "write_adapter"]
