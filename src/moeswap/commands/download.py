"""`moeswap download ORG/NAME [--revision R] [--include config|dense|experts ...] [--local-dir DIR]`: the flags
and the printed result of hub.download (huggingface_hub's progress bars on stderr while it runs). Entry
points: `add_parser(subparsers)`, `run(args)`.
"""

from __future__ import annotations

import argparse

from moeswap.hub import INCLUDES
from moeswap.units import human_bytes


def add_parser(sub) -> None:
    p = sub.add_parser("download", help="fetch a model from the Hugging Face Hub into its cache (or a directory)")
    p.add_argument("repo", metavar="ORG/NAME[@REVISION]", help="the repository, e.g. moonshotai/Kimi-K2-Instruct")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default main)")
    p.add_argument("--include", nargs="+", choices=INCLUDES, default=None, metavar="PART",
                   help="fetch only these parts (default: every file): config = config, index, tokenizer and the "
                        "other small files; dense = those and the shards holding any tensor that is not a routed "
                        "expert; experts = those and the shards holding routed experts (shards are chosen from "
                        "the checkpoint's model.safetensors.index.json)")
    p.add_argument("--local-dir", default=None, metavar="DIR",
                   help="write the files into DIR instead of the Hugging Face cache (then give DIR as the model)")


def run(args: argparse.Namespace) -> int:
    from moeswap.hub import download

    got = download(args.repo, args.revision, args.include, args.local_dir)
    print(f"{got.directory}: {len(got.files)} files of commit {got.commit}, {human_bytes(got.disk_bytes)} on disk "
          f"({human_bytes(got.fetched_bytes)} fetched now)")
    return 0
