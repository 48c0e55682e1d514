"""Two-rank checkpoints for test_dist_ckpt_megatron.py, written under ``torchrun --nproc_per_node 2``:

``<root>/megatron_lm_tp2``  written the way Megatron-LM's ``save_checkpoint`` writes a torch_dist
                            checkpoint (megatron-core ``GPTModel.sharded_state_dict()``, megatron's
                            ``rng_state`` object, the common state with its ``args``, then
                            ``dist_checkpointing.save`` and the tracker file), under TP2, model only
                            (Megatron-LM's --no-save-optim), at iteration 7; ``logits.pt`` beside it:
                            the saving model's logits (gathered over TP) on ``tokens()``.
``<root>/ours_pp2``         saved by the runtime (``--ckpt-format torch_dist``) after 3 iterations under
                            PP2, optimizer state included.

Both are LLaMA-style (grouped-query attention, RMSNorm, SwiGLU, rotary positions): the SwiGLU weight
is a sharded-state factory, the case where layouts differ most.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_ext.config.run import config_from_values  # noqa: E402
from megatron_ext.runtime import distributed  # noqa: E402
from megatron_ext.runtime.loop import Trainer  # noqa: E402
from megatron_ext.runtime.model import unwrap  # noqa: E402
from tests.scenario_helpers import LLAMA_STYLE, TINY  # noqa: E402

BASE = {**TINY, **LLAMA_STYLE, "train_iters": 3, "global_batch_size": 4, "seq_length": 32, "lr": 1e-2,
        "lr_decay_style": "constant", "num_layers": 2, "init_method_std": 0.2}
LAYOUTS = {"megatron_lm_tp2": {"tensor_model_parallel_size": 2}, "ours_pp2": {"pipeline_model_parallel_size": 2}}
ITERATION = 7


def tokens(batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 4096, (batch, seq), generator=torch.Generator().manual_seed(0))


def megatron_lm_save(trainer: Trainer, save_dir: str) -> None:
    """What Megatron-LM's save_checkpoint does for --ckpt-format torch_dist --no-save-optim."""
    from megatron.core import dist_checkpointing, parallel_state as mpu, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    import random

    import numpy as np

    chunk = unwrap(trainer.model.chunks[0])
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
                "dp_cp_group": mpu.get_data_parallel_group(with_context_parallel=True)}
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state(),
           "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    cfg = trainer.cfg
    args = argparse.Namespace(**{**cfg.flat(), "padded_vocab_size": chunk.vocab_size, "iteration": ITERATION,
                                 "consumed_train_samples": ITERATION * cfg.training.global_batch_size,
                                 "add_bias_linear": not cfg.model.disable_bias_linear})
    state = {  # --no-save-optim: no optimizer and no scheduler state
        "args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
        "model": chunk.sharded_state_dict(metadata=metadata),
        "rng_state": ShardedObject("rng_state", [rng], (mpu.get_pipeline_model_parallel_world_size(),
                                                        mpu.get_tensor_model_parallel_world_size()),
                                   (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank()),
                                   replica_id=mpu.get_data_parallel_rank(with_context_parallel=True)),
        "num_floating_point_operations_so_far": 0,
    }
    path = os.path.join(save_dir, f"iter_{ITERATION:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path, get_default_save_sharded_strategy("torch_dist"))
    dist.barrier()
    chunk.eval()
    toks = tokens()
    positions = torch.arange(toks.shape[1]).unsqueeze(0).expand_as(toks)
    with torch.no_grad():
        local = chunk(toks, positions, None).float()
    parts = [torch.empty_like(local) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    if dist.get_rank() == 0:
        torch.save(torch.cat(parts, dim=-1), os.path.join(save_dir, "logits.pt"))
        with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(str(ITERATION))


def main() -> None:
    root = sys.argv[1]
    ctx = distributed.setup(config_from_values(dict(BASE)).parallel, seed=1234)
    for name, layout in LAYOUTS.items():
        ours = name.startswith("ours")
        cfg = config_from_values({**BASE, **layout, **({"save": os.path.join(root, name)} if ours else {})})
        cfg.validate(ctx.world_size)
        p = cfg.parallel
        ctx = distributed.relayout(ctx, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                                   vpp=None, seed=cfg.training.seed)
        trainer = Trainer(cfg, ctx).setup()
        trainer.run()
        if not ours:
            megatron_lm_save(trainer, os.path.join(root, name))
    distributed.teardown()


if __name__ == "__main__":
    main()
