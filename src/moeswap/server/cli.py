"""`moeswap serve MODEL`: load the model once and serve it over HTTP with uvicorn (server.app).

Binds to loopback unless --host says otherwise. The API key comes from --api-key or MOESWAP_API_KEY (a
flag shows in the process list; the environment does not). Entry points: `add_parser(subparsers)`, `run(args)`.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

from moeswap.options import LoadOptions, add_load_flags, add_model_argument

API_KEY_ENV = "MOESWAP_API_KEY"


def add_parser(sub) -> None:
    from moeswap.server.options import DEFAULT_MAX_CONTEXT, ServeOptions

    d = ServeOptions()
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (continuous batching)")
    add_model_argument(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV} if set)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the name clients give as `model` (default: the model directory's name, e.g. stdlib-k3; "
                        "MODEL as given is accepted too)")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help=f"sequences decoded together (default {d.max_batch})")
    p.add_argument("--max-queue", type=int, default=d.max_queue,
                   help=f"requests waiting for a slot; more get HTTP 429 (default {d.max_queue})")
    p.add_argument("--max-context", type=int, default=None,
                   help=f"prompt + generated tokens per request (default: the model's, at most {DEFAULT_MAX_CONTEXT})")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve the LoRA adapter in PATH (PEFT format) as model NAME beside the base model; "
                        "repeat for more (requests with different adapters share the batch)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="accept POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's endpoints): "
                        "adapters loaded and unloaded while serving, from directories on this machine")
    p.add_argument("--max-loras", type=int, default=d.max_loras,
                   help=f"adapters served at once, --lora and runtime loads together (default {d.max_loras})")
    p.add_argument("--reference-step", action="store_true",
                   help="decode through the model's modules (the reference), not the native C step")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    add_load_flags(p)
    from moeswap.distributed.cli import add_ep_flags

    add_ep_flags(p, mode="data-parallel")


def run(args) -> int:
    import uvicorn

    from moeswap.config import load_config
    from moeswap.hub import repo_id_of
    from moeswap.lora.serving import load_adapters, read_adapters, serve_adapters
    from moeswap.models.loader import load_model
    from moeswap.server.app import build_app
    from moeswap.server.options import ServeOptions
    from moeswap.text.tokenizer import load_tokenizer

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    # a hub cache snapshot is served as org/name (its directory's name is a commit hash)
    default_name = repo_id_of(args.model) or Path(args.model).resolve().name or args.model
    options = ServeOptions(model_name=args.served_model_name or default_name,
                           model_aliases=() if args.served_model_name else (args.model,), api_key=api_key,
                           max_batch=args.max_batch, max_queue=args.max_queue, max_context=args.max_context,
                           native=not args.reference_step, lora=tuple(_lora_flag(v) for v in args.lora),
                           allow_runtime_lora=args.allow_runtime_lora, max_loras=args.max_loras)
    options.resolve_max_context(load_config(args.model).max_position_embeddings)
    # every flag is checked before the model loads, the adapters too (their files, their base's fingerprint)
    adapters = read_adapters(options.lora, args.model) if options.lora else []
    # the port is taken before the model loads (minutes for a large one), so a port in use is said at once
    sock = _listen_socket(args.host, args.port) if os.environ.get("RANK", "0") == "0" else None
    if api_key is None and not _loopback(args.host):
        print(f"moeswap: warning: serving on {args.host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    from moeswap.distributed.cli import bind_local_device, join_if_launched, lead

    bind_local_device(args)
    model, store = load_model(args.model, LoadOptions.from_args(args))
    ep = None
    try:
        ep = join_if_launched(model, args)  # under torchrun: rank 0 serves HTTP, the others step in lockstep
        if ep is not None and (adapters or options.allow_runtime_lora):
            raise ValueError(f"{'--lora' if adapters else '--allow-runtime-lora'} is not supported under expert "
                             f"parallelism yet")
        if not lead(ep):
            from moeswap.distributed.lockstep import follow

            follow(model, ep)
            return 0
        extra = {}
        if ep is not None:
            from moeswap.distributed.lockstep import leader_scheduler

            extra["scheduler"] = leader_scheduler(ep)
        served = (load_adapters(model, adapters, args.model) if adapters else
                  serve_adapters(model, args.model) if options.allow_runtime_lora else None)
        app = build_app(model, load_tokenizer(args.model), options, store, adapters=served, **extra)
        srv = app.state.server
        print(f"moeswap: serving {srv.name!r} on http://{args.host}:{sock.getsockname()[1]}/v1 (max batch {options.max_batch}, "
              f"queue {options.max_queue}, context {srv.max_context} tokens, tool calls: "
              f"{srv.tool_format.name if srv.tool_format else 'not parsed'}, reasoning: "
              f"{srv.layout.name if srv.layout else 'not parsed'}"
              + (f", LoRA adapters: {', '.join(srv.adapters)}" if srv.adapters else "")
              + (", runtime LoRA loading on" if options.allow_runtime_lora else "") + ")",
              file=sys.stderr, flush=True)
        if ep is not None:  # uvicorn re-raises SIGTERM after its graceful stop: end here, so the ranks leave together
            signal.signal(signal.SIGTERM, _stopped)
        try:
            config = uvicorn.Config(app, host=args.host, port=sock.getsockname()[1], log_level=args.log_level)
            uvicorn.Server(config).run(sockets=[sock])  # host and port: what its startup line says
        except (_Stopped, KeyboardInterrupt):  # Ctrl-C: a graceful stop (uvicorn re-raises it once shut down)
            pass
    finally:
        if sock is not None:
            sock.close()
        store.close()
        if ep is not None:
            from moeswap.distributed.lockstep import stop_followers
            from moeswap.distributed.runtime import shutdown

            if lead(ep):
                stop_followers(ep)
            shutdown(ep)
    if ep is not None and ep.failed is not None:
        raise ep.failed  # one line from the CLI, exit 1
    return 0


class _Stopped(Exception):
    """SIGTERM after uvicorn's graceful stop, under expert parallelism (the other ranks are told to stop)."""


def _stopped(signum, frame):
    raise _Stopped


def _lora_flag(value: str) -> tuple[str, str]:
    """--lora NAME=PATH -> (NAME, PATH); serve needs the name (the `model` requests give)."""
    from moeswap.cli import parse_lora

    name, path = parse_lora(value)
    if name is None:
        raise ValueError(f"--lora {value!r}: serve needs NAME=PATH (NAME: the `model` requests give to use it)")
    return name, path


def _listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on; ValueError naming the port when it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own bind: TIME_WAIT is no conflict
    try:
        sock.bind(address)
        sock.listen(2048)  # clients that connect before uvicorn starts wait in the backlog (uvicorn's own size)
    except OSError as e:
        sock.close()
        why = "is already in use (another server?)" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise ValueError(f"--port {port}: {host}:{port} {why}; choose another --port or stop what holds it") from None
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
