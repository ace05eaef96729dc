"""The expert store: routed experts live outside the model and are fetched per (layer, expert)."""
