#!/usr/bin/env python
"""Turn text files or JSONL into a megatron-core indexed dataset (.bin/.idx) for pretrain_gpt.py.

Megatron-LM's flags (its tools/preprocess_data.py), with a --tokenizer-type:

    python tools/preprocess_data.py --input data.jsonl --output-prefix data/my --json-keys text \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tok.model --append-eod --workers 4

writes data/my_text_document.bin/.idx (train with --data-path data/my_text_document and the same
tokenizer flags); the end-of-document token is appended only with --append-eod, as there.

The project's own, without a --tokenizer-type:

    python tools/preprocess_data.py --input corpus/ data.jsonl --output-prefix data/mycorpus \
        [--tokenizer-file tok.json | --vocab-size 8192] [--json-key text]

Each file (or JSONL line) is one document, always ending with the end-of-document token. Without
--tokenizer-file a byte-level BPE is trained on the input. The tokenizer is saved as
<prefix>.tokenizer.json, where pretrain_gpt.py finds it.
"""
from __future__ import annotations

import argparse
import logging
import sys
import types

PROG = "preprocess_data.py"


def build_parser() -> argparse.ArgumentParser:
    from megatron_ext.data.tokenizer_types import CHOICES, TIKTOKEN_PATTERNS

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    data = parser.add_argument_group("input and output")
    data.add_argument("--input", nargs="+", required=True,
                      help="JSONL files (.gz read through gzip); without --tokenizer-type also text files and "
                           "directories (each file one document).")
    data.add_argument("--output-prefix", required=True,
                      help="With --tokenizer-type: writes <prefix>_<key>_document.bin/.idx per --json-keys key; "
                           "without: <prefix>.bin, .idx and .tokenizer.json.")
    data.add_argument("--json-keys", nargs="+", default=None,
                      help="Fields of each JSONL record to write, one dataset each (default: text).")
    data.add_argument("--json-key", default=None, help="One field (the project's former flag: --json-keys KEY).")
    data.add_argument("--append-eod", action="store_true",
                      help="End every document with the tokenizer's end-of-document token (always, without "
                           "--tokenizer-type).")
    data.add_argument("--workers", type=int, default=1, help="Tokenizing processes (output in input order).")
    data.add_argument("--partitions", type=int, default=1, help="Megatron-LM's input partitions: 1 only here.")
    data.add_argument("--log-interval", type=int, default=1000, help="Report every N documents.")
    data.add_argument("--keep-sequential-samples", action="store_true",
                      help="Accepted for Megatron-LM's scripts: documents are always written in input order.")
    data.add_argument("--split-sentences", action="store_true", help=argparse.SUPPRESS)
    data.add_argument("--max-bytes", type=int, default=None,
                      help="Without --tokenizer-type: stop after this many bytes of text.")
    tok = parser.add_argument_group("tokenizer (pretrain_gpt.py's flags of the same names)")
    tok.add_argument("--tokenizer-type", choices=CHOICES, default=None,
                     help="Megatron-LM's tokenizer type (unset: the project's BPE; --vocab-file with --merge-file: "
                          "GPT2BPETokenizer).")
    tok.add_argument("--tokenizer-model", default=None, help="SentencePiece model, HF directory or tiktoken JSON.")
    tok.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json.")
    tok.add_argument("--merge-file", default=None, help="GPT-2's merges.txt.")
    tok.add_argument("--vocab-size", type=int, default=None,
                     help="NullTokenizer / TikTokenizer vocabulary; without --tokenizer-type the size of the BPE "
                          "trained on the input (default 4096).")
    tok.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS, default=None, help="TikTokenizer's regex.")
    tok.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, help="TikTokenizer's special tokens.")
    tok.add_argument("--tokenizer-file", default=None,
                     help="Without --tokenizer-type: an existing tokenizers JSON (else a BPE is trained).")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_ext.data.preprocess import InputError, megatron_preprocess, preprocess
    from megatron_ext.data.tokenizer_types import resolved_type
    from megatron_ext.errors import UserError, report

    section = types.SimpleNamespace(
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
        merge_file=args.merge_file, vocab_size=args.vocab_size, tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens, tokenizer_file=None)
    if args.json_key and args.json_keys:
        return report(PROG, "--json-key and --json-keys are one setting: give --json-keys")
    keys = tuple(args.json_keys or ([args.json_key] if args.json_key else ["text"]))
    try:
        if args.split_sentences:
            raise UserError("--split-sentences (NLTK sentence splitting, for BERT-style data) is not supported: "
                            "GPT pretraining reads whole documents")
        if args.partitions != 1:
            raise UserError(f"--partitions {args.partitions}: this tool reads the input in one pass with --workers "
                            "processes; leave --partitions at 1")
        if args.workers < 1:
            raise UserError(f"--workers must be >= 1, got {args.workers}")
        if resolved_type(section) is not None:
            if args.tokenizer_file:
                raise UserError("--tokenizer-file is the project's BPE: give it without --tokenizer-type")
            stats = megatron_preprocess(args.input, args.output_prefix, section, json_keys=keys,
                                        append_eod=args.append_eod, workers=args.workers,
                                        log_interval=args.log_interval)
        else:
            if len(keys) > 1:
                raise UserError("several --json-keys need a --tokenizer-type (Megatron-LM's preprocessing); the "
                                "project's BPE writes one dataset")
            if args.tokenizer_model:
                raise UserError("--tokenizer-model needs --tokenizer-type")
            stats = {args.output_prefix: preprocess(args.input, args.output_prefix, tokenizer_file=args.tokenizer_file,
                                                    vocab_size=args.vocab_size or 4096, json_key=keys[0],
                                                    max_bytes=args.max_bytes)}
    except (UserError, InputError, FileNotFoundError, ValueError) as exc:
        return report(PROG, exc)
    for prefix, counts in stats.items():
        print(f"{prefix}: {counts['documents']} documents, {counts['tokens']} tokens, "
              f"vocabulary {counts['vocab_size']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
