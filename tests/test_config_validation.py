"""config.json as hostile input: every float the model computes with is finite, of the right sign and
within fp32; sizes are integers in range; routing is one the router can do; a malformed file (a
directory, a FIFO, deep nesting, not UTF-8) is a ConfigError naming the file. Through the CLI each is
one line and exit code 2."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import warnings

import pytest

from moeswap.cli import main
from moeswap.config import (
    MAX_EXPERTS,
    MAX_LAYERS,
    MAX_SIZE,
    ConfigError,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    load_config,
    parse_config,
)
from moeswap.formats.files import show
from moeswap.tiny import tiny_config

# config.json key of every float field of the config dataclasses, and the sign the model needs
FLOAT_KEYS = {
    "rms_norm_eps": ("rms_norm_eps", +1),
    "situ_beta": ("activation_situ_beta", +1),
    "situ_linear_beta": ("activation_situ_linear_beta", +1),
    "moe.routed_scaling_factor": ("routed_scaling_factor", +1),
    "kda.gate_lower_bound": ("linear_attn_config.gate_lower_bound", -1),
}
SUB = {"moe": MoEConfig, "kda": KDAConfig, "mla": MLAConfig}


def k3() -> dict:
    return tiny_config("kimi_k3", "tiny")


def text(raw: dict) -> dict:
    return raw.get("text_config", raw)


def put(raw: dict, key: str, value) -> dict:
    """raw with text_config's `key` (dotted for linear_attn_config.x) set to value (deleted if ...)."""
    raw = copy.deepcopy(raw)
    *parents, leaf = key.split(".")
    d = text(raw)
    for p in parents:
        d = d[p]
    if value is ...:
        d.pop(leaf, None)
    else:
        d[leaf] = value
    return raw


def error(raw: dict) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as caught:
            parse_config(raw)
    message = str(caught.value)
    assert "\n" not in message
    return message


def float_fields() -> set[str]:
    found = {f.name for f in dataclasses.fields(ModelConfig) if "float" in str(f.type)}
    for prefix, cls in SUB.items():
        found |= {f"{prefix}.{f.name}" for f in dataclasses.fields(cls) if "float" in str(f.type)}
    return found


def test_every_float_field_of_the_config_is_validated_here():
    assert float_fields() == set(FLOAT_KEYS)


@pytest.mark.parametrize("field", sorted(FLOAT_KEYS))
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, -0.0, "wrong sign", 1e39, 1e-39,
                                   pytest.param(10**400, id="int-1e400"), "1e-5", True, [1.0], {"value": 1.0}])
def test_floats_must_be_finite_fp32_of_the_right_sign(field, value):
    key, sign = FLOAT_KEYS[field]
    if value == "wrong sign":
        value = -sign * 0.5
    message = error(put(k3(), key, value))
    which = "positive" if sign > 0 else "negative"
    assert f"field '{key}' must be a finite {which} number" in message
    assert message.endswith(f"got {show(value)}")  # a 401-digit int is shown cut short


@pytest.mark.parametrize("field", sorted(FLOAT_KEYS))
def test_good_floats_are_kept(field):
    key, sign = FLOAT_KEYS[field]
    cfg = parse_config(put(k3(), key, sign * 0.125))
    owner = cfg
    for part in field.split(".")[:-1]:
        owner = getattr(owner, part)
    assert getattr(owner, field.split(".")[-1]) == sign * 0.125


def test_nan_literal_in_the_file_names_key_and_value(tmp_path):
    raw = put(k3(), "rms_norm_eps", math.nan)
    (tmp_path / "config.json").write_text(json.dumps(raw))  # json writes the NaN literal Python reads back
    assert "NaN" in (tmp_path / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"config\.json: field 'rms_norm_eps' must be a finite positive number .* got nan$"):
        load_config(tmp_path)


# sizes the model is built from: key -> largest accepted value (the smallest is 1)
POSITIVE_INTS = {
    "hidden_size": MAX_SIZE, "num_hidden_layers": MAX_LAYERS, "vocab_size": MAX_SIZE, "intermediate_size": MAX_SIZE,
    "moe_intermediate_size": MAX_SIZE, "num_attention_heads": MAX_SIZE, "kv_lora_rank": MAX_SIZE,
    "qk_nope_head_dim": MAX_SIZE, "v_head_dim": MAX_SIZE, "num_experts": MAX_EXPERTS, "q_lora_rank": MAX_SIZE,
    "linear_attn_config.short_conv_kernel_size": MAX_SIZE,
}


@pytest.mark.parametrize("key", sorted(POSITIVE_INTS))
def test_sizes_must_be_positive_integers_in_range(key):
    high = POSITIVE_INTS[key]
    assert f"field '{key}' must be in 1..{high}, got 0" in error(put(k3(), key, 0))
    assert f"field '{key}' must be in 1..{high}, got {high + 1}" in error(put(k3(), key, high + 1))
    for bad in (-1, "64", 64.0, True, [64]):
        assert f"field '{key}' must be a non-negative integer, got {bad!r}" in error(put(k3(), key, bad))


def test_zero_experts_or_top_k_outside_them():
    assert "num_experts_per_token=0 must be in 1..num_experts=16" in error(put(k3(), "num_experts_per_token", 0))
    assert "num_experts_per_token=17 must be in 1..num_experts=16" in error(put(k3(), "num_experts_per_token", 17))


def test_kda_heads_must_be_positive():
    assert "KDA layers present but linear_attn_config.num_heads/head_dim missing" in error(
        put(k3(), "linear_attn_config.num_heads", 0))
    assert "field 'linear_attn_config.head_dim' must be a non-negative integer, got 'x'" in error(
        put(k3(), "linear_attn_config.head_dim", "x"))


@pytest.mark.parametrize("groups, topk_group, top_k, fragment", [
    (3, 1, 4, "num_expert_group=3 must split num_experts=16 into equal groups of at least 2 experts"),
    (16, 1, 1, "into equal groups of at least 2 experts"),
    (4, 5, 4, "topk_group=5 must be in 1..num_expert_group=4"),
    (4, 1, 8, "keep at least num_experts_per_token=8 experts (4 per group)"),
])
def test_expert_groups_must_allow_the_choice(groups, topk_group, top_k, fragment):
    raw = put(put(put(k3(), "num_expert_group", groups), "topk_group", topk_group), "num_experts_per_token", top_k)
    assert fragment in error(raw)


def test_good_expert_groups_are_kept():
    raw = put(put(put(k3(), "num_expert_group", 4), "topk_group", 2), "num_experts_per_token", 8)
    assert (parse_config(raw).moe.num_groups, parse_config(raw).moe.topk_group) == (4, 2)


@pytest.mark.parametrize("key", ["mla_use_output_gate", "latent_moe_use_norm", "moe_renormalize", "tie_word_embeddings",
                                 "linear_attn_config.use_full_rank_gate"])
@pytest.mark.parametrize("value", ["false", 0, 1, [True]])
def test_flags_must_be_json_booleans(key, value):
    """bool("false") is True: a flag spelled as text would silently flip."""
    assert f"field '{key}' must be true or false, got {value!r}" in error(put(k3(), key, value))


@pytest.mark.parametrize("key", ["eos_token_id", "bos_token_id", "pad_token_id"])
@pytest.mark.parametrize("value, fragment", [(512, "must be in 0..511, got 512"), (-1, "must be a non-negative integer, got -1"),
                                             ("<eos>", "must be a non-negative integer, got '<eos>'")])
def test_token_ids_must_be_in_the_vocabulary(key, value, fragment):
    assert f"field '{key}' {fragment}" in error(put(k3(), key, value))
    if key == "eos_token_id":
        assert f"field '{key}' {fragment}" in error(put(k3(), key, [507, value]))


@pytest.mark.parametrize("mutate, fragment", [
    (lambda t: t.update(linear_attn_config=[1, 2]), "field 'linear_attn_config' must be an object, got [1, 2]"),
    (lambda t: t["linear_attn_config"].update(kda_layers="1,2,3"),
     "linear_attn_config.kda_layers must be a list of 1-based layer numbers, got '1,2,3'"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, [2]]), "lists layer [2], not an integer in 1..6"),
    (lambda t: (t.pop("linear_attn_config"), t.update(layer_types="full_attention")),
     "layer_types must list 6 entries of 'linear_attention'/'full_attention', got 'full_attention'"),
    (lambda t: (t.pop("linear_attn_config"), t.update(layer_types=[["kda"]] * 6)), "layer_types must list 6 entries"),
    (lambda t: t.update(mlp_layer_types={"0": "dense"}), "mlp_layer_types must list 6 entries"),
    (lambda t: t.update(mlp_layer_types=[{}] * 6), "mlp_layer_types must list 6 entries"),
    (lambda t: t.update(first_k_dense_replace="1"), "field 'first_k_dense_replace' must be a non-negative integer"),
    (lambda t: t.update(num_hidden_layers=10**6), "field 'num_hidden_layers' must be in 1..4096, got 1000000"),
    (lambda t: t.update(architectures="KimiLinearForCausalLM"), "field 'architectures' must be a list of names"),
    (lambda t: t.update(hidden_act=["silu"]), "hidden_act=['silu'] is not supported"),
    (lambda t: t.update(moe_router_activation_func={"a": 1}), "moe_router_activation_func={'a': 1}; expected"),
    (lambda t: t.update(quantization_config=["mxfp4"]), "field 'quantization_config' must be an object"),
    (lambda t: t["quantization_config"]["config_groups"].update(group_0=["x"]),
     "quantization_config.config_groups.'group_0' must be an object with an object 'weights', got ['x']"),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"].update(format=["mxfp4"]),
     "config_groups.'group_0': format must be a name, got ['mxfp4']"),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=[32]),
     "MXFP4 group_size must be 32, got [32]"),
    (lambda t: t["quantization_config"]["config_groups"]["group_0"].update(targets="Linear"),
     "config_groups.'group_0'.targets must be a list of names, got 'Linear'"),
    (lambda t: t["quantization_config"].update(ignore=7), "quantization_config.ignore must be a list"),
    (lambda t: t["quantization_config"].update(ignore=["re:(unclosed"]), "'re:(unclosed' is not a valid regex"),
])
def test_structure_of_the_right_type(mutate, fragment):
    raw = k3()
    mutate(text(raw))
    assert fragment in error(raw)


def test_unknown_keys_with_control_characters_warn_in_one_line():
    raw = put(k3(), "evil\nkey", 1)
    with pytest.warns(UserWarning) as caught:
        parse_config(raw)
    assert len(caught) == 1 and "\n" not in str(caught[0].message) and "'evil\\nkey'" in str(caught[0].message)


def test_null_means_absent():
    raw = put(put(k3(), "rms_norm_eps", None), "mla_use_output_gate", None)
    cfg = parse_config(raw)
    assert cfg.rms_norm_eps == 1e-5 and cfg.mla.output_gate is False


# -- the file itself -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, fragment", [
    ("directory", "config.json: expected a JSON file, found a directory"),
    ("fifo", "config.json: expected a JSON file, found not a regular file"),
    ("deep", "config.json: not valid JSON for a model file (nested too deeply to parse)"),
    ("latin-1", "config.json: not valid JSON (not UTF-8 text: invalid byte at offset 20)"),
    ("long int", "config.json: not valid JSON (Exceeds the limit (4300 digits)"),
])
def test_config_files_that_are_hostile(tmp_path, kind, fragment):
    path = tmp_path / "config.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    else:
        path.write_bytes({"deep": b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                          "latin-1": '{"model_type": "kimi\xe9"}'.encode("latin-1"),
                          "long int": b'{"hidden_size": ' + b"7" * 5000 + b"}"}[kind])
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert fragment in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("key, value, fragment", [
    ("rms_norm_eps", math.nan, "field 'rms_norm_eps' must be a finite positive number"),
    ("routed_scaling_factor", -2.5, "field 'routed_scaling_factor' must be a finite positive number"),
    ("linear_attn_config.gate_lower_bound", 5.0, "field 'linear_attn_config.gate_lower_bound' must be a finite negative"),
    ("hidden_size", 0, "field 'hidden_size' must be in 1..16777216, got 0"),
])
def test_the_cli_gives_one_line_and_exit_code_2(tiny_k3_dir, copy_model, capsys, key, value, fragment):
    model = copy_model(tiny_k3_dir)
    raw = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(put(raw, key, value)))
    for argv in (["inspect", str(model)], ["generate", str(model), "--prompt", "hi", "--max-tokens", "1"]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith(f"moeswap: error: {model / 'config.json'}: ") and fragment in err


def test_config_json_directory_through_the_cli(tiny_k3_dir, copy_model, capsys):
    model = copy_model(tiny_k3_dir)
    (model / "config.json").unlink()
    (model / "config.json").mkdir()
    assert main(["inspect", str(model)]) == 2
    assert capsys.readouterr().err == f"moeswap: error: {model / 'config.json'}: expected a JSON file, found a directory\n"
