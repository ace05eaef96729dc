"""DeepSeek-V3 checkpoints beyond the float parity: init-tiny's block-FP8 layout loads to the decoded
values (dense weights kept as their codes and scales, or decoded at load; routed experts kept as their stored bytes by the store's FP8_BLOCK format, computing
from them, also under an evicting cache), the multi-token-prediction layer is skipped, and malformed FP8 tensors fail naming the tensor."""

import shutil

import pytest
import torch

from moeswap import archs
from moeswap.experts.keys import Key
from moeswap.formats import fp8_block
from moeswap.formats.checkpoint import Checkpoint, CheckpointError
from moeswap.formats.files import read_json
from moeswap.jsonio import dumps
from moeswap.models.loader import LoadOptions, load_model
from moeswap.ops import cpu_kernels
from moeswap.ops.expert import FP8ExpertWeights, Int4ExpertWeights
from moeswap.tiny import write_tiny_model
from moeswap.weights.dense import kernel_of
from moeswap.weights.registry import format_of


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ds") / "fp8", "deepseek_v3", "tiny", seed=0, quant="fp8")


def _decoded(ckpt: Checkpoint, module: str) -> torch.Tensor:
    return fp8_block.decode(ckpt.read(module + ".weight"), ckpt.read(module + ".weight_scale_inv"),
                            dtype=torch.float32)


@pytest.mark.parametrize("dense_weights", ["auto", "compute"])
def test_block_fp8_weights_load_as_their_decoded_values(fp8_tiny, dense_weights):
    """Dense block-FP8 Linears: kept as their stored codes and scales (weights.fp8_block's method, whose values are the
    decoded ones) on the CPU by default; decoded to fp32 parameters under --dense-weights compute."""
    model, store = load_model(fp8_tiny, LoadOptions(dtype="float32", dense_weights=dense_weights))
    params = dict(model.named_parameters())
    with Checkpoint.open(fp8_tiny) as ckpt:
        scaled = [n.removesuffix(".weight_scale_inv") for n in ckpt.names() if n.endswith(".weight_scale_inv")]
        dense = [m for m in scaled if ".experts." not in m]
        assert any("kv_a_proj_with_mqa" in m for m in dense) and any("shared_experts" in m for m in dense)
        for module in dense:
            target, _ = archs.get("deepseek_v3").classify(module + ".weight")
            linear = model.get_submodule(target.removesuffix(".weight"))
            if dense_weights == "compute" or cpu_kernels.kernel() is None:
                assert type(linear) is torch.nn.Linear and torch.equal(params[target], _decoded(ckpt, module)), module
                continue
            assert kernel_of(linear) == "fp8", module
            assert torch.equal(params[target].view(torch.uint8), ckpt.read(module + ".weight").view(torch.uint8))
            assert torch.equal(params[target + "_scale_inv"], ckpt.read(module + ".weight_scale_inv"))
            assert torch.equal(linear.method.values(linear), _decoded(ckpt, module)), module
        assert ckpt.info("lm_head.weight").dtype == torch.bfloat16  # not quantised, as published
        layer = next(i for i, k in enumerate(model.config.mlp_kinds) if k == "moe")
        (expert,) = store.fetch(layer, [5])
        assert isinstance(expert, FP8ExpertWeights)  # kept as stored: a cached expert costs its stored bytes
        assert expert.nbytes == store.source.stored_bytes(Key(layer, 5))
        for proj, mat in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            want = _decoded(ckpt, f"model.layers.{layer}.mlp.experts.5.{proj}")
            assert torch.equal(getattr(expert, f"{mat}_weight").view(torch.uint8),
                               ckpt.read(f"model.layers.{layer}.mlp.experts.5.{proj}.weight").view(torch.uint8))
            assert torch.equal(format_of(expert).weight(expert, mat, torch.float32), want), proj


def test_block_fp8_model_decodes_incrementally_with_an_evicting_expert_cache(fp8_tiny):
    """The swap core on the FP8 experts: a fast tier of about 24 experts at their stored size (of 16 per
    layer, 5 MoE layers) gives the logits of one holding them all."""
    tokens = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for memory in (1 << 30, 6 * 3 * 64 * 64 * 4):
        model, store = load_model(fp8_tiny, LoadOptions(dtype="float32", expert_memory=memory))
        state = model.make_state(1)
        with torch.inference_mode():
            outs.append(torch.cat([model(tokens[:, :4], state)] +
                                  [model(tokens[:, t:t + 1], state) for t in range(4, 12)], dim=1))
        evictions = store.stats.fast.evictions
    assert evictions > 0
    assert torch.equal(outs[0], outs[1])


def _copy(src, dst, edit_config=None, add=None, drop=()):
    """src's checkpoint with tensors dropped / added (one extra shard) and config.json edited."""
    shutil.copytree(src, dst)
    if edit_config:
        cfg = read_json(dst / "config.json", ValueError)
        edit_config(cfg)
        (dst / "config.json").write_text(dumps(cfg))
    index = read_json(dst / "model.safetensors.index.json", ValueError)
    weight_map = index["weight_map"]
    if drop:
        from safetensors.torch import load_file, save_file

        for file in {weight_map[n] for n in drop}:
            tensors = {n: t for n, t in load_file(dst / file).items() if n not in drop}
            save_file(tensors, dst / file, metadata={"format": "pt"})
        for n in drop:
            del weight_map[n]
    if add:
        from safetensors.torch import save_file

        save_file(add, dst / "extra.safetensors", metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(add, "extra.safetensors"))
    (dst / "model.safetensors.index.json").write_text(dumps(index))
    return dst


def test_multi_token_prediction_layer_is_skipped(fp8_tiny, tmp_path):
    """DeepSeek-V3 ships its MTP module as layer num_hidden_layers (num_nextn_predict_layers: 1)."""
    n = read_json(fp8_tiny / "config.json", ValueError)["num_hidden_layers"]
    mtp = {f"model.layers.{n}.eh_proj.weight": torch.ones(64, 128, dtype=torch.bfloat16),
           f"model.layers.{n}.mlp.experts.0.gate_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16),
           f"model.layers.{n}.self_attn.o_proj.weight": torch.ones(64, 64, dtype=torch.bfloat16)}
    with_mtp = _copy(fp8_tiny, tmp_path / "mtp", lambda c: c.update(num_nextn_predict_layers=1), add=mtp)
    tokens = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = load_model(fp8_tiny, LoadOptions(dtype="float32"))[0](tokens)
        got = load_model(with_mtp, LoadOptions(dtype="float32"))[0](tokens)
    assert torch.equal(got, want)
    without = _copy(fp8_tiny, tmp_path / "undeclared", add=mtp)  # not declared: an error, not a silent skip
    with pytest.raises(CheckpointError, match=f"layers.{n}"):
        load_model(without, LoadOptions(dtype="float32"))


def test_fp8_weight_without_its_scale_names_the_tensor(fp8_tiny, tmp_path):
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    broken = _copy(fp8_tiny, tmp_path / "noscale", drop=(name,))
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight .*float8 weight without a weight_scale_inv"):
        load_model(broken, LoadOptions(dtype="float32"))


@pytest.mark.parametrize("dense_weights", ["auto", "compute"])  # kept as codes (CPU kernel) or decoded at load
def test_fp8_scale_of_the_wrong_shape_names_the_tensor(fp8_tiny, tmp_path, dense_weights):
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    broken = _copy(fp8_tiny, tmp_path / "badscale", drop=(name,), add={name: torch.ones(7, 3)})
    with pytest.raises(CheckpointError, match=r"q_a_proj\.weight .*cannot decode its block FP8 weight: .*"
                                              r"needs weight_scale_inv of shape .*found \[7, 3\]"):
        load_model(broken, LoadOptions(dtype="float32", dense_weights=dense_weights))


def test_fp8_scales_without_a_declared_block_size_fail(fp8_tiny, tmp_path):
    broken = _copy(fp8_tiny, tmp_path / "undeclared", lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match="weight_scale_inv.*no quant_method 'fp8'"):
        load_model(broken, LoadOptions(dtype="float32"))


def test_native_step_turns_halves_as_the_forward_does(tmp_path):
    """rope_interleave: false (pairs (i, i + R/2)) through the C decode step, bit for bit against the forward
    (the registry test covers DeepSeek's interleaved pairs)."""
    from moeswap.engine.native_step import NativeDecode
    from moeswap.engine.scheduler import fuse_projections
    from moeswap.ops import cpu_kernels

    if cpu_kernels.kernel() is None:
        pytest.skip(f"no CPU kernel: {cpu_kernels.build_error()}")
    base = write_tiny_model(tmp_path / "float", "deepseek_v3", "tiny", seed=0)
    halves = _copy(base, tmp_path / "halves", lambda c: c.update(rope_interleave=False))
    tokens = torch.randint(0, 512, (3, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for native in (False, True):
        model, _ = load_model(halves, LoadOptions(dtype="float32"))
        assert not model.model.layers[0].self_attn.rotary.interleave
        fuse_projections(model)
        step = NativeDecode(model) if native else model
        state = model.make_state(3)
        with torch.inference_mode():
            outs.append(torch.cat([model(tokens[:, :5], state)] +
                                  [step(tokens[:, t:t + 1], state) for t in range(5, 12)], dim=1))
    assert step.reason is None, step.reason
    assert torch.equal(outs[0], outs[1])


def test_int4_experts_load_as_compressed_tensors_decodes_them(tmp_path):
    """init-tiny --quant int4: Kimi K2-Thinking's layout (pack-quantized routed experts, the rest bf16); the
    store hands out the experts as their stored codes and scales, which decode as compressed-tensors does,
    and the native step runs, experts included (dense weights stay bf16)."""
    from moeswap.engine.native_step import NativeDecode
    from moeswap.engine.scheduler import fuse_projections
    from moeswap.formats import compressed_tensors as ct
    from moeswap.ops import cpu_kernels

    path = write_tiny_model(tmp_path / "int4", "deepseek_v3", "tiny", seed=0, quant="int4")
    model, store = load_model(path, LoadOptions(dtype="float32"))
    assert model.config.quant.format == "pack-quantized"
    with Checkpoint.open(path) as ckpt:
        module = "model.layers.2.mlp.experts.9.down_proj"
        stored = {k: ckpt.read(f"{module}.{k}") for k in ct.stored_names("int4")}
        assert stored["weight_packed"].dtype == torch.int32
        (expert,) = store.fetch(2, [9])
        assert isinstance(expert, Int4ExpertWeights)
        assert torch.equal(expert.w2_packed, stored["weight_packed"]) and torch.equal(expert.w2_scale, stored["weight_scale"])
        assert torch.equal(format_of(expert).weight(expert, "w2", torch.float32), ct.decode_weight("int4", stored, torch.float32))
        assert ckpt.info("model.layers.2.mlp.shared_experts.up_proj.weight").dtype == torch.bfloat16
    if cpu_kernels.kernel() is not None:
        fuse_projections(model)
        step = NativeDecode(model)
        state = model.make_state(1)
        with torch.inference_mode():
            model(torch.tensor([[1, 2, 3]]), state)
            step(torch.tensor([[4]]), state)
        assert step.reason is None, step.reason
