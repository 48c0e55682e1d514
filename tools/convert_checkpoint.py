#!/usr/bin/env python
"""Convert between megatron-ext checkpoints and Hugging Face ``transformers`` models.

    python tools/convert_checkpoint.py export runs/llama3_tiny/checkpoints hf/llama3_tiny [--check]
    python tools/convert_checkpoint.py import hf/llama3_tiny runs/from_hf [run flags ...]
    python pretrain_gpt.py --config runs/from_hf/model.yaml --load runs/from_hf --save runs/from_hf [run flags ...]

``export`` reads a checkpoint saved in any TP/PP/DP/EP layout (a save directory's latest, or one
``iter_N``) and writes config.json, model.safetensors and the tokenizer: GPT2LMHeadModel for the GPT
block, LlamaForCausalLM for the LLaMA-style model (Qwen3ForCausalLM with --qk-layernorm),
Qwen3MoeForCausalLM for the MoE model. ``--check`` then runs the export with transformers and the
checkpoint with the runtime's megatron-core model on the same tokens and prints the largest logit
difference. ``import`` writes a save directory (iteration 0, weights only) for the run whose flags
follow, and model.yaml: every model field of the Hugging Face config, its context as --seq-length unless
the flags give one, and one comment line naming any field the run's config has no place for (printed too).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys

PROG = "convert_checkpoint.py"


def check_export(ckpt: str, hf_dir: str, *, batch: int = 2, seq: int = 64, seed: int = 0) -> dict[str, float]:
    """Largest |logit| difference between transformers on the export and the runtime's model on the
    checkpoint (one rank), on ``batch`` x ``seq`` random tokens."""
    import torch

    from megatron_ext.config.run import config_from_values
    from megatron_ext.runtime import checkpoint as ckpt_mod
    from megatron_ext.convert import hf as hf_export
    from megatron_ext.runtime import distributed

    tf = hf_export.transformers_module()
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    seq = min(seq, int(ckpt_mod.config_of(ckpt).get("max_position_embeddings") or seq))
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    ctx = distributed.setup(config_from_values({}).parallel, seed=seed)
    try:
        ours = hf_export.megatron_logits(ckpt, tokens, ctx)
    finally:
        distributed.teardown()
    with torch.no_grad():
        theirs = model(tokens).logits.float()
    return {"max_abs_diff": float((ours - theirs).abs().max()), "max_abs_logit": float(ours.abs().max()),
            "tokens": batch * seq}


def main(argv: list[str] | None = None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("megatron", "megatron.core", "torch.distributed", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="megatron-ext checkpoint -> Hugging Face model directory")
    ex.add_argument("checkpoint", help="save directory (its latest) or one iter_N directory")
    ex.add_argument("out", help="Hugging Face model directory to write")
    ex.add_argument("--tokenizer-file", default=None,
                    help="tokenizers JSON of the run (default: the one its config names)")
    ex.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the weights")
    ex.add_argument("--check", action="store_true",
                    help="compare transformers' logits on the export with the runtime's on the checkpoint")
    im = sub.add_parser("import", help="Hugging Face model directory -> megatron-ext save directory")
    im.add_argument("hf_dir", help="Hugging Face model directory (config.json, safetensors, tokenizer.json)")
    im.add_argument("out", help="new save directory to write")
    im.add_argument("--tokenizer-file", default=None, help="tokenizers JSON (default: <hf_dir>/tokenizer.json)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "export" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    from megatron_ext.errors import UserError, report

    try:
        import torch

        from megatron_ext.convert import hf as hf_export

        if args.command == "export":
            done = hf_export.export(args.checkpoint, args.out, tokenizer_file=args.tokenizer_file,
                                    dtype=getattr(torch, args.dtype))
            print(f"{args.out}: {done.hf_class} ({done.model_type}), {done.num_tensors} tensors, with tokenizer")
            if args.check:
                figures = check_export(args.checkpoint, args.out)
                print(f"logits of transformers vs megatron-ext on {figures['tokens']} tokens: max |diff| "
                      f"{figures['max_abs_diff']:.3g} (max |logit| {figures['max_abs_logit']:.3g})")
                print(json.dumps(figures))
        else:
            done = hf_export.import_hf(args.hf_dir, args.out, rest, tokenizer_file=args.tokenizer_file)
            print(f"{args.out}: iteration 0 of {done.model_type}; train on with "
                  f"pretrain_gpt.py --config {done.model_yaml} --load {args.out} (data tokenized with "
                  f"{done.tokenizer_file})")
            if done.not_carried:
                print(f"not carried from {args.hf_dir}/config.json: {'; '.join(done.not_carried)}")
    except UserError as exc:
        return report(PROG, exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
