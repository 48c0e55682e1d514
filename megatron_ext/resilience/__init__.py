"""Resilient training under faults, simulated apart from ResiHP's planner (not independently of it:
both run megatron's 1F1B order compiled by ``pipeline.pipesim`` and FLOPs counts held equal by a
test; ``perturb`` scores on truths the planner is not told, ``oracle`` bounds every policy).

An event-level simulator of one training job (``sim``): per micro-batch forward and backward on
each device at that device's speed, the pipeline schedule compiled by ``pipeline.pipesim``, TP
collectives and PP sends over their links at the links' bandwidth, the data-parallel gradient
reduce and the optimizer step. A fault trace (``faults``) changes device speeds and link
bandwidths over wall-clock time; a policy (``policies``) reacts to a detector model's verdicts
(``detector``) by changing the job's layout and paying its mechanism's cost; ``run`` drives one
policy through one trace. ``setting`` is the seed's 256-GPU setting, ``validate`` the simulator's
error against recorded CPU runs. docs/resilience.md describes the model and each baseline.

Pure: numpy and the project's pure cores (``pipeline``, ``resihp``); no torch.
"""
