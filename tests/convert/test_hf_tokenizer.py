"""The Hugging Face export and import carry the run's tokenizer with its own end of document (no
hard-coded <|endoftext|>): the project's BPE, GPT-2's files, a Hugging Face tokenizer directory."""
from __future__ import annotations

import json
import os

import pytest

from megatron_ext.convert import hf as hf_export
from megatron_ext.convert.hf_adapters import ConversionError
from megatron_ext.data.tokenizer import BPETokenizer, GPT2BPETokenizer
from megatron_ext.data.tokenizer_types import build_tokenizer
from tests.data.tokenizer_files import gpt2_files, hf_directory, section, sentencepiece_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return hf_directory(str(tmp_path_factory.mktemp("hf") / "tok"))


def exported(tok, what, out) -> tuple[dict, object]:
    from transformers import AutoTokenizer

    special = hf_export.write_hf_tokenizer(tok, what, str(out), model_max_length=64, where="ckpt")
    return special, AutoTokenizer.from_pretrained(str(out))


def test_the_project_bpe_exports_with_its_own_end_of_document(hf_dir, tmp_path):
    tok = BPETokenizer(os.path.join(hf_dir, "tokenizer.json"))   # an imported tokenizer: eos </s>
    special, theirs = exported(tok, "bpe", tmp_path / "out")
    assert theirs.eos_token == theirs.bos_token == "</s>" and special["eos_token_id"] == tok.eod == theirs.eos_token_id
    text = "def add(a, b):\n    return a + b"
    assert theirs(text)["input_ids"] == tok.tokenize(text)
    # The export's tokenizer.json, read back by the runtime, ends documents where transformers does.
    assert BPETokenizer(str(tmp_path / "out" / "tokenizer.json")).eod == theirs.eos_token_id


def test_gpt2_files_export_as_gpt2_with_endoftext(tmp_path):
    vocab, merges = gpt2_files(str(tmp_path / "gpt2"))
    tok = GPT2BPETokenizer(vocab, merges)
    special, theirs = exported(tok, "GPT2BPETokenizer", tmp_path / "out")
    assert theirs.eos_token == "<|endoftext|>" and special["eos_token_id"] == tok.eod == theirs.eos_token_id
    text = "I'll say it's 3.14, they've 42"
    assert theirs(text)["input_ids"] == tok.tokenize(text)


def test_a_hugging_face_tokenizer_exports_its_own_files(hf_dir, tmp_path):
    tok = build_tokenizer(section(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_dir))
    special, theirs = exported(tok, "HuggingFaceTokenizer", tmp_path / "out")
    assert theirs.eos_token == "</s>" and special == {"bos_token_id": theirs.bos_token_id,
                                                      "eos_token_id": theirs.eos_token_id,
                                                      "pad_token_id": theirs.pad_token_id}


def test_a_tokenizer_without_a_hugging_face_form_is_refused(tmp_path):
    sp = sentencepiece_model(str(tmp_path / "sp"))
    meta = {"config": {"tokenizer_type": "Llama2Tokenizer", "tokenizer_model": sp}}
    tok, what = hf_export.run_tokenizer(meta, None, "ckpt")
    assert what == f"Llama2Tokenizer {sp}" and tok.vocab_size == 320
    with pytest.raises(ConversionError) as err:
        hf_export.write_hf_tokenizer(tok, what, str(tmp_path / "out"), model_max_length=64, where="ckpt")
    assert str(err.value) == (f"ckpt: the run's tokenizer (Llama2Tokenizer {sp}) has no Hugging Face tokenizer form "
                              "here: export with --tokenizer-file, a tokenizers JSON of the same vocabulary")


def test_import_keeps_the_models_end_of_document(hf_dir, tmp_path):
    """A LLaMA whose tokenizer has no <|endoftext|> (eos </s>, as Mistral's) imports, and the run
    that continues it ends documents with </s>."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = tmp_path / "llama"
    shutil.copytree(hf_dir, src)
    theirs = AutoTokenizer.from_pretrained(str(src))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(theirs), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=theirs.bos_token_id,
                                 eos_token_id=theirs.eos_token_id)).save_pretrained(src)
    done = hf_export.import_hf(str(src), str(tmp_path / "out"), [])
    tok = BPETokenizer(done.tokenizer_file)
    assert tok.eod_token == "</s>" and tok.eod == json.load(open(src / "config.json"))["eos_token_id"]
