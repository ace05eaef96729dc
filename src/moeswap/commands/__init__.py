"""The one-shot commands' CLI code: init_tiny, inspect (and --verify), quantize, trace; each module has
`add_parser(subparsers)` and `run(args) -> int`, and cli.py dispatches to it. The work they do lives with the
primitives (tiny/, summary.py, verify.py, quantize.py, experts/trace.py); nothing outside the CLI imports
this package except the benchmarks (read_prompts).
"""
