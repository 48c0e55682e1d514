"""Helix configuration: one flag per field (``--helix``, ``--helix-tiles``, ...).

The run config registers this class as its ``helix`` section; the backend is built from it with
:func:`megatron_ext.helix.backend_from_config`.
"""
from __future__ import annotations

import dataclasses

from megatron_ext.config.base import ConfigError, doc

INTERCONNECTS = ("none", "intra_node", "cross_node")
COST_MODELS = ("analytical", "calibrated")
MODES = ("auto", "tiled", "baseline")
DEFAULT_SELECT_ROUNDS = 8
"""Measured-selection rounds of ``--helix-mode auto`` when ``--helix-select-rounds`` is unset."""
CANDIDATE_DEFAULTS = ("tiled-k2", "tiled-k4", "tiled-k2-unbucketed", "inductor")
"""The measured selection's candidates besides the untiled graph and the --helix-mode schedule
(``helix/selection.py`` parses them)."""


@dataclasses.dataclass(kw_only=True)
class HelixConfig:
    """Helix: overlap communication with computation by scheduling the torch.compile graph."""

    helix: bool = doc("Compile the model with the Helix torch.compile backend (tiling, segmented "
                      "round-robin reordering, bucketing).", False)
    helix_tiles: int = doc("Tile streams per batch (K); 1 keeps the graph untiled and only reorders "
                           "and buckets.", 2)
    helix_memory_budget_gb: float | None = doc("Peak-memory budget of one compiled graph step in GiB; "
                                               "schedules predicted above it are refused. Unset = no "
                                               "limit.", None)
    helix_seq_tiling: bool = doc("Also tile along the sequence where the batch does not split (micro-batch 1). "
                                 "In forward-only graphs (validation, --skip-train) each query tile attends to "
                                 "every key and the causal mask is made per tile, so one tile's attention "
                                 "scores are live at a time; with --helix-memory-budget-gb such a graph over "
                                 "the budget is tiled finer until its predicted peak fits.", False)
    helix_bucketing: bool = doc("Merge tile collectives back where the simulator predicts a gain.", True)
    helix_min_gain: float = doc("Keep the tiled schedule only when the simulator predicts at least "
                                "this relative makespan gain over the untiled graph.", 0.02)
    helix_cost_model: str = doc("Cost model of the simulator: analytical roofline, or calibrated by "
                                "micro-benchmarks of each operator on this device (cached).",
                                "calibrated", choices=COST_MODELS)
    helix_cost_cache: str | None = doc("Micro-benchmark cache file; default "
                                       "$MEGATRON_EXT_CACHE/helix_costs.json or "
                                       "~/.cache/megatron_ext/helix_costs.json.", None)
    helix_interconnect: str = doc("Emulate an interconnect for collectives (CPU measurement "
                                  "harness; every figure measured with it is emulated).", "none",
                                  choices=INTERCONNECTS)
    helix_host_interference: float | None = doc(
        "Share of compute throughput a real collective takes from the compute it overlaps on this host, "
        "charged by the simulator over the real collective's time (CPU ranks: gloo reduces and copies on the "
        "cores the compute needs). Unset: measured once with the collectives (calibrated cost model; 0 on "
        "GPUs, whose SMs the emulated interconnect's own share stands for). 0: off.", None)
    helix_mode: str = doc("auto: keep the tiled schedule where the simulator predicts a gain; tiled: "
                          "always keep it (parity checks, comparisons); baseline: compile without "
                          "any pass.", "auto", choices=MODES)

    helix_select_rounds: int | None = doc(
        "Measured selection: at the start (and after a re-layout) the job runs the untiled graph and the "
        "--helix-mode schedule one iteration each, then this many rounds of one iteration each in rotated order, "
        "and keeps the schedule resolved faster than the untiled graph by the rounds' own spread, else the "
        "untiled graph (helix/selection.py). Unset: 8 with --helix-mode auto, so that --helix never keeps a "
        "schedule slower than not using it; 0 with tiled or baseline (the schedule as forced). 0: the "
        "simulator's choice alone.", None)

    helix_select_candidates: list[str] = doc(
        "Schedules the measured selection compiles besides the untiled graph and the --helix-mode schedule: "
        "tiled-kN (forced tiling at N tiles), auto-kN (the simulator decides), either with -unbucketed, or "
        "inductor (Inductor's own overlap scheduler on the untiled graph). The simulator ranks them all after "
        "each compiles once; the best --helix-select-measure are timed.",
        default_factory=lambda: list(CANDIDATE_DEFAULTS))
    helix_select_measure: int = doc(
        "How many of the simulator's best candidates the measured selection times against the untiled graph "
        "(the rest compile once and are not timed).", 2)

    def __post_init__(self) -> None:
        from megatron_ext.helix.selection import parse_candidate

        for spec in self.helix_select_candidates or []:
            try:
                parse_candidate(spec)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.helix_select_measure < 1:
            raise ConfigError(f"--helix-select-measure must be >= 1, got {self.helix_select_measure}")
        if self.helix_select_rounds is not None and self.helix_select_rounds < 0:
            raise ConfigError(f"--helix-select-rounds must be >= 0, got {self.helix_select_rounds}")
        if self.helix_select_rounds and self.helix_mode == "baseline":
            raise ConfigError("--helix-select-rounds compares the untiled graph with the --helix-mode schedule: "
                              "--helix-mode baseline leaves nothing to compare")
        if self.helix_host_interference is not None and not 0.0 <= self.helix_host_interference < 1.0:
            raise ConfigError(f"--helix-host-interference must be in [0, 1), got {self.helix_host_interference}")
        if self.helix_tiles < 1:
            raise ConfigError(f"--helix-tiles must be >= 1, got {self.helix_tiles}")
        if self.helix_memory_budget_gb is not None and self.helix_memory_budget_gb <= 0:
            raise ConfigError(f"--helix-memory-budget-gb must be > 0, got {self.helix_memory_budget_gb}")
        if not 0.0 <= self.helix_min_gain < 1.0:
            raise ConfigError(f"--helix-min-gain must be in [0, 1), got {self.helix_min_gain}")
        if self.helix_interconnect not in INTERCONNECTS:
            raise ConfigError(f"--helix-interconnect must be one of {', '.join(INTERCONNECTS)}, "
                              f"got {self.helix_interconnect!r}")
        if self.helix_mode not in MODES:
            raise ConfigError(f"--helix-mode must be one of {', '.join(MODES)}, got {self.helix_mode!r}")
        if self.helix_cost_model not in COST_MODELS:
            raise ConfigError(f"--helix-cost-model must be one of {', '.join(COST_MODELS)}, "
                              f"got {self.helix_cost_model!r}")

    def capabilities(self) -> dict[str, str]:
        """What the model layer must know of Helix (``RunConfig.capability``): its backend traces
        megatron's local layer spec (not Transformer Engine's), and its traceable MoE dispatch has
        no shared experts."""
        if not self.helix:
            return {}
        return {"local_layer_spec": "--helix",
                "no_shared_experts": "--helix: Helix's traceable MoE dispatch (helix/adapter_moe.py) does not "
                                     "implement shared experts"}

    @property
    def select_rounds(self) -> int:
        """``--helix-select-rounds`` as it applies: its default depends on ``--helix-mode``."""
        if self.helix_select_rounds is not None:
            return self.helix_select_rounds
        return DEFAULT_SELECT_ROUNDS if self.helix_mode == "auto" else 0

    @property
    def memory_budget_bytes(self) -> int | None:
        if self.helix_memory_budget_gb is None:
            return None
        return int(self.helix_memory_budget_gb * (1 << 30))
