"""One adapter per Hugging Face architecture: which of a family's models it takes, its transformers
config, its tensor table (both directions) and the way back from an HF config to ``ModelConfig``.

Each model family (``models/families.py``) names its adapters in ``ModelFamily.hf_adapters``, in the
order they are tried: the GPT block exports as GPT-2, the LLaMA-style block as Llama (or Qwen3 when
it has per-head q/k norms), the MoE block as Qwen3-MoE. ``convert/hf.py`` reads and writes the files
and asks the model's adapter for everything architecture-specific, so a new family or a new HF
architecture is one adapter here and one line in its family entry.
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable

import torch

from megatron_ext.errors import UserError
from megatron_ext.models import families
from megatron_ext.models.families import (FINAL_NORM_BIAS, FINAL_NORM_WEIGHT, OUTPUT_LAYER, POSITION_EMBEDDINGS,
                                          WORD_EMBEDDINGS, layer_key)

Key = tuple[str, tuple[int, ...]]  # (megatron checkpoint key, index along stacked axes: layer, expert)

# megatron's layernorm_epsilon: TransformerConfig's default, which the runtime never changes.
NORM_EPS = 1e-5


class ConversionError(UserError):
    """A checkpoint or Hugging Face model that cannot be converted; the message names what and where."""


# --- the table's rows ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Rule:
    """One megatron tensor and the Hugging Face tensors it becomes (``to_hf``) and comes from (``from_hf``)."""

    ours: Key
    theirs: tuple[str, ...]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]
    from_hf: Callable[[list[torch.Tensor]], torch.Tensor]


def _same(ours: Key, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda t: [t], lambda ts: ts[0])


def _transposed(ours: Key, theirs: str) -> Rule:
    return Rule(ours, (theirs,), lambda t: [t.t().contiguous()], lambda ts: ts[0].t().contiguous())


def _halves(ours: Key, gate: str, up: str) -> Rule:
    # SwiGLU [W; V]: W is gated by SiLU (megatron's glu: chunk(2)[0]), HF's gate_proj.
    return Rule(ours, (gate, up), lambda t: [c.contiguous() for c in torch.chunk(t, 2, dim=0)],
                lambda ts: torch.cat(ts, dim=0))


def split_qkv(t: torch.Tensor, heads: int, groups: int, head_dim: int) -> list[torch.Tensor]:
    """megatron's per-group [q heads of the group; k; v] rows -> [q, k, v] (weights or biases)."""
    r, rest = heads // groups, t.shape[1:]
    g = t.reshape(groups, (r + 2) * head_dim, *rest)
    return [g[:, : r * head_dim].reshape(heads * head_dim, *rest).contiguous(),
            g[:, r * head_dim:(r + 1) * head_dim].reshape(groups * head_dim, *rest).contiguous(),
            g[:, (r + 1) * head_dim:].reshape(groups * head_dim, *rest).contiguous()]


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int,
             head_dim: int) -> torch.Tensor:
    """Inverse of ``split_qkv``."""
    r, rest = heads // groups, q.shape[1:]
    return torch.cat([q.reshape(groups, r * head_dim, *rest), k.reshape(groups, head_dim, *rest),
                      v.reshape(groups, head_dim, *rest)], dim=1).reshape(-1, *rest).contiguous()


def _groups(m: Any) -> int:
    return m.num_query_groups if m.group_query_attention else m.num_attention_heads


def _qkv(ours: Key, theirs: tuple[str, str, str], m: Any) -> Rule:
    shape = (m.num_attention_heads, _groups(m), m.hidden_size // m.num_attention_heads)
    return Rule(ours, theirs, lambda t: split_qkv(t, *shape), lambda ts: join_qkv(*ts, *shape))


def _gpt2_qkv(ours: Key, theirs: str, m: Any, weight: bool) -> Rule:
    """GPT-2's one ``c_attn``: [q | k | v] along its output axis, a Conv1D ([in, out]) for the weight."""
    shape = (m.num_attention_heads, m.num_attention_heads, m.hidden_size // m.num_attention_heads)
    h = m.hidden_size

    def to_hf(t: torch.Tensor) -> list[torch.Tensor]:
        qkv = torch.cat(split_qkv(t, *shape), dim=0)
        return [qkv.t().contiguous() if weight else qkv]

    def from_hf(ts: list[torch.Tensor]) -> torch.Tensor:
        qkv = ts[0].t() if weight else ts[0]
        return join_qkv(qkv[:h], qkv[h:2 * h], qkv[2 * h:], *shape)

    return Rule(ours, (theirs,), to_hf, from_hf)


Refuse = Callable[[str, Any, str], None]


# --- the adapters ----------------------------------------------------------------------------------

class HFAdapter:
    """One Hugging Face architecture (``model_type``, ``hf_class``) and the models of a family it takes."""

    model_type: str
    hf_class: str
    title: str  # the architecture's name in messages

    def selects(self, m: Any) -> bool:
        """Whether this adapter, rather than the family's next one, is the model's counterpart."""
        return True

    def check(self, m: Any, where: str) -> None:
        """ConversionError naming the flag that has no counterpart in this architecture."""

    def config_kwargs(self, m: Any, common: dict[str, Any]) -> dict[str, Any]:
        """Keyword arguments of the transformers config class, ``common`` (vocabulary, tokens, init) included."""
        raise NotImplementedError

    def patch_config_json(self, data: dict[str, Any], m: Any) -> None:
        """Keys older transformers versions read that the installed one no longer writes."""

    def rules(self, m: Any) -> list[Rule]:
        """Every tensor of the model ``m`` and its place in this architecture."""
        raise NotImplementedError

    def model_values(self, c: Any, refuse: Refuse) -> dict[str, Any]:
        """The ``ModelConfig`` values of the HF config ``c``; ``refuse(key, value, why)`` a key that
        megatron-ext's blocks cannot reproduce."""
        raise NotImplementedError

    def training_defaults(self, c: Any) -> dict[str, Any]:
        """Training choices the HF config records too: defaults the importing run's flags may change."""
        return {"init_method_std": c.initializer_range}

    def not_carried(self, c: Any) -> list[str]:
        """The HF config's fields that neither ``model_values`` nor ``training_defaults`` can carry and
        that do not hold their neutral value, as "key value (why)"."""
        return []


class GPT2(HFAdapter):
    model_type, hf_class, title = "gpt2", "GPT2LMHeadModel", "GPT-2"

    def config_kwargs(self, m: Any, common: dict[str, Any]) -> dict[str, Any]:
        return dict(common, n_positions=m.max_position_embeddings, n_embd=m.hidden_size, n_layer=m.num_layers,
                    n_head=m.num_attention_heads, n_inner=m.ffn_hidden_size, activation_function="gelu",
                    resid_pdrop=m.hidden_dropout, embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout,
                    layer_norm_epsilon=NORM_EPS, scale_attn_weights=True)

    def rules(self, m: Any) -> list[Rule]:
        out = [_same((WORD_EMBEDDINGS, ()), "transformer.wte.weight"),
               _same((POSITION_EMBEDDINGS, ()), "transformer.wpe.weight")]
        for i in range(m.num_layers):
            h, ix = f"transformer.h.{i}.", (i,)
            out += [_same((layer_key("input_layernorm.weight"), ix), h + "ln_1.weight"),
                    _same((layer_key("input_layernorm.bias"), ix), h + "ln_1.bias"),
                    _gpt2_qkv((layer_key("linear_qkv.weight"), ix), h + "attn.c_attn.weight", m, True),
                    _gpt2_qkv((layer_key("linear_qkv.bias"), ix), h + "attn.c_attn.bias", m, False),
                    _transposed((layer_key("linear_proj.weight"), ix), h + "attn.c_proj.weight"),
                    _same((layer_key("linear_proj.bias"), ix), h + "attn.c_proj.bias"),
                    _same((layer_key("pre_mlp_layernorm.weight"), ix), h + "ln_2.weight"),
                    _same((layer_key("pre_mlp_layernorm.bias"), ix), h + "ln_2.bias"),
                    _transposed((layer_key("linear_fc1.weight"), ix), h + "mlp.c_fc.weight"),
                    _same((layer_key("linear_fc1.bias"), ix), h + "mlp.c_fc.bias"),
                    _transposed((layer_key("linear_fc2.weight"), ix), h + "mlp.c_proj.weight"),
                    _same((layer_key("linear_fc2.bias"), ix), h + "mlp.c_proj.bias")]
        out += [_same((FINAL_NORM_WEIGHT, ()), "transformer.ln_f.weight"),
                _same((FINAL_NORM_BIAS, ()), "transformer.ln_f.bias")]
        if m.untie_embeddings_and_output_weights:
            out.append(_same((OUTPUT_LAYER, ()), "lm_head.weight"))
        return out

    def model_values(self, c: Any, refuse: Refuse) -> dict[str, Any]:
        if c.activation_function != "gelu":
            refuse("activation_function", c.activation_function, "megatron-ext's GPT block uses the exact GELU "
                   "(\"gelu\")")
        if not math.isclose(c.layer_norm_epsilon, NORM_EPS):
            refuse("layer_norm_epsilon", c.layer_norm_epsilon, f"megatron's norms use epsilon {NORM_EPS}")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
            if bool(getattr(c, key, want)) != want:
                refuse(key, getattr(c, key), f"megatron's attention has {key} {want}")
        return dict(num_layers=c.n_layer, hidden_size=c.n_embd, num_attention_heads=c.n_head,
                    ffn_hidden_size=c.n_inner or 4 * c.n_embd, max_position_embeddings=c.n_positions,
                    position_embedding_type="learned_absolute",
                    untie_embeddings_and_output_weights=not bool(getattr(c, "tie_word_embeddings", True)),
                    normalization="LayerNorm", swiglu=False, group_query_attention=False,
                    disable_bias_linear=False, qk_layernorm=False)

    def training_defaults(self, c: Any) -> dict[str, Any]:
        return dict(super().training_defaults(c), hidden_dropout=c.resid_pdrop, attention_dropout=c.attn_pdrop)

    def not_carried(self, c: Any) -> list[str]:
        # megatron's --hidden-dropout is both GPT-2's embd_pdrop and resid_pdrop (export writes it to both).
        if c.embd_pdrop != c.resid_pdrop:
            return [f"embd_pdrop {c.embd_pdrop} (megatron's one --hidden-dropout, here resid_pdrop {c.resid_pdrop}, "
                    "also drops after the embedding)"]
        return []


class Llama(HFAdapter):
    """The LLaMA-style block: RMSNorm, SwiGLU, rotary positions, grouped-query attention."""

    model_type, hf_class, title = "llama", "LlamaForCausalLM", "Llama"

    def selects(self, m: Any) -> bool:
        return not m.qk_layernorm

    def check(self, m: Any, where: str) -> None:
        need = [flag for flag, ok in (("--normalization RMSNorm", m.normalization == "RMSNorm"),
                                      ("--swiglu", m.swiglu),
                                      ("--position-embedding-type rope", m.position_embedding_type == "rope")) if not ok]
        if need:
            raise ConversionError(f"{where}: the {families.family_of(m).name} model "
                                  f"({' '.join(families.non_gpt_flags(m))}) has no Hugging Face equivalent: "
                                  f"{self.title} needs {', '.join(need)}")

    def config_kwargs(self, m: Any, common: dict[str, Any]) -> dict[str, Any]:
        return dict(common, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
                    num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                    num_key_value_heads=_groups(m), hidden_act="silu", max_position_embeddings=m.max_position_embeddings,
                    rms_norm_eps=NORM_EPS, rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
                    attention_dropout=m.attention_dropout, attention_bias=not m.disable_bias_linear,
                    mlp_bias=not m.disable_bias_linear, head_dim=m.hidden_size // m.num_attention_heads)

    def patch_config_json(self, data: dict[str, Any], m: Any) -> None:
        # transformers < 5 reads the rotary base from rope_theta (5 writes rope_parameters only).
        data.setdefault("rope_theta", float(m.rotary_base))

    def _attention_rules(self, m: Any, h: str, ix: tuple[int, ...]) -> list[Rule]:
        a = h + "self_attn."
        out = [_same((layer_key("input_layernorm.weight"), ix), h + "input_layernorm.weight"),
               _qkv((layer_key("linear_qkv.weight"), ix), (a + "q_proj.weight", a + "k_proj.weight",
                                                            a + "v_proj.weight"), m),
               _same((layer_key("linear_proj.weight"), ix), a + "o_proj.weight"),
               _same((layer_key("pre_mlp_layernorm.weight"), ix), h + "post_attention_layernorm.weight")]
        if not m.disable_bias_linear:
            out += [_qkv((layer_key("linear_qkv.bias"), ix), (a + "q_proj.bias", a + "k_proj.bias",
                                                              a + "v_proj.bias"), m),
                    _same((layer_key("linear_proj.bias"), ix), a + "o_proj.bias")]
        if m.qk_layernorm:
            out += [_same((layer_key("q_layernorm.weight"), ix), a + "q_norm.weight"),
                    _same((layer_key("k_layernorm.weight"), ix), a + "k_norm.weight")]
        return out

    def _mlp_rules(self, m: Any, h: str, ix: tuple[int, ...]) -> list[Rule]:
        out = [_halves((layer_key("linear_fc1.weight"), ix), h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
               _same((layer_key("linear_fc2.weight"), ix), h + "mlp.down_proj.weight")]
        if not m.disable_bias_linear:
            out += [_halves((layer_key("linear_fc1.bias"), ix), h + "mlp.gate_proj.bias", h + "mlp.up_proj.bias"),
                    _same((layer_key("linear_fc2.bias"), ix), h + "mlp.down_proj.bias")]
        return out

    def rules(self, m: Any) -> list[Rule]:
        out = [_same((WORD_EMBEDDINGS, ()), "model.embed_tokens.weight")]
        for i in range(m.num_layers):
            h, ix = f"model.layers.{i}.", (i,)
            out += self._attention_rules(m, h, ix) + self._mlp_rules(m, h, ix)
        out.append(_same((FINAL_NORM_WEIGHT, ()), "model.norm.weight"))
        if m.untie_embeddings_and_output_weights:
            out.append(_same((OUTPUT_LAYER, ()), "lm_head.weight"))
        return out

    def _attention_bias(self, c: Any, refuse: Refuse) -> bool:
        attn_bias = bool(getattr(c, "attention_bias", False))
        if attn_bias != bool(getattr(c, "mlp_bias", False)):
            refuse("attention_bias", attn_bias, f"megatron's --disable-bias-linear covers attention and MLP alike "
                   f"(mlp_bias is {getattr(c, 'mlp_bias', False)})")
        return attn_bias

    def model_values(self, c: Any, refuse: Refuse) -> dict[str, Any]:
        if c.hidden_act != "silu":
            refuse("hidden_act", c.hidden_act, "megatron-ext's --swiglu uses SiLU")
        if not math.isclose(c.rms_norm_eps, NORM_EPS):
            refuse("rms_norm_eps", c.rms_norm_eps, f"megatron's norms use epsilon {NORM_EPS} (no flag sets another)")
        rope = dict(getattr(c, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            refuse("rope_parameters.rope_type", rope.get("rope_type"), "megatron-ext's rotary embedding is unscaled")
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        if theta != int(theta):
            refuse("rope_theta", theta, "--rotary-base is an integer")
        heads, kv = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        if head_dim * heads != c.hidden_size:
            refuse("head_dim", head_dim, f"megatron-ext's heads are hidden_size / num_attention_heads "
                   f"({c.hidden_size} / {heads}) wide")
        attn_bias = self._attention_bias(c, refuse)
        if self.model_type != "llama" and getattr(c, "use_sliding_window", False):
            refuse("use_sliding_window", True, "megatron-ext's attention is full causal attention")
        return dict(num_layers=c.num_hidden_layers, hidden_size=c.hidden_size, num_attention_heads=heads,
                    ffn_hidden_size=c.intermediate_size, max_position_embeddings=c.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=int(theta),
                    untie_embeddings_and_output_weights=not bool(getattr(c, "tie_word_embeddings", True)),
                    normalization="RMSNorm", swiglu=True, group_query_attention=kv != heads,
                    num_query_groups=kv if kv != heads else None, disable_bias_linear=not attn_bias,
                    qk_layernorm=self.model_type != "llama")

    def training_defaults(self, c: Any) -> dict[str, Any]:
        # HF's LLaMA-style models have no dropout after attention and MLP (megatron's --hidden-dropout).
        return dict(super().training_defaults(c), hidden_dropout=0.0, attention_dropout=float(c.attention_dropout))


class Qwen3(Llama):
    """The LLaMA-style block with per-head query and key norms (``--qk-layernorm``), no MLP biases."""

    model_type, hf_class, title = "qwen3", "Qwen3ForCausalLM", "Qwen3"

    def selects(self, m: Any) -> bool:
        return bool(m.qk_layernorm)

    def check(self, m: Any, where: str) -> None:
        super().check(m, where)
        if not m.disable_bias_linear:
            raise ConversionError(f"{where}: --qk-layernorm with biases has no Hugging Face equivalent: Qwen3 "
                                  "(the HF model with q/k norms) has no MLP biases; use --disable-bias-linear")

    def config_kwargs(self, m: Any, common: dict[str, Any]) -> dict[str, Any]:
        kw = super().config_kwargs(m, common)
        del kw["mlp_bias"]
        return dict(kw, use_sliding_window=False)

    def _attention_bias(self, c: Any, refuse: Refuse) -> bool:
        attn_bias = bool(getattr(c, "attention_bias", False))
        if attn_bias:
            refuse("attention_bias", attn_bias, f"{self.hf_class} has no MLP biases, megatron's biases cover both")
        return attn_bias


class Qwen3MoE(Qwen3):
    """The MoE block: Qwen3's attention, every MLP a router and experts."""

    model_type, hf_class, title = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE"

    def selects(self, m: Any) -> bool:
        return True

    def check(self, m: Any, where: str) -> None:
        Llama.check(self, m, where)
        if not m.disable_bias_linear:
            raise ConversionError(f"{where}: the MoE model with biases has no Hugging Face equivalent: Qwen3-MoE has "
                                  "no biases; use --disable-bias-linear")
        if not m.qk_layernorm:
            raise ConversionError(f"{where}: the MoE model without --qk-layernorm has no Hugging Face equivalent: "
                                  "Qwen3-MoE normalises queries and keys per head")
        if m.moe_router_load_balancing_type == "sinkhorn" and m.moe_router_topk == 1:
            raise ConversionError(f"{where}: Sinkhorn routing with --moe-router-topk 1 weighs the expert by a "
                                  "sigmoid, which Qwen3-MoE's router does not")
        if getattr(m, "moe_router_score_function", "softmax") != "softmax":
            raise ConversionError(f"{where}: --moe-router-score-function {m.moe_router_score_function} has no "
                                  "Hugging Face equivalent: Qwen3-MoE's router scores the experts by a softmax")
        if getattr(m, "moe_router_topk_scaling_factor", None) not in (None, 1.0):
            raise ConversionError(f"{where}: --moe-router-topk-scaling-factor {m.moe_router_topk_scaling_factor} has "
                                  "no Hugging Face equivalent: Qwen3-MoE's router does not scale the top-k weights")
        if getattr(m, "moe_shared_expert_intermediate_size", None):
            raise ConversionError(f"{where}: --moe-shared-expert-intermediate-size has no Hugging Face equivalent: "
                                  "Qwen3-MoE has no shared expert")

    def config_kwargs(self, m: Any, common: dict[str, Any]) -> dict[str, Any]:
        kw = super().config_kwargs(m, common)
        del kw["head_dim"]
        return dict(kw, num_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                    moe_intermediate_size=m.moe_ffn_hidden_size, decoder_sparse_step=1, mlp_only_layers=[],
                    # softmax over the top-k logits renormalises; Sinkhorn and --moe-router-pre-softmax
                    # (softmax over every expert, then top-k) do not
                    norm_topk_prob=not (m.moe_router_load_balancing_type == "sinkhorn"
                                        or getattr(m, "moe_router_pre_softmax", False)),
                    router_aux_loss_coef=m.moe_aux_loss_coeff)

    def _mlp_rules(self, m: Any, h: str, ix: tuple[int, ...]) -> list[Rule]:
        out = [_same((layer_key("router.weight"), ix), h + "mlp.gate.weight")]
        for e in range(m.num_experts):
            x, ex = f"{h}mlp.experts.{e}.", ix + (e,)
            out += [_halves((layer_key("expert_fc1.weight"), ex), x + "gate_proj.weight", x + "up_proj.weight"),
                    _same((layer_key("expert_fc2.weight"), ex), x + "down_proj.weight")]
        return out

    def model_values(self, c: Any, refuse: Refuse) -> dict[str, Any]:
        values = super().model_values(c, refuse)
        if c.decoder_sparse_step != 1 or list(c.mlp_only_layers or []):
            refuse("decoder_sparse_step / mlp_only_layers", (c.decoder_sparse_step, c.mlp_only_layers),
                   "every MLP of megatron-ext's MoE model is an MoE layer")
        # norm_topk_prob false (softmax over every expert, then the top k, not renormalised) is
        # megatron's --moe-router-pre-softmax
        return dict(values, num_experts=c.num_experts, moe_router_topk=c.num_experts_per_tok,
                    moe_ffn_hidden_size=c.moe_intermediate_size, moe_router_pre_softmax=not c.norm_topk_prob)

    def training_defaults(self, c: Any) -> dict[str, Any]:
        return dict(super().training_defaults(c), moe_aux_loss_coeff=c.router_aux_loss_coef)


GPT2_ADAPTER, LLAMA_ADAPTER, QWEN3_ADAPTER, QWEN3_MOE_ADAPTER = GPT2(), Llama(), Qwen3(), Qwen3MoE()


def adapters() -> dict[str, HFAdapter]:
    """Every family's adapters by HF ``model_type``, in the families' order."""
    out: dict[str, HFAdapter] = {}
    for fam in families.FAMILIES.values():
        for a in family_adapters(fam):
            out.setdefault(a.model_type, a)
    return out


def family_adapters(fam: families.ModelFamily) -> list[HFAdapter]:
    """The adapters a family entry names (``module:attribute``), in the order they are tried."""
    out = []
    for path in fam.hf_adapters:
        module, _, attr = path.partition(":")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def adapter_for_model(m: Any, where: str) -> HFAdapter:
    """The adapter of the HF architecture equal to the model ``m`` describes, or ConversionError
    saying which flag has no counterpart there."""
    fam = families.family_of(m)
    candidates = family_adapters(fam)
    if not candidates:
        raise ConversionError(f"{where}: the {fam.name} model has no Hugging Face counterpart")
    adapter = next((a for a in candidates if a.selects(m)), candidates[-1])
    adapter.check(m, where)
    return adapter


def adapter_for_config(hf_config: Any, where: str) -> HFAdapter:
    """The adapter of a transformers config's ``model_type``, or ConversionError listing the known ones."""
    known = adapters()
    mt = getattr(hf_config, "model_type", None)
    if mt not in known:
        raise ConversionError(f"{where}: model_type {mt!r} is not one of {', '.join(known)}")
    return known[mt]
