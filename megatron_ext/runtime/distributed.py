"""Process group and megatron-core parallel state, built from the run config and the Layout."""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from megatron_ext.compat import devices
from megatron_ext.config.run import ParallelConfig
from megatron_ext.ft import store as store_lib
from megatron_ext.layout import Coord, Layout

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DistContext:
    """Who this process is in the job. Passed around explicitly (no module globals)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    layout: Layout
    """The layout in force: sizes, stages, the replicas' micro-batches and the launch rank in each
    rank's place (``layout.members``). Built from the launch request at set-up and replaced by
    every layout change; nothing after launch reads the config's ``parallel`` section for it."""
    member: int = -1
    """This process's rank at launch: its name for fault injection and logs. Stays the same when a
    fail-stop renumbers the ranks of a smaller world (default: ``rank``)."""
    generation: int = 0
    """The default process group's generation: 0 at launch, then the number of the round in which a
    layout change formed it anew (a loss, a rejoin, a permutation; ``ft/core.py``)."""
    store_addr: str | None = None
    """``host:port`` of a rendezvous store outside every rank (``ft/store.py``), or None."""
    timeout_s: float = 600.0
    """Timeout of every collective and rendezvous of this job's process groups."""
    pgs: Any = None
    """The layout's process groups (megatron-core's ``ProcessGroupCollection``: tp, pp, dp, mp, ep,
    embedding groups, ...), built with the layout and destroyed with it; passed explicitly to the
    model, DDP, the gradient finalisation, the optimizer and the schedules. None on an engine that
    builds its own (DeepSpeed)."""

    def __post_init__(self) -> None:
        if self.member < 0:
            self.member = self.rank

    @property
    def members(self) -> tuple[int, ...]:
        """Launch rank of each rank of the current world, in rank order (``layout.members``)."""
        return self.layout.members

    @property
    def vpp(self) -> int | None:
        """Model chunks per rank under interleaved 1F1B; None for plain 1F1B."""
        return self.layout.vp if self.layout.vp > 1 else None

    @property
    def coord(self) -> Coord:
        return self.layout.coord(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.layout.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that prints and writes TensorBoard: last stage (it has the loss), tp 0, dp 0."""
        c = self.coord
        return c.pp == self.layout.pp - 1 and c.tp == 0 and c.dp == 0


@runtime_checkable
class OnBackend(Protocol):
    """What the job's collectives need of its context (``DistContext``): the world group's backend
    and this process's device."""

    backend: str
    device: torch.device


def collective_device(of: OnBackend | dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must be for a ``torch.distributed`` collective: the one rule of the job.

    The CPU where the backend has a gloo side (gloo, or a ``cpu:gloo,cuda:nccl`` group, which
    reduces CPU tensors on its gloo side); else the GPU, since NCCL cannot reduce, gather or send
    a CPU tensor. ``of``: the job's context (its world group's backend and its device; the job's
    own groups share that backend), or a process group (default: the world group; its GPU is the
    current CUDA device, the CPU where there is none)."""
    if isinstance(of, OnBackend):
        return torch.device("cpu") if "gloo" in str(of.backend) else of.device
    if "gloo" in str(dist.get_backend(of)) or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def free_port() -> int:
    """A TCP port on the loopback that nothing holds now (the OS picks it): a fixed MASTER_PORT
    collides on a shared machine. The one helper of the job, the tests and the benchmarks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_and_backend(parallel: ParallelConfig) -> tuple[torch.device, str]:
    """This process's device and the process group's backend (``auto`` as ``compat/devices.py``
    resolves it for every check before launch); on CUDA, the device of ``LOCAL_RANK`` made current."""
    want = devices.resolve_device(parallel.device)
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but CUDA is not available")
    backend = devices.resolve_backend(parallel.distributed_backend, want)
    if backend == "nccl" and want != "cuda":
        raise RuntimeError("--distributed-backend nccl needs --device cuda")
    if want == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), backend
    return torch.device("cpu"), backend


def world_from_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun / Slurm variables; a lone process is rank 0 of 1."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0


def init_process_group(parallel: ParallelConfig, *, timeout_s: float = 600.0) -> tuple[int, int, int, torch.device, str]:
    rank, world, local_rank = world_from_env()
    device, backend = device_and_backend(parallel)
    addr = store_lib.address_from_env()
    if world == 1 and "MASTER_ADDR" not in os.environ and addr is None:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(free_port())
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if addr is not None:  # the launcher hosts the store: generation 0 of the default group
            base = store_lib.connect(addr, timeout_s=timeout_s)
            dist.init_process_group(backend=backend, store=store_lib.generation(base, 0, "pg"), rank=rank,
                                    world_size=world, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    return rank, world, local_rank, device, backend


def build_parallel_state(layout: Layout, rank: int, *, vpp: int | None, seed: int, ep: int = 1,
                         timeout_s: float = 1800.0) -> Any:
    """The process groups of ``layout`` (same rank order as Layout) as one ``ProcessGroupCollection``,
    then RNG seeding.

    The adapter to megatron-core 0.16.1's globals: the groups are built by ``initialize_model_parallel``
    and read back into the collection (``use_mpu_process_groups``), because 0.16.1 still reads
    ``parallel_state`` where no collection reaches it: ``get_forward_backward_func`` (the pipeline
    size picks the schedule), the CUDA RNG tracker (``model_parallel_cuda_manual_seed``), the MoE
    token dispatchers and aux-loss tracker, and the layers' defaults for what ``GPTModel`` does not
    pass on. Everything of ours takes the collection (``DistContext.pgs``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        # Experts are split over ``ep`` of the data-parallel ranks; the dense TP/PP/DP groups (what
        # Layout describes) do not change with it.
        expert_model_parallel_size=ep,
        order="tp-cp-ep-dp-pp",
        distributed_timeout_minutes=timeout_s / 60.0,
    )
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    c = layout.coord(rank)
    got = Coord(tp=dist.get_rank(pgs.tp), pp=dist.get_rank(pgs.pp), dp=dist.get_rank(pgs.dp))
    if got != c:  # the Layout function and megatron disagree: groups would be wrong
        raise RuntimeError(f"rank {rank}: megatron parallel state {got} != layout {c} ({layout.name})")
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return pgs


def collection_groups(pgs: Any) -> list[Any]:
    """Every distinct process group a collection holds (its list-valued fields included)."""
    out: dict[int, Any] = {}
    for f in dataclasses.fields(pgs):
        value = getattr(pgs, f.name, None)
        for g in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(g, dist.ProcessGroup):
                out.setdefault(id(g), g)
    return list(out.values())


def megatron_groups_outside_the_collection() -> list[Any]:
    """The adapter's other half: groups ``initialize_model_parallel`` 0.16.1 builds that a
    ``ProcessGroupCollection`` does not carry and ``destroy_model_parallel`` does not destroy (it
    destroys the ``*_GLOO`` twins): the tensor-and-data-parallel group, read by its getter."""
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_and_data_parallel_group(check_initialized=False)
    return [group] if isinstance(group, dist.ProcessGroup) else []


def joining_context(parallel: ParallelConfig, *, timeout_s: float) -> DistContext:
    """A process the launcher started again in place of a lost one: no process group yet (the
    layout change that takes it in forms one, ``ft/core.py``). ``member`` is its launch rank; the
    rest describes no layout until then."""
    rank, _, local_rank = world_from_env()
    device, backend = device_and_backend(parallel)
    return DistContext(rank=0, world_size=1, local_rank=local_rank, device=device, backend=backend,
                       layout=Layout(1, 1, 1, members=(rank,)), member=rank, generation=-1,
                       store_addr=store_lib.address_from_env(), timeout_s=timeout_s)


def setup(parallel: ParallelConfig, *, seed: int, timeout_s: float = 600.0, join: bool = False) -> DistContext:
    """The process group and megatron's parallel state of the launch layout (``join``: a
    replacement process, which waits for a layout change to take it in: no group yet)."""
    if join:
        ctx = joining_context(parallel, timeout_s=timeout_s)
        if ctx.device.type == "cpu":
            from megatron_ext.compat import megatron_cpu

            megatron_cpu.apply()
        return ctx
    rank, world, local_rank, device, backend = init_process_group(parallel, timeout_s=timeout_s)
    if device.type == "cpu":
        from megatron_ext.compat import megatron_cpu

        megatron_cpu.apply()
    layout = parallel.launch_layout(world)
    pgs = build_parallel_state(layout, rank, vpp=parallel.virtual_pipeline_model_parallel_size, seed=seed,
                               ep=parallel.expert_model_parallel_size, timeout_s=timeout_s)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend,
                       layout=layout, member=rank, store_addr=store_lib.address_from_env(), timeout_s=timeout_s,
                       pgs=pgs)


def teardown() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_parallel_state(pgs: Any) -> int:
    """Destroy the layout's process groups (``pgs``, the collection it was built with, and what the
    adapter says megatron built beside it) and megatron's parallel state. The default group stays.
    Returns how many groups were destroyed here."""
    from megatron.core import parallel_state as ps

    groups = (collection_groups(pgs) if pgs is not None else []) + megatron_groups_outside_the_collection()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()  # forgets the globals; destroys the gloo twins
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    destroyed = 0
    for group in {id(g): g for g in groups}.values():
        if group is default:
            continue
        try:
            dist.destroy_process_group(group)
            destroyed += 1
        except (ValueError, RuntimeError) as exc:  # already gone with a world that had a dead member
            logger.debug("destroying a process group: %s", exc)
    return destroyed


def relayout(ctx: DistContext, *, tp: int, pp: int, vpp: int | None, seed: int, ep: int = 1,
             layout: Layout | None = None) -> DistContext:
    """Rebuild megatron's parallel state for a new layout over the same processes: ``layout`` (its
    stages, split and members included), or TP x PP x ``vpp`` over the ranks in their order.

    The default process group stays; every group of the old layout is destroyed and megatron's
    groups are rebuilt from the layout. Collective: every rank of the default group calls it.
    """
    if layout is None:
        layout = Layout.from_world(ctx.world_size, tp, pp, vp=vpp or 1, members=ctx.members)
    destroy_parallel_state(ctx.pgs)
    pgs = build_parallel_state(layout, ctx.rank, vpp=layout.vp if layout.vp > 1 else None, seed=seed, ep=ep,
                               timeout_s=ctx.timeout_s)
    return dataclasses.replace(ctx, layout=layout, pgs=pgs)


def rendezvous_address(ctx: DistContext) -> str | None:
    """Where the ranks can form a new default group: the job's store outside every rank
    (``ctx.store_addr``: the project's launcher or ``MEGATRON_EXT_STORE``), else the store of
    torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``: the agent hosts it at ``MASTER_ADDR:MASTER_PORT``
    and every rank is a client), else None (e.g. a store that lives in rank 0's default group)."""
    if ctx.store_addr is not None:
        return ctx.store_addr
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
    return None


def regroup(ctx: DistContext, *, layout: Layout, seed: int, ep: int = 1, store_addr: str | None = None,
            generation: int | None = None) -> DistContext:
    """A new default process group over ``layout.members`` (launch ranks, in their new rank order;
    this process among them) on the store keys of ``generation`` (default: the next one), and
    megatron's parallel state for ``layout`` over it: the survivors of a fail-stop, a rank that
    rejoins, or every rank in another order (a live rank permutation).

    gloo cannot shrink or renumber a group, so the old default group and every group built on it
    are destroyed and a new one rendezvouses on fresh keys (torchft's pattern). Collective over
    ``members``; bounded by ``ctx.timeout_s``. ``store_addr``: where to meet (default
    ``ctx.store_addr``)."""
    ctx = new_world(ctx, layout=layout, store_addr=store_addr, generation=generation)
    pgs = build_parallel_state(layout, ctx.rank, vpp=ctx.vpp, seed=seed, ep=ep, timeout_s=ctx.timeout_s)
    return dataclasses.replace(ctx, pgs=pgs)


def leave(ctx: DistContext) -> None:
    """Destroy the layout's process groups and the default group of this process (a rank that
    leaves the layout, or before it joins a new world). Groups with a dead member may refuse a
    clean shutdown: that is logged, not raised."""
    try:
        if dist.is_initialized():
            destroy_parallel_state(ctx.pgs)
    except Exception as exc:
        logger.debug("destroying the old parallel state: %s", exc)
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            logger.debug("destroying the old default group: %s", exc)


def new_world(ctx: DistContext, *, layout: Layout, store_addr: str | None = None,
              generation: int | None = None) -> DistContext:
    """The default process group of ``generation`` (default: the next one) over ``layout.members``
    (launch ranks in their new rank order), every old group destroyed; no megatron state (the
    DeepSpeed engine builds its own groups). Collective over ``members``; bounded by
    ``ctx.timeout_s``. ``store_addr``: where to meet (default ``ctx.store_addr``;
    ``rendezvous_address`` finds one)."""
    addr = store_addr or ctx.store_addr
    if addr is None:
        raise RuntimeError("a new world needs a store outside the ranks (ft/store.py)")
    gen = ctx.generation + 1 if generation is None else generation
    members = list(layout.members)
    rank, world = members.index(ctx.member), len(members)
    leave(ctx)
    base = store_lib.connect(addr, timeout_s=ctx.timeout_s)
    dist.init_process_group(backend=ctx.backend, store=store_lib.generation(base, gen, "pg"), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=ctx.timeout_s))
    return dataclasses.replace(ctx, rank=rank, world_size=world, layout=layout, generation=gen)
