"""Version-guarded shims that let megatron-core 0.16.1 train on CPU ranks (gloo).

Each shim replaces one symbol *inside one megatron module's namespace* (never in torch itself), so
GPU code paths and other libraries are untouched. ``apply()`` is explicit and idempotent;
``SHIMS`` lists every patch with the upstream source fragment it relies on, and
``tests/compat/test_megatron_cpu.py`` fails when a fragment moves upstream.

megatron's optimizer (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``, ``clip_grads``)
runs on CPU with three more device shims plus ``cuda_type_names()``: its dtype checks compare
``Tensor.type()`` against CUDA type names, so the runtime builds and steps it inside that context
(``runtime/optimizer.py``). The fp32 CPU runtime keeps a plain torch AdamW over ``param.main_grad``.

Not shimmed: ``Timers`` — pass ``config.timers`` explicitly; ``batch_p2p_sync`` — set
``TransformerConfig(batch_p2p_sync=False)`` (``runtime/model.py`` does).
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import types
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

SUPPORTED_MEGATRON_CORE = ("0.16.1",)
_CPU = torch.device("cpu")


class _CudaProxy:
    """Stands in for ``torch.cuda`` inside one megatron module: device queries answer CPU."""

    def __init__(self) -> None:
        self.__dict__["_real"] = torch.cuda

    def current_device(self) -> torch.device:
        return _CPU

    def synchronize(self, device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_real"], name)


class _NullStream:
    """A CUDA stream / event stand-in on CPU: work is synchronous, so ordering calls do nothing."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> "_NullStream":
        return self

    def synchronize(self) -> None:
        return None


_NULL_STREAM = _NullStream()


class _CudaStreamProxy(_CudaProxy):
    """``torch.cuda`` with side streams that are all the one null stream (the MoE all-to-all
    dispatcher copies token counts to the host on a side stream)."""

    def Stream(self, *args: Any, **kwargs: Any) -> _NullStream:  # noqa: N802 (torch's name)
        return _NULL_STREAM

    def current_stream(self, device: Any = None) -> _NullStream:
        return _NULL_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return _CPU
    return device


class _TorchProxy(types.ModuleType):
    """Stands in for ``torch`` inside one megatron module.

    ``torch.cuda.current_device()`` answers CPU, and tensor factories given a CUDA device build on
    CPU. Everything else is the real ``torch``.
    """

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")

    def __init__(self, streams: bool = False) -> None:
        super().__init__("torch")
        self.__dict__["cuda"] = _CudaStreamProxy() if streams else _CudaProxy()
        for name in self._FACTORIES:
            self.__dict__[name] = self._wrap_factory(getattr(torch, name))

    @staticmethod
    def _wrap_factory(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if "device" in kwargs:
                kwargs["device"] = _cpu_device(kwargs["device"])
            return fn(*args, **kwargs)

        factory.__name__ = fn.__name__
        return factory

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@dataclasses.dataclass(frozen=True)
class Shim:
    """One patch: in ``module`` replace ``attr``; ``fragment`` is upstream source it exists for."""

    name: str
    module: str
    attr: str
    fragment: str
    why: str
    # The attribute may be absent upstream (a name only defined when an optional import succeeds).
    may_be_absent: bool = False


SHIMS: tuple[Shim, ...] = (
    Shim("p2p-device", "megatron.core.pipeline_parallel.p2p_communication", "torch",
         "device=torch.cuda.current_device()",
         "recv buffers and shape tensors are allocated on torch.cuda.current_device()"),
    Shim("global-buffer-device", "megatron.core.utils", "torch",
         "device=torch.cuda.current_device()",
         "GlobalMemoryBuffer.get_tensor (used by dot-product attention) allocates on the current GPU"),
    Shim("schedule-token-count", "megatron.core.pipeline_parallel.schedules", "torch",
         'torch.zeros([], dtype=torch.int, device="cuda")',
         "total_num_tokens is created on CUDA in every schedule"),
    Shim("ddp-buffer-device", "megatron.core.distributed.param_and_grad_buffer", "torch",
         "device=torch.cuda.current_device()",
         "megatron DDP allocates its parameter and gradient buffers on the current GPU"),
    Shim("tp-mappings-device", "megatron.core.tensor_parallel.mappings", "torch",
         "device=torch.cuda.current_device()",
         "sequence-parallel gather/scatter allocate their outputs on the current GPU"),
    Shim("tp-layers-device", "megatron.core.tensor_parallel.layers", "torch",
         "device=torch.cuda.current_device()",
         "sequence-parallel linear layers allocate all-gather buffers on the current GPU"),
    Shim("causal-mask-device", "megatron.core.transformer.utils", "torch",
         'torch.ones(sq, sq, device="cuda")',
         "the default causal mask (no explicit attention mask given) is built on CUDA"),
    Shim("optimizer-device", "megatron.core.optimizer.optimizer", "torch",
         "device='cuda'",
         "mixed-precision optimizers keep found_inf / unit loss scale tensors on CUDA"),
    Shim("grad-scaler-device", "megatron.core.optimizer.grad_scaler", "torch",
         "device='cuda'",
         "--fp16's loss scalers keep their scale, floor and factors on CUDA"),
    Shim("clip-grads-device", "megatron.core.optimizer.clip_grads", "torch",
         "device='cuda'",
         "gradient norm and clipping build their reduction and overflow buffers on CUDA"),
    Shim("distrib-optimizer-device", "megatron.core.optimizer.distrib_optimizer", "torch",
         "device=torch.cuda.current_device()",
         "the distributed optimizer allocates its parameter-state buffers on the current GPU"),
    Shim("rope-device", "megatron.core.models.common.embeddings.rotary_pos_embedding", "torch",
         "self.inv_freq.to(device=torch.cuda.current_device())",
         "rotary embeddings move their inverse frequencies to the current GPU on every forward"),
    Shim("moe-tracker-device", "megatron.core.transformer.moe.moe_utils", "torch",
         'torch.zeros(num_layers, device="cuda")',
         "the MoE aux-loss logging tracker keeps its per-layer values on CUDA"),
    Shim("moe-router-device", "megatron.core.transformer.moe.router", "torch",
         "self.weight.data.to(device=torch.cuda.current_device())",
         "the MoE router moves its gate weight to the current GPU on first use"),
    Shim("moe-router-gemm", "megatron.core.transformer.moe.moe_utils", "te_general_gemm",
         "if te_general_gemm is not None and router_dtype != torch.float64:",
         "the router gate reads te_general_gemm, which is only defined when Transformer Engine imports "
         "(a NameError without it); None selects its plain torch.mm branch", may_be_absent=True),
    Shim("moe-alltoall-streams", "megatron.core.transformer.moe.token_dispatcher", "torch",
         "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()",
         "the all-to-all token dispatcher copies its split sizes to the host on a CUDA side stream"),
    Shim("torch-norm-sequence-parallel", "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
         'assert not config.sequence_parallel, f"sequence parallel not supported by torch LayerNorm"',
         "the plain-torch norm of the local spec refuses --sequence-parallel (MoE with TP needs it), though "
         "a norm is per token: it only has to mark its weights for the TP gradient all-reduce, as "
         "Transformer Engine's and apex's norms do"),
    Shim("torch-norm-zero-centered-gamma", "megatron.core.transformer.torch_norm", "WrappedTorchNorm.__new__",
         'not config.layernorm_zero_centered_gamma',
         "the plain-torch norm of the local spec refuses --apply-layernorm-1p (LLaMA-3 recipes use it), which "
         "only scales by 1 + gain instead of the gain, the gain starting at zero"),
    Shim("moe-alltoall-splits", "megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu",
         "self.input_splits, as_numpy=True",
         "the all-to-all split sizes become numpy arrays only when they were on a GPU; CPU tensors stay "
         "tensors, which all_to_all_single does not take as split sizes"),
    Shim("rng-tracker", "megatron.core.tensor_parallel.random", "CudaRNGStatesTracker",
         "base_tracker = CudaRNGStatesTracker",
         "the model-parallel RNG tracker keeps CUDA generator states"),
    Shim("rng-get-state", "megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
         "def _get_cuda_rng_state(",
         "activation checkpointing saves the CUDA RNG state"),
    Shim("rng-set-state", "megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
         "def _set_cuda_rng_state(",
         "activation checkpointing restores the CUDA RNG state"),
    Shim("dist-ckpt-preload-sync", "megatron.core.dist_checkpointing.strategies.filesystem_async", "torch",
         "torch.cuda.synchronize()",
         "dist_checkpointing's writer waits for the device after staging tensors to host memory"),
    Shim("dist-ckpt-saver-flags", "megatron.core.dist_checkpointing.strategies.state_dict_saver", "torch",
         "device=torch.cuda.current_device()",
         "dist_checkpointing's saver broadcasts its failure flag from a tensor on the current GPU"),
    Shim("dist-ckpt-results-queue", "megatron.core.dist_checkpointing.strategies.filesystem_async",
         "_get_write_results_queue", "_results_queue = ctx.Manager().Queue()",
         "dist_checkpointing's writer collects write results through a multiprocessing manager it spawns once "
         "per process (a fresh interpreter importing the training script); the synchronous save used here "
         "collects them in the saving process"),
    Shim("tied-embedding-cuda", "megatron.core.models.common.language_module.language_module",
         "LanguageModule.setup_embeddings_and_output_layer", "weight.data = weight.data.cuda()",
         "tied embeddings with PP>1 move the shared weight to CUDA before all-reducing it"),
)


def _in_process_queue() -> Any:
    """dist_checkpointing's results queue for a synchronous save: written and read in this process."""
    import queue

    return queue.Queue()


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _make_cpu_tracker(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """Megatron's RNG tracker over the CPU generator.

        CPU ops draw from the default CPU generator, so a fork swaps that generator's state — the
        same contract the CUDA tracker keeps for the device generator, without its check that the
        CPU state is untouched (which would fire on every fork here).
        """

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):  # noqa: D401
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            if torch.compiler.is_compiling():
                # Dynamo cannot trace get/set of the CPU generator state (a graph break at every
                # layer). Under torch.compile the forked region draws from the default generator:
                # identical when dropout is 0, a different random stream otherwise.
                yield
                return
            orig = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig = self.states_[orig_name]
                torch.set_rng_state(orig)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


# Upstream checks that compare ``Tensor.type()`` with CUDA type names (module, fragment):
# ``cuda_type_names()`` exists for exactly these, and ``missing_fragments()`` reports them as
# "cuda-type-names" when one moves.
TYPE_NAME_CHECKS: tuple[tuple[str, str], ...] = (
    ("megatron.core.optimizer.optimizer", "param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"),
    ("megatron.core.optimizer.optimizer", "param.type() == 'torch.cuda.FloatTensor'"),
    ("megatron.core.optimizer.distrib_optimizer",
     "model_param.type() in ['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']"),
    ("megatron.core.optimizer.clip_grads", "assert param.grad.type() == 'torch.cuda.FloatTensor'"),
)


@contextlib.contextmanager
def cuda_type_names():
    """Within the block, ``Tensor.type()`` (no arguments) names CPU tensors as CUDA ones.

    megatron's optimizers sort parameters into fp16/bf16 and fp32 groups, and ``clip_grads``
    asserts fp32 gradients, by comparing ``param.type()`` with ``'torch.cuda.BFloat16Tensor'`` and
    ``'torch.cuda.FloatTensor'`` (``TYPE_NAME_CHECKS``). A CPU tensor of the same dtype answers
    ``'torch.BFloat16Tensor'`` and would be refused. Only the no-argument query changes; a cast
    (``t.type(torch.float16)``) is untouched, and so is every CUDA tensor.
    """
    real = torch.Tensor.type

    def type_name(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or self.device.type != "cpu":
            return real(self, *args, **kwargs)
        return real(self).replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_name  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.type = real  # type: ignore[method-assign]


_applied: dict[str, tuple[Any, str, Any]] = {}
_ABSENT = object()


def check_version() -> str:
    import megatron.core

    version = megatron.core.__version__
    if version not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron_ext CPU shims were written against megatron-core {SUPPORTED_MEGATRON_CORE}, "
            f"found {version}; install the pinned version (pip install -e .) or update "
            "megatron_ext/compat/megatron_cpu.py and its tests")
    return version


def _owner(shim: Shim) -> tuple[Any, str]:
    """(object holding the patched attribute, attribute name); ``attr`` may be ``Class.method``."""
    owner: Any = importlib.import_module(shim.module)
    *path, leaf = shim.attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, leaf


def missing_fragments() -> list[str]:
    """Shims whose upstream fragment is gone: non-empty means the shim list is out of date."""
    import inspect

    missing = []
    for shim in SHIMS:
        try:
            owner, leaf = _owner(shim)
        except AttributeError:
            missing.append(shim.name)
            continue
        source = inspect.getsource(importlib.import_module(shim.module))
        if shim.fragment not in source or not (hasattr(owner, leaf) or shim.may_be_absent):
            missing.append(shim.name)
    for module, fragment in TYPE_NAME_CHECKS:
        if fragment not in inspect.getsource(importlib.import_module(module)):
            missing.append("cuda-type-names")
            break
    return missing


def _without_tensor_cuda(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``method`` with ``Tensor.cuda`` as identity (CPU tensors stay where they are)."""
    import functools

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        real = torch.Tensor.cuda
        torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = real  # type: ignore[method-assign]

    return wrapper


def _host_copy(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's ``maybe_move_tensor_to_cpu`` for tensors already on the host: a numpy copy when
    asked for one, as the GPU path returns; otherwise the tensor itself."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.detach().clone().numpy()
    return tensor


def _torch_norm_accepting(new: Callable[..., Any], option: str,
                          adapt: Callable[[torch.nn.Module], None]) -> Callable[..., Any]:
    """``WrappedTorchNorm.__new__`` that accepts the config ``option`` it refuses: with the option on,
    the torch norm is built from a copy of the config without it, then ``adapt`` gives it the
    option's meaning."""
    import copy
    import functools

    @functools.wraps(new)
    def wrapper(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, option):
            return new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        setattr(plain, option, False)
        norm = new(cls, plain, *args, **kwargs)
        adapt(norm)
        return norm

    return wrapper


def _mark_sequence_parallel(norm: torch.nn.Module) -> None:
    """Sequence parallelism: megatron's finalize_model_grads sums the gradients of weights marked
    ``sequence_parallel`` (partial sums over each rank's tokens) over the tensor-parallel group."""
    for param in norm.parameters():
        param.sequence_parallel = True


class _ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` scaled by 1 + weight (megatron's ``zero_centered_gamma``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` scaled by 1 + weight (megatron's ``zero_centered_gamma``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


_ZERO_CENTERED = {torch.nn.LayerNorm: _ZeroCenteredLayerNorm, torch.nn.RMSNorm: _ZeroCenteredRMSNorm}


def _center_gamma(norm: torch.nn.Module) -> None:
    """``layernorm_zero_centered_gamma``: the norm becomes its zero-centered twin (same parameter
    names and shapes, so checkpoints and initialisation by name see an ordinary norm), gain zero."""
    norm.__class__ = _ZERO_CENTERED[type(norm)]
    with torch.no_grad():
        norm.weight.zero_()


def _replacement(shim: Shim, original: Any) -> Any:
    if shim.attr == "torch":
        return _TorchProxy(streams=shim.name == "moe-alltoall-streams")
    if shim.name == "rng-tracker":
        return _make_cpu_tracker(original)
    if shim.name == "tied-embedding-cuda":
        return _without_tensor_cuda(original)
    if shim.name == "torch-norm-sequence-parallel":
        return staticmethod(_torch_norm_accepting(original.__func__, "sequence_parallel", _mark_sequence_parallel))
    if shim.name == "torch-norm-zero-centered-gamma":
        return staticmethod(_torch_norm_accepting(original.__func__, "layernorm_zero_centered_gamma", _center_gamma))
    if shim.name == "moe-alltoall-splits":
        return _host_copy
    if shim.name == "moe-router-gemm":
        return original  # None when Transformer Engine is absent; TE's own gemm when it is there
    if shim.name == "dist-ckpt-results-queue":
        return _in_process_queue
    if shim.name == "rng-get-state":
        return _cpu_get_rng_state
    if shim.name == "rng-set-state":
        return _cpu_set_rng_state
    raise AssertionError(shim.name)


DIST_CHECKPOINTING = ("dist-ckpt-preload-sync", "dist-ckpt-saver-flags", "dist-ckpt-results-queue")
"""The shims a CPU save through ``dist_checkpointing`` needs, whatever the engine (``apply_for_checkpoints``)."""


def apply_for_checkpoints() -> None:
    """Install the ``dist_checkpointing`` shims only (idempotent): a CPU run of an engine that needs
    no other shim (the DeepSpeed engine at TP 1) saves Megatron-LM's format through them."""
    _install([s for s in SHIMS if s.name in DIST_CHECKPOINTING])


def apply() -> None:
    """Install every shim (idempotent). Call only for CPU runs, before building models."""
    if applied():
        return
    _install(list(SHIMS))
    # The tracker may already exist (built on import paths that call get_cuda_rng_tracker()):
    # force the next model_parallel_cuda_manual_seed to rebuild it from the CPU class.
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._CUDA_RNG_STATE_TRACKER = None
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
    logger.debug("megatron-core CPU shims applied: %s", ", ".join(s.name for s in SHIMS))


def _install(shims: list[Shim]) -> None:
    shims = [s for s in shims if s.name not in _applied]
    if not shims:
        return
    check_version()
    gone = [g for g in missing_fragments() if g in {s.name for s in shims}]
    if gone:
        raise RuntimeError(f"megatron-core source changed under shims {gone}; see megatron_ext/compat/megatron_cpu.py")
    for shim in shims:
        owner, leaf = _owner(shim)
        original = owner.__dict__[leaf] if isinstance(owner, type) else getattr(owner, leaf, _ABSENT)
        _applied[shim.name] = (owner, leaf, original)
        setattr(owner, leaf, _replacement(shim, None if original is _ABSENT else original))


def remove() -> None:
    """Undo ``apply()`` (tests), last shim first: two shims of one attribute wrap each other."""
    for owner, attr, original in reversed(list(_applied.values())):
        if original is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _applied.clear()


def applied() -> bool:
    """Whether every shim is installed (``apply``; ``apply_for_checkpoints`` installs a few)."""
    return all(s.name in _applied for s in SHIMS)
