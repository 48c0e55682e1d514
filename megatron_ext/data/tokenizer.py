"""Byte-level BPE tokenizer (the ``tokenizers`` library) behind megatron-core's tokenizer interface.

megatron-core's own HuggingFace wrapper needs ``transformers``; this adapter needs only the
``tokenizers`` JSON file, which ``tools/preprocess_data.py`` trains or is given.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import numpy as np
from megatron.core.tokenizers import MegatronTokenizerBase
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOD, PAD)


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


class BPETokenizer(MegatronTokenizerBase):
    """megatron-core tokenizer over a ``tokenizers`` JSON file."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} does not exist; pass --tokenizer-file or "
                                    "rebuild the dataset with tools/preprocess_data.py")
        super().__init__(path, {"library": "tokenizers", "class_name": type(self).__name__})
        self._tok = Tokenizer.from_file(path)
        # megatron's dataset cache key includes the tokenizer's identity.
        self.unique_identifiers = {"class": type(self).__name__, "path": os.path.abspath(path),
                                   "vocab_size": self._tok.get_vocab_size()}
        eod = self._tok.token_to_id(EOD)
        if eod is None:
            raise ValueError(f"tokenizer {path} has no {EOD} token; train it with tools/preprocess_data.py")
        self._eod = eod
        pad = self._tok.token_to_id(PAD)
        self._pad = eod if pad is None else pad

    # megatron-core interface
    def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(map(int, ids)))

    def apply_chat_template(self, *args, **kwargs):  # pragma: no cover - not a chat tokenizer
        raise NotImplementedError("BPETokenizer has no chat template")

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

    def encode_batch(self, texts: list[str]) -> Iterator[np.ndarray]:
        for enc in self._tok.encode_batch(texts):
            yield np.asarray(enc.ids, dtype=np.int32)
