"""The cost of --expert-top-p on the shipped model (docs/swap.md, "Routed-expert tail skipping"): held-out loss
as stdlib_model/evaluate.py measures it, greedy agreement with P = 1 on the held-out prompts, and expert reads
of a store that keeps nothing (every routed expert of every layer step read once).

    python scripts/expert_top_p.py models/stdlib-k3 /tmp/stdlib-corpus 1,0.9,0.8,0.7,0.5
"""

import json
import math
import sys
from pathlib import Path

import torch

from moeswap.engine.generate import GenerationConfig, generate
from moeswap.models.loader import load_model
from moeswap.options import LoadOptions
from moeswap.stdlib_model import evaluate as ev
from moeswap.stdlib_model.corpus import write_corpus
from moeswap.train.data import eval_rows
from moeswap.train.loop import evaluate


def main(model_dir: str, corpus_dir: str, ps: str, max_tokens: int = 32) -> None:
    model_dir, corpus = Path(model_dir), Path(corpus_dir)
    if not (corpus / "eval.jsonl").exists():  # the card's corpus: same split settings, same files
        info = json.loads((model_dir / "corpus.json").read_text())
        write_corpus(corpus, max_chars=info["max_chars"], eval_per_mille=info["eval_per_mille"])
    cfg, tok, data = ev._data(model_dir, corpus, 1024)
    rows = eval_rows(data.eval)
    prompts = [line for line in (model_dir / "heldout-prompts.txt").read_text().splitlines() if line.strip()]
    base = None
    for p in [float(x) for x in ps.split(",")]:
        model, store = load_model(model_dir, LoadOptions(expert_policy="none", expert_top_p=p))
        loss = evaluate(model, rows, tok.eos_ids[0], cfg.replace(micro_batch=4), torch.device("cpu"))
        eval_reads = store.stats.disk_reads
        store.reset_stats()
        outs = [generate(model, tok.encode(q), GenerationConfig(max_tokens=max_tokens)).tokens for q in prompts]
        reads, nbytes = store.stats.disk_reads, store.stats.disk_bytes
        store.close()
        base = base or (outs, eval_reads, reads)
        same = sum(a == b for o, r in zip(outs, base[0]) for a, b in zip(o, r))
        print(f"P={p}: held-out loss {loss:.4f} perplexity {math.exp(loss):.3f}; eval expert reads {eval_reads} "
              f"({eval_reads / base[1]:.1%} of the first P); greedy {same}/{sum(map(len, base[0]))} tokens agree, "
              f"{sum(o == r for o, r in zip(outs, base[0]))}/{len(outs)} continuations identical; generation "
              f"expert reads {reads} ({reads / base[2]:.1%}), {nbytes / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
