"""`moeswap init-tiny`: small random models, with their tokenizers, in the exact published checkpoint layout.

model.py writes the config and weights (`write_tiny_model`); tokenizer.py trains the tiny tokenizers on
corpus.txt. Entry point: `write_tiny_model(out_dir, arch, size, seed)`.
"""

from moeswap.tiny.model import ARCHES, SIZES, tiny_config, write_tiny_model

__all__ = ["ARCHES", "SIZES", "tiny_config", "write_tiny_model"]
