"""LoadOptions (options.py): one dataclass, one flag group, choices from the registries.

The toy-policy test is the contract for extending the store: a cache policy registered in
experts/policy.py's POLICIES, and nothing else, reaches every flag, benchmark and the store itself.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest

from moeswap import cli
from moeswap.archs import REGISTRY
from moeswap.bench import cache as bench_cache
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.experts.policy import POLICIES, CachePolicy, make_policy, online_policies
from moeswap.experts.trace import TraceRecorder
from moeswap.models.loader import load_model
from moeswap.options import LoadOptions, add_load_flags, load_flag_names


class FirstIn(CachePolicy):
    """A toy policy: evicts the expert that became resident first."""

    name = "fifo"

    def __init__(self):
        super().__init__()
        self._since: dict = {}
        self._inserts = itertools.count()

    def insert(self, key):
        self._since[key] = next(self._inserts)
        super().insert(key)

    def _count(self, key):
        pass

    def _priority(self, key):
        return self._since.get(key, -1)


@pytest.fixture
def fifo(monkeypatch):
    monkeypatch.setitem(POLICIES, FirstIn.name, FirstIn)
    return FirstIn.name


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _choices(parser: argparse.ArgumentParser, flag: str):
    return next(a for a in parser._actions if flag in a.option_strings).choices


def test_a_policy_registered_in_policy_py_reaches_flags_benches_and_the_store(fifo, tiny_k3_dir, tmp_path):
    parser = cli.build_parser()
    for path in (("generate",), ("trace",), ("bench", "memory"), ("bench", "decode"), ("bench", "prefill")):
        assert fifo in _choices(_subparser(parser, *path), "--expert-policy"), path
    assert fifo in online_policies()
    assert isinstance(make_policy(fifo), FirstIn)

    # the store runs it, and swapping under it changes no token
    reference, store = load_model(tiny_k3_dir, LoadOptions())
    expert_bytes = store.fast.cost(min(store.index.entries))
    cfg = GenerationConfig(max_tokens=6, stop_ids=())
    recorder = TraceRecorder({"num_experts": reference.config.moe.num_experts, "top_k": reference.config.moe.top_k,
                              "moe_layers": [i for i, k in enumerate(reference.config.mlp_kinds) if k == "moe"]})
    store.trace = recorder
    want = generate(reference, [3, 1, 4, 1, 5], cfg).tokens
    model, small = load_model(tiny_k3_dir, LoadOptions(expert_policy=fifo,
                                                       expert_memory=reference.config.moe.top_k * expert_bytes))
    assert isinstance(small.policies[0], FirstIn)
    assert generate(model, [3, 1, 4, 1, 5], cfg).tokens == want
    assert small.stats.fast.misses > 0 and small.stats.fast.evictions > 0

    # the cache benchmark replays it by default, and counts it among the online policies
    rows = bench_cache.run_replays(recorder.trace, budgets=(50,))
    assert fifo in rows[0]["hit_rate"]
    args = parser.parse_args(["bench", "swap", str(tiny_k3_dir), "--policies", f"lru,{fifo}"])
    assert args.policies == f"lru,{fifo}"


def test_choices_come_from_the_registries():
    parser = cli.build_parser()
    generate_p = _subparser(parser, "generate")
    assert tuple(_choices(generate_p, "--expert-policy")) == (*POLICIES, "none")
    assert tuple(_choices(_subparser(parser, "init-tiny"), "--arch")) == tuple(REGISTRY)
    for name in load_flag_names():  # every flag of the group is on generate, with the dataclass's default
        flag = "--" + name.replace("_", "-")
        action = next(a for a in generate_p._actions if flag in a.option_strings)
        assert action.default == getattr(LoadOptions(), name), name


@pytest.mark.parametrize("options", [
    LoadOptions(),
    LoadOptions(dtype="bfloat16", expert_memory=123 << 20, host_memory=1 << 30, expert_policy="lfu",
                prefetch="next-layer", decoded_experts=True, expert_profile="t.bin", dense_weights="compute",
                expert_activations="int8", gemm_precision="bf16", device="cuda:1"),
    LoadOptions(expert_policy="none", expert_memory=0),
])
def test_flags_round_trip(options):
    parser = argparse.ArgumentParser()
    add_load_flags(parser)
    assert LoadOptions.from_args(parser.parse_args(options.to_argv())) == options


def test_a_subset_of_flags_and_overridden_defaults():
    parser = argparse.ArgumentParser()
    add_load_flags(parser, only=("dtype", "decoded_experts"), defaults={"dtype": "float32"})
    options = LoadOptions.from_args(parser.parse_args([]))
    assert options == LoadOptions(dtype="float32")
    with pytest.raises(SystemExit):
        parser.parse_args(["--expert-memory", "1GiB"])
    with pytest.raises(ValueError, match="no load option 'nonesuch'"):
        add_load_flags(argparse.ArgumentParser(), only=("nonesuch",))


@pytest.mark.parametrize("changes, message", [
    ({"expert_policy": "fifo"}, "--expert-policy 'fifo': expected one of lru, lfu, lfru, static, belady, none"),
    ({"prefetch": "always"}, "--prefetch 'always': expected one of none, next-layer"),
    ({"dense_weights": "half"}, "--dense-weights 'half'"),
    ({"gemm_precision": "int4"}, "--gemm-precision 'int4'"),
    ({"expert_memory": -1}, "--expert-memory must be a byte count >= 0"),
    ({"expert_reads": "mmap"}, "--expert-reads 'mmap'"),
    ({"read_threads": 0}, "--read-threads must be an integer >= 1"),
])
def test_invalid_options_name_the_flag(changes, message):
    with pytest.raises(ValueError, match=message):
        LoadOptions(**changes)


def test_options_without_a_flag_stay_off_the_command_line():
    assert "drop_page_cache" not in load_flag_names()
    with pytest.raises(ValueError, match="drop_page_cache has no flag"):
        LoadOptions(drop_page_cache=True).to_argv()


def test_importing_moeswap_changes_nothing_in_the_process():
    code = ("import json, os; before = dict(os.environ); "
            "import moeswap, moeswap.cli, moeswap.models.loader, moeswap.experts.build, moeswap.engine.scheduler, "
            "moeswap.api, moeswap.commands.chat; "
            "print(json.dumps([k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k)]))")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == []


def test_the_command_tunes_its_process(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.tuning, "tune_process", lambda: calls.append("tuned"))
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert calls == ["tuned"]


def test_load_options_are_frozen_and_replace_checks():
    options = LoadOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.dtype = "float32"
    with pytest.raises(ValueError, match="--prefetch 'sometimes'"):
        options.replace(prefetch="sometimes")
