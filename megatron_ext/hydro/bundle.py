"""A fused trial bundle: B trials of one model trained as one unit (a ``HydroTrial``).

The bundle is what the tuner runs and what the Bubble Squeezer will schedule into pipeline bubbles:

* ``train_step`` / ``evaluate`` run all trials at once (one fused forward and backward);
* pause points between layers (``gate``: forward pre-hooks and gradient hooks on fused modules);
* ``memory_footprint`` reports parameter, gradient, optimizer-state and activation bytes, in
  total and per trial, so a scheduler can size the fusion count to a memory window;
* ``resize`` drops trials and adds new ones between steps; the survivors keep parameters,
  optimizer state, step counts and schedules (everything is sliced along the trial dim).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Hashable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .fuse import fuse_model
from .gate import PauseGate
from .nn import FusedDropout, FusedModule, expand_trials, resize_trials, unfuse_state
from .optim import FusedOptimizer, TrialHParams
from .parametrization import fused_param_groups

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]   # (output, target, B) -> [B]


@dataclasses.dataclass
class TrialSpec:
    """One trial of a bundle: an id (the tuner uses Optuna's trial number), the seed of its
    initialization, its optimizer hyperparameters and its dropout."""
    trial_id: Hashable
    seed: int
    hparams: TrialHParams = dataclasses.field(default_factory=TrialHParams)
    dropout: float | None = None


class TrialBundle:
    """B trials of the model built by ``factory(seed)`` (a plain model; muP already applied)."""

    def __init__(self, factory: Callable[[int], nn.Module], specs: Sequence[TrialSpec], *, optimizer: str,
                 loss_fn: LossFn, example_inputs: Sequence[Any], multipliers: Mapping[str, tuple[float, float]] | None = None,
                 check: bool = True, device: str | torch.device = "cpu") -> None:
        if not specs:
            raise ValueError("a bundle needs at least one trial")
        self.factory, self.loss_fn, self.multipliers = factory, loss_fn, multipliers
        self.device = torch.device(device)
        self.specs: list[TrialSpec] = list(specs)
        replicas = [factory(s.seed).to(self.device) for s in self.specs]
        ex = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in example_inputs]
        self.model = fuse_model(replicas[0], len(replicas), replicas=replicas, example_inputs=ex, check=check)
        self.model.train()
        self._apply_dropout()
        self.optimizer = FusedOptimizer(fused_param_groups(self.model, multipliers), optimizer,
                                        [s.hparams for s in self.specs])
        self.gate = PauseGate()
        self._hooks: list[Any] = []
        self._install_hooks()
        self.last_activation_bytes = 0
        self._measure = True   # activation bytes are measured on the first step after a (re)build

    # ---- introspection ------------------------------------------------------------------------
    @property
    def num_trials(self) -> int:
        return len(self.specs)

    @property
    def trial_ids(self) -> list[Hashable]:
        return [s.trial_id for s in self.specs]

    def steps_of(self, trial_id: Hashable) -> int:
        return self.optimizer.steps[self._index(trial_id)]

    def _index(self, trial_id: Hashable) -> int:
        for i, s in enumerate(self.specs):
            if s.trial_id == trial_id:
                return i
        raise KeyError(f"trial {trial_id!r} is not in this bundle (has {self.trial_ids})")

    def trial_state(self, trial_id: Hashable) -> dict[str, torch.Tensor]:
        """Trial's plain ``state_dict`` (loadable into ``factory(seed)``)."""
        return unfuse_state(self.model, self._index(trial_id))

    # ---- pause points ---------------------------------------------------------------------------
    def _boundary_modules(self) -> list[tuple[str, nn.Module]]:
        """Fused modules not inside another fused module: one pause point per layer, not per matmul."""
        out, inside = [], set()
        for name, m in self.model.named_modules():
            if any(name.startswith(p + ".") for p in inside):
                continue
            if isinstance(m, FusedModule):
                out.append((name, m))
                inside.add(name)
        return out

    def _install_hooks(self) -> None:
        gate = self.gate

        def pre(name: str):
            return lambda mod, args: gate.checkpoint(f"forward {name}")

        def post(name: str):
            def hook(mod, args, out):
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g: (gate.checkpoint(f"backward {name}"), None)[1])
            return hook

        for name, m in self._boundary_modules():
            self._hooks.append(m.register_forward_pre_hook(pre(name)))
            self._hooks.append(m.register_forward_hook(post(name)))

    # ---- running --------------------------------------------------------------------------------
    def _inputs(self, inputs: Any) -> Any:
        return expand_trials(inputs.to(self.device), self.num_trials)

    def train_step(self, inputs: torch.Tensor, target: torch.Tensor) -> list[float]:
        """One optimizer step of every trial on the same batch; returns each trial's loss."""
        self.model.train()
        self.optimizer.zero_grad()
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            try:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):
                pass
            return t

        if self._measure:
            # A python callback per saved tensor costs per-op overhead; measure once per shape.
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.model(self._inputs(inputs))
                losses = self.loss_fn(out, target.to(self.device), self.num_trials)
            self.last_activation_bytes = sum(saved.values())
            self._measure = False
        else:
            out = self.model(self._inputs(inputs))
            losses = self.loss_fn(out, target.to(self.device), self.num_trials)
        losses.sum().backward()
        self.optimizer.step()
        return [float(v) for v in losses.detach()]

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Mean loss of each trial over ``batches`` (eval mode; dropout off)."""
        self.model.eval()
        total, n = torch.zeros(self.num_trials, dtype=torch.float64), 0
        for x, y in batches:
            out = self.model(self._inputs(x))
            total += self.loss_fn(out, y.to(self.device), self.num_trials).double().cpu()
            n += 1
        self.model.train()
        return [float(v) for v in total / max(n, 1)]

    # ---- elasticity -----------------------------------------------------------------------------
    def resize(self, keep_ids: Sequence[Hashable], new_specs: Sequence[TrialSpec] = ()) -> None:
        """Keep ``keep_ids`` (in that order) and append ``new_specs``, between steps."""
        if self.gate.is_parked:
            raise RuntimeError("cannot resize a bundle parked inside a step; resume it and resize between steps")
        keep = [self._index(t) for t in keep_ids]
        taken = set(keep_ids)
        for s in new_specs:
            if s.trial_id in taken:
                raise ValueError(f"trial id {s.trial_id!r} is already in the bundle")
            taken.add(s.trial_id)
        if not keep and not new_specs:
            raise ValueError("a bundle cannot be resized to zero trials")
        new_states = [self._fresh_state(s) for s in new_specs]
        resize_trials(self.model, keep, new_states)
        self.optimizer.resize(keep, [s.hparams for s in new_specs])
        self.specs = [self.specs[i] for i in keep] + list(new_specs)
        self._apply_dropout()
        self._measure = True
        logger.debug("bundle resized to %d trials: %s", self.num_trials, self.trial_ids)

    def remove(self, trial_ids: Iterable[Hashable]) -> None:
        drop = set(trial_ids)
        self.resize([t for t in self.trial_ids if t not in drop])

    def add(self, specs: Sequence[TrialSpec]) -> None:
        self.resize(self.trial_ids, specs)

    def _fresh_state(self, spec: TrialSpec) -> dict[str, torch.Tensor]:
        plain = self.factory(spec.seed)
        state = {k: v.to(self.device) for k, v in plain.state_dict().items()}
        for name, m in self.model.named_modules():
            if isinstance(m, FusedDropout):
                state[f"{name}.p" if name else "p"] = torch.tensor(float(plain.get_submodule(name).p))
        return state

    def _apply_dropout(self) -> None:
        for m in self.model.modules():
            if isinstance(m, FusedDropout):
                current = m.p.tolist()
                m.set_p([s.dropout if s.dropout is not None else current[i] for i, s in enumerate(self.specs)])

    # ---- memory -------------------------------------------------------------------------------
    def memory_footprint(self) -> dict[str, int]:
        """Bytes held by the bundle: parameters, gradients (as of the last step), optimizer state,
        activations saved for backward (measured in the first ``train_step`` after building or
        resizing; 0 before it; the batch shape is assumed fixed), and the
        per-trial share of their sum (the unit a scheduler multiplies by the fusion count)."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        grads = sum(p.numel() * p.element_size() for p in self.model.parameters())  # allocated each step
        buffers = sum(b.numel() * b.element_size() for b in self.model.buffers())
        opt = self.optimizer.state_bytes()
        act = self.last_activation_bytes
        total = params + grads + buffers + opt + act
        return {"num_trials": self.num_trials, "param_bytes": params, "grad_bytes": grads, "buffer_bytes": buffers,
                "optimizer_bytes": opt, "activation_bytes": act, "total_bytes": total,
                "per_trial_bytes": total // max(1, self.num_trials)}
