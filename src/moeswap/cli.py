"""The `moeswap` command: one thin dispatcher over the subsystems.

Each subcommand parses its flags, calls one library entry point and prints the result. User errors
(bad files, configs, flags, prompts) print one line `moeswap: error: ...` and exit 2 without a
traceback unless --debug is given. A closed output pipe (`moeswap ... | head`) ends any command quietly
with exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib
import os
import select
import sys
import time
import warnings

from moeswap import tuning
from moeswap.atomic_dir import OutOfSpaceError, UnwritableError
from moeswap.jsonio import dumps
from moeswap.options import LoadOptions, add_load_flags, add_model_argument, add_sampling_flags
from moeswap.units import human_bytes

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, FileExistsError, PermissionError,
                                                OutOfSpaceError, UnwritableError)
# OS errors of a write that no atomic writer worded: said in one line with the file, never a traceback
WRITE_ERRNOS = (errno.EROFS, errno.ENOSPC, errno.EDQUOT)

class _Parser(argparse.ArgumentParser):
    """Flag errors as one line, like every other user error (argparse would print the usage first)."""

    def error(self, message: str):
        self.exit(2, f"moeswap: error: {message}; see `{self.prog} --help`\n")


# Subcommands owned by their packages: each module has add_parser(subparsers) and run(args) -> int.
SUBCOMMANDS = {"init-tiny": "moeswap.commands.init_tiny", "inspect": "moeswap.commands.inspect",
               "plan": "moeswap.planner.cli", "quantize": "moeswap.commands.quantize", "trace": "moeswap.commands.trace",
               "serve": "moeswap.server.cli", "train": "moeswap.train.cli", "merge": "moeswap.lora.merge",
               "chat": "moeswap.commands.chat", "download": "moeswap.commands.download"}
FIRST = ("init-tiny",)  # listed before generate in --help (the quickstart's first step); the rest after it
BENCHES = {"memory": "moeswap.bench.memory", "kernels": "moeswap.bench.kernels", "swap": "moeswap.bench.swap",
           "cache": "moeswap.bench.cache", "decode": "moeswap.bench.decode", "prefill": "moeswap.bench.prefill",
           "load": "moeswap.bench.load", "serve": "moeswap.bench.serve.command", "train": "moeswap.bench.train",
           "ep": "moeswap.bench.ep", "gpu-kernels": "moeswap.bench.gpu_kernels", "stream": "moeswap.bench.stream"}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moeswap", description="Run, swap, serve, fine-tune and plan Kimi K3-class MoE models.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name in FIRST:
        importlib.import_module(SUBCOMMANDS[name]).add_parser(sub)

    p = sub.add_parser("generate", help="generate text from a model directory")
    add_model_argument(p)
    p.add_argument("--prompt", required=True, action="append",
                   help="the prompt ('-': read it from standard input); give it several times for several "
                        "sequences, generated one after another (under torchrun: split over the ranks, "
                        "data-parallel attention; docs/distributed.md)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--special-tokens", action="store_true",
                   help="read special-token strings in --prompt (e.g. <|im_end|>) as those tokens, and print the "
                        "special tokens generated; by default a prompt's are text, as user input always is (the chat "
                        "template's own markers are tokens), and generated ones are not printed")
    add_sampling_flags(p, max_tokens=64, seed_help="sampling seed (several --prompt: seed + i for prompt i)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    p.add_argument("--stats", action="store_true", help="print timing and expert-store statistics")
    p.add_argument("--reference-step", action="store_true",
                   help="decode through the model's modules (the reference), not the fast step (the native C step "
                        "on the CPU, CUDA graphs on CUDA)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="N",
                   help="prompt tokens prefilled per step: each distinct routed expert is read once per chunk and "
                        "layer where the store keeps none (default 512)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    shaped = p.add_mutually_exclusive_group()
    shaped.add_argument("--json-schema", metavar="FILE",
                        help="generate JSON that follows the JSON schema in FILE (the server's response_format "
                             "json_schema; docs/serve.md \"Structured output\")")
    shaped.add_argument("--json-object", action="store_true",
                        help="generate a JSON object (the server's response_format json_object)")
    p.add_argument("--lora", action="append", default=[], metavar="[NAME=]PATH",
                   help="apply a LoRA adapter in PEFT format (adapter_config.json + adapter_model.safetensors); "
                        "generate takes one")
    add_load_flags(p)
    from moeswap.distributed.cli import add_ep_flags

    add_ep_flags(p)
    importlib.import_module(SUBCOMMANDS["inspect"]).add_parser(sub)  # (its place in --help, as before)

    p = sub.add_parser("bench", help="measurements side by side with named baselines (JSON + markdown)")
    bench = p.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(bench)
    for name, module in SUBCOMMANDS.items():
        if name not in (*FIRST, "inspect"):
            importlib.import_module(module).add_parser(sub)
    return parser


def check_text(flag: str, text: str) -> None:
    """Text from the command line must be UTF-8: Python hands other bytes over as lone surrogates
    (surrogateescape), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        try:
            raw = text[err.start:err.end].encode("utf-8", "surrogateescape")
            bad = ("byte " if len(raw) == 1 else "bytes ") + raw.hex(" ")
        except UnicodeEncodeError:
            bad = f"lone surrogate {text[err.start]!r}"
        raise ValueError(f"{flag} is not valid UTF-8 ({bad} at character {err.start}): pass UTF-8 text") from None


def parse_lora(value: str) -> tuple[str | None, str]:
    """--lora [NAME=]PATH -> (name or None, path). NAME is a plain identifier; a PATH holding `=` is taken
    whole when it exists as it is."""
    name, sep, path = value.partition("=")
    if sep and name and name.replace("-", "_").replace(".", "_").isidentifier() and not os.path.exists(value):
        return name, path
    return None, value


def read_lora_flag(values: list[str], model_dir: str):
    """The one adapter `generate --lora` names as (name, Adapter), read and checked against the model's
    base fingerprint (before the model loads), or None."""
    if not values:
        return None
    if len(values) > 1:
        raise ValueError(f"--lora: generate applies one adapter, got {len(values)}")
    from moeswap.lora.serving import read_adapters

    name, path = parse_lora(values[0])
    return read_adapters([(name or "adapter", path)], model_dir)[0]


def _stop_ids(args, tok, model) -> tuple[int, ...]:
    """The token ids that end generate's sequences: end of sequence (--chat: and the template's end of turn)."""
    return (tok.chat_stop_ids if args.chat else tok.stop_ids)(model.config.eos_token_ids)


def _structured(args, model, tok, ep):
    """GenerationConfig.constraint for --json-schema / --json-object (None without them)."""
    if args.json_schema is None and not args.json_object:
        return None
    if ep is not None:  # the constraint lives with the tokenizer on rank 0; every rank must choose alike
        raise ValueError("--json-schema and --json-object are not supported under torchrun yet")
    from moeswap.text.structured import ANY_OBJECT, StructuredOutput

    so = StructuredOutput(tok, tok.stop_ids(model.config.eos_token_ids), model.config.vocab_size)
    grammar = so.grammar(args.schema if args.json_schema is not None else ANY_OBJECT,
                         f"--json-schema {args.json_schema}" if args.json_schema is not None else "--json-object")
    return lambda: so.constraint(grammar)


def cmd_generate(args) -> int:
    import torch

    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.sampling import from_flags
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import load_model
    from moeswap.text.output import TextOutput
    from moeswap.text.tokenizer import load_tokenizer

    if args.prompt.count("-") > 1:
        raise ValueError("--prompt -: standard input can be read once; give '-' one time")
    args.prompt = [_stdin_prompt() if text == "-" else text for text in args.prompt]
    for text in args.prompt:
        check_text("--prompt", text)
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1, got {args.prefill_chunk}")
    if args.json_schema is not None:
        from moeswap.text.structured import read_schema

        args.schema = read_schema(args.json_schema)
    if len(args.prompt) > 1:
        return generate_many(args)
    args.prompt = args.prompt[0]
    # every flag is checked before the model loads
    cfg = GenerationConfig(max_tokens=args.max_tokens, seed=args.seed,
                           sampling=from_flags(args))
    lora = read_lora_flag(args.lora, args.model)
    from moeswap.distributed.cli import bind_local_device, finish, from_lead, join_if_launched

    bind_local_device(args)  # under torchrun on CUDA: cuda:LOCAL_RANK
    t0 = time.perf_counter()
    model, store = load_model(args.model, LoadOptions.from_args(args))
    ep = None
    try:
        ep = join_if_launched(model, args)  # under torchrun: this rank's experts; rank 0 owns tokenizer and output
        if ep is not None and lora is not None:
            raise ValueError("--lora is not supported under expert parallelism yet")
        if lora is not None:  # the machinery of `serve --lora`, with one adapter in slot 1 for the request
            from moeswap.lora.serving import load_adapters

            load_adapters(model, [lora])
            cfg = dataclasses.replace(cfg, adapter=1)

        def encode():  # rank 0's part under torchrun (the others get its result, or its error)
            tok = load_tokenizer(args.model)
            messages = [{"role": "user", "content": args.prompt}]
            ids = tok.encode_chat(messages) if args.chat else tok.encode(args.prompt, specials=args.special_tokens)
            return tok, ids, () if args.ignore_eos else _stop_ids(args, tok, model)

        tok, ids, stop_ids, seed = from_lead(ep, encode, cfg.seed)  # every rank runs the same sequence
        load_s = time.perf_counter() - t0
        cfg = dataclasses.replace(cfg, stop_ids=stop_ids, seed=seed, constraint=_structured(args, model, tok, ep))
        out = TextOutput(tok, args.stop, skip_specials=not args.special_tokens) if tok is not None else None
        text: list[str] = []
        on_token = None
        if out is not None:
            if not args.json:
                print(args.prompt if not args.chat else "", end="", flush=True)

            def on_token(token: int) -> bool:
                """Shows the text (--json: keeps it); True at a stop string ends the sequence there (under
                torchrun every rank decodes it to the end: the ranks' steps must stay in lockstep)."""
                piece, stopped = out.push(token)
                text.append(piece)
                if not args.json:
                    print(piece, end="", flush=True)
                return stopped and ep is None
        engine = EngineConfig(max_batch=1, max_len=len(ids) + cfg.max_tokens, native=not args.reference_step,
                              prefill_chunk=args.prefill_chunk)
        try:
            result = generate(model, ids, cfg, on_token=on_token, engine=engine)
        except ValueError:
            if not args.json:
                print(flush=True)  # end the streamed line, so that the error starts on its own
            raise
    finally:
        store.close()
    if not finish(ep):
        return 0
    rate = result.decode_tokens_per_s  # None: nothing decoded after the first token
    stats = {
        "prompt_tokens": result.prompt_tokens, "completion_tokens": len(result.tokens),
        "finish_reason": result.finish_reason, "load_s": round(load_s, 3),
        "ttft_ms": round(result.ttft_s * 1e3, 2), "decode_tokens_per_s": None if rate is None else round(rate, 2),
        "expert_store": store.stats.as_dict(), "native_decode_steps": result.native_steps,
        # tokens through the model: the prompt and each generated token but the last
        "expert_bytes_per_token": store.stats.disk_bytes / max(1, result.prompt_tokens + len(result.tokens) - 1),
        "decode_step": result.decode_step, "expert_executor": result.expert_executor,
        "graph_capture_s": round(result.graph_capture_s, 4),
        "state_bytes": result.state_bytes, "lora": None if lora is None else str(lora[1].directory),
        "threads": torch.get_num_threads(), "openmp": tuning.last_fit.summary() if tuning.last_fit else None,
    }
    if ep is not None:
        stats["expert_parallel"] = {"world": ep.world, "placement": ep.placement.kind, "rank0": ep.stats.as_dict()}
    text.append(out.finish())
    if out.stopped:  # the text ended at a stop string (under torchrun the tokens went on past it)
        stats["finish_reason"] = "stop"
    if args.json:
        print(dumps({"text": "".join(text), "tokens": result.tokens, **stats}))
        return 0
    print(text[-1])
    print(f"\n[{stats['completion_tokens']} tokens, finish: {stats['finish_reason']}, "
          f"time to first token {stats['ttft_ms']:.1f} ms, decode "
          + ("n/a]" if rate is None else f"{stats['decode_tokens_per_s']:.1f} tokens/s]"),
          file=sys.stderr)
    if args.stats:
        fast = "in one C call" if model.model.embed_tokens.weight.is_cpu else "replayed from CUDA graphs"
        native = ("decode steps through the model's modules (--reference-step)" if args.reference_step else
                  f"decode steps {fast}: {result.native_steps} of {result.decoded}"
                  + (f" (otherwise: {result.native_off})" if result.native_off else "")
                  + (f", {result.graph_capture_s * 1e3:.0f} ms capturing" if result.graph_capture_s else ""))
        print(f"[load {load_s:.2f}s; {store.stats.summary()} "
              f"({stats['expert_bytes_per_token'] / 1e6:.2f} MB per token); {native}; "
              f"expert executor {result.expert_executor}, last decode step {result.decode_step or 'none'}; "
              f"sequence state {human_bytes(result.state_bytes)}; torch threads {stats['threads']}"
              + (f", OpenMP: {stats['openmp']}" if stats["openmp"] else "") + "]", file=sys.stderr)
    return 0


def generate_many(args) -> int:
    """`generate` with several --prompt: each sequence on its own (max_batch 1), in order; under torchrun
    prompt i runs on rank i % world with data-parallel attention and token dispatch, and rank 0 prints every
    output in the prompts' order. Sampling uses seed + i for prompt i. No streaming: whole outputs."""
    import torch

    from moeswap.distributed.cli import bind_local_device, data_parallel_map, finish, from_lead, join_if_launched
    from moeswap.engine.generate import GenerationConfig, generate
    from moeswap.engine.sampling import from_flags
    from moeswap.engine.scheduler import EngineConfig
    from moeswap.models.loader import load_model
    from moeswap.text.output import TextOutput
    from moeswap.text.tokenizer import load_tokenizer

    if args.lora:
        raise ValueError("--lora takes a single --prompt")
    cfg = GenerationConfig(max_tokens=args.max_tokens, seed=args.seed,
                           sampling=from_flags(args))
    bind_local_device(args)
    t0 = time.perf_counter()
    model, store = load_model(args.model, LoadOptions.from_args(args))
    ep = None
    try:
        ep = join_if_launched(model, args, data_parallel=True)

        def encode():  # rank 0's part under torchrun (the others get its result, or its error)
            tok = load_tokenizer(args.model)
            ids = [tok.encode_chat([{"role": "user", "content": p}]) if args.chat else
                   tok.encode(p, specials=args.special_tokens) for p in args.prompt]
            return tok, ids, () if args.ignore_eos else _stop_ids(args, tok, model)

        tok, ids, stop_ids, seed = from_lead(ep, encode, cfg.seed)
        load_s = time.perf_counter() - t0
        cfg = dataclasses.replace(cfg, constraint=_structured(args, model, tok, ep))

        def one(i: int) -> dict:
            c = dataclasses.replace(cfg, stop_ids=stop_ids, seed=None if seed is None else seed + i)
            engine = EngineConfig(max_batch=1, max_len=len(ids[i]) + c.max_tokens, native=not args.reference_step,
                                  prefill_chunk=args.prefill_chunk)
            on_token = None
            if args.stop and ep is None:  # (under torchrun the lead cuts the text afterwards)
                out = TextOutput(tok, args.stop)
                on_token = lambda t: out.push(t)[1]  # noqa: E731  (True at a stop string: the sequence ends)
            r = generate(model, ids[i], c, on_token=on_token, engine=engine)
            rate = r.decode_tokens_per_s
            return {"tokens": r.tokens, "prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
                    "finish_reason": r.finish_reason, "ttft_ms": round(r.ttft_s * 1e3, 2),
                    "decode_tokens_per_s": None if rate is None else round(rate, 2),
                    "decode_step": r.decode_step, "expert_executor": r.expert_executor,
                    "rank": 0 if ep is None else ep.rank}

        outputs = data_parallel_map(ep, len(ids), one)
        wall_s = time.perf_counter() - t0 - load_s
    finally:
        store.close()
    if not finish(ep):
        return 0
    for i, out in enumerate(outputs):
        text = TextOutput(tok, args.stop, skip_specials=not args.special_tokens)
        out["text"] = "".join(text.push(t)[0] for t in out["tokens"]) + text.finish()
        if text.stopped:
            out["finish_reason"] = "stop"
        out["prompt_index"] = i
    stats = {"outputs": outputs, "load_s": round(load_s, 3), "generate_s": round(wall_s, 3),
             "expert_store": store.stats.as_dict(), "threads": torch.get_num_threads()}
    if ep is not None:
        stats["expert_parallel"] = {"world": ep.world, "placement": ep.placement.kind, "mode": "data-parallel",
                                    "rank0": ep.dispatch.stats.as_dict()}
    if args.json:
        print(dumps(stats))
        return 0
    for prompt, out in zip(args.prompt, outputs):
        print((prompt if not args.chat else "") + out["text"], flush=True)
        print(f"[prompt {out['prompt_index']}: {out['completion_tokens']} tokens, finish: {out['finish_reason']}"
              + (f", rank {out['rank']}" if ep is not None else "") + "]", file=sys.stderr)
    return 0


COMMANDS = {"generate": cmd_generate}


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """Warnings as the CLI's errors are: one line, no source location (--debug keeps Python's format)."""
    return f"moeswap: warning: {' '.join(str(message).split())}\n"


def main(argv: list[str] | None = None) -> int:
    tuning.tune_process()  # before torch is imported (the commands that need it import it)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except FileNotFoundError as err:  # a model name that is no directory and not cached (hub.resolve_model)
        print(f"moeswap: error: {err}", file=sys.stderr)
        return 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed (train's resume hint repeats it)
    if not args.debug:
        warnings.formatwarning = _one_line_warning
    if args.command == "bench":
        handler = importlib.import_module(BENCHES[args.bench]).run
    elif args.command in SUBCOMMANDS:
        handler = importlib.import_module(SUBCOMMANDS[args.command]).run
    else:
        handler = COMMANDS[args.command]
    try:
        return handler(args)
    except KeyboardInterrupt as e:  # Ctrl-C: 130; a SIGTERM a command turned into one says so (train.cli.Terminated)
        print(f"\nmoeswap: {getattr(e, 'what', 'interrupted')}", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    except BrokenPipeError:
        if args.debug or _reader_gone(sys.stdout) is False:
            raise  # not our output's reader leaving (some other pipe): a failure
        # As Python's docs advise (signal module, "Note on SIGPIPE"): stop quietly, point the closed streams
        # at devnull so that the flush at exit cannot fail again, and exit 1, as Python itself does on EPIPE.
        for stream in (sys.stdout, sys.stderr):
            if _reader_gone(stream):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return 1
    except USER_ERRORS as err:
        if args.debug:
            raise
        if not getattr(err, "reported", False):  # (said already: distributed.cli.from_lead under torchrun)
            print(f"moeswap: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if args.debug or err.errno not in WRITE_ERRNOS:
            raise
        where = f" {err.filename}" if err.filename else ""
        print(f"moeswap: error: cannot write{where}: {err.strerror or err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # failures that explain themselves in one line (distributed.ep.PeerLost)
        if args.debug or not hasattr(err, "exit_code"):
            raise
        print(f"moeswap: error: {err}", file=sys.stderr)
        return err.exit_code


MAX_STDIN_PROMPT = 64 << 20  # bytes: a prompt piped in is held whole, so it is read with a bound


def _stdin_prompt() -> str:
    """`--prompt -`: the prompt from standard input (a pipe or a file; a terminal until end of file)."""
    data = sys.stdin.buffer.read(MAX_STDIN_PROMPT + 1)
    if len(data) > MAX_STDIN_PROMPT:
        raise ValueError(f"--prompt -: more than {MAX_STDIN_PROMPT >> 20} MiB on standard input")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"--prompt -: standard input is not UTF-8 text (byte {data[err.start]:#04x} at offset "
                         f"{err.start})") from None


def _reader_gone(stream) -> bool | None:
    """Whether `stream` is a pipe whose reader has closed it (poll reports an error or hang-up on its write
    end); None where that cannot be told (no file descriptor, as under a test's capture; no poll)."""
    try:
        fd = stream.fileno()
        poll = select.poll()
    except (AttributeError, OSError, ValueError):
        return None
    poll.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poll.poll(0))


if __name__ == "__main__":
    sys.exit(main())
