"""Generation engine: per-sequence state, sampling and scheduling; it works on token ids only.
tokenizer.py is the text side, imported only by the CLI and the server."""
