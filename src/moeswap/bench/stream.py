"""`moeswap bench stream MODEL --memory-limit 5GiB`: decode and prefill with routed experts larger than memory,
moeswap next to llama.cpp, each confined to the same memory limit (page cache included: a memory cgroup,
bench/memlimit.py), measured against the drive's own read ceiling.

One run: (1) the drive's ceiling on the model's largest shard (O_DIRECT sequential and expert-sized random
reads, memlimit.read_ceiling); (2) for each engine, caches dropped, its worker process started inside a new
cgroup of the limit (it joins before it runs anything), then a prefill of `--prompt-tokens` tokens and a
decode of `--tokens` tokens from a short prompt; bytes read from the drive come from the worker's
/proc/PID/io `read_bytes` (what the kernel read for it: O_DIRECT reads, buffered reads and mmap faults
alike), so both engines are counted the same way. Decode bytes per token = (bytes of the decode request -
bytes of a prefill-only request of the same prompt length) / tokens decoded.

Reported per engine: decode and prefill s/token and tokens/s, bytes read per token, achieved GB/s, the peak
memory the cgroup charged, and for moeswap the I/O bound (missed expert bytes per token / the ceiling) and
the planner's prediction of the same run (planner/stream.py). Markdown, JSON and a plot, as the other benches.
The run is refused (one line, exit 2) where no memory limit can be set or the experts are under 4x the limit
(`--min-ratio`): then they would fit in the page cache and the bench would measure memory, not the drive.
Entry points: `measure`, `add_parser`, `run`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from moeswap.bench import sidebyside as sbs
from moeswap.units import parse_bytes
from moeswap.weights import dense_quant

MIN_RATIO = 4.0  # expert bytes / memory limit below which the run is refused
DEFAULT_LIMIT = 5 << 30
GGUF_OUTTYPE = "q8_0"  # llama.cpp's converter's narrowest general dense type (its experts stay MXFP4)


def read_bytes(pid: int) -> int:
    """Bytes the kernel read from storage for process `pid` (all its threads): /proc/PID/io read_bytes."""
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    raise OSError(f"/proc/{pid}/io has no read_bytes (kernel without task I/O accounting)")


def model_bytes(model_dir: str) -> dict:
    """decode_bytes (sidebyside) plus every routed expert's bytes and the largest file of the checkpoint."""
    by = sbs.decode_bytes(model_dir)
    by["all_expert_bytes"] = by["expert_bytes"] * by["moe_layers"] * by["num_experts"]
    files = sorted(Path(model_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    if not files:
        raise FileNotFoundError(f"{model_dir}: no .safetensors files")
    by["largest_file"] = str(files[-1])
    return by


def default_expert_memory(limit: int, dense_bytes: float, by: dict) -> int:
    """The expert cache that leaves room in `limit` for the dense trunk (as the run keeps it), the sequence
    state, torch and the engine: what remains after the dense bytes and 1.5 GiB, and at least two layers'
    active experts (the least the store runs with)."""
    least = 2 * by["top_k"] * by["expert_bytes"]
    return int(max(least, limit - dense_bytes - (3 << 29)))


def _engine_run(kind: str, setup: sbs.Setup, limit: int, extra: list[str], prompt: list[int],
                short: list[int], tokens: int, log) -> dict:
    """One engine inside its own memory cgroup: prefill `prompt`, a prefill-only request of `short`, then
    `tokens` decoded after `short`. Caches are dropped first, so the run starts from the drive."""
    from moeswap.bench.memlimit import drop_caches, memory_cgroup
    from moeswap.bench.peers.worker import Worker

    drop_caches()
    with memory_cgroup(limit) as cg:
        t0 = time.perf_counter()
        worker = Worker(kind, setup.model, setup.threads, extra, setup.moeswap_env if kind == "moeswap" else None,
                        preexec_fn=cg.join)
        try:
            load_s = time.perf_counter() - t0
            pid = worker.proc.pid
            log(f"  {worker.name}: loaded in {load_s:.1f} s")
            b0 = read_bytes(pid)
            pre = worker.generate([prompt], 1)
            b1 = read_bytes(pid)
            log(f"  prefill {len(prompt)} tokens: {pre['ttft_s']:.1f} s, {(b1 - b0) / 1e9:.2f} GB read")
            worker.generate([short], 1)  # a prefill alone: its reads come off the decode request's
            b2 = read_bytes(pid)
            dec = worker.generate([short[::-1]], tokens + 1)
            b3 = read_bytes(pid)
            decoded = max(1, dec["decoded"])
            decode_read = max(0, (b3 - b2) - (b2 - b1))
            log(f"  decode {decoded} tokens: {dec['decode_s'] / decoded:.2f} s/token, "
                f"{decode_read / decoded / 1e9:.2f} GB read per token")
            row = {"name": worker.name, "load_s": load_s,
                   "prefill_tokens": len(prompt), "prefill_s": pre["ttft_s"],
                   "prefill_s_per_token": pre["ttft_s"] / len(prompt),
                   "prefill_tokens_per_s": len(prompt) / pre["ttft_s"], "prefill_read_bytes": b1 - b0,
                   "decode_tokens": decoded, "decode_s": dec["decode_s"],
                   "decode_s_per_token": dec["decode_s"] / decoded,
                   "decode_tokens_per_s": decoded / dec["decode_s"],
                   "short_prefill_read_bytes": b2 - b1, "decode_read_bytes": decode_read,
                   "decode_read_bytes_per_token": decode_read / decoded,
                   "decode_read_GBps": decode_read / dec["decode_s"] / 1e9,
                   "tokens": dec["tokens"][0]}
            for name in ("store", "engine"):
                if name in dec:
                    row[f"decode_{name}"] = dec[name]
            if "store" in pre:
                row["prefill_store"] = pre["store"]
        finally:
            worker.close()
        row["peak_bytes"] = cg.peak()
        row["oom_kills"] = cg.oom_kills()
        return row


def measure(setup: sbs.Setup, limit: int, prompt_tokens: int, tokens: int, min_ratio: float = MIN_RATIO,
            gguf_outtype: str = GGUF_OUTTYPE, log=print) -> dict:
    from moeswap.bench.memlimit import MemoryLimitError, drop_caches, memory_cgroup, read_ceiling
    from moeswap.config import load_config
    from moeswap.planner.stream import CpuFacts, predict_stream

    by = model_bytes(setup.model)
    ratio = by["all_expert_bytes"] / limit
    if ratio < min_ratio:
        raise ValueError(f"{setup.model}: its routed experts are {by['all_expert_bytes'] / 1e9:.2f} GB, "
                         f"{ratio:.2f}x the {limit / 2**30:.2f} GiB memory limit; bench stream needs >= "
                         f"{min_ratio:g}x (a smaller --memory-limit, or a larger slice: init-tiny --size k3-slice)")
    with memory_cgroup(limit):
        pass  # refuses in one line, before anything slow, where no limit can be set
    drop_caches()
    log(f"drive read ceiling on {by['largest_file']} ...")
    # random reads of one expert's size (rounded to 4 KiB: O_DIRECT offsets), as the store reads them
    block = -(-int(by["expert_bytes"]) // 4096) * 4096
    # the better of one reader and the store's reader threads: a virtio or network disk may favour either,
    # and its rate moves by ~20 % from run to run (docs/benchmarks.md), so the ceiling is the higher
    probes = [read_ceiling(by["largest_file"], block=block, sequential_bytes=4 << 30, random_reads=128,
                           threads=threads) for threads in sorted({1, setup.load.read_threads})]
    ceiling = max(probes, key=lambda c: c.random_gbps)
    log(f"  sequential {ceiling.sequential_gbps:.2f} GB/s, random {ceiling.random_gbps:.2f} GB/s ({ceiling.how})")
    # the CPU's measured facts for the planner's prediction: memory bandwidth and fp32 GEMM rate (moeswap's
    # kernels widen bf16 and low-bit weights to fp32)
    bw = sbs.memory_bandwidth(setup.threads)
    cpu = CpuFacts(cores=setup.threads, mem_bw_gbs=bw["read_GBps"],
                   bf16_tflops=sbs.matmul_gflops(setup.threads) / 1e3)
    cfg = load_config(setup.model)
    vocab = cfg.vocab_size
    prompt = sbs.random_prompts(1, prompt_tokens, vocab, seed=1)[0]
    short = sbs.random_prompts(1, 4, vocab, seed=2)[0]
    load = setup.load
    dense_fmt = load.dense_weights if load.dense_weights in dense_quant.FORMATS else "bf16"
    dense_resident = _dense_resident(by, dense_fmt, cfg.hidden_size)
    if load.expert_memory == sbs.BENCH_LOAD.expert_memory:  # not set by the user: what the limit leaves
        load = load.replace(expert_memory=default_expert_memory(limit, dense_resident, by))
    report: dict = {"bench": "stream", "model": setup.model, "machine": sbs.machine_info(setup.threads),
                    "memory_limit": limit, "bytes": by, "expert_to_limit": ratio,
                    "ceiling": {**vars(ceiling), "probes": [vars(c) for c in probes]}, "cpu": vars(cpu),
                    "settings": {**vars(load), "threads": setup.threads, "gguf_outtype": gguf_outtype},
                    "engines": {}, "skipped": {}}
    log(f"moeswap (--dense-weights {load.dense_weights}, --expert-memory {load.expert_memory / 2**30:.2f} GiB) ...")
    report["engines"]["moeswap"] = _engine_run("moeswap", setup, limit, load.to_argv(), prompt, short, tokens, log)
    for peer in setup.peers:
        if peer != "llama.cpp":
            report["skipped"][peer] = "bench stream compares with llama.cpp only"
            continue
        kind, why = sbs.llama_engine(setup)
        if kind is None:
            report["skipped"][peer] = why
            continue
        from moeswap.bench.peers import llamacpp

        log(f"llama.cpp: GGUF of {setup.model} ({gguf_outtype} dense) ...")
        gguf = setup.gguf or str(llamacpp.ensure_gguf(setup.model, outtype=gguf_outtype))
        args = ["--gguf", gguf, "--max-seqs", "1", "--max-len", str(prompt_tokens + tokens + 16)]
        # as shipped first; where its repacked weight copies (anonymous memory) do not fit the limit, again with
        # its own --no-repack, which reads them in place from the GGUF's mapping (llama-cpp-python only)
        for how, extra in (("defaults", []), ("--no-repack", ["--no-repack"] if kind == "llama.cpp" else None)):
            if extra is None:
                break
            log(f"llama.cpp ({how}) ...")
            try:
                report["engines"][peer] = {**_engine_run(kind, setup, limit, args + extra, prompt, short, tokens,
                                                         log), "settings": how}
                break
            except RuntimeError as err:
                report["skipped"][f"{peer} ({how})"] = f"failed: {' '.join(str(err).split())[-400:]}"
                log(f"  failed: {' '.join(str(err).split())[-200:]}")
    m = report["engines"]["moeswap"]
    # the I/O bound: what the drive alone needs for the bytes moeswap read per token, at the ceiling of
    # expert-sized random reads (its read pattern)
    m["io_bound_s_per_token"] = m["decode_read_bytes_per_token"] / (ceiling.random_gbps * 1e9)
    m["decode_over_io_bound"] = m["decode_s_per_token"] / m["io_bound_s_per_token"] if m["io_bound_s_per_token"] else None
    disk = (m.get("decode_store") or {}).get("disk_io") or {}
    if disk.get("read_GBps"):
        m["read_phase_of_ceiling"] = disk["read_GBps"] / ceiling.random_gbps
    m["prefill_read_vs_single_steps"] = (m["prefill_read_bytes"] / (prompt_tokens * m["decode_read_bytes_per_token"])
                                         if m["decode_read_bytes_per_token"] else None)
    for peer, row in report["engines"].items():
        if peer != "moeswap":
            row["moeswap_decode_speedup"] = row["decode_s_per_token"] / m["decode_s_per_token"]
            row["moeswap_prefill_speedup"] = row["prefill_s_per_token"] / m["prefill_s_per_token"]
            row["first_token_agrees"] = row["tokens"][:1] == m["tokens"][:1]
    try:
        pred = predict_stream(cfg, limit, ceiling.random_gbps, cpu, dense=dense_fmt,
                              expert_memory=load.expert_memory, prompt_tokens=prompt_tokens, tokens=tokens)
        report["prediction"] = {**{k: v for k, v in vars(pred).items() if k != "parts"}, "parts": pred.parts,
                                "measured_over_predicted": m["decode_s_per_token"] / pred.s_per_token}
    except (ValueError, MemoryLimitError) as err:
        report["prediction"] = {"error": str(err)}
    return report


def _dense_resident(by: dict, fmt: str, hidden: int) -> float:
    """Bytes of the dense trunk a run keeps in `fmt` (planner/formats.py's table; the bf16-stored trunk's rows
    `hidden` wide), and its embedding table: none under int8/int4, where it stays the checkpoint's mapping
    (StoredEmbedding), else a copy in the CPU's fp32 compute dtype."""
    from moeswap.planner.formats import bytes_per_weight

    trunk = by["dense_bytes"] * bytes_per_weight(fmt, hidden) / 2.0
    return trunk + (0 if fmt in dense_quant.FORMATS else 2 * by["embed_bytes"])


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_markdown(report: dict) -> str:
    c, by = report["ceiling"], report["bytes"]
    m = report["machine"]
    lines = [f"model `{report['model']}`: {by['all_expert_bytes'] / 1e9:.1f} GB of routed experts "
             f"({by['moe_layers']} MoE layers x {by['num_experts']} x {by['expert_bytes'] / 1e6:.2f} MB), "
             f"{report['expert_to_limit']:.1f}x the memory limit of {report['memory_limit'] / 2**30:.2f} GiB "
             f"(page cache included); {report['settings']['threads']} threads on {m['cores']} cores ({m['cpu']}), "
             f"git {m['git']}, load average {m['load_average'][0]:.1f} at start",
             f"drive read ceiling ({c['how']}): sequential {c['sequential_gbps']:.2f} GB/s, "
             f"random {c['block'] / 1e6:.2f} MB reads {c['random_gbps']:.2f} GB/s (the better of "
             + " and ".join(f"{p['threads']} thread(s) {p['random_gbps']:.2f}" for p in c["probes"]) + ")", ""]
    head = ("| engine | decode s/token | decode tok/s | GB read / token | read GB/s | prefill s/token | "
            "prefill tok/s | prefill GB read | peak memory GiB |")
    lines += [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["engines"].values():
        peak = r.get("peak_bytes")
        name = r["name"] + (f" ({r['settings']})" if "settings" in r else "")
        lines.append(f"| {name} | {r['decode_s_per_token']:.2f} | {r['decode_tokens_per_s']:.3f} | "
                     f"{r['decode_read_bytes_per_token'] / 1e9:.3f} | {r['decode_read_GBps']:.2f} | "
                     f"{r['prefill_s_per_token']:.3f} | {r['prefill_tokens_per_s']:.2f} | "
                     f"{r['prefill_read_bytes'] / 1e9:.2f} | {'-' if peak is None else f'{peak / 2**30:.2f}'} |")
    mo = report["engines"]["moeswap"]
    lines.append("")
    lines.append(f"moeswap: I/O bound {mo['io_bound_s_per_token']:.2f} s/token (its bytes per token at the random-read "
                 f"ceiling); decode / I/O bound = {_num(mo['decode_over_io_bound'])}"
                 + (f"; reads in flight at {100 * mo['read_phase_of_ceiling']:.0f} % of the ceiling"
                    if mo.get("read_phase_of_ceiling") else ""))
    if mo.get("prefill_read_vs_single_steps") is not None:
        lines.append(f"moeswap: a {mo['prefill_tokens']}-token prefill read {mo['prefill_read_vs_single_steps']:.3f}x "
                     f"the bytes of {mo['prefill_tokens']} single-token steps")
    for name, r in report["engines"].items():
        if name != "moeswap":
            lines.append(f"moeswap / {name}: decode {r['moeswap_decode_speedup']:.2f}x, prefill "
                         f"{r['moeswap_prefill_speedup']:.2f}x (first token agrees: {r['first_token_agrees']})")
    p = report.get("prediction", {})
    if "s_per_token" in p:
        lines.append(f"planner (planner/stream.py) predicted {p['s_per_token']:.2f} s/token "
                     f"(dense {p['dense_s']:.2f} + experts {p['expert_compute_s']:.2f} + drive {p['drive_s']:.2f}); "
                     f"measured / predicted = {p['measured_over_predicted']:.2f}")
    elif p:
        lines.append(f"planner: no prediction ({p['error']})")
    for peer, why in report["skipped"].items():
        lines.append(f"- {peer}: SKIPPED, {why}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> str | None:
    """Decode and prefill s/token per engine, with moeswap's I/O bound and the planner's prediction."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = list(report["engines"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in ((axes[0], "decode_s_per_token", "decode s/token"),
                           (axes[1], "prefill_s_per_token", "prefill s/token")):
        ax.bar(names, [report["engines"][n][key] for n in names], color=["C0", "C1", "C2"][: len(names)])
        ax.set_title(title)
    mo = report["engines"]["moeswap"]
    axes[0].axhline(mo["io_bound_s_per_token"], color="k", ls="--", label="moeswap I/O bound")
    if "s_per_token" in report.get("prediction", {}):
        axes[0].axhline(report["prediction"]["s_per_token"], color="C3", ls=":", label="planner")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"experts {report['expert_to_limit']:.1f}x a {report['memory_limit'] / 2**30:.1f} GiB limit", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_parser(benches) -> None:
    b = benches.add_parser("stream", help="experts larger than memory: decode/prefill under a memory limit, "
                                          "vs llama.cpp and the drive's read ceiling")
    sbs.add_common_flags(b)
    b.set_defaults(peers="llama.cpp")
    b.add_argument("--memory-limit", type=parse_bytes, default=DEFAULT_LIMIT, help="memory each engine may use, page cache included "
                                                          "(a memory cgroup; default 5GiB)")
    b.add_argument("--prompt-tokens", type=int, default=256, help="prefill length (default 256)")
    b.add_argument("--tokens", type=int, default=8, help="decoded tokens (default 8)")
    b.add_argument("--min-ratio", type=float, default=MIN_RATIO,
                   help=f"refuse unless the routed experts are this many times the limit (default {MIN_RATIO:g})")
    b.add_argument("--gguf-outtype", default=GGUF_OUTTYPE, help="llama.cpp converter's --outtype for the dense "
                                                                f"weights (default {GGUF_OUTTYPE})")


def run(args: argparse.Namespace) -> int:
    setup = sbs.setup_from_args(args)
    limit = args.memory_limit
    if args.prompt_tokens < 1 or args.tokens < 1:
        raise ValueError("--prompt-tokens and --tokens must be >= 1")
    report = measure(setup, limit, args.prompt_tokens, args.tokens, args.min_ratio, args.gguf_outtype)
    md = format_markdown(report)
    print(md)
    paths = sbs.write_report("stream", report, md, args.out_dir or None, args.json, args.markdown)
    if args.out_dir:
        png = plot(report, str(Path(paths[0]).with_suffix(".png")))
        if png:
            paths.append(png)
    for path in paths:
        print(f"wrote {path}")
    return 0
