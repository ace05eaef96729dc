"""moeswap: run, swap, serve, fine-tune and plan Kimi K3-class mixture-of-experts models.

Importing it changes nothing in the process and imports no torch. `moeswap.load(path, **options)` returns a
`moeswap.LLM` (generate, stream, chat: moeswap/api.py, imported when first named); it tunes the process on
first use as the `moeswap` command does (huge pages, the allocator, OpenMP threads on a busy machine:
`moeswap.tuning.tune_process()`, which a library user may also call first, or leave out with tune=False).
"""

__version__ = "0.1.0"

_API = ("load", "LLM", "Completion")  # moeswap.api's, named here without importing it until asked for


def __getattr__(name: str):
    if name in _API:
        from moeswap import api

        return getattr(api, name)
    raise AttributeError(f"module 'moeswap' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_API])
