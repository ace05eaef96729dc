"""Models by Hugging Face name (hub.py): `org/name[@revision]` resolved in a hub cache laid out as
huggingface_hub lays it out (blobs/, snapshots/<commit>/ links, refs/), and `moeswap download` with the Hub
replaced by a local source. Never reaches the network: HF_HUB_OFFLINE is set, the cache is in tmp_path.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.utils import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from moeswap import hub
from moeswap.cli import main
from moeswap.formats.checkpoint import INDEX_NAME
from moeswap.tiny import write_tiny_model

COMMIT_A, COMMIT_B = "a" * 40, "b" * 40
PROMPT = "the quick brown fox"


def put_in_cache(cache: Path, repo: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 names: list[str] | None = None) -> Path:
    """Copies `source`'s files (or `names` of them) into the hub cache layout: each file's bytes once in
    blobs/<sha256>, snapshots/<commit>/<file> a relative link to it, refs/<ref> holding the commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    for rel in names if names is not None else [p.relative_to(source).as_posix() for p in sorted(source.rglob("*"))
                                                 if p.is_file()]:
        data = (source / rel).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.unlink(missing_ok=True)
        link.symlink_to(Path(*[".."] * (len(Path(rel).parts) + 1), "blobs", blob.name))
    for ref in refs:
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache in tmp_path, offline: huggingface_hub reads its constants at import, so they are set
    on the module as well as in the environment (for child processes)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def generate_tokens(capsys, model: str) -> list[int]:
    code = main(["generate", model, "--prompt", PROMPT, "--json", "--max-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["tokens"]


def one_line_error(capsys, argv: list[str], *fragments: str) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("moeswap: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


# -- resolution --------------------------------------------------------------------------------------


def test_generate_by_name_gives_the_directorys_tokens(capsys, hf_cache, tiny_k3_dir, tmp_path):
    snapshot = put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    assert all(p.is_symlink() for p in snapshot.iterdir())  # the real layout: links into blobs/
    assert hub.resolve_model("org/tiny-k3") == str(snapshot)
    assert hub.repo_id_of(snapshot) == "org/tiny-k3" and hub.repo_id_of(tiny_k3_dir) is None
    assert generate_tokens(capsys, "org/tiny-k3") == generate_tokens(capsys, str(tiny_k3_dir))


def test_merge_takes_a_name_for_its_base(capsys, hf_cache, tiny_k3_dir, tmp_path, make_lora_adapter):
    """`moeswap merge ORG/NAME ADAPTER OUT`: the same merged tensors as with the directory."""
    from safetensors.torch import load_file

    put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    adapter = make_lora_adapter(tiny_k3_dir, tmp_path / "adapter", ["q_proj", "w1"], seed=3)
    for base, out in (("org/tiny-k3", tmp_path / "by-name"), (str(tiny_k3_dir), tmp_path / "by-path")):
        assert main(["merge", base, str(adapter), str(out)]) == 0, capsys.readouterr().err

    def tensors(d: Path) -> dict:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    by_name, by_path = tensors(tmp_path / "by-name"), tensors(tmp_path / "by-path")
    assert by_name.keys() == by_path.keys() and all(by_name[k].equal(by_path[k]) for k in by_name)


def test_a_revision_picks_its_snapshot(capsys, hf_cache, tiny_k3_dir, tmp_path):
    other = write_tiny_model(tmp_path / "seed1", "kimi_k3", "tiny", 1)
    put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    put_in_cache(hf_cache, "org/tiny-k3", other, COMMIT_B, refs=("v2",))
    expected = generate_tokens(capsys, str(other))
    assert expected != generate_tokens(capsys, str(tiny_k3_dir))  # the two revisions tell apart
    assert generate_tokens(capsys, "org/tiny-k3@v2") == expected
    assert generate_tokens(capsys, f"org/tiny-k3@{COMMIT_B}") == expected
    assert hub.resolve_model("org/tiny-k3@main").endswith(COMMIT_A)


def test_a_local_path_wins_over_a_name(hf_cache, tiny_k3_dir, tmp_path, monkeypatch):
    put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    (tmp_path / "org").mkdir()
    shutil.copytree(tiny_k3_dir, tmp_path / "org" / "tiny-k3")
    monkeypatch.chdir(tmp_path)
    assert hub.resolve_model("org/tiny-k3") == "org/tiny-k3"
    assert hub.resolve_model("not a repo id/x/y") == "not a repo id/x/y"  # not shaped as one: left to the loader


def test_a_name_not_in_the_cache_is_one_line_naming_the_download_command(capsys, hf_cache, tiny_k3_dir):
    for argv in (["generate", "org/missing", "--prompt", "hi"], ["inspect", "org/missing"],
                 ["chat", "org/missing"], ["serve", "org/missing"]):
        one_line_error(capsys, argv, "org/missing", "not in the Hugging Face cache", str(hf_cache),
                       "`moeswap download org/missing`")
    put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    one_line_error(capsys, ["generate", "org/tiny-k3@nope", "--prompt", "hi"], "at revision nope",
                   "`moeswap download org/tiny-k3 --revision nope`")
    with pytest.raises(hub.ModelNotCachedError, match="moeswap download org/missing"):
        import moeswap

        moeswap.load("org/missing", tune=False)


def test_train_config_takes_a_name(hf_cache, tiny_k3_dir):
    from moeswap.train.config import given_flags

    snapshot = put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    assert given_flags(argparse.Namespace(model="org/tiny-k3"))["model"] == str(snapshot)
    with pytest.raises(hub.ModelNotCachedError):
        given_flags(argparse.Namespace(model="org/missing"))


def test_the_cache_is_found_as_huggingface_hub_finds_it(hf_cache, tiny_k3_dir, tmp_path):
    """HF_HOME/hub when HF_HUB_CACHE is unset, in a fresh process (huggingface_hub reads it at import)."""
    home = tmp_path / "hf-home"
    put_in_cache(home / "hub", "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(Path(hub.__file__).parents[1]), env.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, "-m", "moeswap", "inspect", model, "--json"], env=env,
                           capture_output=True, text=True, timeout=120) for model in ("org/tiny-k3", str(tiny_k3_dir))]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr
    by_name, by_path = json.loads(runs[0].stdout), json.loads(runs[1].stdout)
    assert by_name.pop("path") == str(home / "hub" / "models--org--tiny-k3" / "snapshots" / COMMIT_A)
    assert by_path.pop("path") == str(tiny_k3_dir) and by_name == by_path


# -- download, the Hub replaced by a local source ---------------------------------------------------------


class FakeHub:
    """HfApi.model_info and snapshot_download over a local directory: what was asked is recorded, files
    "downloaded" land in the cache layout (or local_dir) as huggingface_hub writes them."""

    def __init__(self, source: Path, cache: Path, commit: str = COMMIT_A):
        self.source, self.cache, self.commit = source, cache, commit
        self.files = {p.relative_to(source).as_posix(): p.stat().st_size for p in sorted(source.rglob("*"))
                      if p.is_file()}
        self.fetched: list[str] = []
        self.error: BaseException | None = None

    def install(self, monkeypatch) -> FakeHub:
        fake, real = self, huggingface_hub.snapshot_download

        def model_info(api, repo_id, *, revision=None, files_metadata=False, **kw):
            if fake.error is not None:
                raise fake.error
            assert files_metadata
            return SimpleNamespace(sha=fake.commit, siblings=[SimpleNamespace(rfilename=f, size=s)
                                                              for f, s in fake.files.items()])

        def snapshot_download(repo_id, *, revision=None, local_dir=None, allow_patterns=None, **kw):
            if kw.get("local_files_only"):  # a cache look-up (hub.resolve_model): the real one
                return real(repo_id, revision=revision, local_dir=local_dir, allow_patterns=allow_patterns, **kw)
            assert revision == fake.commit  # the commit model_info answered: both steps read the same files
            names = [f for f in fake.files if any(fnmatch.fnmatch(f, p) for p in allow_patterns)]
            if local_dir is not None:
                for f in names:
                    (Path(local_dir) / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(fake.source / f, Path(local_dir) / f)
                fake.fetched += names
                return str(local_dir)
            new = [f for f in names if huggingface_hub.try_to_load_from_cache(repo_id, f, revision=fake.commit)
                   is None]
            fake.fetched += new
            return str(put_in_cache(fake.cache, repo_id, fake.source, fake.commit, names=names))

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        return self


@pytest.fixture
def sharded_source(tmp_path, tiny_k3_dir) -> tuple[Path, dict[str, str]]:
    """A repository whose index puts the dense tensors in shard 1, the routed experts in shard 2, and one of
    each in shard 3 (files of placeholder bytes of distinct sizes: only their names and sizes matter here)."""
    src = tmp_path / "source"
    shutil.copytree(tiny_k3_dir, src, ignore=shutil.ignore_patterns("*.safetensors", INDEX_NAME))
    names = json.loads((tiny_k3_dir / INDEX_NAME).read_text())["weight_map"]
    # K3's published names: routed experts are ...block_sparse_moe.experts.<e>...; shared experts and the rest
    # are dense
    experts = sorted(n for n in names if re.search(r"\.block_sparse_moe\.experts\.\d+\.", n))
    dense = sorted(n for n in names if n not in experts)
    assert experts and dense
    shards = {i: f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    weight_map = {**{n: shards[1] for n in dense[1:]}, **{n: shards[2] for n in experts[1:]},
                  dense[0]: shards[3], experts[0]: shards[3]}
    (src / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for i, name in shards.items():
        (src / name).write_bytes(bytes([i]) * (1000 * i))
    return src, shards


@pytest.mark.parametrize("include, shards", [(["experts"], {2, 3}), (["dense"], {1, 3}), (["config"], set()),
                                             (["dense", "experts"], {1, 2, 3}), (None, {1, 2, 3})])
def test_download_include_fetches_the_shards_holding_the_chosen_tensors(capsys, hf_cache, sharded_source,
                                                                          monkeypatch, include, shards):
    src, names = sharded_source
    fake = FakeHub(src, hf_cache).install(monkeypatch)
    code = main(["download", "org/tiny-k3", *(["--include", *include] if include else [])])
    out, err = capsys.readouterr()
    assert code == 0, err
    small = {f for f in fake.files if not f.endswith(".safetensors")}
    assert set(fake.fetched) == small | {names[i] for i in shards}
    fetched = sum(fake.files[f] for f in fake.fetched)
    snapshot = hf_cache / "models--org--tiny-k3" / "snapshots" / COMMIT_A
    assert out.startswith(f"{snapshot}: {len(fake.fetched)} files of commit {COMMIT_A}")
    assert f"({hub.human_bytes(fetched)} fetched now)" in out
    # said before fetching: the hub's sizes of each step's files
    steps = [set(fake.files)] if include is None else [small] + ([{names[i] for i in shards}] if shards else [])
    said = err.strip().splitlines()
    assert len(said) == len(steps)
    for line, files in zip(said, steps):
        assert f": {len(files)} files, {hub.human_bytes(sum(fake.files[f] for f in files))} to fetch" in line
    assert hub.resolve_model("org/tiny-k3") == str(snapshot)
    # a second run finds everything there and fetches nothing
    fake.fetched.clear()
    assert main(["download", "org/tiny-k3", *(["--include", *include] if include else [])]) == 0
    assert fake.fetched == [] and "(0 B fetched now)" in capsys.readouterr().out


def test_download_into_a_local_directory_then_run_it(capsys, hf_cache, tiny_k3_dir, tmp_path, monkeypatch):
    fake = FakeHub(tiny_k3_dir, hf_cache).install(monkeypatch)
    target = tmp_path / "k3"
    assert main(["download", "org/tiny-k3", "--local-dir", str(target)]) == 0
    assert sorted(fake.fetched) == sorted(fake.files)
    assert capsys.readouterr().out.startswith(f"{target}: {len(fake.files)} files")
    assert generate_tokens(capsys, str(target)) == generate_tokens(capsys, str(tiny_k3_dir))


def test_download_refuses_when_the_filesystem_lacks_the_space(capsys, hf_cache, sharded_source, monkeypatch):
    src, _ = sharded_source
    fake = FakeHub(src, hf_cache).install(monkeypatch)
    total = sum(fake.files.values())
    monkeypatch.setattr(hub, "free_bytes", lambda path: total - 1)
    one_line_error(capsys, ["download", "org/tiny-k3"], f"need {total} bytes", str(hf_cache),
                   f"has {total - 1} bytes")
    assert fake.fetched == []


def fake_response(status: int) -> SimpleNamespace:
    return SimpleNamespace(headers={}, request=None, status_code=status)


@pytest.mark.parametrize("error, fragment", [
    (GatedRepoError("403 gated\nmore lines", response=fake_response(403)), "a gated repository"),
    (RepositoryNotFoundError("404\nRepository Not Found", response=fake_response(404)), "no such repository"),
    (RevisionNotFoundError("404 rev\nx", response=fake_response(404)), "no revision 'v9'"),
    (ConnectionError("[Errno -3] Temporary failure in name resolution"), "cannot reach the Hugging Face Hub"),
])
def test_download_hub_failures_are_one_line(capsys, hf_cache, sharded_source, monkeypatch, error, fragment):
    fake = FakeHub(sharded_source[0], hf_cache).install(monkeypatch)
    fake.error = error
    one_line_error(capsys, ["download", "org/tiny-k3", "--revision", "v9"], "org/tiny-k3", fragment)
    one_line_error(capsys, ["download", "./not/a/repo"], "is not a Hugging Face repository id")


# -- the hub cache's links, as untrusted data ------------------------------------------------------------


def test_a_snapshot_link_that_leaves_its_blobs_is_refused(capsys, hf_cache, tiny_k3_dir, tmp_path):
    snapshot = put_in_cache(hf_cache, "org/tiny-k3", tiny_k3_dir, COMMIT_A)
    (tmp_path / "elsewhere").mkdir()
    secret = tmp_path / "elsewhere" / "config.json"
    secret.write_text((tiny_k3_dir / "config.json").read_text())
    (snapshot / "config.json").unlink()
    (snapshot / "config.json").symlink_to(secret)
    one_line_error(capsys, ["inspect", "org/tiny-k3"], "a link that resolves outside its directory")
    # nor is a snapshots/ folder outside a models--ORG--NAME repository given the blobs exception
    fake_root = tmp_path / "not-a-repo"
    put_in_cache(fake_root, "org/x", tiny_k3_dir, COMMIT_A)
    renamed = fake_root / "plain"
    (fake_root / "models--org--x").rename(renamed)
    one_line_error(capsys, ["inspect", str(renamed / "snapshots" / COMMIT_A)], "resolves outside its directory")
