"""Models by Hugging Face name: `org/name[@revision]` resolved to a snapshot of the local hub cache, and
`moeswap download` (the files to fetch, the routed-expert / dense shard choice, the space check).

The cache is huggingface_hub's own (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and is
read through its API, never by walking the layout here; the one layout fact moeswap relies on elsewhere is
formats.files' rule that a snapshot's links may land in its own repository's blobs/. huggingface_hub is
imported only when a name is looked up. Entry points: `resolve_model`, `repo_id_of`, `download`.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from moeswap.units import human_bytes

# --include choices: which files of a repository `download` fetches (all of them when none is given)
INCLUDES = ("config", "dense", "experts")
# files holding weights: what `--include config` leaves out (everything else is small: configs, tokenizer, code)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")
_REPO_ARG = re.compile(r"(?P<repo>[^/@\s.~][^/@\s]*/[^/@\s]+)(?:@(?P<rev>[^\s@]+))?")


class HubError(ValueError):
    """A model name that cannot be resolved or downloaded: the CLI's one-line error, exit 2."""


class ModelNotCachedError(FileNotFoundError):
    """`org/name` given as a model that is neither a directory nor in the hub cache. A FileNotFoundError,
    not a ValueError, so that an argparse `type=` raising it is not reworded as a flag error."""


def parse_repo(arg: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `arg` is shaped as `org/name[@revision]` with a valid Hub repo id;
    None otherwise (a path, or a name the Hub could not hold)."""
    m = _REPO_ARG.fullmatch(arg)
    if m is None:
        return None
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(m["repo"])
    except HFValidationError:
        return None
    return m["repo"], m["rev"]


def cache_dir() -> str:
    """The hub cache directory, as huggingface_hub reads it from the environment."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve_model(arg: str) -> str:
    """The model directory a command's model argument names: `arg` itself when it exists (a local path
    always wins) or is not shaped as a repo id; else the cached snapshot of `org/name[@revision]`
    (default revision main). A snapshot that holds only part of the repository (`download --include`) is
    returned as it is: the loader says which shard is missing. ModelNotCachedError when none is cached."""
    if os.path.exists(arg):
        return arg
    parsed = parse_repo(arg)
    if parsed is None:
        return arg
    repo, revision = parsed
    import huggingface_hub as hf
    from huggingface_hub.utils import LocalEntryNotFoundError

    try:
        return str(hf.snapshot_download(repo, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError as err:
        partial = getattr(err, "snapshot_path", None)  # IncompleteSnapshotError: some files not fetched
        if partial:
            return str(partial)
    at = f" at revision {revision}" if revision else ""
    raise ModelNotCachedError(f"{arg}: no such model directory, and {repo}{at} is not in the Hugging Face cache "
                              f"({cache_dir()}); get it with `moeswap download {repo}"
                              + (f" --revision {revision}`" if revision else "`"))


def repo_id_of(path: str | os.PathLike) -> str | None:
    """`org/name` of a hub cache snapshot directory (models--org--name/snapshots/<commit>), else None."""
    real = Path(path).resolve()
    repo = real.parent.parent.name
    if real.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo[len("models--"):].replace("--", "/")  # a repo id never holds "--" (validate_repo_id)


# -- download -----------------------------------------------------------------------------------------


@dataclass
class Fetched:
    """What `download` did: the directory, its commit, the files chosen, bytes fetched and on disk."""

    directory: Path
    commit: str
    files: list[str]
    fetched_bytes: int
    disk_bytes: int


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def choose_shards(directory: Path, weight_files: Iterable[str], include: Iterable[str]) -> set[str]:
    """The weight files of `directory` (its config.json and index already there) holding the tensors
    `include` chooses: `experts` the routed experts, `dense` every other tensor (shared experts, attention,
    embeddings, vision tower), by the architecture's own name map. A checkpoint of one file without an
    index holds everything. The index is the checkpoint's (formats.checkpoint), read as untrusted data."""
    wanted = set(include) & {"dense", "experts"}
    if not wanted:
        return set()
    from moeswap import archs
    from moeswap.config import load_config
    from moeswap.formats.checkpoint import INDEX_NAME, CheckpointError
    from moeswap.formats.files import read_json, show

    if not (directory / INDEX_NAME).is_file():
        return {f for f in weight_files if f.endswith(".safetensors")}
    config = load_config(directory)
    arch, prefix = archs.get(config.arch), config.weight_prefix
    weight_map = read_json(directory / INDEX_NAME, CheckpointError)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{directory / INDEX_NAME}: expected a JSON object with a 'weight_map' object")
    chosen = set()
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            raise CheckpointError(f"{directory / INDEX_NAME}: weight_map entry {show(name)} is not a file name")
        local = name[len(prefix):] if prefix and name.startswith(prefix) else name
        kind = "experts" if arch.classify(local)[0] == "expert" else "dense"
        if kind in wanted:
            chosen.add(shard)
    return chosen


def free_bytes(directory: str | os.PathLike) -> int:
    """Free bytes on the filesystem that holds (or will hold) `directory`: its nearest existing ancestor's."""
    p = Path(directory).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def download(repo_arg: str, revision: str | None = None, include: Iterable[str] | None = None,
             local_dir: str | None = None, say: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
             ) -> Fetched:
    """Fetches `org/name` at `revision` (default main) through huggingface_hub.snapshot_download, into the hub
    cache or `local_dir`. With `include`, the small files first (config, index, tokenizer), then only the
    shards holding the chosen tensors. Before each fetch: `say` how many bytes, and refuse (HubError) when
    the target filesystem has fewer free. Every Hub failure is a one-line HubError."""
    parsed = parse_repo(repo_arg)
    if parsed is None:
        raise HubError(f"{repo_arg!r} is not a Hugging Face repository id (org/name)")
    repo, at = parsed
    if at and revision and at != revision:
        raise HubError(f"{repo_arg}: two revisions given ({at} and --revision {revision})")
    revision = revision or at
    include = None if include is None else tuple(include)
    bad = [c for c in include or () if c not in INCLUDES]
    if bad:
        raise HubError(f"--include {bad[0]!r}: choose from {', '.join(INCLUDES)}")
    import huggingface_hub as hf

    info = _hub_call(repo, revision, lambda: hf.HfApi().model_info(repo, revision=revision, files_metadata=True))
    commit = str(info.sha)
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or ()}
    if not sizes:
        raise HubError(f"{repo}@{commit[:12]}: the repository holds no files")
    target = local_dir if local_dir is not None else cache_dir()
    fetched = 0

    def fetch(names: list[str], what: str) -> Path:
        nonlocal fetched
        todo = [f for f in names if not _present(repo, commit, f, sizes[f], local_dir)]
        need = sum(sizes[f] for f in todo)
        free = free_bytes(target)
        if need > free:
            raise HubError(f"{repo}@{commit[:12]}: {what} need {need} bytes ({human_bytes(need)}) on the filesystem "
                           f"of {target}, which has {free} bytes ({human_bytes(free)}) free")
        say(f"moeswap: {repo}@{commit[:12]}: {what}: {len(names)} files, {human_bytes(need)} to fetch"
            + (f" ({len(names) - len(todo)} already here)" if len(todo) < len(names) else ""))
        path = _hub_call(repo, revision, lambda: hf.snapshot_download(
            repo, revision=commit, local_dir=local_dir, allow_patterns=[glob.escape(f) for f in names]))
        fetched += need
        return Path(path)

    if include is None:
        chosen = sorted(sizes)
        directory = fetch(chosen, "every file")
    else:
        chosen = sorted(f for f in sizes if not is_weight_file(f))
        directory = fetch(chosen, "the small files (config, index, tokenizer)")
        shards = sorted(choose_shards(directory, [f for f in sizes if is_weight_file(f)], include) & set(sizes))
        parts = sorted(set(include) - {"config"})
        if parts:
            directory = fetch(shards, f"the shards holding the {' and '.join(parts)} tensors")
        chosen += shards
    return Fetched(directory, commit, chosen, fetched, sum(_disk(directory / f) for f in chosen))


def _present(repo: str, commit: str, name: str, size: int, local_dir: str | None) -> bool:
    """Whether `name` of the commit is on disk already (snapshot_download would not fetch it again)."""
    if local_dir is not None:
        p = Path(local_dir) / name
        return p.is_file() and p.stat().st_size == size
    import huggingface_hub as hf

    return isinstance(hf.try_to_load_from_cache(repo, name, revision=commit), str)


def _disk(path: Path) -> int:
    """Bytes `path` (its link followed) takes on disk."""
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def _network_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's transport errors (httpx / httpx2 / requests, whichever this huggingface_hub uses),
    besides OSError, which requests' errors already are."""
    found: list[type[BaseException]] = [OSError]
    for module in ("httpx", "httpx2"):
        mod = sys.modules.get(module)
        if mod is not None and hasattr(mod, "TransportError"):
            found.append(mod.TransportError)
    return tuple(found)


def _hub_call(repo: str, revision: str | None, call):
    """`call()` with huggingface_hub's failures as one-line HubErrors naming the repository."""
    from huggingface_hub.utils import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return call()
    except GatedRepoError:
        raise HubError(f"{repo}: a gated repository: accept its terms on its Hugging Face page, then log in "
                       f"(`hf auth login`, or HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise HubError(f"{repo}: no revision {revision!r} on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise HubError(f"{repo}: no such repository on the Hugging Face Hub (or a private one: log in with "
                       f"`hf auth login`, or HF_TOKEN)") from None
    except OfflineModeIsEnabled:
        raise HubError(f"{repo}: HF_HUB_OFFLINE is set, so nothing can be downloaded") from None
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        raise HubError(f"{repo}: the Hugging Face Hub answered"
                       + (f" HTTP {status}" if status else "") + f": {_first_line(err)}") from None
    except _network_errors() as err:
        raise HubError(f"{repo}: cannot reach the Hugging Face Hub ({type(err).__name__}: {_first_line(err)})"
                       ) from None


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
