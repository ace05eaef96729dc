"""Every JSON text moeswap writes parses as strict JSON, with null where a value is undefined: the
jsonio writer itself, a written model's files, `generate --json` with nothing decoded and no prefetch,
and the planner's report with saturated points. (The benchmarks', quantize's and the routing trace's
JSON are parsed strictly by their own tests; `inspect --json` and `generate --json` by tests/test_cli.py.)"""

from __future__ import annotations

import io
import json
import math
import struct

import pytest

from moeswap import jsonio
from moeswap.cli import main


def test_dumps_writes_null_and_refuses_non_finite_values_naming_where():
    assert jsonio.dumps({"a": None, "b": [1.5, 2]}) == '{"a": null, "b": [1.5, 2]}'
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValueError, match=r"not writing invalid JSON: .* at \$\.rows\[1\]\.x "):
            jsonio.dumps({"rows": [{"x": 1.0}, {"x": bad}]})
    buf = io.StringIO()
    jsonio.dump({"x": [1, 2]}, buf, indent=2)
    assert buf.getvalue() == json.dumps({"x": [1, 2]}, indent=2)


@pytest.mark.parametrize("which", ["tiny_k3_dir", "tiny_linear_dir"])
def test_a_written_models_json_and_safetensors_headers(which, request, strict_json):
    model = request.getfixturevalue(which)
    files = sorted(model.glob("*.json"))
    assert {f.name for f in files} >= {"config.json", "generation_config.json", "tokenizer_config.json"}
    for f in files:
        strict_json(f.read_text())
    for shard in sorted(model.glob("*.safetensors")):
        with open(shard, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            assert strict_json(fh.read(size).decode())


def test_generate_json_writes_null_for_undefined_rates(capsys, tiny_k3_dir, strict_json):
    """One token (the prefill's), no prefetch: decode tokens/s, prefetch precision and recall are
    undefined. They were NaN, which no strict parser reads."""
    assert main(["generate", str(tiny_k3_dir), "--prompt", "hi", "--max-tokens", "1", "--json"]) == 0
    out = strict_json(capsys.readouterr().out)
    assert out["completion_tokens"] == 1 and out["decode_tokens_per_s"] is None
    p = out["expert_store"]["prefetch"]
    assert p["predicted"] == p["actual"] == 0 and p["precision"] is None and p["recall"] is None
    assert main(["generate", str(tiny_k3_dir), "--prompt", "hi", "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert "[1 tokens, finish: length, " in err and "decode n/a]" in err


def test_generate_json_prefetch_accuracy(capsys, tiny_k3_dir, strict_json):
    assert main(["generate", str(tiny_k3_dir), "--prompt", "hi", "--max-tokens", "3", "--ignore-eos", "--json",
                 "--expert-memory", "40KB", "--prefetch", "next-layer"]) == 0
    p = strict_json(capsys.readouterr().out)["expert_store"]["prefetch"]
    assert p["predicted"] > 0 and p["precision"] == pytest.approx(p["correct"] / p["predicted"])
    assert p["actual"] > 0 and p["recall"] == pytest.approx(p["correct"] / p["actual"])


def test_plan_json_with_saturated_points(tmp_path, capsys, strict_json):
    """Steady arrivals beyond what prefill keeps up with: the queue grows without bound, so TTFT and
    TPOT have no value (null, with saturated: true); they were written as Infinity."""
    out = tmp_path / "plan.json"
    assert main(["plan", "--hardware", "h200", "--devices", "16", "--arrival", "steady", "--concurrency", "1,4096",
                 "--top", "2", "--json", str(out)]) == 0
    capsys.readouterr()
    points = [p for c in strict_json(out.read_text())["candidates"] for p in c["serve"]]
    assert {p["saturated"] for p in points} == {True, False}
    for p in points:
        assert (p["ttft_s"] is None and p["tpot_s"] is None) == p["saturated"], p
