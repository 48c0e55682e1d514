"""Byte-level BPE tokenizers (the ``tokenizers`` library) behind megatron-core's tokenizer interface.

Two files make one: the project's own BPE (a ``tokenizers`` JSON that ``tools/preprocess_data.py``
trains or is given, and the default corpus's), and GPT-2's ``vocab.json`` + ``merges.txt``
(Megatron-LM's ``--tokenizer-type GPT2BPETokenizer``). megatron-core's own wrappers of both need
``transformers``, and its GPT-2 one asks the Hugging Face hub for the model "gpt2" even when both
files are given; these need only the files.

The end-of-document token is the tokenizer's: GPT-2's is ``<|endoftext|>`` of its vocabulary; a
``tokenizers`` JSON with a Hugging Face ``tokenizer_config.json`` beside it (an exported or imported
model's) ends documents with that file's ``eos_token``; the BPE trained here reserves ``EOD``.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD = "<|endoftext|>"
"""The end-of-document token the BPE trained here reserves (GPT-2's too)."""
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOD, PAD)
HF_TOKENIZER_CONFIG = "tokenizer_config.json"


def tokenizer_path_for(prefix: str) -> str:
    """Where a dataset prefix keeps its tokenizer."""
    return prefix + ".tokenizer.json"


def train_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE with the end-of-document and pad tokens first in the vocabulary."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab size {vocab_size} is below the byte alphabet (258)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def hf_eos_token(directory: str) -> str | None:
    """The ``eos_token`` of a Hugging Face ``tokenizer_config.json`` in ``directory``, if any."""
    path = os.path.join(directory, HF_TOKENIZER_CONFIG)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            eos = json.load(fh).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(eos, dict):   # older transformers write the AddedToken's fields
        eos = eos.get("content")
    return eos if isinstance(eos, str) and eos else None


class _ByteLevelBPE(MegatronTokenizerBase):
    """megatron-core's tokenizer interface over a ``tokenizers.Tokenizer`` and its EOD token."""

    def __init__(self, path: str, tok: Tokenizer, eod_token: str, where: str) -> None:
        super().__init__(path, {"library": "tokenizers", "class_name": type(self).__name__})
        self._tok = tok
        eod = tok.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"{where} has no end-of-document token {eod_token}")
        self._eod, self.eod_token = eod, eod_token
        pad = tok.token_to_id(PAD)
        self._pad = eod if pad is None else pad
        # megatron's dataset cache key includes the tokenizer's identity.
        self.unique_identifiers = {"class": type(self).__name__, "path": os.path.abspath(path),
                                   "vocab_size": tok.get_vocab_size()}

    # megatron-core interface
    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        # Special tokens stay in the text, as Megatron-LM's and transformers' decoders keep them.
        return self._tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):  # pragma: no cover - not a chat tokenizer
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    @property
    def vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def backend(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer`` (the Hugging Face export writes it as tokenizer.json)."""
        return self._tok

    def encode_batch(self, texts: list[str]) -> Iterator[np.ndarray]:
        for enc in self._tok.encode_batch(texts):
            yield np.asarray(enc.ids, dtype=np.int32)


class BPETokenizer(_ByteLevelBPE):
    """A ``tokenizers`` JSON file: the BPE trained with the data, or a Hugging Face model's
    tokenizer.json. Its EOD is the ``eos_token`` of a ``tokenizer_config.json`` beside it, else
    ``EOD``."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} does not exist; pass --tokenizer-file or "
                                    "rebuild the dataset with tools/preprocess_data.py")
        try:
            tok = Tokenizer.from_file(path)
        except Exception as exc:  # the tokenizers library raises its own Exception types
            raise ValueError(f"tokenizer file {path} is not a tokenizers JSON ({_first_line(exc)})") from None
        eod_token = hf_eos_token(os.path.dirname(os.path.abspath(path))) or EOD
        hint = "" if eod_token != EOD else " (and no tokenizer_config.json beside it names an eos_token)"
        super().__init__(path, tok, eod_token, f"tokenizer {path}{hint}")


class GPT2BPETokenizer(_ByteLevelBPE):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt`` (Megatron-LM's
    ``--tokenizer-type GPT2BPETokenizer``); ``<|endoftext|>`` of the vocabulary ends a document."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOD) is not None:
            # As GPT-2's tokenizers in transformers (and megatron-core's wrapper of them) treat it.
            tok.add_special_tokens([EOD])
        super().__init__(vocab_file, tok, EOD, f"GPT-2 vocabulary {vocab_file}")
        self.unique_identifiers = {**self.unique_identifiers, "merges": os.path.abspath(merge_file)}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def describe_json(path: str) -> str | None:
    """What a JSON file is, by its top level (for errors that name a file of the wrong kind)."""
    try:
        with open(path, encoding="utf-8") as fh:
            data: Any = json.load(fh)
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if isinstance(data, dict) and "model" in data and "normalizer" in data:
        return "a tokenizers JSON (a whole tokenizer)"
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        return "a token -> id vocabulary (GPT-2's vocab.json)"
    if isinstance(data, list) and data and isinstance(data[0], dict) and "token_bytes" in data[0]:
        return "Megatron-LM's tiktoken vocabulary (a list of rank, token_bytes, token_str)"
    return "a JSON file"
