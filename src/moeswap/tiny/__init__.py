"""`moeswap init-tiny`: small random models, with their tokenizers, in the exact published checkpoint layout.

model.py writes the config and weights (`write_tiny_model`) at a size from sizes.py; tokenizer.py trains
the tiny tokenizers on corpus.txt. Entry point: `write_tiny_model(out_dir, arch, size, seed)`. The
package imports model.py (and torch) only when one of its names is used, so the CLI can read SIZES.
"""

from moeswap.tiny.sizes import SIZES

__all__ = ["SIZES", "tiny_config", "write_tiny_model"]


def __getattr__(name: str):
    if name in ("tiny_config", "write_tiny_model"):
        from moeswap.tiny import model

        return getattr(model, name)
    raise AttributeError(f"module 'moeswap.tiny' has no attribute {name!r}")
