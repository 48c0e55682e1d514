"""``pretrain_gpt.py`` with one forced live rank permutation, for test_failstop.py: the ranks are
started by the project's launcher (``ft/launch.py``, the store in the launcher process).

``FORCE_RANK_ORDER=ITER:R0,R1,...`` in the environment: after iteration ITER the job re-lays out
with the ranks in that order (``Trainer.request_layout`` with the same shape over the launch ranks
of those ranks); everything else is ``pretrain_gpt.py``'s own ``main`` with the given flags.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_ext.runtime.extension import Extension, register_extension  # noqa: E402


class ForcedPermutation(Extension):
    name = "forced_permutation"

    def __init__(self, at: int, order: list[int]) -> None:
        self.at, self.order = at, order

    def after_iteration(self, trainer, metrics) -> None:
        if metrics.iteration == self.at:
            members = tuple(trainer.ctx.members[r] for r in self.order)
            trainer.request_layout(trainer.ctx.layout.with_members(members), reason="forced by the test")


@register_extension("forced_permutation")
def _factory(cfg, required: bool = False) -> ForcedPermutation | None:
    spec = os.environ.get("FORCE_RANK_ORDER")
    if not spec:
        return None
    at, _, order = spec.partition(":")
    return ForcedPermutation(int(at), [int(r) for r in order.split(",")])


if __name__ == "__main__":
    import pretrain_gpt

    sys.exit(pretrain_gpt.main())
