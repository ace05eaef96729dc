"""Run llama.cpp's own HF -> GGUF converter (`convert_hf_to_gguf.py` from the llama-cpp-python sdist,
extracted by scripts/setup-peers.sh) on a moeswap checkpoint directory.

The one change to its behaviour: a tokenizer whose pre-tokenizer hash llama.cpp does not know (the
project's test tokenizers) is written as llama.cpp's "default" pre-tokenizer instead of refused. The
cross-checks compare token ids, never text, so the pre-tokenizer does not enter any result.
Usage: python -m moeswap.bench.peers.convert_gguf CONVERTER_DIR MODEL_DIR --outfile OUT.gguf [flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: convert_gguf CONVERTER_DIR MODEL_DIR --outfile OUT.gguf [converter flags]")
    converter = Path(argv[0]).resolve()
    script = converter / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"{script} not found: run scripts/setup-peers.sh first")
    sys.path.insert(0, str(converter))
    import conversion.base as base  # the converter's own package, found next to the script

    known = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # unrecognised hash: a test tokenizer
            return "default"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
