"""A decode step's decoder layers in one C call (ops/csrc/decode_step.c moeswap_decode_layers).

Between the kernels of an eager decode step, Python spends time on every layer (module calls, views, checks,
tensor allocations, cold caches after each kernel): a large share of a batch-1 step (docs/benchmarks.md). Here
the layers' weights are described once, as a table of pointers, and a step is one C call that runs the
same kernels in the same order on the same values; the model's forward stays the reference and runs
whenever this does not apply:

- eager CPU inference without gradients, fp32 activations, at most KERNEL_MAX_ROWS sequences (either GEMM precision:
  under bf16, every bf16-weight product rounds its input as ops/linear.py does);
- dense weights kept bf16 (the loader's default on the CPU), or kept as codes and scales of one kind per layer:
  block FP8 (weights.fp8_block, DeepSeek-V3's published layout), INT8 or INT4 (weights.int8 / weights.int4,
  --dense-weights int8|int4; MLA, KDA and MLPs), with each attention's input projections and each gated MLP's
  gate/up fused (EngineConfig.fuse); K3's latent expert projections kept as codes leave that layer's FFN to
  the model (csrc/moe.c reads them as bf16).

Routed experts run in the call from the layers' resident tables (experts/executors.py ResidentTable), which
mirror what the store's fast tier holds, whether it can evict or not; the hits are booked with the store after each
call (`ExpertStore.table_hits`: the policy's recency, as a fetch books them). A chosen expert not in its
layer's table is read by the call itself where the store allows (experts/incall.py: evicting from victims the
store offered before the call, its books kept after it). Where it cannot be (the store keeps experts another
way, or the call ran out of what it was offered), the call stops after that layer's attention; here the
expert lookahead runs (a
store that can evict: the next MoE layer's guess is loaded in the background; the call has routed the next
layer on this input already, so NextLayerLookahead only counts and hints its ids), the layer's experts are
taken through the store (the same books and loads as the model's own fetch; all are taken before any
computes, so the first miss is read on this thread while the reader threads read the rest), the next layer's
hinted loads whose reads are done are stored (in its table before the call reaches it), and the call resumes at
that FFN with them. A layer without a table (a store that records a trace or keeps nothing) stops and
the model runs that FFN. So the store sees the same fetches, in the same order, as under the model's
forward (tests/engine/test_native_step.py), but the lookahead guesses only at layers that missed.

MLA with a rotary shared key (DeepSeek-V3 / Kimi K2): each step's cos/sin come from the model's Rotary
(the same values), and the C step turns q and k_r with them as the forward does; group-limited routing is
the C router's, as in the forward.

Served LoRA adapters (lora.multi) leave the table on the base weights, read through their wrappers: the
call runs while no row of the batch uses an adapter, and a step with one takes the model's forward.

The table points at the bf16 weights and fp32 parameters themselves, so in-place changes to them are seen;
where it holds a copy (fp32 casts, conv taps, the absorbed MLA weights, AttnRes scores) it is rebuilt when
a source weight changes in place (its version). A model whose modules or parameters are replaced
(fusion, .to()) needs a new NativeDecode. Results: the model forward's logits and states, bit for bit
(tests/engine/test_native_step.py).
Entry point: `NativeDecode(model)`, called as `model(tokens_B1, state)` is.
"""

from __future__ import annotations

import ctypes

import torch

from moeswap.experts.hybrid import fetch_step
from moeswap.experts.incall import InCallLoads
from moeswap.models.decoder import DecoderModel, ModelState
from moeswap.models.layers.attn_res import score_vector
from moeswap.models.layers.basic import embedding_dtype, fused_codes, fused_weight, unadapted
from moeswap.models.layers.kda import KDAState
from moeswap.models.layers.mla import MLA, MLACache
from moeswap.ops import cpu_kernels
from moeswap.ops.gemm_precision import gemm_precision
from moeswap.ops.kda import L2_EPS
from moeswap.ops.linear import KERNEL_MAX_ROWS
from moeswap.weights.dense import codes_of, kernel_of, weight_sources

_i64 = ctypes.c_int64


class _Layer(ctypes.Structure):
    """csrc/cpu_kernels.h `decode_layer`: its fields as MOESWAP_DECODE_LAYER_FIELDS lists them (comments there),
    compared with the library's own layout, field by field, before a table of them is used."""

    _fields_ = cpu_kernels.abi().layer_fields


class Unsupported(Exception):
    """Why a model cannot take the native step (the message names it)."""


class _Plan:
    """The layer table of one model as its parameters are now, and the tensors it points into."""

    def __init__(self, model: DecoderModel):
        self.kernel = cpu_kernels.kernel()
        if self.kernel is None:
            raise Unsupported(f"no CPU kernel ({cpu_kernels.build_error()})")
        problem = self.kernel.layout_problem(_Layer)
        if problem:
            raise Unsupported(problem)
        c = model.config
        self.eps, self.D = c.rms_norm_eps, c.hidden_size
        self.act_name, self.act = c.hidden_act, cpu_kernels.ACTS.get(c.hidden_act)
        if self.act is None:
            raise Unsupported(f"activation {c.hidden_act!r}")
        self.betas = (c.situ_beta, c.situ_linear_beta)
        if any(block.gate.top_p < 1 for block in model.moe_blocks()):
            raise Unsupported("--expert-top-p below 1 (the call routes without skipping)")
        self._kept: list[torch.Tensor] = []
        self.watched: list[torch.Tensor] = []  # weights the table holds copies of (see _f32)
        layers = model.model.layers
        self.table = (_Layer * len(layers))()
        self.moe: list[tuple[int, object]] = []  # (layer, MoE block)
        self.rotary = None  # the MLA layers' Rotary (models/layers/rope.py), and their rows of the table
        self.rope_layers: list[_Layer] = []
        self._rope: torch.Tensor | None = None  # this step's cos/sin, which the rows point into
        self.module_ffn: set[int] = set()  # layers whose FFN the model always runs
        block = c.attn_res_block_size
        self.max_bank = -(-len(layers) // block) if block else 0
        for i, layer in enumerate(layers):
            t = self.table[i]
            t.dense_format = cpu_kernels.FORMAT_CODES["bf16"]  # until a weight kept as codes says otherwise
            t.ln_in = self._f32(layer.input_layernorm.weight)
            t.ln_post = self._f32(layer.post_attention_layernorm.weight)
            self._norm_eps(layer.input_layernorm, layer.post_attention_layernorm)
            if block:
                t.bank_before = int(i % block == 0)
                t.score_attn = self._score(layer.self_attention_res_norm, layer.self_attention_res_proj)
                t.score_ffn = self._score(layer.mlp_res_norm, layer.mlp_res_proj)
            (self._mla if isinstance(layer.self_attn, MLA) else self._kda)(t, layer.self_attn)
            if hasattr(layer, "mlp"):
                self._gated_mlp(t, layer.mlp)
            else:
                self._moe(t, i, layer.block_sparse_moe)
        m = model.model
        self.score_out = self._score(m.output_attn_res_norm, m.output_attn_res_proj) if block else None
        # the final norm and lm_head in the call too, where the head is a bf16 stored weight
        self._norm_eps(m.norm)
        self.final_norm, self.head, self.V = self._f32(m.norm.weight), None, model.config.vocab_size
        if not model.config.tie_word_embeddings and kernel_of(unadapted(model.lm_head)) == "bf16":
            self.head = self._bf16(model.lm_head)
        self._scratch: dict[int, tuple] = {}
        self._blocks = list(model.moe_blocks())

    def stores(self) -> list:
        """The MoE blocks' stores as they are now (attach_store may change them between steps)."""
        return list({id(b.store): b.store for b in self._blocks}.values())

    # -- pointers, checked --------------------------------------------------------------------------
    def _ptr(self, t: torch.Tensor) -> int:
        self._kept.append(t)
        return t.data_ptr()

    def _f32(self, t: torch.Tensor, *sources: torch.Tensor) -> int:
        """An fp32 contiguous t: t itself (read live), or a copy, whose sources (t, or the weights t was
        derived from) the step then watches for in-place changes (`versions`)."""
        c = t.detach().float().contiguous()
        if c.data_ptr() != t.data_ptr() or sources:
            self.watched += sources or (t,)
        return self._ptr(c)

    def versions(self) -> list[int] | None:
        """The versions of the weights behind the table's copies (None: inference tensors, which keep none)."""
        try:
            return [p._version for p in self.watched]
        except RuntimeError:
            return None

    def _score(self, norm, proj) -> int:
        return self._f32(score_vector(norm, proj), norm.weight, proj.weight)

    def _bf16(self, linear_module) -> int:
        linear_module = unadapted(linear_module)  # the step runs only while no row uses an adapter
        w = linear_module.weight
        if kernel_of(linear_module) != "bf16" or w.dtype != torch.bfloat16 or not w.is_contiguous():
            raise Unsupported(f"{type(linear_module).__name__} with {w.dtype} weights (expected bf16 kept as stored)")
        return self._ptr(w)

    def _weight(self, t: _Layer, linear_module) -> tuple[int, int | None]:
        """A Linear's (weight pointer, scales pointer): bf16 kept as stored (no scales), or codes and scales (block
        FP8, INT8, INT4: the method's `codes`), which the call multiplies from them as the module does; a layer's
        codes are all of one kind (its dense_format)."""
        m = unadapted(linear_module)
        names = codes_of(m)
        if names is not None and getattr(m, names[0]).is_contiguous() and m.in_features % 32 == 0:
            self._dense_format(t, kernel_of(m))
            return self._ptr(getattr(m, names[0])), self._ptr(getattr(m, names[1]))
        return self._bf16(linear_module), None

    @staticmethod
    def _dense_format(t: _Layer, kind: str | None) -> None:
        code = cpu_kernels.FORMAT_CODES[kind or "bf16"]
        if t.dense_format not in (cpu_kernels.FORMAT_CODES["bf16"], code):
            raise Unsupported("a layer with dense weights kept as codes of two kinds")
        t.dense_format = code

    def _fused(self, t: _Layer, module, names: tuple[str, ...]) -> tuple[int, int, list[int], int | None]:
        """The named Linears' fused weight: (pointer, rows, each one's first row, scales pointer or None):
        bf16, or codes with their scales (block FP8, INT8, INT4: models/layers/basic.py fuses them all)."""
        coded = fused_codes(module, names, unadapted_rows=True)
        w = fused_weight(module, names, unadapted_rows=True) if coded is None else coded[0]
        if coded is None and (w is None or w.dtype != torch.bfloat16):
            raise Unsupported(f"{type(module).__name__}'s {', '.join(names)} are not fused bf16 weights or codes")
        for n in names:
            self._weight(t, getattr(module, n))
        starts, at = [], 0
        for rows in module.__dict__["_fused_input"][3]:
            starts.append(at)
            at += rows
        if coded is not None and coded[2] == "fp8" and (w.shape[1] % 32 or any(s % 128 for s in starts)):
            raise Unsupported(f"{type(module).__name__}'s block-FP8 {', '.join(names)} do not fit the kernel's blocks")
        return self._ptr(w), at, starts, None if coded is None else self._ptr(coded[1])

    def _norm_eps(self, *norms) -> None:
        if any(n.eps != self.eps for n in norms):
            raise Unsupported("norms with different eps")

    # -- layers -------------------------------------------------------------------------------------
    def _kda(self, t: _Layer, a) -> None:
        t.w_in, t.in_rows, starts, t.s_in = self._fused(t, a, a.input_projections())
        C = a.H * a.K
        if starts[1:3] != [starts[0] + C, starts[0] + 2 * C] or a.f_a_proj.out_features != a.K:
            raise Unsupported("KDA's q, k, v projections are not adjacent")
        t.off[:] = starts + [0] * (len(t.off) - len(starts))
        (t.w_o, t.s_o), t.w_fb = self._weight(t, a.o_proj), self._bf16(a.f_b_proj)
        if hasattr(a, "g_b_proj"):
            t.w_gb = self._bf16(a.g_b_proj)
        convs = (a.q_conv1d.weight, a.k_conv1d.weight, a.v_conv1d.weight)
        t.taps, t.rate = self._f32(a.conv_taps(), *convs), self._f32(a.decay_rate(), a.A_log)
        t.dt_bias = self._f32(a.dt_bias)
        t.o_norm = self._f32(a.o_norm.weight)
        t.bounded, t.lower = int(a.lower_bound is not None), float(a.lower_bound or 0.0)
        t.kda_scale, t.H, t.K, t.W = a.K**-0.5, a.H, a.K, a.W
        if a.eps != self.eps:
            raise Unsupported("KDA's o_norm eps differs from the model's")

    def _mla(self, t: _Layer, a) -> None:
        t.mla = 1
        if a.rotary is not None:  # the step's cos/sin are set per step (_Plan.set_rope); one config, one Rotary
            self.rotary = self.rotary or a.rotary
            self.rope_layers.append(t)
            t.rope_interleave = int(a.rotary.interleave)
        t.w_in, t.in_rows, starts, t.s_in = self._fused(t, a, a.input_projections())
        t.off[:] = starts + [0] * (len(t.off) - len(starts))
        if hasattr(a, "q_a_proj"):
            self._norm_eps(a.q_a_layernorm)
            t.q_norm = self._f32(a.q_a_layernorm.weight)
            t.w_qb, t.s_qb = self._weight(t, a.q_b_proj)
            t.q_rank = a.q_a_proj.out_features
        self._norm_eps(a.kv_a_layernorm)
        t.kv_norm = self._f32(a.kv_a_layernorm.weight)
        w_k, w_v = a.absorbed_weights(torch.float32)
        sources = weight_sources(unadapted(a.kv_b_proj))  # block FP8: the codes and their scales
        t.wk, t.wv = self._f32(w_k, *sources), self._f32(w_v, *sources)
        t.H, t.N, t.R, t.L, t.V, t.mla_scale = a.H, a.N, a.R, a.L, a.V, a.scale
        t.gated = int(hasattr(a, "g_proj"))
        t.w_o, t.s_o = self._weight(t, a.o_proj)

    def _gated_mlp(self, t: _Layer, mlp) -> None:
        if (mlp.act, tuple(mlp.situ_betas)) != (self.act_name, self.betas):
            raise Unsupported("an MLP with its own activation")
        t.w_gu, _, _, t.s_gu = self._fused(t, mlp, ("gate_proj", "up_proj"))
        t.w_down, t.s_down = self._weight(t, mlp.down_proj)
        t.hidden = mlp.down_proj.in_features
        if (t.s_gu is None) != (t.s_down is None):
            raise Unsupported("an MLP with codes (block FP8, INT8, INT4) and bf16 weights mixed")

    def _moe(self, t: _Layer, i: int, moe) -> None:
        t.moe = 1
        r = moe.gate
        if r.weight.dtype != torch.float32 or r.e_score_correction_bias.dtype != torch.float32:
            self.module_ffn.add(i)  # no fp32 router: the model runs this FFN
            return
        if hasattr(moe, "routed_expert_down_proj") and any(
                kernel_of(unadapted(p)) != "bf16" for p in (moe.routed_expert_down_proj, moe.routed_expert_up_proj)):
            self.module_ffn.add(i)  # latent projections kept as codes (csrc/moe.c reads bf16): the model runs it
            return
        if (moe.act, tuple(moe.situ_betas)) != (self.act_name, self.betas):
            raise Unsupported("experts with their own activation")
        t.router, t.router_bias = self._f32(r.weight), self._f32(r.e_score_correction_bias)
        t.E, t.topk, t.route_scale = moe.num_experts, r.top_k, r.scaling
        t.groups, t.topk_group = (r.groups, r.topk_group) if r.groups > 1 else (1, 1)
        t.softmax, t.renorm = int(r.scoring != "sigmoid"), int(r.renormalize)
        if hasattr(moe, "routed_expert_down_proj"):
            t.lat_down, t.lat_up = self._bf16(moe.routed_expert_down_proj), self._bf16(moe.routed_expert_up_proj)
            t.lat_dim = moe.routed_expert_down_proj.out_features
            if hasattr(moe, "routed_expert_norm"):
                self._norm_eps(moe.routed_expert_norm)
                t.lat_norm = self._f32(moe.routed_expert_norm.weight)
        if hasattr(moe, "shared_experts"):
            self._gated_mlp(t, moe.shared_experts)
        self.moe.append((i, moe))

    def set_rope(self, lengths_B: torch.Tensor) -> None:
        """Points the RoPE layers at cos/sin of this step's positions (each row's cached length), computed by
        the Rotary the model's forward uses, so the same values."""
        if self.rotary is None:
            return
        cos_BF, sin_BF = self.rotary.cos_sin(lengths_B, torch.float32)
        self._rope = torch.stack([cos_BF, sin_BF]).contiguous()
        for t in self.rope_layers:
            t.rope_cos, t.rope_sin = self._rope[0].data_ptr(), self._rope[1].data_ptr()

    def scratch(self, B: int) -> tuple[torch.Tensor, torch.Tensor, ctypes.Array, torch.Tensor]:
        """The call's bank [max_bank, B, D], stop output [B, D], experts-per-layer array and router choices
        [layers, B * topk], kept per batch size (the call overwrites them; nothing of them is returned);
        the MoE rows point at this size's choices."""
        if B not in self._scratch:
            with torch.inference_mode(False):
                K = max((self.table[i].topk for i, _ in self.moe), default=1)
                self._scratch[B] = (torch.empty(max(self.max_bank, 1), B, self.D), torch.empty(B, self.D),
                                    (_i64 * len(self.table))(), torch.zeros(len(self.table), B * K, dtype=torch.int64))
        chosen = self._scratch[B][3]
        for i, _ in self.moe:
            self.table[i].chosen = chosen[i].data_ptr()
        return self._scratch[B]

    def refresh(self) -> dict[int, object]:
        """Per step, what may change between steps: which MoE layers stop for the model to run their FFN
        (no fp32 router, no resident table, or a table that has no format yet) and each table's expert width
        and format. Returns the tables by layer."""
        tables = {}
        for i, moe in self.moe:
            t, table = self.table[i], moe.resident_table()
            if table is None or table.kind is None:
                t.stop, t.table = 1, None
                continue
            t.stop, t.table, t.F = 0, table.rows.data_ptr(), table.F  # MoE.resident_table keeps it alive
            t.format = cpu_kernels.resident_format_code(table.kind, moe.int8_activations)
            tables[i] = table
        for i in self.module_ffn:
            self.table[i].stop = 1
        return tables


class NativeDecode:
    """model(tokens_B1, state) for decode steps, through moeswap_decode_layers where it applies."""

    def __init__(self, model: DecoderModel):
        self.model = model
        self._plan: _Plan | None = None
        self._params: list[torch.Tensor] | None = None  # listed once: a listing is not free (docs/benchmarks.md)
        self._key: list[int] | None = None  # the plan's watched versions when it was made
        self._built = False
        self._unsupported: str | None = None  # why no plan could be made for the current parameters
        self.reason: str | None = None  # why the last step took the model's forward, or None
        self._states: tuple | None = None  # (state, batch, its pointer table, its MLA caches): _state_table
        self._loads: InCallLoads | None = None  # the store's in-call loads (experts/incall.py), for _loads_key
        self._loads_key: tuple | None = None  # (plan, store)

    def __call__(self, tokens_BT: torch.Tensor, state: ModelState | None, last_only: bool = False) -> torch.Tensor:
        plan = self._applicable(tokens_BT, state)
        if plan is None:
            return self.model(tokens_BT, state, last_only)
        with gemm_precision(self.model.gemm_precision):  # for what the model runs between native calls
            return self._step(plan, tokens_BT, state)

    def _applicable(self, tokens_BT: torch.Tensor, state: ModelState | None) -> _Plan | None:
        m = self.model
        if (state is None or tokens_BT.ndim != 2 or tokens_BT.shape[1] != 1 or not tokens_BT.is_cpu
                or not 0 < tokens_BT.shape[0] <= KERNEL_MAX_ROWS or torch.compiler.is_compiling()
                or embedding_dtype(m.model.embed_tokens) != torch.float32):
            self.reason = "not an eager fp32 CPU decode step of at most 32 sequences"
            return None
        if self._params is None:
            self._params = list(m.parameters())
        if torch.is_grad_enabled() and any(p.requires_grad for p in self._params):
            self.reason = "gradients are enabled"
            return None
        rows = getattr(m, "adapter_rows", None)  # served LoRA adapters (lora.multi): the table holds base weights
        if rows is not None and rows.active:
            self.reason = "a row uses a LoRA adapter"
            return None
        if not self._built or (self._plan is not None and self._plan.versions() != self._key):
            self._built, self._unsupported = True, None
            try:
                self._plan = _Plan(m)
                self._key = self._plan.versions()
            except Unsupported as err:
                self._plan, self._unsupported = None, str(err)
        plan = self._plan
        if plan is None:
            self.reason = self._unsupported
            return None
        self.reason = None
        return plan

    def forget_state(self) -> None:
        """Drop the pointer table of the last step's state (and with it the buffers it keeps alive): its
        owner reallocated them (engine/state.py SlotStates grows and shrinks its buffers)."""
        self._states = None

    def _state_table(self, state: ModelState, B: int) -> ctypes.Array:
        """Per layer (conv, S, 0) or (latent, lengths, capacity) of the batch's rows; MLA caches grown to fit.
        Kept for the same state object (the scheduler's views) while its MLA caches keep their buffers."""
        kept = self._states
        if kept is not None and kept[0] is state and kept[1] == B:
            caches = kept[3]
            if all(st.latent_BSX is lat and st.longest() < lat.shape[1] for st, lat in caches):
                return kept[2]
        values: list[int] = []
        caches = []
        for st in state.layers:
            if isinstance(st, KDAState):
                S, conv = st.recurrent_BHKK, st.conv_BWC
                ok = (S.dtype == conv.dtype == torch.float32 and S.shape[0] == conv.shape[0] == B
                      and S.is_contiguous() and conv.is_contiguous())
                values += [conv.data_ptr(), S.data_ptr(), 0]
            else:
                st.reserve(1)
                lat, lengths = st.latent_BSX, st.lengths_B
                ok = (lat.dtype == torch.float32 and lengths.dtype == torch.int64
                      and lat.shape[0] == lengths.shape[0] == B and lat.is_contiguous() and lengths.is_contiguous())
                values += [lat.data_ptr(), lengths.data_ptr(), lat.shape[1]]
                caches.append((st, lat))
            if not ok:
                raise ValueError(f"native decode step: a layer state does not fit {B} sequences "
                                 f"of fp32 contiguous rows")
        table = (_i64 * len(values))(*values)
        self._states = (state, B, table, caches)
        return table

    def _step(self, plan: _Plan, tokens_B1: torch.Tensor, state: ModelState) -> torch.Tensor:
        m, B, D = self.model, tokens_B1.shape[0], plan.D
        states = self._state_table(state, B)
        longest = [st.longest() for st in state.layers if isinstance(st, MLACache)]
        plan.set_rope(next((st.lengths_B for st in state.layers if isinstance(st, MLACache)), None))
        # a lookahead runs only where a store can evict: with every expert resident it has nothing to load
        stores = plan.stores()
        lookahead = m.expert_lookahead if any(getattr(s, "can_evict", True) for s in stores) else None
        # the call itself routes the next layer at a stop (its `chosen` row), for a lookahead that takes a guess
        guessed = getattr(lookahead, "guessed", None)
        loads = self._in_call_loads(plan, stores)
        tables = plan.refresh()
        partial = m.model.embed_tokens(tokens_B1).reshape(B, D).contiguous()
        bank, m_out, used, chosen = plan.scratch(B)
        logits = torch.empty(B, plan.V) if plan.head else None
        n_layers = len(plan.table)
        n_bank, stopped = _i64(0), _i64(-1)
        first, ffn_first = 0, 0
        while True:
            if loads is not None:
                loads.offer(B)
            status = plan.kernel.lib.moeswap_decode_layers(
                plan.table, n_layers, first, states, partial.data_ptr(), bank.data_ptr(), plan.max_bank,
                ctypes.byref(n_bank), m_out.data_ptr(), plan.score_out, plan.final_norm, plan.head, plan.V,
                None if logits is None else logits.data_ptr(), B, D, plan.eps, L2_EPS, plan.act,
                plan.betas[0], plan.betas[1], used, ctypes.byref(stopped), ffn_first, int(guessed is not None),
                int(m.gemm_precision == "bf16"),
                max(1, torch.get_num_threads()))
            if ffn_first:  # the resumed layer's experts are back from their own table
                plan.table[first].table = tables[first].rows.data_ptr()
            end = stopped.value if status == 4 else n_layers
            loaded = loads.books(end) if loads is not None else {}
            self._book(plan, tables, used, chosen, first + ffn_first, end, B, loaded)
            if status != 4:
                break
            i = stopped.value
            layer, x = m.model.layers[i], m_out.view(B, 1, D)
            if lookahead is not None:
                nxt = plan.table[i + 1] if i + 1 < n_layers else None
                if guessed is not None and nxt is not None and nxt.moe and nxt.router and nxt.chosen:
                    guessed(i, chosen[i + 1, :B * nxt.topk].view(B, nxt.topk))  # the call's guess, as the hook's
                else:
                    lookahead(i, x)
            rows = None if plan.table[i].stop else self._fetched_rows(tables[i], i, chosen[i, :B * plan.table[i].topk], B)
            if lookahead is not None and i + 1 < n_layers:  # the guess in the next layer's table before it runs
                for store in stores:
                    store.settle(i + 1)
            if rows is not None:  # resume at this FFN with its experts (their rows kept alive by `rows`)
                plan.table[i].table, first, ffn_first = rows[0].data_ptr(), i, 1
                continue
            # a layer whose FFN the model runs (through the store), then the rest
            partial += layer.feed_forward(layer.post_attention_layernorm(x)).view(B, D)
            tables = plan.refresh()
            first, ffn_first = i + 1, 0
        if status:
            why = {1: "bad sizes", 2: "out of memory"}.get(status, f"status {status}")
            raise RuntimeError(f"native decode step failed ({why}); the sequences' state is no longer consistent")
        for st, n in zip((st for st in state.layers if isinstance(st, MLACache)), longest):
            st.max_length = n + 1
        if logits is not None:
            return logits.view(B, 1, plan.V)
        return m.head(m.model.norm(partial.view(B, 1, D)))  # the forward's own last step

    def _in_call_loads(self, plan: _Plan, stores: list) -> InCallLoads | None:
        """The in-call loads of the one store the MoE layers share (experts/incall.py), made when the plan or
        the store changes; None where they do not apply."""
        store = stores[0] if len(stores) == 1 else None
        if self._loads_key != (plan, store):
            if self._loads is not None:
                self._loads.clear()
            rows = {i: (plan.table[i], table) for i, moe in plan.moe if (table := moe.resident_table()) is not None}
            self._loads = InCallLoads.build(store, rows) if store is not None and rows else None
            self._loads_key = (plan, store)
        return self._loads

    @staticmethod
    def _book(plan: _Plan, tables: dict, used, chosen: torch.Tensor, start: int, end: int, B: int,
              loaded: dict) -> None:
        """The store's books of the MoE layers in [start, end) that the call ran from their tables; `loaded`:
        what it loaded itself, by layer (InCallLoads.books)."""
        for i, _ in plan.moe:
            if start <= i < end and used[i] and i in tables:
                tables[i].book(i, chosen[i, :B * plan.table[i].topk], used[i], loaded.pop(i, None))
        for i, loads in loaded.items():  # (none expected: a layer's loads are booked with its step)
            tables[i].store.table_step(i, None, loads)

    @staticmethod
    def _fetched_rows(table, i: int, ids: torch.Tensor, B: int) -> tuple | None:
        """Layer i's chosen experts fetched through the store (its books, its loads; the evictions may or
        may not leave them all in the tier; hybrid experts: those it lacks read into host memory instead),
        as a copy of the table with their rows: (rows, the experts they point into). None where one cannot
        be in the table (the model runs the FFN then, and the store books this layer step twice)."""
        unique = sorted(set(ids.tolist()))
        # takes_all: the first miss read on this thread, the rest by the readers meanwhile
        experts = fetch_step(table.store, i, unique, B, takes_all=True)
        kept = [experts[j] for j in range(len(unique))]  # loaded (and evicting) before the table is read
        rows = table.rows.clone()
        for e, w in zip(unique, kept):
            if table.experts.get(e) is not w:  # not (or no longer) in the tier: its row here only
                row = table.row(w)
                if row is None:
                    return None
                rows[e] = torch.tensor(row, dtype=torch.int64)
        return rows, kept
