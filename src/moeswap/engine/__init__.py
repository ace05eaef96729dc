"""Generation engine: per-sequence state, sampling and scheduling; it works on token ids only.
The text side (tokenizer, chat template) is the moeswap.text package, imported by the CLI and the server."""
