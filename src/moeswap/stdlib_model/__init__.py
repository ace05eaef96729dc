"""The default model: a small K3-architecture model moeswap trains itself on the Python standard library.

corpus.py (the text and its split), recipe.py (the steps that rebuild the model: corpus, tokenizer and a
freshly initialised K3-layout base, the training config; `python -m moeswap.stdlib_model prepare DIR`).
The model card (models/stdlib-k3/README.md) records what a run produced.
"""
