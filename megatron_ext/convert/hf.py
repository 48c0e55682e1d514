"""Export a megatron-ext checkpoint (any layout) to Hugging Face ``transformers``, and import one back.

    GPT block      <-> GPT2LMHeadModel       (gpt2)
    LLaMA-style    <-> LlamaForCausalLM      (llama; with --qk-layernorm: Qwen3ForCausalLM, qwen3)
    MoE            <-> Qwen3MoeForCausalLM   (qwen3_moe)

A checkpoint is read as full tensors: every saved shard is placed at its global offset, whatever
TP/PP/DP/EP layout wrote it, so export does not depend on the layout. The model family's adapter
(``convert/hf_adapters.py``, named in its ``models/families.py`` entry) carries the architecture:
its transformers config and one table of ``Rule`` s per model, mapping each full megatron tensor
to its Hugging Face tensors and back; export and
import walk the same table in opposite directions, and both refuse a tensor the table has no place
for, so nothing is dropped silently.

The parts that are not renames, from megatron-core's and transformers' model code:

* ``linear_qkv`` holds, per query group, that group's query heads, then its key head, then its value
  head (``SelfAttention.get_query_key_value_tensors``); HF keeps q, k and v apart (GPT-2: one
  ``c_attn`` as [q | k | v]). HF's ``repeat_kv`` serves query heads g*r..g*r+r-1 from key/value head
  g, the same grouping.
* GPT-2's ``Conv1D`` stores weights as [in, out]: megatron's [out, in] transposed.
* A SwiGLU ``linear_fc1`` is [W; V] with ``silu(x W^T) * (x V^T)``: HF's ``gate_proj`` is W and
  ``up_proj`` is V (experts likewise).
* Router: megatron's default (``moe_router_pre_softmax=False``) takes the top-k logits and softmaxes
  them, which is Qwen3-MoE's softmax, top-k and renormalise (``norm_topk_prob=True``). Sinkhorn
  routing evaluates as softmax then top-k without renormalising (``norm_topk_prob=False``); during
  training it picks experts by Sinkhorn, which no HF model does.
* Norm epsilon: megatron's ``layernorm_epsilon`` (1e-5; the project has no flag for another), GELU:
  exact (``F.gelu``, HF ``"gelu"``), rotary: not interleaved, rotate-half as HF's.

``transformers`` and ``safetensors`` are imported only here, lazily (the ``dev`` extra installs them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
from typing import Any

import numpy as np
import torch

from megatron_ext.convert.hf_adapters import (ConversionError, Key, Rule, adapter_for_config, adapter_for_model,
                                              adapters)

logger = logging.getLogger(__name__)

Tensors = dict[Key, torch.Tensor]

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def transformers_module() -> Any:
    """``import transformers``, or ConversionError saying what to install or remove."""
    try:
        import transformers
    except ImportError as exc:
        raise ConversionError(f"transformers is not installed ({exc}): pip install -e \".[dev]\"") from None
    _refuse_unloadable_torchvision()
    return transformers


def _refuse_unloadable_torchvision() -> None:
    """transformers imports torchvision for every model and config class whenever it is installed, so
    a torchvision that cannot be imported beside this torch (PyPI's builds beside the pinned CPU torch:
    "operator torchvision::nms does not exist") fails every load with "Could not import module
    'LlamaConfig'", which names neither. The project's environment holds none (setup.py); this says so
    where another one does."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
    except Exception as exc:  # any failure: an ImportError, or a RuntimeError from its ops library
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ConversionError(f"torchvision is installed but does not import beside torch {torch.__version__} "
                              f"({first}), and transformers imports it for every model: pip uninstall "
                              "torchvision (make setup removes it)") from None


# --- reading a checkpoint in any layout ----------------------------------------------------------

def read_full_tensors(path: str) -> tuple[dict[str, Any], Tensors]:
    """(meta.json, every saved tensor assembled whole) of the checkpoint ``path`` points at (a save
    directory's latest or one ``iter_N``). Files are verified against meta.json first."""
    from megatron_ext.runtime import checkpoint as ckpt

    if not os.path.isdir(path):
        raise ConversionError(f"{path}: no such checkpoint directory")
    full: Tensors = {}
    if ckpt.format_of(path) == "torch_dist":
        from megatron_ext.runtime import dist_ckpt

        where = dist_ckpt.resolve(path)
        common = dist_ckpt.read_common(where)
        meta = {"config": dist_ckpt.config_of(where), "iteration": common.get("iteration"), "path": where}
        shapes = {k: v for k, v in dist_ckpt.tensor_shapes(where).items() if not k.startswith("optimizer.")}
        dtypes = dist_ckpt.tensor_dtypes(where)
        whole = {k: torch.empty(v, dtype=dtypes[k]) for k, v in shapes.items()}
        dist_ckpt.read_slices(where, {k: [((0,) * t.dim(), t)] for k, t in whole.items()})
        stacked = dist_ckpt.stacked_axes(common, shapes)
        for k, t in whole.items():
            n = stacked.get(k, 0)
            for index in np.ndindex(*t.shape[:n]):
                full[(k, tuple(int(i) for i in index))] = t[index]
        return meta, _merge_norm_names(full)
    where = ckpt.resolve(path)
    meta = ckpt.read_meta(where)
    files = sorted(f for f in meta["files"] if f.startswith("shards_"))
    ckpt.verify(where, meta, files)
    covered: dict[Key, int] = {}
    for f in files:
        for item in torch.load(os.path.join(where, f), map_location="cpu", weights_only=False):
            key = (item["key"], tuple(item["index"]))
            t = item["tensor"]
            if key not in full:
                full[key] = torch.zeros(tuple(item["global_shape"]), dtype=t.dtype)
            full[key][tuple(slice(o, o + n) for o, n in zip(item["offset"], t.shape))] = t
            covered[key] = covered.get(key, 0) + t.numel()
    for key, n in covered.items():
        if n != full[key].numel():
            raise ConversionError(f"{where}: the saved shards of {key[0]}{list(key[1]) or ''} cover {n} of its "
                                  f"{full[key].numel()} elements")
    return meta, _merge_norm_names(full)


def _merge_norm_names(full: Tensors) -> Tensors:
    # The Transformer Engine spec keeps an MoE layer's pre-MLP norm as its own module; the local
    # spec files it under the fused-linear name of the dense block. Same tensor, one name here.
    for key in [k for k in full if k[0] == "decoder.layers.pre_mlp_layernorm.weight"]:
        full[("decoder.layers.mlp.linear_fc1.layer_norm_weight", key[1])] = full.pop(key)
    return full


UNMAPPED = ("squared_relu", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
            "kv_channels", "norm_epsilon", "apply_layernorm_1p", "add_qkv_bias", "qk_l2_norm", "attention_output_gate",
            "softmax_type", "rotary_interleaved", "apply_residual_connection_post_layernorm", "glu_linear_offset",
            "activation_func_clamp_value")
"""Megatron-LM flags that change what the model computes and that no Hugging Face adapter maps: an
export of a model trained with one would not compute what it does."""


def model_config_of(meta: dict[str, Any], where: str) -> Any:
    """The checkpoint's ``ModelConfig`` (from the run config saved in meta.json); ConversionError
    where the run set a flag of ``UNMAPPED``."""
    from megatron_ext.config.base import build, field_names, flag_name
    from megatron_ext.config.run import ModelConfig, config_from_values

    values = meta.get("config") or {}
    m = build(ModelConfig, {k: values[k] for k in field_names(ModelConfig) if k in values}, f"{where}/meta.json")
    defaults = config_from_values({}).flat()
    unmapped = [f"{flag_name(k)} {values[k]}" for k in UNMAPPED if k in values and values[k] != defaults[k]
                and not (k == "kv_channels" and values[k] == m.hidden_size // m.num_attention_heads)]
    if unmapped:
        raise ConversionError(f"{where}: {', '.join(unmapped)}: no Hugging Face architecture here maps "
                              f"{'it' if len(unmapped) == 1 else 'them'}, so the export would not compute what the "
                              "model does")
    return m


# --- which Hugging Face architecture ---------------------------------------------------------------

def hf_model_type(m: Any, where: str) -> str:
    """The HF ``model_type`` equal to the model ``m`` describes (its family's adapter), or
    ConversionError saying which flag has no counterpart there."""
    return adapter_for_model(m, where).model_type


def rules(m: Any, model_type: str) -> list[Rule]:
    """Every tensor of the model ``m`` and its place in the HF model ``model_type``."""
    return adapters()[model_type].rules(m)


def _name(key: Key) -> str:
    return key[0] + (str(list(key[1])) if key[1] else "")


def to_hf_tensors(full: Tensors, m: Any, model_type: str, where: str) -> dict[str, torch.Tensor]:
    table = rules(m, model_type)
    missing = [_name(r.ours) for r in table if r.ours not in full]
    extra = sorted(_name(k) for k in set(full) - {r.ours for r in table})
    if missing or extra:
        raise ConversionError(f"{where}: the checkpoint's tensors do not match its model config "
                              f"({adapters()[model_type].hf_class} mapping): "
                              + "; ".join(p for p in (f"missing {', '.join(missing[:4])}" if missing else "",
                                                      f"not mapped {', '.join(extra[:4])}" if extra else "") if p))
    out = {}
    for r in table:
        for name, t in zip(r.theirs, r.to_hf(full[r.ours])):
            out[name] = t
    return out


def from_hf_tensors(hf: dict[str, torch.Tensor], m: Any, model_type: str, where: str) -> Tensors:
    table = rules(m, model_type)
    wanted = {n for r in table for n in r.theirs}
    missing = sorted(wanted - set(hf))
    # A tied model may still carry lm_head.weight (a copy of the embedding); nothing else is ignored.
    extra = sorted(set(hf) - wanted - ({"lm_head.weight"} if not m.untie_embeddings_and_output_weights else set()))
    if missing or extra:
        raise ConversionError(f"{where}: the weights do not match config.json ({adapters()[model_type].hf_class}): "
                              + "; ".join(p for p in (f"missing {', '.join(missing[:4])}" if missing else "",
                                                      f"not mapped {', '.join(extra[:4])}" if extra else "") if p))
    return {r.ours: r.from_hf([hf[n] for n in r.theirs]) for r in table}


# --- export ----------------------------------------------------------------------------------------

def tokenizer_file_for(meta: dict[str, Any], explicit: str | None) -> str:
    """The project BPE's tokenizers JSON of the run that saved the checkpoint: --tokenizer-file, else
    the run's ``tokenizer_file``, else its dataset's (``<prefix>.tokenizer.json`` of its first data
    prefix, the default corpus when it had none)."""
    from megatron_ext.data.tokenizer import tokenizer_path_for

    if explicit:
        return explicit
    cfg = meta.get("config") or {}
    if cfg.get("tokenizer_file"):
        return cfg["tokenizer_file"]
    for key in ("data_path", "train_data_path"):
        items = cfg.get(key)
        if items:
            from megatron_ext.data.blend import parse_blend

            return tokenizer_path_for(parse_blend([items] if isinstance(items, str) else items).prefixes[0])
    from megatron_ext.data.corpus import default_corpus

    return tokenizer_path_for(default_corpus(cfg.get("data_cache_path") or cfg.get("data_cache_dir")))


def _bpe(path: str, where: str) -> Any:
    from megatron_ext.data.tokenizer import BPETokenizer

    try:
        return BPETokenizer(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ConversionError(f"{where}: {exc}") from None


def run_tokenizer(meta: dict[str, Any], explicit: str | None, where: str) -> tuple[Any, str]:
    """The tokenizer of the run that saved the checkpoint, and what it is: the project's BPE
    (``tokenizer_file_for``), or the --tokenizer-type of its config, built as the run built it."""
    import types

    from megatron_ext.data import tokenizer_types
    from megatron_ext.errors import UserError

    cfg = meta.get("config") or {}
    fields = {k: cfg.get(k) for k in ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "vocab_size",
                                      "tiktoken_pattern", "tokenizer_file")}
    fields["tiktoken_num_special_tokens"] = cfg.get("tiktoken_num_special_tokens") or 1000
    section = types.SimpleNamespace(**fields)
    if explicit or tokenizer_types.resolved_type(section) is None:
        path = tokenizer_file_for(meta, explicit)
        return _bpe(path, where), path
    try:
        return tokenizer_types.build_tokenizer(section), tokenizer_types.describe(section)
    except UserError as exc:
        raise ConversionError(f"{where}: {exc}") from None


def write_hf_tokenizer(tok: Any, what: str, out_dir: str, *, model_max_length: int, where: str) -> dict[str, Any]:
    """Write ``tok`` as Hugging Face tokenizer files in ``out_dir``; returns the special token ids
    for config.json. The end of a document is the tokenizer's own token, HF's bos and eos. A
    tokenizer without a Hugging Face form (SentencePiece, tiktoken, the null tokenizer) is refused:
    export with --tokenizer-file, a tokenizers JSON of the same vocabulary."""
    from megatron_ext.data.tokenizer import PAD

    tf = transformers_module()
    backend = getattr(tok, "backend", None)
    if backend is not None:   # the project's BPE, or GPT-2's vocab.json + merges.txt
        pad = tok.vocab.get(PAD)
        hf_tok = tf.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=tok.eod_token, eos_token=tok.eod_token,
                                            pad_token=PAD if pad is not None else None,
                                            model_max_length=model_max_length)
        hf_tok.save_pretrained(out_dir)
        # transformers 5 records the class as TokenizersBackend, which transformers < 5 does not have;
        # both load PreTrainedTokenizerFast (in 5 another name of the same class).
        tok_cfg_path = os.path.join(out_dir, "tokenizer_config.json")
        tok_cfg = json.load(open(tok_cfg_path, encoding="utf-8"))
        if tok_cfg.get("tokenizer_class") != "PreTrainedTokenizerFast":
            tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
            with open(tok_cfg_path, "w", encoding="utf-8") as fh:
                json.dump(tok_cfg, fh, indent=2, sort_keys=True)
        return {"bos_token_id": tok.eod, "eos_token_id": tok.eod, "pad_token_id": pad}
    if getattr(tok, "library", None) == "huggingface":
        tok.save_pretrained(out_dir)
        bos = tok.bos
        return {"bos_token_id": tok.eod if bos is None else bos, "eos_token_id": tok.eod, "pad_token_id": tok.pad}
    raise ConversionError(f"{where}: the run's tokenizer ({what}) has no Hugging Face tokenizer form here: export "
                          "with --tokenizer-file, a tokenizers JSON of the same vocabulary")


@dataclasses.dataclass
class Exported:
    out_dir: str
    model_type: str
    hf_class: str
    num_tensors: int


def export(path: str, out_dir: str, *, tokenizer_file: str | None = None, dtype: torch.dtype = torch.float32
           ) -> Exported:
    """Write the checkpoint at ``path`` as a Hugging Face model directory ``out_dir``: config.json,
    model.safetensors (the hub's layout: one tensor per expert, no tied copy) and the tokenizer."""
    from safetensors.torch import save_file

    meta, full = read_full_tensors(path)
    where = path
    m = model_config_of(meta, where)
    model_type = hf_model_type(m, where)
    hf = to_hf_tensors(full, m, model_type, where)
    vocab = full[("embedding.word_embeddings.weight", ())].shape[0]
    tok, tok_what = run_tokenizer(meta, tokenizer_file, where)
    from megatron_ext.runtime.model import padded_vocab_size

    from megatron_ext.runtime.model import pads_vocabulary

    if not pads_vocabulary(vocab, tok.vocab_size):
        raise ConversionError(f"{where}: tokenizer {tok_what} has {tok.vocab_size} tokens (padded "
                              f"{padded_vocab_size(tok.vocab_size, 1)}), the checkpoint's embedding {vocab} rows: "
                              "pass the run's --tokenizer-file")
    os.makedirs(out_dir, exist_ok=True)
    # model_max_length: the context the model was built for (the tokenizer's truncation limit).
    special = write_hf_tokenizer(tok, tok_what, out_dir, model_max_length=m.max_position_embeddings, where=where)
    tf = transformers_module()
    adapter = adapters()[model_type]
    common = dict(vocab_size=vocab, initializer_range=m.init_method_std, **special,
                  tie_word_embeddings=not m.untie_embeddings_and_output_weights, architectures=[adapter.hf_class])
    config = tf.AutoConfig.for_model(model_type, **adapter.config_kwargs(m, common))
    config.dtype = str(dtype).removeprefix("torch.")
    config.save_pretrained(out_dir)
    cfg_path = os.path.join(out_dir, "config.json")
    data = json.load(open(cfg_path, encoding="utf-8"))
    patched = dict(data)
    adapter.patch_config_json(patched, m)
    if patched != data:
        with open(cfg_path, "w", encoding="utf-8") as fh:
            json.dump(patched, fh, indent=2, sort_keys=True)
    save_file({k: v.to(dtype).contiguous() for k, v in hf.items()}, os.path.join(out_dir, WEIGHTS),
              metadata={"format": "pt"})
    logger.info("exported %s (iteration %s) to %s as %s", path, meta.get("iteration"), out_dir, adapters()[model_type].hf_class)
    return Exported(out_dir=out_dir, model_type=model_type, hf_class=adapters()[model_type].hf_class, num_tensors=len(hf))


# --- import ----------------------------------------------------------------------------------------

def model_values(hf_config: Any, where: str) -> tuple[str, dict[str, Any]]:
    """(model_type, the ``ModelConfig`` values of the architecture) for a transformers config, or
    ConversionError naming the key that megatron-ext's blocks cannot reproduce."""
    adapter = adapter_for_config(hf_config, where)

    def refuse(key: str, value: Any, why: str) -> None:
        raise ConversionError(f"{where}: {key} {value!r} cannot be mapped: {why}")

    return adapter.model_type, adapter.model_values(hf_config, refuse)


def read_hf_weights(hf_dir: str) -> dict[str, torch.Tensor]:
    """The tensors of ``model.safetensors`` (or its shards), with fused expert tensors
    (``mlp.experts.gate_up_proj``, [E, 2I, H]; ``down_proj``, [E, H, I]) split into the hub's one
    tensor per expert."""
    from safetensors.torch import load_file

    index = os.path.join(hf_dir, WEIGHTS_INDEX)
    if os.path.isfile(index):
        files = sorted(set(json.load(open(index, encoding="utf-8"))["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise ConversionError(f"{hf_dir}: no {WEIGHTS} or {WEIGHTS_INDEX} (only safetensors weights are read)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(os.path.join(hf_dir, f)))
    for name in [n for n in out if n.endswith("mlp.experts.gate_up_proj")]:
        base = name.removesuffix("gate_up_proj")
        gate_up, down = out.pop(name), out.pop(base + "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = torch.chunk(gate_up[e], 2, dim=0)
            out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = gate, up
            out[f"{base}{e}.down_proj.weight"] = down[e]
    return out


@dataclasses.dataclass
class Imported:
    save_dir: str
    model_type: str
    model_yaml: str
    tokenizer_file: str
    not_carried: list[str]  # the HF config's fields the run's config has no place for: "key value (why)"


def import_hf(hf_dir: str, out_dir: str, run_argv: list[str] | None = None, *,
              tokenizer_file: str | None = None) -> Imported:
    """Write the Hugging Face model ``hf_dir`` as a megatron-ext save directory ``out_dir``
    (iteration 0, one shard file, no optimizer state) that ``pretrain_gpt.py --load out_dir`` continues.

    ``run_argv``: the flags of the run that will continue it (its learning-rate schedule is written,
    because a checkpoint's schedule wins on resume); model flags among them must agree with the HF
    model. Also writes ``out_dir/model.yaml`` (the model section, for ``--config``: every model field the HF
    config has, and the training sequence length = its context unless ``run_argv`` sets one) and
    ``out_dir/tokenizer.json``."""
    import yaml

    from megatron_ext.config.base import flag_name
    from megatron_ext.config.run import parse_run_config
    from megatron_ext.runtime import checkpoint as ckpt
    from megatron_ext.runtime.model import padded_vocab_size
    from megatron_ext.runtime.optimizer import build_scheduler

    if not os.path.isdir(hf_dir):
        raise ConversionError(f"{hf_dir}: no such Hugging Face model directory")
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConversionError(f"{hf_dir}: no config.json: not a Hugging Face model directory")
    tf = transformers_module()
    try:
        hf_config = tf.AutoConfig.from_pretrained(hf_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise ConversionError(f"{cfg_path}: {str(exc).splitlines()[0]}") from None
    model_type, values = model_values(hf_config, cfg_path)
    adapter = adapters()[model_type]
    # Defaults the run's flags may change, unlike the architecture: the training sequence length is the
    # model's context, and the training choices HF's config records too (initialisation, dropout,
    # load-balancing loss).
    soft = {"seq_length": values["max_position_embeddings"], **adapter.training_defaults(hf_config)}
    cfg = parse_run_config(list(run_argv or []), defaults={**soft, **values})
    for k, v in values.items():
        if getattr(cfg.model, k) != v:
            raise ConversionError(f"{flag_name(k)} {getattr(cfg.model, k)} contradicts the Hugging Face model "
                                  f"{cfg_path} ({v}): leave it out")
    m = cfg.model
    tok_src = tokenizer_file or os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(tok_src):
        raise ConversionError(f"{hf_dir}: no tokenizer.json: pass --tokenizer-file")
    tok = _bpe(tok_src, tok_src)
    hf = read_hf_weights(hf_dir)
    full = from_hf_tensors(hf, m, model_type, hf_dir)
    vocab = padded_vocab_size(tok.vocab_size, 1)
    hf_vocab = hf_config.vocab_size
    if tok.vocab_size > hf_vocab:
        raise ConversionError(f"{tok_src} has {tok.vocab_size} tokens, more than the model's vocab_size {hf_vocab}")
    for key in [("embedding.word_embeddings.weight", ()), ("output_layer.weight", ())]:
        if key in full and full[key].shape[0] != vocab:
            # The runtime pads the tokenizer's vocabulary to a multiple of 128; rows past the
            # tokenizer's tokens carry no token, so cutting or zero-padding them changes no logit of one.
            rows = torch.zeros(vocab, full[key].shape[1], dtype=full[key].dtype)
            n = min(vocab, full[key].shape[0])
            rows[:n] = full[key][:n]
            full[key] = rows
    not_carried = adapter.not_carried(hf_config)
    if hf_vocab != vocab:
        not_carried.append(f"vocab_size {hf_vocab} (the run's vocabulary is the tokenizer's {tok.vocab_size} tokens "
                           f"padded to {vocab})")
    dtype = str(getattr(hf_config, "dtype", None) or "float32").removeprefix("torch.")
    if dtype != "float32":
        not_carried.append(f"dtype {dtype} (the weights are imported as float32; --bf16 trains in bfloat16)")

    scheduler = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.training.lr),
                                cfg.training).state_dict()
    write_checkpoint(out_dir, {k: v.float() for k, v in full.items()}, config=cfg.flat(), scheduler=scheduler,
                     extra={"imported_from": os.path.abspath(hf_dir), "hf_model_type": model_type})
    model_yaml = os.path.join(out_dir, "model.yaml")
    with open(model_yaml, "w", encoding="utf-8") as fh:
        fh.write(f"# The model of {adapter.hf_class} (imported by tools/convert_checkpoint.py); "
                 "train on with --config this file --load this directory\n")
        if not_carried:
            fh.write(f"# not carried from {cfg_path}: {'; '.join(not_carried)}\n")
        yaml.safe_dump({k: v for k, v in dataclasses.asdict(m).items() if v is not None}, fh, sort_keys=False)
    tok_dst = os.path.join(out_dir, "tokenizer.json")
    shutil.copyfile(tok_src, tok_dst)
    # The end of a document is the HF tokenizer's eos (tokenizer_config.json): it travels beside the
    # tokenizer.json, where BPETokenizer reads it (and HuggingFaceTokenizer loads the directory).
    from megatron_ext.data.tokenizer import HF_TOKENIZER_CONFIG

    tok_cfg = os.path.join(os.path.dirname(os.path.abspath(tok_src)), HF_TOKENIZER_CONFIG)
    if os.path.isfile(tok_cfg):
        shutil.copyfile(tok_cfg, os.path.join(out_dir, HF_TOKENIZER_CONFIG))
    logger.info("imported %s (%s) into %s (%s)", hf_dir, adapters()[model_type].hf_class, out_dir, ckpt.iter_dir_name(0))
    return Imported(save_dir=out_dir, model_type=model_type, model_yaml=model_yaml, tokenizer_file=tok_dst,
                    not_carried=not_carried)


def write_checkpoint(save_dir: str, full: Tensors, *, config: dict[str, Any], scheduler: dict[str, Any],
                     extra: dict[str, Any], iteration: int = 0) -> str:
    """A single-rank checkpoint of whole tensors in the runtime's format (``runtime/checkpoint.py``):
    weights only (no optimizer state, no RNG), loadable in any layout."""
    from megatron_ext.runtime import checkpoint as ckpt

    name = ckpt.iter_dir_name(iteration)
    final = os.path.join(save_dir, name)
    if os.path.exists(os.path.join(save_dir, ckpt.LATEST)) or os.path.exists(final):
        raise ConversionError(f"{save_dir}: already holds a checkpoint; import into a new directory")
    partial = final + ".partial"
    os.makedirs(partial, exist_ok=True)
    payload = [{"key": k, "index": ix, "offset": (0,) * t.dim(), "shape": tuple(t.shape),
                "global_shape": tuple(t.shape), "tensor": t, "optim": {}, "step": None}
               for (k, ix), t in full.items()]
    shard_file = "shards_rank00000.pt"
    torch.save(payload, os.path.join(partial, shard_file))
    digest = hashlib.sha256(open(os.path.join(partial, shard_file), "rb").read()).hexdigest()
    meta = {"format_version": ckpt.FORMAT_VERSION, "iteration": iteration, "consumed_samples": 0,
            "scheduler": scheduler, "extra": extra, "layout": {"tp": 1, "pp": 1, "dp": 1, "vpp": 1},
            "world_size": 1, "config": config,
            "files": {shard_file: {"bytes": os.path.getsize(os.path.join(partial, shard_file)), "sha256": digest}},
            "shards": [{"key": p["key"], "index": list(p["index"]), "offset": list(p["offset"]),
                        "shape": list(p["shape"]), "global_shape": list(p["global_shape"]), "file": shard_file}
                       for p in payload]}
    with open(os.path.join(partial, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1, default=str)
    os.replace(partial, final)
    with open(os.path.join(save_dir, ckpt.LATEST), "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
    return final


# --- ours: the runtime's model on the same tokens ---------------------------------------------------

def megatron_logits(path: str, tokens: torch.Tensor, ctx: Any) -> torch.Tensor:
    """Logits [batch, seq, vocab] of the runtime's megatron-core model loaded from the checkpoint
    ``path`` by the runtime's own loader, on one rank (``ctx``: a TP1 x PP1 context, any layout saved)."""
    from megatron_ext.config.run import all_keys, config_from_values
    from megatron_ext.runtime import checkpoint as ckpt
    from megatron_ext.runtime.model import build_model
    from megatron_ext.runtime.optimizer import build_optimizer

    known = set(all_keys())
    values = {k: v for k, v in ckpt.config_of(path).items() if k in known}
    # One rank, plain causal attention: the same model whatever layout or packing trained it.
    values.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, expert_model_parallel_size=1,
                  virtual_pipeline_model_parallel_size=None, pipeline_stage_layers=None,
                  data_parallel_microbatches=None, sequence_parallel=False, use_distributed_optimizer=False,
                  doc_length_dist=None, helix=False, engine="megatron", load=None, save=None)
    cfg = config_from_values({k: v for k, v in values.items() if k in known})
    vocab = ckpt.embedding_rows(path)
    bundle = build_model(cfg, ctx, vocab)
    optimizer = build_optimizer(list(bundle.parameters()), cfg.training, ctx.device.type == "cuda", bundle.chunks)
    ckpt.load(path, model=bundle, optimizer=optimizer, layout={"tp": 1, "pp": 1, "dp": ctx.layout.dp, "vpp": 1},
              load_optim=False, load_rng=False)
    bundle.eval()
    tokens = tokens.to(ctx.device)
    positions = torch.arange(tokens.shape[1], device=ctx.device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return bundle.chunks[0](tokens, positions, None).float().cpu()
