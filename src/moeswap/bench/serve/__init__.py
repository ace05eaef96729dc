"""`moeswap bench serve`: load on an OpenAI-compatible server (vLLM's benchmark_serving, SGLang's bench_serving):
streamed `/v1/completions` at a fixed concurrency or Poisson arrivals; TTFT, TPOT, ITL, throughput, failures,
server RSS; the target (`--url` or `--launch MODEL`) measured round-robin with its peers (`moeswap-batch1`,
`llama-server`). One module per concern: workload, servers, client, stats, greedy, runner, report; the command
(`add_parser(benches)`, `run(args)`) is command.py.
"""
