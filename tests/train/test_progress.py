"""train/progress.py and the interruption hint: without a terminal a plain line every --log-interval steps
holding loss.csv's values; loss.csv grows during the run and a resumed run continues it from its
checkpoint (no row twice, none missing); Ctrl-C / SIGTERM prints a command that, run, resumes."""

from __future__ import annotations

import csv
import io
import os
import re
import shlex
import signal

import yaml

from moeswap import cli
from moeswap.train import loop
from moeswap.train.loop import train
from moeswap.train.manifest import read_manifest

LINE = re.compile(r"^train step (\d+)/(\d+): loss (\S+), lr (\S+), (\d+) tokens/s, elapsed \d+:\d\d:\d\d, "
                  r"eta \d+:\d\d:\d\d$")


def test_without_a_terminal_a_line_every_n_steps_holds_loss_csv_values(small_run, tmp_path, capsys):
    result = train(small_run(max_steps=5, log_interval=2))  # progress=None: stderr is captured, not a tty
    lines = [LINE.match(s) for s in capsys.readouterr().err.splitlines() if s.startswith("train step")]
    assert all(lines)
    rows = {int(r["step"]): r for r in csv.DictReader(io.StringIO((result.out_dir / "loss.csv").read_text()))}
    assert [int(m[1]) for m in lines] == [1, 2, 4, 5]  # the first step, every 2nd, the last
    for m in lines:
        row = rows[int(m[1])]
        assert m[2] == "5" and m[3] == f"{float(row['loss']):.4f}" and m[4] == f"{float(row['lr']):.3e}"

    train(small_run(max_steps=2, log_interval=0, output=str(tmp_path / "quiet")))
    assert "train step" not in capsys.readouterr().err


def test_loss_csv_grows_as_the_run_goes_and_a_resume_continues_it_exactly(small_run, tmp_path):
    whole = train(small_run(output=str(tmp_path / "whole"), max_steps=6, eval_interval=3), progress=False)
    expected = (whole.out_dir / "loss.csv").read_text().splitlines(keepends=True)
    assert len(expected) == 8  # header, the eval before training, 6 steps

    cfg = small_run(output=str(tmp_path / "cut"), max_steps=6, eval_interval=3, save_interval=2)
    live = tmp_path / "cut" / "loss.csv"
    seen = {}
    train(cfg, progress=False, stop_after=5, on_checkpoint=lambda step, _: seen.update({step: live.read_text()}))
    assert seen == {2: "".join(expected[:4]), 4: "".join(expected[:6])}  # mid-run: the rows so far
    assert live.read_text() == "".join(expected[:7])  # stopped after step 5, one past the step-4 checkpoint
    train(cfg, resume=True, progress=False, stop_after=5)  # from step 4: row 5 again, once
    assert live.read_text() == "".join(expected[:7])
    resumed = train(cfg, resume=True, progress=False)
    assert live.read_text() == "".join(expected) and resumed.losses == whole.losses


def test_sigterm_prints_the_command_that_resumes(small_run, tmp_path, monkeypatch, capsys):
    whole = train(small_run(output=str(tmp_path / "whole"), max_steps=6), progress=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    settings = small_run(max_steps=6, save_interval=2).as_dict()
    settings.update(settings.pop("load"), output="out")  # relative to the config's directory
    (run_dir / "run.yaml").write_text(yaml.safe_dump(settings))
    monkeypatch.chdir(run_dir)

    real = loop.save_checkpoint

    def save_then_terminate(out, step, *rest):
        path = real(out, step, *rest)
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)  # as a batch system stops a job
        return path

    monkeypatch.setattr(loop, "save_checkpoint", save_then_terminate)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["train", "run.yaml", "--no-progress"]) == 128 + signal.SIGTERM  # a shell's code for it
    assert signal.getsignal(signal.SIGTERM) is before  # the handler lasts the run only
    err = capsys.readouterr().err
    assert "moeswap: terminated" in err
    hint = next(line for line in err.splitlines() if "continue with: " in line)
    assert "the newest checkpoint is step 4" in hint
    command = shlex.split(hint.split("continue with: ", 1)[1])
    assert command == ["moeswap", "train", "run.yaml", "--no-progress", "--resume"]  # the path as given

    monkeypatch.setattr(loop, "save_checkpoint", real)
    assert cli.main(command[1:]) == 0
    m = read_manifest(run_dir / "out")
    assert [p["loss"] for p in m["curve"]] == whole.losses
    assert [s["from_step"] for s in m["segments"]] == [0, 4]


def test_an_interrupt_before_the_first_checkpoint_says_to_start_again(small_run, tmp_path, monkeypatch, capsys):
    settings = small_run(max_steps=3).as_dict()
    settings.update(settings.pop("load"))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(settings))

    def interrupt(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "evaluate", interrupt)  # Ctrl-C during the eval before training
    assert cli.main(["train", str(tmp_path / "run.yaml")]) == 130
    err = capsys.readouterr().err
    assert f"stopped before its first checkpoint (--save-interval N writes one every N steps); start it again " \
           f"with: moeswap train {tmp_path / 'run.yaml'}" in err
    assert not (tmp_path / "out").exists()  # nothing half-made is left to refuse the new start
