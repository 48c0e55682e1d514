"""Tokenizer files in their real formats, made here from a small text (nothing is downloaded).

* ``sentencepiece_model``: a BPE SentencePiece model trained by the ``sentencepiece`` package
  (LLaMA-2 / Mixtral's format; unk 0, bos 1, eos 2);
* ``gpt2_files``: GPT-2's ``vocab.json`` + ``merges.txt`` as the ``tokenizers`` package writes them;
* ``tiktoken_json``: Megatron-LM's tiktoken vocabulary (a JSON list of rank, token_bytes,
  token_str) with ranks trained by tiktoken's own reference BPE trainer;
* ``hf_directory``: a Hugging Face tokenizer directory whose end of document is ``</s>`` (as
  Mistral's; no ``<|endoftext|>``).
"""
from __future__ import annotations

import base64
import json
import os
import sysconfig

TEXT_FILES = ("json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py", "textwrap.py")


def sample_text(max_chars: int = 60_000) -> str:
    """Python standard-library source: the same on every machine with this Python."""
    root = sysconfig.get_paths()["stdlib"]
    text = "\n".join(open(os.path.join(root, f), encoding="utf-8").read() for f in TEXT_FILES)
    return text[:max_chars]


def documents(n: int, seed: int = 0, words: int = 40) -> list[str]:
    """``n`` short documents cut from the sample text."""
    import random

    lines = [ln for ln in sample_text().splitlines() if ln.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(len(lines) - words)
        out.append("\n".join(lines[start:start + rng.randint(3, words)]))
    return out


def sentencepiece_model(directory: str, vocab_size: int = 320) -> str:
    import sentencepiece as spm

    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(directory, "sp_corpus.txt")
    with open(corpus, "w", encoding="utf-8") as fh:
        fh.write(sample_text())
    prefix = os.path.join(directory, "sp")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
                                   minloglevel=2, num_threads=1)
    return prefix + ".model"


def gpt2_files(directory: str, vocab_size: int = 400) -> tuple[str, str]:
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(directory, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([sample_text()], vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    vocab, merges = bpe.save_model(directory)
    return vocab, merges


def tiktoken_json(directory: str, vocab_size: int = 280) -> str:
    from tiktoken._educational import bpe_train

    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2

    os.makedirs(directory, exist_ok=True)
    ranks = bpe_train(sample_text(6_000), vocab_size, _PATTERN_TIKTOKEN_V2, visualise=None)
    rows = [{"rank": r, "token_bytes": base64.b64encode(t).decode("ascii"), "token_str": t.decode("utf-8", "replace")}
            for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    path = os.path.join(directory, "tiktoken.json")
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rows, fh)
    return path


def hf_directory(directory: str, vocab_size: int = 360, eos: str = "</s>") -> str:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([sample_text()], vocab_size=vocab_size, special_tokens=["<s>", eos],
                            show_progress=False)
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token=eos).save_pretrained(directory)
    return directory


def all_files(directory: str) -> dict[str, str]:
    """One file set of every kind above, under ``directory``."""
    vocab, merges = gpt2_files(os.path.join(directory, "gpt2"))
    return {"sp": sentencepiece_model(os.path.join(directory, "sp")), "vocab": vocab, "merges": merges,
            "tiktoken": tiktoken_json(os.path.join(directory, "tiktoken")),
            "hf": hf_directory(os.path.join(directory, "hf"))}


def section(**given):
    """A tokenizer section (the run config's fields) with ``given`` set and the rest at their defaults."""
    import types

    fields = dict(tokenizer_type=None, tokenizer_model=None, vocab_file=None, merge_file=None, vocab_size=None,
                  tiktoken_pattern=None, tiktoken_num_special_tokens=1000, tokenizer_file=None,
                  tokenizer_special_tokens=None, trust_remote_code=False, tokenizer_hf_use_fast=False,
                  tokenizer_hf_include_special_tokens=False, tokenizer_sentencepiece_legacy=False)
    return types.SimpleNamespace(**{**fields, **given})
