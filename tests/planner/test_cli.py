"""CLI: end-to-end output, files, one-line errors, and wiring into another parser."""

import argparse
import json

from moeswap.planner.cli import add_parser, main


def test_plan_prints_table_and_writes_files(tmp_path, capsys):
    js, md, plots = tmp_path / "p.json", tmp_path / "p.md", tmp_path / "plots"
    rc = main(["plan", "--hardware", "h200", "--devices", "16", "--concurrency", "1,64", "--top", "3",
               "--json", str(js), "--markdown", str(md), "--plots", str(plots)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "c=64 TTFT s" in out and "best by throughput" in out and "KDA state" in out
    data = json.loads(js.read_text())
    assert data["sizes"]["expert_bytes"] == 17_547_264 and data["candidates"][0]["serve"][1]["concurrency"] == 64
    assert md.read_text().startswith("# moeswap plan: kimi-k3 on 16 x h200")
    assert sorted(p.name for p in plots.iterdir()) == ["memory.png", "throughput_tpot.png"]
    assert (plots / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_errors_are_one_line_without_traceback(capsys):
    rc = main(["--hardware", "h300", "--devices", "8"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("moeswap: error: ")  # every command's prefix
    assert "unknown hardware 'h300'" in err and "mi350x" in err and "Traceback" not in err
    assert main(["--hardware", "h200", "--devices", "8", "--layout", "tp8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeswap: error: ") and err.count("\n") == 1 and "routed experts need" in err


def test_lora_and_show_rejected(capsys):
    rc = main(["--hardware", "atlas-950-superpod", "--devices", "16", "--workload", "lora", "--top", "2",
               "--show-rejected"])
    out = capsys.readouterr().out
    assert rc == 0 and "tok/s/dev" in out and "swap GB/step/dev" in out and "rejected" in out


def test_list_hardware(capsys):
    assert main(["--list-hardware"]) == 0
    out = capsys.readouterr().out
    assert "zhenwu-m890-supernode" in out and "moeswap-cpu" in out


def test_plots_skip_without_matplotlib(monkeypatch, tmp_path, capsys):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    rc = main(["--hardware", "h200", "--devices", "16", "--layout", "pp2xtp8", "--plots", str(tmp_path / "p")])
    assert rc == 0 and "matplotlib is not installed" in capsys.readouterr().out


def test_add_parser_wires_into_an_existing_cli():
    top = argparse.ArgumentParser(prog="moeswap")
    sub = top.add_subparsers(dest="command")
    add_parser(sub)
    args = top.parse_args(["plan", "--hardware", "h200", "--devices", "16", "--layout", "pp2xtp8"])
    assert args.command == "plan" and args.func(args) == 0
