"""The scheduler's per-sequence state (engine/state.py) is sized to what is in use: nothing before a
sequence arrives, rows as sequences join, MLA capacity as the longest grows, less again once they leave;
across every reallocation the native decode step writes the buffers the model's forward would (bit for
bit), and EngineStats reports the bytes per sequence."""

import json

import pytest
import torch

from moeswap.cli import main
from moeswap.engine.generate import GenerationConfig, generate
from moeswap.engine.scheduler import EngineConfig, Request, Scheduler
from moeswap.engine.state import MIN_CAPACITY
from moeswap.models.layers.kda import KDAState
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.units import human_bytes


def _tokens(n, seed):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sequence_bytes(model, tokens: int) -> int:
    """One sequence's fp32 state from the config: KDA recurrent [H, K, K] and conv [W-1, 3HK] per KDA
    layer, a latent of kv_lora_rank + qk_rope_head_dim per token per MLA layer."""
    c = model.config
    kda = c.kda.num_heads * c.kda.head_dim * (c.kda.head_dim + 3 * (c.kda.conv_kernel - 1))
    mla = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    return 4 * sum(kda if kind == "kda" else tokens * mla for kind in c.attn_kinds)


def test_state_is_sized_to_the_sequences_in_use(model):
    sched = Scheduler(model, EngineConfig(max_batch=8, max_len=4096))
    st = sched.states
    assert st.nbytes() == 0  # nothing for slots no sequence holds
    assert st.sequence_bytes(100) == _sequence_bytes(model, 100)
    sched.submit(Request(_tokens(10, 1), 3))
    sched.step()
    assert (st.rows, st.capacity) == (1, MIN_CAPACITY)
    assert st.nbytes() == _sequence_bytes(model, MIN_CAPACITY)
    assert sched.stats.state_bytes == st.nbytes() and sched.stats.state_bytes_per_sequence == st.nbytes()
    for i in range(4):
        sched.submit(Request(_tokens(5 + i, 2 + i), 2))
    sched.step()  # four join: rows 1 -> 2 -> 4 -> 8 (at most max_batch)
    assert st.rows == 8 and sched.stats.state_sequences == 5
    assert sched.stats.state_bytes_per_sequence == pytest.approx(8 * _sequence_bytes(model, MIN_CAPACITY) / 5)
    while sched.busy:
        sched.step()
    # all gone: the buffers shrank (to 2 rows), the peak is kept
    assert st.rows == 2 and st.nbytes() == 2 * _sequence_bytes(model, MIN_CAPACITY)
    assert sched.stats.state_bytes_peak == 8 * _sequence_bytes(model, MIN_CAPACITY)
    assert sched.stats.as_dict()["state_bytes_peak"] == sched.stats.state_bytes_peak


def _assert_same_state(a, b, live):
    for x, y in zip(a.full.layers, b.full.layers):
        if isinstance(x, KDAState):
            assert torch.equal(x.recurrent_BHKK[:live], y.recurrent_BHKK[:live])
            assert torch.equal(x.conv_BWC[:live], y.conv_BWC[:live])
        else:
            assert torch.equal(x.lengths_B[:live], y.lengths_B[:live])
            for row in range(live):
                n = a.lengths[row]
                assert torch.equal(x.latent_BSX[row, :n], y.latent_BSX[row, :n])


@pytest.mark.skipif(cpu_kernels.kernel() is None, reason="no CPU kernel")
def test_native_step_follows_reallocated_buffers(model):
    """The same requests through the native step and through the model's modules, step by step: the
    capacity grows in a decode step (a sequence passes 64 tokens) and in a prefill (a 150-token prompt),
    rows grow as one joins and shrink as they leave; every decode step is native, and after each step
    the states are equal bit for bit (a native step that kept pointers into the old buffers would
    write its rows there, and the new ones would miss them)."""
    runs = [Scheduler(model, EngineConfig(max_batch=4, max_len=256, prefill_chunk=64, native=n))
            for n in (True, False)]
    arrivals = {0: [Request(_tokens(60, 1), 12, id=0)], 3: [Request(_tokens(150, 2), 4, id=1),
                                                            Request(_tokens(7, 3), 20, id=2)]}
    capacities, rows = set(), set()
    step = 0
    while step < 4 or any(s.busy for s in runs):
        for sched in runs:
            for r in arrivals.get(step, []):
                sched.submit(Request(r.prompt, r.max_tokens, id=r.id))
        events = [[(e.id, e.token, e.finish_reason) for e in s.step()] for s in runs]
        assert events[0] == events[1]
        native, reference = runs
        assert (native.states.rows, native.states.capacity) == (reference.states.rows, reference.states.capacity)
        _assert_same_state(native.states, reference.states, len(native.live))
        capacities.add(native.states.capacity)
        rows.add(native.states.rows)
        step += 1
    assert {64, 128, 256} <= capacities and {1, 2, 4} <= rows and native.states.generation >= 5
    assert native.stats.native_steps == native.stats.decode_steps > 0, native.stats.native_off
    assert native.stats.state_bytes_peak == 4 * _sequence_bytes(model, 256)
    for i in range(3):
        assert native.finished[i].tokens == reference.finished[i].tokens


def test_capacity_shrinks_when_the_longest_leaves(model, greedy_oracle):
    sched = Scheduler(model, EngineConfig(max_batch=2, max_len=512))
    long, short = _tokens(300, 5), _tokens(6, 6)
    sched.submit(Request(long, 2, id="long"))
    sched.submit(Request(short, 14, id="short"))
    sched.step()
    assert sched.states.capacity == 320  # 300 prompt tokens in MIN_CAPACITY units
    sched.step()  # long's last token: it leaves, short (8 tokens) is left
    assert [s.req.id for s in sched.live] == ["short"] and sched.states.capacity == MIN_CAPACITY
    while sched.busy:
        sched.step()
    # the moves and the shrink kept short's state: its tokens are the full forward's
    assert sched.finished["short"].tokens == greedy_oracle(model, short, 14)
    assert sched.finished["long"].tokens == greedy_oracle(model, long, 2)


def test_generate_reports_state_bytes(model):
    # one sequence of 40 + 30 tokens, capacity in MIN_CAPACITY units (max_len 70 caps it at 128)
    res = generate(model, _tokens(40, 7), GenerationConfig(max_tokens=30, stop_ids=()))
    assert res.state_bytes == _sequence_bytes(model, 128)


def test_generate_json_and_stats_print_the_state_bytes(tiny_k3_dir, capsys):
    argv = ["generate", str(tiny_k3_dir), "--prompt", "the quick brown fox", "--max-tokens", "3", "--ignore-eos"]
    model = load_model(tiny_k3_dir, LoadOptions(dtype="float32"))[0]
    want = _sequence_bytes(model, MIN_CAPACITY)  # a short prompt: one row of MIN_CAPACITY tokens
    assert main(argv + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state_bytes"] == want
    assert main(argv + ["--stats"]) == 0
    assert f"sequence state {human_bytes(want)};" in capsys.readouterr().err
