"""tuning.py: OpenMP threads fitted to the machine's load, set only before torch starts its runtime."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from moeswap.tuning import ENV_THREADS, OPENMP_VARIABLES, fit_threads_to_load, fit_torch_threads


@pytest.mark.parametrize("cores, load, threads", [
    (2, 0.0, None), (2, 0.4, None), (8, 0.3, None),  # quiet: OpenMP's defaults
    (2, 0.6, 1), (2, 1.4, 1), (2, 2.0, 1), (2, 5.3, 1), (8, 4.0, 4), (8, 7.4, 1), (16, 3.5, 12),
])
def test_threads_are_the_cores_left_free(cores, load, threads):
    env = {}
    fit = fit_threads_to_load(cores, load, env)
    assert fit.threads == threads
    if threads is None:
        assert env == {} and not fit.passive
    else:
        assert env == {"OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE"} and fit.passive
        assert 1 <= threads <= max(1, cores - math.floor(load)) and threads < cores


@pytest.mark.parametrize("var", OPENMP_VARIABLES)
def test_what_the_user_set_wins(var):
    env = {var: "3"}
    fit = fit_threads_to_load(2, 9.0, env)
    assert env == {var: "3"} and fit.threads is None and var in fit.why


def test_spin_mode_and_bad_values():
    env = {"MOESWAP_THREADS": "spin"}
    assert fit_threads_to_load(2, 9.0, env).threads is None and env == {"MOESWAP_THREADS": "spin"}
    with pytest.raises(ValueError, match="MOESWAP_THREADS='many'"):
        fit_threads_to_load(2, 0.0, {"MOESWAP_THREADS": "many"})
    assert fit_threads_to_load(2, math.nan, {}).threads is None  # an unreadable load changes nothing


@pytest.mark.slow
def test_the_command_applies_it_before_torch_starts(tiny_k3_dir):
    """A busy machine (other processes' load patched to 9) reaches torch: one thread, and --json says why."""
    code = ("import sys; import moeswap.tuning as t; t.other_load = lambda: 9.0; from moeswap.cli import main; "
            f"sys.exit(main(['generate', {str(tiny_k3_dir)!r}, '--prompt', 'hi', '--max-tokens', '2', '--json']))")
    env = {k: v for k, v in os.environ.items()
           if k not in (*OPENMP_VARIABLES, ENV_THREADS)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["threads"] == 1 and "passive wait" in result["openmp"] and "busy machine" in result["openmp"]


@pytest.mark.parametrize("before, cores, load, after", [
    (2, 2, 1.4, 1),  # busy: lowered to the cores left free
    (1, 8, 4.0, 1),  # never raised
    (2, 2, 0.0, 2),  # quiet: left as it is
])
def test_after_torch_only_its_threads_are_lowered(monkeypatch, before, cores, load, after):
    """torch imported first: the fit lowers torch.set_num_threads and leaves the environment alone."""
    import torch

    for var in (*OPENMP_VARIABLES, ENV_THREADS):
        monkeypatch.delenv(var, raising=False)
    env = dict(os.environ)
    was = torch.get_num_threads()
    torch.set_num_threads(before)
    try:
        fit = fit_torch_threads(cores, load)
        assert torch.get_num_threads() == after and dict(os.environ) == env
        assert (fit.threads, fit.passive) == ((after, False) if load >= 0.5 else (None, False))
    finally:
        torch.set_num_threads(was)


def test_other_load_counts_runnable_processes_now():
    import subprocess as sp

    quiet = fit_threads_to_load(2, None, {})  # whatever the machine does now: a decision, never an error
    assert quiet.load >= 0
    spinners = [sp.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        import time

        time.sleep(0.5)
        from moeswap.tuning import other_load

        assert other_load() >= 2  # three spinners are runnable (at most one is between time slices)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
