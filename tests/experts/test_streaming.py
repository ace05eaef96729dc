"""Streamed experts (--expert-policy none): every read by O_DIRECT or buffered (forced each, and auto's fallback
where O_DIRECT is refused) gives the all-resident logits bit for bit; a layer step's reads go in file-offset
order; the read log's in-flight time is the union of the reads' intervals; dedup counts what the routing says.
O_DIRECT may be refused where the tests run (tmpfs): they check the mode that actually ran."""

from __future__ import annotations

import errno
import os
import random

import pytest
import torch

from moeswap.experts import tiers
from moeswap.experts.keys import Key
from moeswap.experts.reads import DIRECT_ALIGN, DIRECT_SLACK, Direct, Reads, direct_layout, native_library, read_now
from moeswap.experts.stats import ReadStats
from moeswap.formats.checkpoint import CheckpointError
from moeswap.models.loader import load_model
from moeswap.ops.expert import tensors
from moeswap.options import LoadOptions

pytestmark = pytest.mark.skipif(native_library() is None, reason="the native reader does not build here")

PROMPT = torch.tensor([[1, 5, 9, 3, 7, 2, 4, 8, 11, 6]])


@pytest.fixture(scope="module")
def resident_logits(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_memory=1 << 30))
    with torch.no_grad():
        out = model(PROMPT)
    store.close()
    return out


def _streamed(model_dir, **options):
    model, store = load_model(model_dir, LoadOptions(expert_policy="none", **options))
    try:
        with torch.no_grad():
            out = model(PROMPT)
    finally:
        store.close()
    return out, store.stats


def _direct_allowed(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
    except OSError as err:
        if err.errno == errno.EINVAL:
            return False
        raise
    return True


@pytest.mark.parametrize("options", [dict(expert_reads="auto"), dict(expert_reads="buffered", read_threads=3),
                                     dict(expert_reads="auto", prefetch="next-layer", read_threads=1)],
                         ids=["auto", "buffered", "auto-next-layer"])
def test_streamed_experts_give_the_resident_logits(tiny_k3_dir, resident_logits, options):
    out, stats = _streamed(tiny_k3_dir, **options)
    assert torch.equal(out, resident_logits)
    io = stats.disk_io
    assert io.reads == stats.disk_reads and io.bytes == stats.disk_bytes > 0
    direct = options["expert_reads"] != "buffered" and _direct_allowed(next(tiny_k3_dir.glob("*.safetensors")))
    assert io.mode == ("direct" if direct else "buffered")
    assert io.direct_reads == (io.reads if direct else 0)
    d = stats.as_dict()["disk_io"]
    assert d["busy_s"] > 0 and d["read_GBps"] == stats.disk_bytes / d["busy_s"] / 1e9


def test_forced_direct_reads_or_a_one_line_refusal(tiny_k3_dir, resident_logits):
    if not _direct_allowed(next(tiny_k3_dir.glob("*.safetensors"))):
        with pytest.raises(CheckpointError, match="refuses O_DIRECT; use --expert-reads auto or buffered"):
            _streamed(tiny_k3_dir, expert_reads="direct")
        return
    out, stats = _streamed(tiny_k3_dir, expert_reads="direct")
    assert torch.equal(out, resident_logits) and stats.disk_io.direct_reads == stats.disk_reads > 0


def _refuse_o_direct(monkeypatch) -> None:
    real_open = os.open

    def refusing(path, flags, *a):  # as tmpfs on older kernels: open with O_DIRECT fails with EINVAL
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)

    monkeypatch.setattr(tiers.os, "open", refusing)


def test_auto_falls_back_to_buffered_where_o_direct_is_refused(tiny_k3_dir, resident_logits, monkeypatch):
    _refuse_o_direct(monkeypatch)
    with pytest.warns(RuntimeWarning, match="O_DIRECT refused"):
        out, stats = _streamed(tiny_k3_dir, expert_reads="auto")
    assert torch.equal(out, resident_logits)
    assert stats.disk_io.mode == "buffered" and stats.disk_io.direct_reads == 0 and stats.disk_io.reads > 0
    with pytest.raises(CheckpointError, match="refuses O_DIRECT; use --expert-reads auto or buffered"):
        _streamed(tiny_k3_dir, expert_reads="direct")


def test_direct_layout_puts_the_bytes_where_an_aligned_read_lands_them():
    raw = torch.empty(5000 + DIRECT_SLACK, dtype=torch.uint8)
    for offset in (0, 1, 4095, 4096, 12345, 1 << 33):
        buf, head, tail = direct_layout(raw[3:], offset, 5000)  # a misaligned raw buffer too
        pad = offset % DIRECT_ALIGN
        assert buf.numel() == 5000 and (buf.data_ptr() - pad) % DIRECT_ALIGN == 0
        assert head >= pad and tail >= -(offset + 5000) % DIRECT_ALIGN
        assert buf.data_ptr() - head >= raw.data_ptr() and buf.data_ptr() + 5000 + tail <= raw.data_ptr() + raw.numel()


def test_direct_read_of_unaligned_ranges_gives_the_files_bytes(tmp_path):
    """O_DIRECT where the file system allows it (else the reader reads buffered and says so: direct -1)."""
    data = torch.randint(0, 256, (3 * DIRECT_ALIGN + 777,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    fd, dfd = os.open(path, os.O_RDONLY), None
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        pass
    log = ReadStats()
    try:
        for offset, n in ((0, 100), (5, 4096), (4090, 8000), (data.numel() - 300, 300)):
            raw = torch.empty(n + DIRECT_SLACK, dtype=torch.uint8)
            buf, head, tail = direct_layout(raw, offset, n)
            direct = Direct(dfd, head, tail) if dfd is not None else None
            read_now(fd, offset, buf, None, direct, log)
            assert torch.equal(buf, data[offset:offset + n]), (offset, n)
    finally:
        os.close(fd)
        if dfd is not None:
            os.close(dfd)
    assert log.reads == 4 and log.direct_reads + log.refused == (4 if dfd is not None else 0)


def test_a_steps_reads_are_submitted_in_file_offset_order(tiny_k3_dir):
    _, store = load_model(tiny_k3_dir, LoadOptions(expert_policy="none"))
    src, reads = store.source, Reads(2)
    submitted: list[int] = []
    real = reads.read_many

    def spy(jobs, **kw):
        submitted.extend(j[0][0][1] for j in jobs)  # each job's first segment's offset
        return real(jobs, **kw)

    reads.read_many = spy
    try:
        keys = [Key(*k) for k in src.index.entries]
        random.Random(0).shuffle(keys)
        keys = keys[:12]
        got = src.start_many(keys, reads)
        spans = [src.span(k) for k in keys]
        order = sorted(range(len(keys)), key=lambda i: (spans[i].file, spans[i].start))
        assert submitted == [spans[i].start for i in order]
        for key, pending in zip(keys, got):  # handed back in the order asked
            w, fresh = tensors(pending.result()), tensors(src.get(key))
            assert w.keys() == fresh.keys() and all(torch.equal(w[n], fresh[n]) for n in w), key
    finally:
        reads.close()
        store.close()


def test_read_stats_time_in_flight_is_the_union_of_intervals():
    rng = random.Random(1)
    log, intervals = ReadStats(), []
    t0 = 0
    for _ in range(1500):  # past the merge threshold; reads start in the order they were submitted
        t0 += rng.randrange(0, 30)
        intervals.append((t0, t0 + rng.randrange(1, 40)))
    head = intervals[:400]
    rng.shuffle(head)  # ... and results are taken in any order within the first merge's batch
    intervals[:400] = head
    for t0, t1 in intervals:
        log.read(t0, t1, 1, 1)
    log.merge()
    covered = set()
    for t0, t1 in intervals:
        covered.update(range(t0, t1))
    assert log.busy_s * 1e9 == pytest.approx(len(covered), abs=1e-3)


def test_dedup_counts_the_routing(tiny_k3_dir):
    model, store = load_model(tiny_k3_dir, LoadOptions(expert_policy="none"))
    pairs = distinct = 0
    seen: list[torch.Tensor] = []
    hooks = [b.gate.register_forward_hook(lambda m, i, o: seen.append(o[0])) for b in model.moe_blocks()]
    try:
        with torch.no_grad():
            model(PROMPT)
    finally:
        for h in hooks:
            h.remove()
        store.close()
    for ids in seen:
        pairs += ids.numel()
        distinct += len(set(ids.flatten().tolist()))
    s = store.stats
    assert (s.routed_pairs, s.fetched) == (pairs, distinct) and s.dedup == pairs / distinct > 1
    assert s.disk_reads == distinct  # a store that keeps nothing reads each distinct expert once per step


def _tail_oracle(ids, w, p, renormalize):
    """Per token, in float64 Python: the kept experts (fewest by descending weight reaching p) and their weights."""
    out = []
    for row_ids, row_w in zip(ids.tolist(), w.double().tolist()):
        total, acc, kept = sum(row_w), 0.0, {}
        for i in sorted(range(len(row_w)), key=lambda i: -row_w[i]):
            if acc / total >= p:
                break
            kept[row_ids[i]] = row_w[i]
            acc += row_w[i]
        if renormalize:
            kept = {e: v * total / acc for e, v in kept.items()}
        out.append(kept)
    return out


@pytest.mark.parametrize("p", [1.0, 0.9, 0.5, 0.01])
def test_tail_skip_keeps_the_fewest_experts_reaching_p(p):
    from moeswap.models.layers.moe import tail_skip

    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(40)])
    w = torch.rand(40, 8, generator=g) + 0.01
    for renormalize in (True, False):
        got_ids, got_w = tail_skip(ids, w, p, renormalize)
        for t, kept in enumerate(_tail_oracle(ids, w, p, renormalize)):
            nonzero = {int(e): float(v) for e, v in zip(got_ids[t], got_w[t]) if v != 0}
            assert nonzero.keys() == kept.keys(), (t, p)
            assert all(nonzero[e] == pytest.approx(kept[e], rel=1e-6) for e in kept)
            assert set(got_ids[t].tolist()) == set(kept)  # a skipped slot names a kept expert: nothing else fetched
        if p == 1.0:
            assert torch.equal(got_ids, ids) and (torch.equal(got_w, w) or renormalize)


def test_top_p_one_is_off_and_below_reads_fewer_experts(tiny_k3_dir, resident_logits):
    out, stats = _streamed(tiny_k3_dir, expert_top_p=1.0)
    assert torch.equal(out, resident_logits)
    _, skipped = _streamed(tiny_k3_dir, expert_top_p=0.5)
    assert skipped.disk_reads < stats.disk_reads


def test_groups_cut_anywhere_give_the_same_bits(tiny_k3_dir, resident_logits, monkeypatch):
    """A streaming step cuts its group wherever a read is still in flight: the sums must not depend on the cuts."""
    from moeswap.experts import executors

    monkeypatch.setattr(executors.Group, "GROUP_BYTES", 1)  # every expert its own kernel call
    out, _ = _streamed(tiny_k3_dir, expert_reads="buffered")
    assert torch.equal(out, resident_logits)


@pytest.mark.parametrize("flags, fragment", [(("--prefill-chunk", "0"), "--prefill-chunk must be at least 1"),
                                             (("--expert-top-p", "1.5"), "--expert-top-p must be a number in (0, 1]")])
def test_bad_streaming_flags_are_one_line_errors(tiny_k3_dir, capsys, flags, fragment):
    from moeswap.cli import main

    code = main(["generate", str(tiny_k3_dir), "--prompt", "hi", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err


def test_generate_json_reports_the_streams_reads(tiny_k3_dir, capsys, strict_json):
    from moeswap.cli import main

    code = main(["generate", str(tiny_k3_dir), "--prompt", "the quick brown fox", "--max-tokens", "3", "--json",
                 "--expert-policy", "none", "--prefill-chunk", "2"])
    got = strict_json(capsys.readouterr().out)
    store = got["expert_store"]
    assert code == 0 and store["disk_bytes"] > 0
    tokens = got["prompt_tokens"] + got["completion_tokens"] - 1
    assert got["expert_bytes_per_token"] == store["disk_bytes"] / tokens
    assert store["disk_io"]["read_GBps"] == store["disk_bytes"] / store["disk_io"]["busy_s"] / 1e9
    assert 0 <= store["disk_io"]["hidden"] <= 1 and store["dedup"] >= 1
