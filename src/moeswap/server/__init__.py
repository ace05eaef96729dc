"""`moeswap serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

protocol.py (wire format, request checks), output.py (a chat answer split into
reasoning, content and tool calls; its text and stop strings: text/output.py), engine_loop.py (the thread
that owns the Scheduler), metrics.py (Prometheus), app.py (FastAPI routes), options.py and cli.py (flags).
"""
