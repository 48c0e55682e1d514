"""Distinct parameter sets: no two trials of a study that count share every searched value.

Several workers may ask trials of one study at once (the Bubble Squeezer's guests: one sampler per
guest, each with its own seed, all on one storage). Distinct seeds keep their draws apart in a
continuous space, not in a small discrete one, where two samplers land on one point by chance,
and a worker that resumes a study draws again what an earlier run drew. ``DistinctSampler`` wraps
the study's sampler and checks every value as it is drawn against the trials in the storage, the
one state the workers share: a value is kept only if the set can still be completed into a point
no other counted trial holds; otherwise it is drawn again, and after ``redraws`` draws a free value
is picked directly. Failed trials do not count: they hold no result, so their points may be drawn
again.

Two workers that draw the same point at the same moment each check before the other's values are
stored; ``duplicate_of`` finds that afterwards (the guest withdraws its trial and asks again).
Only when every point of a discrete space is taken do trials repeat points.
"""
from __future__ import annotations

import math
import random
from typing import Any, Mapping, Sequence

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from .search_space import Param

# The states of trials that hold a point: everything but FAIL.
COUNTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)


def points(dist: BaseDistribution) -> int | None:
    """How many values ``dist`` has; None when continuous."""
    if isinstance(dist, CategoricalDistribution):
        return len(dist.choices)
    if isinstance(dist, IntDistribution):
        return (dist.high - dist.low) // dist.step + 1    # Optuna has already moved high onto the grid
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        return int(round((dist.high - dist.low) / dist.step)) + 1
    return None


def space_points(space: Mapping[str, Param]) -> float:
    """Points of the whole search space (``math.inf`` when a parameter is continuous)."""
    n = 1.0
    for p in space.values():
        k = points(p.distribution())
        if k is None:
            return math.inf
        n *= k
    return n


def _key(dist: BaseDistribution, value: Any) -> Any:
    """What two values are compared by: a choice's index, a grid index (a stepped float, so that
    rounding in storage does not make one point two), or the value itself."""
    if isinstance(dist, CategoricalDistribution):
        return dist.to_internal_repr(value)
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        return int(round((value - dist.low) / dist.step))
    return value


def _value(dist: BaseDistribution, key: Any) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return dist.choices[key]
    if isinstance(dist, FloatDistribution) and dist.step is not None:
        return min(dist.high, dist.low + key * dist.step)
    return key


def _keys(dist: BaseDistribution) -> list[Any]:
    if isinstance(dist, CategoricalDistribution):
        return list(range(len(dist.choices)))
    if isinstance(dist, IntDistribution):
        return list(range(dist.low, dist.high + 1, dist.step))
    return list(range(points(dist)))


def counted_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The study's counted trials, read from its storage: a sampler may be handed a view that shows
    only some of them (Hyperband gives it one bracket's trials), and a duplicate is one in any."""
    return study._storage.get_all_trials(study._study_id, deepcopy=False, states=COUNTED)


def duplicate_of(study: optuna.Study, trial: FrozenTrial | optuna.Trial, names: Sequence[str]) -> int | None:
    """The lowest number of another counted trial with the same values of every name as ``trial``
    (whose values are all set), or None."""
    mine, dists = trial.params, trial.distributions
    want = tuple(_key(dists[n], mine[n]) for n in names)
    for t in sorted(counted_trials(study), key=lambda t: t.number):
        if t.number != trial.number and all(n in t.params for n in names) and \
                tuple(_key(t.distributions[n], t.params[n]) for n in names) == want:
            return t.number
    return None


def distinct_sets(trials: Sequence[FrozenTrial], names: Sequence[str]) -> set[tuple[Any, ...]]:
    """The distinct parameter sets among ``trials`` (compared as ``DistinctSampler`` compares them)."""
    return {tuple(_key(t.distributions[n], t.params[n]) for n in names) for t in trials
            if all(n in t.params for n in names)}


class DistinctSampler(BaseSampler):
    """``base`` with every trial's parameter set kept apart from the study's other counted trials.

    Values are checked in the order the tuner suggests them (the search space's). With some values
    of a trial already set, a candidate for the next is kept when fewer counted trials share the
    values so far than the parameters still to draw can tell apart (infinitely many when one is
    continuous): the set can still become new. A joint (relative) draw -- Optuna's TPE models the
    parameters together by default -- is checked the same way, value by value; it is drawn again
    when it does not fit, and after ``redraws`` draws the values past the first that does not fit
    are left to the one-by-one draws."""

    def __init__(self, base: BaseSampler, space: Mapping[str, Param], *, seed: int | None = None,
                 redraws: int = 16) -> None:
        self.base = base
        self.dists = {name: p.distribution() for name, p in space.items()}
        self.redraws = redraws
        self.repeats = 0          # draws that had to repeat a point: the space is full
        self._rng = random.Random(seed)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self.base.infer_relative_search_space(study, trial)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.base.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()

    def _fits(self, trials: list[FrozenTrial], number: int, fixed: dict[str, Any], name: str, key: Any) -> bool:
        """Whether ``name`` = ``key`` after the values ``fixed`` (name -> key) can still complete a
        set that no trial of ``trials`` but ``number`` holds."""
        room = 1.0
        for n in self.dists:
            if n != name and n not in fixed:
                k = points(self.dists[n])
                room = math.inf if k is None else room * k
        if room == math.inf:
            return True
        held = 0
        for t in trials:
            if t.number == number or name not in t.params or any(n not in t.params for n in fixed):
                continue
            if _key(t.distributions[name], t.params[name]) == key and \
                    all(_key(t.distributions[n], t.params[n]) == k for n, k in fixed.items()):
                held += 1
        return held < room

    def _fixed(self, trial: FrozenTrial) -> dict[str, Any]:
        return {n: _key(self.dists[n], trial.params[n]) for n in self.dists if n in trial.params}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        rel = self.base.sample_relative(study, trial, search_space)
        names = [n for n in self.dists if n in rel]
        if not names:
            return rel
        trials = counted_trials(study)
        for attempt in range(self.redraws + 1):
            if attempt:
                rel = self.base.sample_relative(study, trial, search_space)
            fixed, ok = self._fixed(trial), 0
            for n in names:
                k = _key(search_space[n], rel[n])
                if not self._fits(trials, trial.number, fixed, n, k):
                    break
                fixed[n], ok = k, ok + 1
            if ok == len(names):
                return rel
        # the values that fit stay; the rest are drawn one by one (sample_independent checks each)
        return {n: v for n, v in rel.items() if n not in self.dists or n in names[:ok]}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, name: str,
                           param_distribution: BaseDistribution) -> Any:
        value = self.base.sample_independent(study, trial, name, param_distribution)
        if name not in self.dists:
            return value
        trials = counted_trials(study)
        fixed = self._fixed(trial)

        def fits(v: Any) -> bool:
            return self._fits(trials, trial.number, fixed, name, _key(param_distribution, v))

        if fits(value):
            return value
        for _ in range(self.redraws):
            value = self.base.sample_independent(study, trial, name, param_distribution)
            if fits(value):
                return value
        if points(param_distribution) is None:
            # A continuous value repeats only by an exact collision: draw it directly.
            lo, hi = param_distribution.low, param_distribution.high
            while True:
                v = (math.exp(self._rng.uniform(math.log(lo), math.log(hi))) if param_distribution.log
                     else self._rng.uniform(lo, hi))
                if fits(v):
                    return v
        free = [k for k in _keys(param_distribution)
                if self._fits(trials, trial.number, fixed, name, k)]
        if free:
            return _value(param_distribution, self._rng.choice(free))
        self.repeats += 1         # every point after these values is taken (the whole space, by construction)
        return value
