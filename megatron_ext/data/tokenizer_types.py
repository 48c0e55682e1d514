"""Megatron-LM's ``--tokenizer-type`` families: what each reads, built through megatron-core.

| type | reads | built by | end of document |
|---|---|---|---|
| (none) | ``--tokenizer-file``, else ``<data-path>.tokenizer.json``, else the default corpus's | ``tokenizer.BPETokenizer`` | its ``EOD``, or the eos of a ``tokenizer_config.json`` beside it |
| GPT2BPETokenizer | ``--vocab-file`` + ``--merge-file`` | ``tokenizer.GPT2BPETokenizer`` (megatron-core's needs the hub) | ``<|endoftext|>`` |
| HuggingFaceTokenizer | ``--tokenizer-model``: a directory, or a hub name | megatron-core ``HuggingFaceTokenizer`` | its eos |
| SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer | ``--tokenizer-model``: a ``.model`` | megatron-core ``SentencePieceTokenizer`` | the model's eos |
| TikTokenizer | ``--tokenizer-model``: Megatron-LM's tiktoken JSON; ``--tiktoken-pattern``, ``--tiktoken-num-special-tokens``, ``--vocab-size`` | megatron-core ``TikTokenTokenizer`` | ``</s>`` |
| NullTokenizer | ``--vocab-size`` | megatron-core ``NullTokenizer`` | id ``--vocab-size`` (one past the last) |

megatron-core's ``build_tokenizer`` (``megatron.core.tokenizers.text.utils``) is what Megatron-LM
``core_v0.16.1`` uses without ``--legacy-tokenizer``: the three SentencePiece names are one reader
there (no BOS added, EOD = eos), so they are here. Without ``--tokenizer-type`` but with
``--vocab-file`` and ``--merge-file`` the type is GPT2BPETokenizer, Megatron-LM's
``pretrain_gpt.py`` default; with neither, the project's own BPE.

Every file is checked for its kind before megatron-core reads it, so a file of the wrong kind is
one line that names the flag, the file and what it is, not an assertion from inside a library.
"""
from __future__ import annotations

import os
import types
from typing import Any

from megatron_ext.errors import ConfigError

GPT2 = "GPT2BPETokenizer"
HF = "HuggingFaceTokenizer"
SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TIKTOKEN = "TikTokenizer"
NULL = "NullTokenizer"
SUPPORTED = (GPT2, HF, *SENTENCEPIECE, TIKTOKEN, NULL)

REFUSED = {
    "BertWordPieceLowerCase": "BERT's WordPiece vocabulary serves Megatron-LM's pretrain_bert.py and pretrain_t5.py; "
                              "pretrain_gpt.py here trains GPT-style models",
    "BertWordPieceCase": "BERT's WordPiece vocabulary serves Megatron-LM's pretrain_bert.py and pretrain_t5.py; "
                         "pretrain_gpt.py here trains GPT-style models",
    "MultimodalTokenizer": "it serves Megatron-LM's vision-language training (pretrain_vlm.py), which is not "
                           "part of megatron-ext",
    "NullMultimodalTokenizer": "it serves Megatron-LM's vision-language training (pretrain_vlm.py), which is not "
                               "part of megatron-ext",
    "SFTTokenizer": "it formats prompts for supervised fine-tuning (--sft); megatron-ext pretrains",
}
"""Megatron-LM's other ``--tokenizer-type`` choices, each with why it is refused."""

CHOICES = (*SUPPORTED, *REFUSED)
TIKTOKEN_PATTERNS = ("v1", "v2")
TIKTOKEN_DEFAULT_VOCAB = 2 ** 17
"""megatron-core's TikTokenTokenizer vocabulary when --vocab-size is not given."""


def resolved_type(tok: Any) -> str | None:
    """The tokenizer type a section asks for (None: the project's BPE)."""
    if tok.tokenizer_type is None and tok.vocab_file and tok.merge_file:
        return GPT2
    return tok.tokenizer_type


def check_request(tok: Any) -> None:
    """Field checks of a tokenizer section (no file is read)."""
    kind = tok.tokenizer_type
    if kind in REFUSED:
        raise ConfigError(f"--tokenizer-type {kind} is not supported: {REFUSED[kind]}")
    if kind is not None and tok.tokenizer_file:
        raise ConfigError(f"--tokenizer-file is the file of the project's BPE (no --tokenizer-type); "
                          f"--tokenizer-type {kind} reads {needs(kind)}")
    if kind is None:
        given = [f for f, v in (("--tokenizer-model", tok.tokenizer_model), ("--vocab-size", tok.vocab_size),
                                ("--vocab-file", tok.vocab_file), ("--merge-file", tok.merge_file)) if v]
        if given and not (tok.vocab_file and tok.merge_file):
            raise ConfigError(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --tokenizer-type (one of "
                              f"{', '.join(SUPPORTED)}); without it the tokenizer is the data's own BPE "
                              "(--tokenizer-file), and --vocab-file with --merge-file is GPT2BPETokenizer")
        return
    missing = [flag for flag, attr in _FILES[kind] if not getattr(tok, attr)]
    if missing:
        raise ConfigError(f"--tokenizer-type {kind} needs {' and '.join(missing)}")
    if tok.vocab_size is not None and tok.vocab_size < 1:
        raise ConfigError(f"--vocab-size must be >= 1, got {tok.vocab_size}")
    if tok.tiktoken_num_special_tokens < 7:
        raise ConfigError(f"--tiktoken-num-special-tokens must be >= 7 (megatron-core's <unk> <s> </s> <mask> <pad> "
                          f"<cls> <sep>), got {tok.tiktoken_num_special_tokens}")


_FILES = {
    GPT2: (("--vocab-file", "vocab_file"), ("--merge-file", "merge_file")),
    HF: (("--tokenizer-model", "tokenizer_model"),),
    **{name: (("--tokenizer-model", "tokenizer_model"),) for name in SENTENCEPIECE},
    TIKTOKEN: (("--tokenizer-model", "tokenizer_model"),),
    NULL: (("--vocab-size", "vocab_size"),),
}


def needs(kind: str) -> str:
    return " and ".join(flag for flag, _ in _FILES[kind])


def missing_files(tok: Any) -> list[str]:
    """``--flag path`` for each file the section names that does not exist (a Hugging Face
    --tokenizer-model may be a hub name: not counted)."""
    kind = resolved_type(tok)
    out = []
    for flag, attr in (("--tokenizer-file", "tokenizer_file"), ("--vocab-file", "vocab_file"),
                       ("--merge-file", "merge_file"), ("--tokenizer-model", "tokenizer_model")):
        path = getattr(tok, attr)
        if not path or os.path.exists(path):
            continue
        if attr == "tokenizer_model" and kind == HF:
            continue   # a hub name, or a directory: transformers says which it could not find
        out.append(f"{flag} {path}")
    return out


# --- the kind of each file -----------------------------------------------------------------------

def _head(path: str, n: int = 64) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(n)


def _what_is(path: str) -> str:
    """A short description of a file, for 'X is <what>, not <wanted>'."""
    from megatron_ext.data.tokenizer import describe_json

    if os.path.isdir(path):
        return "a directory"
    described = describe_json(path)
    if described:
        return described
    head = _head(path)
    if head.startswith(b"#version") or (b" " in head.split(b"\n")[0] and b"\x00" not in head):
        try:
            head.decode("utf-8")
            return "a text file"
        except UnicodeDecodeError:
            pass
    if _is_sentencepiece(path):
        return "a SentencePiece model"
    return "a binary file"


def _is_sentencepiece(path: str) -> bool:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(path)
    except (OSError, RuntimeError):
        return False
    return sp.get_piece_size() > 0


def _wrong_kind(flag: str, path: str, wanted: str, hint: str = "") -> ConfigError:
    return ConfigError(f"{flag} {path} is {_what_is(path)}, not {wanted}{hint}")


def check_files(tok: Any) -> None:
    """Each file the tokenizer type reads is of the kind it reads."""
    from megatron_ext.data.tokenizer import describe_json

    kind = resolved_type(tok)
    if kind is None:
        if tok.tokenizer_file and not (describe_json(tok.tokenizer_file) or "").startswith("a tokenizers JSON"):
            raise _wrong_kind("--tokenizer-file", tok.tokenizer_file, "a tokenizers JSON",
                              " (for other tokenizers give --tokenizer-type and its files)")
    elif kind == GPT2:
        if not (describe_json(tok.vocab_file) or "").startswith("a token -> id vocabulary"):
            raise _wrong_kind("--vocab-file", tok.vocab_file, "GPT-2's vocab.json (a JSON object token -> id)")
        with open(tok.merge_file, "rb") as fh:
            lines = [ln for ln in fh.read(1 << 16).split(b"\n")[:50] if ln and not ln.startswith(b"#version")]
        if not lines or any(len(ln.split(b" ")) != 2 for ln in lines[:-1]) or describe_json(tok.merge_file):
            raise _wrong_kind("--merge-file", tok.merge_file, "GPT-2's merges.txt (a pair of tokens a line)")
    elif kind in SENTENCEPIECE:
        if os.path.isdir(tok.tokenizer_model) or not _is_sentencepiece(tok.tokenizer_model):
            raise _wrong_kind("--tokenizer-model", tok.tokenizer_model, f"a SentencePiece model (--tokenizer-type {kind})")
    elif kind == TIKTOKEN:
        if not (describe_json(tok.tokenizer_model) or "").startswith("Megatron-LM's tiktoken"):
            raise _wrong_kind("--tokenizer-model", tok.tokenizer_model,
                              "Megatron-LM's tiktoken vocabulary (a .json list of rank, token_bytes, token_str)")
    elif kind == HF and os.path.isfile(tok.tokenizer_model):
        raise _wrong_kind("--tokenizer-model", tok.tokenizer_model,
                          "a Hugging Face tokenizer directory (HuggingFaceTokenizer loads a directory or a hub name)")


# --- building ------------------------------------------------------------------------------------

def megatron_args(tok: Any) -> types.SimpleNamespace:
    """The attributes megatron-core's ``build_tokenizer`` reads from Megatron-LM's arguments."""
    path = lambda p: os.path.abspath(p) if p and os.path.exists(p) else p  # noqa: E731 - identity in the cache key
    return types.SimpleNamespace(
        tokenizer_type=resolved_type(tok), tokenizer_model=path(tok.tokenizer_model),
        vocab_file=path(tok.vocab_file), merge_file=path(tok.merge_file), vocab_size=tok.vocab_size,
        tiktoken_pattern=tok.tiktoken_pattern, tiktoken_num_special_tokens=tok.tiktoken_num_special_tokens,
        # the run config's options; a section of another tool (preprocess_data, the HF import) may lack them
        tokenizer_special_tokens=list(getattr(tok, "tokenizer_special_tokens", None) or []) or None,
        tokenizer_sentencepiece_legacy=getattr(tok, "tokenizer_sentencepiece_legacy", False),
        tokenizer_hf_use_fast=getattr(tok, "tokenizer_hf_use_fast", False),
        trust_remote_code=getattr(tok, "trust_remote_code", False),
        tokenizer_hf_include_special_tokens=getattr(tok, "tokenizer_hf_include_special_tokens", False),
        tokenizer_metadata=None)


def describe(tok: Any, bpe_file: str | None = None) -> str:
    """The tokenizer a section asks for, in its flags' words (for messages)."""
    kind = resolved_type(tok)
    if kind is None:
        return f"the BPE {tok.tokenizer_file or bpe_file}"
    files = [getattr(tok, attr) for _, attr in _FILES[kind]]
    return f"{kind} " + " ".join(str(f) for f in files)


def build_tokenizer(tok: Any, bpe_file: str | None = None) -> Any:
    """The tokenizer a section asks for. ``bpe_file``: the project's BPE file when no type is given
    and no --tokenizer-file (the dataset's, or the default corpus's)."""
    check_request(tok)
    missing = missing_files(tok)
    if missing:
        raise ConfigError(f"{', '.join(missing)}: no such file")
    check_files(tok)
    kind = resolved_type(tok)
    from megatron_ext.data.tokenizer import BPETokenizer, GPT2BPETokenizer

    try:
        if kind is None:
            path = tok.tokenizer_file or bpe_file
            if path is None:
                raise ConfigError("no tokenizer: give --tokenizer-file, or --tokenizer-type and its files")
            built = BPETokenizer(path)
        elif kind == GPT2:
            built = GPT2BPETokenizer(tok.vocab_file, tok.merge_file)
        else:
            if kind == TIKTOKEN:
                _check_tiktoken_size(tok)
            from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as megatron_build

            built = megatron_build(megatron_args(tok))
    except ConfigError:
        raise
    except ModuleNotFoundError as exc:
        raise ConfigError(f"--tokenizer-type {kind} needs the Python package {exc.name} (pip install {exc.name})") from None
    except Exception as exc:  # the libraries' own assertions and errors, as one line
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{describe(tok, bpe_file)}: the tokenizer does not load: {text}") from None
    eod = getattr(built, "eod", None)
    if not isinstance(eod, int) or not 0 <= eod < built.vocab_size:
        raise ConfigError(f"{describe(tok, bpe_file)} has no end-of-document token (eod {eod!r} of {built.vocab_size} tokens): "
                          "documents could not be told apart")
    return built


def _check_tiktoken_size(tok: Any) -> None:
    import json

    with open(tok.tokenizer_model, encoding="utf-8") as fh:
        ranks = len(json.load(fh))
    size = tok.vocab_size or TIKTOKEN_DEFAULT_VOCAB
    most = ranks + tok.tiktoken_num_special_tokens
    if size > most:
        raise ConfigError(f"--tokenizer-model {tok.tokenizer_model} holds {ranks} tokens, which with "
                          f"--tiktoken-num-special-tokens {tok.tiktoken_num_special_tokens} make {most}, fewer than "
                          f"--vocab-size {size}{'' if tok.vocab_size else ' (megatron-core default)'}: "
                          f"pass --vocab-size {most} or less")
