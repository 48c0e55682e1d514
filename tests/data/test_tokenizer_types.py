"""Megatron-LM's --tokenizer-type families: the tokenizers are megatron-core's own (or, for GPT-2,
encode as GPT-2's reference does), and a file of the wrong kind is one line naming flag and file."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from megatron_ext.config.run import parse_run_config
from megatron_ext.data.tokenizer import EOD, BPETokenizer, GPT2BPETokenizer
from megatron_ext.data.tokenizer_types import build_tokenizer, megatron_args, resolved_type
from megatron_ext.errors import ConfigError
from tests.data.tokenizer_files import all_files, section

TEXTS = ["def add(a, b):\n    return a + b\n", "  leading spaces,\ttabs\nand ünïcödé — ✓ 😀", "x" * 300, ""]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return all_files(str(tmp_path_factory.mktemp("tokenizers")))


def megatron_core_tokenizer(sec):
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as megatron_build

    return megatron_build(megatron_args(sec))


@pytest.mark.parametrize("kind", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer",
                                  "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer"])
def test_each_type_is_megatron_cores_own_tokenizer(files, kind):
    model = {"HuggingFaceTokenizer": files["hf"], "TikTokenizer": files["tiktoken"]}.get(kind, files["sp"])
    sec = section(tokenizer_type=kind, tokenizer_model=None if kind == "NullTokenizer" else model,
                  vocab_size={"TikTokenizer": 1280, "NullTokenizer": 500}.get(kind))
    ours, theirs = build_tokenizer(sec), megatron_core_tokenizer(sec)
    assert type(ours) is type(theirs) and type(ours).__module__.startswith("megatron.core.tokenizers")
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod)
    texts = ["1 2 3 499", "7"] if kind == "NullTokenizer" else TEXTS
    for text in texts:
        assert ours.tokenize(text) == theirs.tokenize(text)
    assert ours.unique_identifiers == theirs.unique_identifiers


def test_the_end_of_document_is_each_tokenizers_own(files):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=files["sp"])
    assert build_tokenizer(section(tokenizer_type="Llama2Tokenizer", tokenizer_model=files["sp"])).eod == sp.eos_id() == 2
    from transformers import AutoTokenizer

    hf = build_tokenizer(section(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=files["hf"]))
    theirs = AutoTokenizer.from_pretrained(files["hf"])
    assert hf.eod == theirs.eos_token_id == theirs.convert_tokens_to_ids("</s>") and EOD not in theirs.get_vocab()
    tik = build_tokenizer(section(tokenizer_type="TikTokenizer", tokenizer_model=files["tiktoken"], vocab_size=1280))
    assert tik.eod == 2   # megatron-core's special tokens <unk> <s> </s> ...: </s>
    null = build_tokenizer(section(tokenizer_type="NullTokenizer", vocab_size=500))
    assert (null.eod, null.vocab_size) == (500, 501)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: printable Latin-1 bytes stand for themselves, the others for
    256, 257, ... in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def gpt2_reference_encode(text: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> list[int]:
    """GPT-2's BPE as published: the text cut by GPT-2's pattern (<|endoftext|> kept whole), each
    piece's bytes as characters, then the best-ranked adjacent pair merged everywhere, until none is."""
    import regex

    table = gpt2_bytes_to_unicode()
    rank = {pair: i for i, pair in enumerate(merges)}
    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
    ids: list[int] = []
    for n, part in enumerate(text.split(EOD)):
        if n:
            ids.append(vocab[EOD])
        for piece in pattern.findall(part):
            word = [table[b] for b in piece.encode("utf-8")]
            while len(word) > 1:
                best = min(zip(word, word[1:]), key=lambda p: rank.get(p, float("inf")))
                if best not in rank:
                    break
                merged, i = [], 0
                while i < len(word):
                    if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                        merged.append(word[i] + word[i + 1])
                        i += 2
                    else:
                        merged.append(word[i])
                        i += 1
                word = merged
            ids += [vocab[w] for w in word]
    return ids


def test_gpt2_bpe_encodes_as_gpt2s_published_algorithm(files):
    """megatron-core's GPT2BPETokenizer asks the hub for "gpt2"; ours reads the two files with the
    tokenizers library and encodes as GPT-2's published BPE (which Megatron-LM's legacy
    gpt2_tokenization implements)."""
    ours = build_tokenizer(section(vocab_file=files["vocab"], merge_file=files["merges"]))
    assert isinstance(ours, GPT2BPETokenizer)
    vocab = json.load(open(files["vocab"], encoding="utf-8"))
    lines = open(files["merges"], encoding="utf-8").read().splitlines()
    merges = [tuple(ln.split(" ")) for ln in lines if ln and not ln.startswith("#version")]
    assert ours.vocab_size == len(vocab) and ours.eod == vocab[EOD]
    for text in TEXTS + [f"one{EOD}two", "I'll say it's 3.14 and they've 42 ... OK?!\n\n  x"]:
        assert ours.tokenize(text) == gpt2_reference_encode(text, vocab, merges), text
        assert ours.detokenize(ours.tokenize(text)) == text


def test_vocab_and_merge_files_without_a_type_are_megatrons_default_gpt2(files):
    cfg = parse_run_config(["--vocab-file", files["vocab"], "--merge-file", files["merges"]])
    assert cfg.tokenizer.tokenizer_type is None and resolved_type(cfg.tokenizer) == "GPT2BPETokenizer"
    assert resolved_type(parse_run_config([]).tokenizer) is None   # the project's BPE


def test_the_project_bpe_ends_documents_with_the_eos_of_a_tokenizer_config_beside_it(files, tmp_path):
    """An imported Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) ends documents
    with its eos, not a hard-coded <|endoftext|>."""
    tok = BPETokenizer(os.path.join(files["hf"], "tokenizer.json"))
    assert tok.eod_token == "</s>" and tok.eod == tok.vocab["</s>"]
    alone = tmp_path / "tokenizer.json"
    shutil.copyfile(os.path.join(files["hf"], "tokenizer.json"), alone)
    with pytest.raises(ValueError) as err:
        BPETokenizer(str(alone))
    assert str(err.value) == (f"tokenizer {alone} (and no tokenizer_config.json beside it names an eos_token) has no "
                              "end-of-document token <|endoftext|>")


def bad(sec) -> str:
    with pytest.raises(ConfigError) as err:
        build_tokenizer(sec)
    return str(err.value)


def test_a_tokenizer_file_of_the_wrong_kind_is_one_line(files):
    sp, vocab, merges, tik, hf = files["sp"], files["vocab"], files["merges"], files["tiktoken"], files["hf"]
    assert bad(section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=vocab)) == (
        f"--tokenizer-model {vocab} is a token -> id vocabulary (GPT-2's vocab.json), not a SentencePiece model "
        "(--tokenizer-type SentencePieceTokenizer)")
    assert bad(section(tokenizer_type="Llama2Tokenizer", tokenizer_model=hf)) == (
        f"--tokenizer-model {hf} is a directory, not a SentencePiece model (--tokenizer-type Llama2Tokenizer)")
    assert bad(section(tokenizer_type="GPT2BPETokenizer", vocab_file=sp, merge_file=merges)) == (
        f"--vocab-file {sp} is a SentencePiece model, not GPT-2's vocab.json (a JSON object token -> id)")
    assert bad(section(vocab_file=merges, merge_file=vocab)) == (
        f"--vocab-file {merges} is a text file, not GPT-2's vocab.json (a JSON object token -> id)")
    assert bad(section(vocab_file=vocab, merge_file=vocab)) == (
        f"--merge-file {vocab} is a token -> id vocabulary (GPT-2's vocab.json), not GPT-2's merges.txt "
        "(a pair of tokens a line)")
    assert bad(section(tokenizer_type="TikTokenizer", tokenizer_model=sp, vocab_size=1280)) == (
        f"--tokenizer-model {sp} is a SentencePiece model, not Megatron-LM's tiktoken vocabulary (a .json list of "
        "rank, token_bytes, token_str)")
    assert bad(section(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=sp)) == (
        f"--tokenizer-model {sp} is a SentencePiece model, not a Hugging Face tokenizer directory "
        "(HuggingFaceTokenizer loads a directory or a hub name)")
    assert bad(section(tokenizer_file=sp)) == (
        f"--tokenizer-file {sp} is a SentencePiece model, not a tokenizers JSON (for other tokenizers give "
        "--tokenizer-type and its files)")
    assert bad(section(tokenizer_type="TikTokenizer", tokenizer_model=tik)) == (
        f"--tokenizer-model {tik} holds 280 tokens, which with --tiktoken-num-special-tokens 1000 make 1280, fewer "
        "than --vocab-size 131072 (megatron-core default): pass --vocab-size 1280 or less")
    assert bad(section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp + ".missing")) == (
        f"--tokenizer-model {sp}.missing: no such file")


def config_error(argv) -> str:
    with pytest.raises(ConfigError) as err:
        parse_run_config(argv)
    return str(err.value)


def test_tokenizer_flags_are_checked_with_megatrons_names():
    assert config_error(["--tokenizer-type", "BertWordPieceCase"]) == (
        "--tokenizer-type BertWordPieceCase is not supported: BERT's WordPiece vocabulary serves Megatron-LM's "
        "pretrain_bert.py and pretrain_t5.py; pretrain_gpt.py here trains GPT-style models")
    assert config_error(["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json"]) == (
        "--tokenizer-type GPT2BPETokenizer needs --merge-file")
    assert config_error(["--tokenizer-type", "NullTokenizer"]) == "--tokenizer-type NullTokenizer needs --vocab-size"
    assert config_error(["--tokenizer-model", "x.model"]) == (
        "--tokenizer-model needs --tokenizer-type (one of GPT2BPETokenizer, HuggingFaceTokenizer, "
        "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, TikTokenizer, NullTokenizer); without it "
        "the tokenizer is the data's own BPE (--tokenizer-file), and --vocab-file with --merge-file is GPT2BPETokenizer")
    assert config_error(["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "x", "--tokenizer-file", "t"]) == (
        "--tokenizer-file is the file of the project's BPE (no --tokenizer-type); --tokenizer-type Llama2Tokenizer "
        "reads --tokenizer-model")
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]).validate(1)
    assert str(err.value) == ("--tokenizer-type NullTokenizer needs --data-path (or --mock-data): the embedded default "
                              "corpus is tokenized with its own BPE")


@pytest.mark.parametrize("kind, extra", [
    ("HuggingFaceTokenizer", {"tokenizer_special_tokens": ["<extra_0>", "<extra_1>"]}),
    ("HuggingFaceTokenizer", {"tokenizer_special_tokens": ["<extra_0>"], "trust_remote_code": True,
                              "tokenizer_hf_use_fast": True}),
])
def test_megatrons_tokenizer_options_reach_megatron_core(files, kind, extra):
    # --tokenizer-special-tokens, --trust-remote-code, --tokenizer-hf-use-fast: handed to megatron-core's
    # builder as Megatron-LM hands them; the special tokens are new ids the text maps to whole.
    model = files["hf"] if kind == "HuggingFaceTokenizer" else files["sp"]
    plain = build_tokenizer(section(tokenizer_type=kind, tokenizer_model=model))
    sec = section(tokenizer_type=kind, tokenizer_model=model, **extra)
    ours, theirs = build_tokenizer(sec), megatron_core_tokenizer(sec)
    assert ours.vocab_size == theirs.vocab_size == plain.vocab_size + len(extra["tokenizer_special_tokens"])
    for text in [*TEXTS, "a <extra_0> b"]:
        assert ours.tokenize(text) == theirs.tokenize(text)
    ids = ours.tokenize("<extra_0>")
    assert len(ids) == 1 and ids[0] >= plain.vocab_size


def test_the_tokenizer_options_are_flags():
    cfg = parse_run_config(["--tokenizer-special-tokens", "<a>", "<b>", "--trust-remote-code",
                            "--tokenizer-hf-use-fast"])
    t = cfg.tokenizer
    assert (t.tokenizer_special_tokens, t.trust_remote_code, t.tokenizer_hf_use_fast) == (["<a>", "<b>"], True, True)


def test_special_tokens_on_a_sentencepiece_model_are_megatron_cores_one_line(files):
    # megatron-core adds special tokens to a SentencePiece model only in its legacy mode
    with pytest.raises(ConfigError, match=r"sp.model: the tokenizer does not load: Special tokens must be None when "
                                          r"legacy is set to False"):
        build_tokenizer(section(tokenizer_type="SentencePieceTokenizer", tokenizer_model=files["sp"],
                                tokenizer_special_tokens=["<extra_0>"]))
