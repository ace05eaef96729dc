"""Text <-> token ids: a checkpoint's tokenizer (tokenizer.py) and chat template (chat_template.py), used by the
CLI, the server, training data and the benchmarks. The engine never imports this package: it works on ids.
Entry point: `moeswap.text.tokenizer.load_tokenizer(model_dir)`.
"""
