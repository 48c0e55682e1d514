"""An export is loaded the way a user loads it, and an import keeps the model's own fields.

A LLaMA-style model trained at sequence length 128 with fields away from their defaults is exported with
``tools/convert_checkpoint.py export``; a fresh Python that imports transformers plainly (nothing hidden
from it, the project's environment as installed) loads the directory with AutoModelForCausalLM and
AutoTokenizer and generates; ``convert_checkpoint.py import`` of that directory writes a model.yaml that
carries the context and every model field.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import yaml

from megatron_ext.config.run import config_from_values
from megatron_ext.convert import hf as hf_export
from megatron_ext.runtime import distributed
from megatron_ext.runtime.loop import Trainer
from tests.conftest import run_python

SEQ = 128
# Away from the defaults: the context (seq 128, not 64), rotary base, GQA, FFN width, untied output
# layer, and two training choices the HF config records (initialisation, attention dropout).
MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": SEQ,
         "normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "rotary_base": 500000,
         "group_query_attention": True, "num_query_groups": 2, "ffn_hidden_size": 96,
         "disable_bias_linear": True, "untie_embeddings_and_output_weights": True,
         "init_method_std": 0.05, "attention_dropout": 0.1}
RUN = {"train_iters": 2, "eval_iters": 0, "progress": False, "global_batch_size": 2, "micro_batch_size": 2,
       "lr": 1e-2, "lr_decay_style": "constant"}

# What a user types after `pip install -e ".[dev]"`: transformers imported plainly, in a fresh process.
USER_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
prompt = tok(sys.argv[2], return_tensors="pt")
out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
print(json.dumps({"model": type(model).__name__, "dtype": str(model.dtype), "prompt": prompt["input_ids"][0].tolist(),
                  "ids": out[0].tolist(), "text": tok.decode(out[0]), "max_length": tok.model_max_length}))
"""
PROMPT = "def main(argv):\n    return"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, its export by the CLI, a single-rank context) of the model above."""
    root = tmp_path_factory.mktemp("hf_user")
    ctx = distributed.setup(config_from_values(dict(RUN)).parallel, seed=1234)
    try:
        ckpt = str(root / "ckpt")
        Trainer(config_from_values({**RUN, **MODEL, "save": ckpt}), ctx).setup().run()
        out = str(root / "hf")
        done = run_python("tools/convert_checkpoint.py", "export", ckpt, out)
        assert f"{out}: LlamaForCausalLM (llama)" in done.stdout
        yield ckpt, out, ctx
    finally:
        distributed.teardown()


def test_transformers_loads_the_export_and_generates_our_greedy_tokens(trained):
    from megatron_ext.data.tokenizer import BPETokenizer

    ckpt, out, ctx = trained
    got = json.loads(run_python("-c", USER_SCRIPT, out, PROMPT).stdout.strip().splitlines()[-1])
    assert got["model"] == "LlamaForCausalLM" and got["dtype"] == "torch.float32"
    assert got["max_length"] == SEQ
    ours_tok = BPETokenizer(os.path.join(out, "tokenizer.json"))
    assert got["prompt"] == ours_tok.tokenize(PROMPT)
    ids = got["ids"]
    assert ids[:len(got["prompt"])] == got["prompt"] and len(ids) > len(got["prompt"])
    assert got["text"] == ours_tok.detokenize(ids)
    # Greedy decoding: each new token is the argmax of the logits at the position before it. One
    # forward of the runtime's megatron-core model on the checkpoint checks every step at once.
    logits = hf_export.megatron_logits(ckpt, torch.tensor([ids[:-1]]), ctx)
    n = len(got["prompt"])
    assert logits[0, n - 1:].argmax(-1).tolist() == ids[n:]


def test_import_writes_the_models_own_fields(trained, tmp_path):
    _, out, _ = trained
    back = str(tmp_path / "imported")
    done = run_python("tools/convert_checkpoint.py", "import", out, back)
    assert "not carried" not in done.stdout
    written = yaml.safe_load(open(os.path.join(back, "model.yaml")))
    # seq_length: the model's context, not the flag's default (64)
    assert {k: written[k] for k in MODEL} == MODEL
    assert written["max_position_embeddings"] == SEQ
    # the run's flags still choose the training sequence length
    done = hf_export.import_hf(out, str(tmp_path / "imported_32"), ["--seq-length", "32"])
    written = yaml.safe_load(open(done.model_yaml))
    assert (written["seq_length"], written["max_position_embeddings"]) == (32, SEQ)


def test_import_names_the_fields_it_cannot_carry(trained, tmp_path):
    _, out, _ = trained
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(out, hf_dir)
    cfg_path = os.path.join(hf_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(vocab_size=4224, dtype="bfloat16")
    json.dump(cfg, open(cfg_path, "w"))
    done = hf_export.import_hf(hf_dir, str(tmp_path / "imported"))
    assert done.not_carried == [
        "vocab_size 4224 (the run's vocabulary is the tokenizer's 4096 tokens padded to 4096)",
        "dtype bfloat16 (the weights are imported as float32; --bf16 trains in bfloat16)"]
    header = open(done.model_yaml).read().splitlines()[1]
    assert header == f"# not carried from {cfg_path}: " + "; ".join(done.not_carried)


def test_an_unloadable_torchvision_is_named(tmp_path, monkeypatch):
    """transformers imports any installed torchvision for every model; a build that cannot load beside
    this torch is reported as such, not as transformers' "Could not import module 'LlamaConfig'"."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    with pytest.raises(hf_export.ConversionError) as err:
        hf_export.transformers_module()
    assert str(err.value) == (f"torchvision is installed but does not import beside torch {torch.__version__} "
                              "(operator torchvision::nms does not exist), and transformers imports it for every "
                              "model: pip uninstall torchvision (make setup removes it)")
