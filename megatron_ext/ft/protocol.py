"""What the fault-tolerance core needs of a trainer: a small protocol, so the core never imports
the training loop (``runtime/loop.py``) and any engine's trainer can be driven by it.

``runtime.loop.Trainer`` (megatron-core) and ``deepspeed_patches.trainer.DeepSpeedTrainer``
implement it; the engine hooks are the methods a subclass for another engine overrides.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # pragma: no cover
    from megatron_ext.config.run import RunConfig
    from megatron_ext.ft.target import LayoutTarget
    from megatron_ext.runtime.distributed import DistContext


class TrainerLike(Protocol):
    cfg: "RunConfig"
    ctx: "DistContext"
    extensions: list[Any]
    iteration: int
    history: list[dict[str, Any]]
    model: Any            # None while this process is a spare
    optimizer: Any
    scheduler: Any
    train_stream: Any
    relayout_knobs: frozenset[str]
    """What this engine changes live: ``ft.target.KNOBS``."""
    layout_change: Any
    """The ``ft.transaction.Change`` being applied while extensions attach (None otherwise)."""
    extensions_set_up: bool
    """False in a process that has not joined yet: the change that takes it in sets them up."""

    # --- engine hooks ------------------------------------------------------------------------
    def check_target(self, target: "LayoutTarget") -> None:
        """Raise ``UserError`` for a target this engine cannot run (before anything changes)."""

    def layout_context(self, target: "LayoutTarget", *, generation: int | None, store_addr: str | None
                       ) -> "DistContext":
        """Process groups of ``target``, the old ones destroyed: on the same default group
        (``generation`` None: same members in the same order), or on a new default group over
        ``target.members`` meeting at ``store_addr`` under ``generation``'s keys."""

    def build_model(self) -> None:
        """Set ``model``, ``optimizer`` and ``scheduler`` for the layout in ``ctx`` / ``cfg``."""

    def drop_model(self) -> None:
        """Let go of model, optimizer and the engine's process groups (a rank that becomes a spare)."""

    def drop_gradients(self) -> None:
        """Forget the gradients of an iteration that is rolled back."""

    def prepare_schedule(self) -> None: ...

    def layout_name(self) -> str: ...

    @property
    def schedule_name(self) -> str:
        """The pipeline schedule the engine runs: ``1f1b``, ``interleaved`` or ``deepspeed``."""

    def install_recorder(self, recorder: Any) -> Any:
        """Record the pipeline events of this layout into ``recorder``; returns a handle with
        ``new_iteration()`` (before each iteration) and ``uninstall()``."""

    # --- the runtime's own parts ---------------------------------------------------------------
    def build_streams(self, consumed_samples: int) -> None: ...

    def open_outputs(self, purge_step: int | None = None) -> None: ...

    def rewind_outputs(self, iteration: int) -> None:
        """Drop the train and validation rows after ``iteration`` (a rollback redoes them)."""

    def close_outputs(self, finish: bool = False) -> None:
        """Close the output files; ``finish``: the run ends in this process (Weights & Biases too)."""

    def record(self, kind: str, payload: dict[str, Any]) -> None: ...

    @property
    def tensorboard(self) -> Any:
        """Where scalars go on the logging rank (TensorBoard and Weights & Biases; None elsewhere)."""

    def save_checkpoint(self) -> str: ...

    def load_checkpoint(self, path: str) -> None: ...

    def fault_point(self, point: str, iteration: int | None = None) -> None:
        """Test-only fault injection (``--inject-stop RANK:ITER:POINT``)."""
