"""moeswap: run, swap, serve, fine-tune and plan Kimi K3-class mixture-of-experts models."""

__version__ = "0.1.0"
