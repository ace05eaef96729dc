"""`moeswap serve`: an OpenAI-compatible HTTP server over the continuous-batching scheduler.

protocol.py (wire format, request checks), engine_loop.py (the thread that owns the Scheduler), metrics.py
(Prometheus), app.py (FastAPI routes), options.py and cli.py (flags). A completion's text, reasoning and tool
calls come from the text package (text/output.py, reasoning.py, tool_calls.py), which the Python API shares.
"""
