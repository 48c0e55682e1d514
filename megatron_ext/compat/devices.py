"""What a run's ``auto`` device and ``auto`` backend mean, decided in one place.

``--device auto`` and ``--distributed-backend auto`` (``config/run.py``), and the tuner's own
``device`` (``hydro/config.py``), are resolved by the process group set-up, by the checks made
before any rank starts (the model families', fault tolerance's, megatron's TransformerConfig) and by
the tuner. They must agree: a check that took ``auto`` for the CPU would pass a run that then starts
on NCCL. This module sits below the config (layer 2) so that every one of them can import it.

Pure: torch is imported only to answer ``auto`` (a check of an explicit ``cpu`` run stays free of
it).
"""
from __future__ import annotations

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl")


def resolve_device(want: str) -> str:
    """``"cuda"`` or ``"cpu"`` for a device setting: ``auto`` is CUDA where torch sees a GPU.

    An explicit ``cuda`` stays ``cuda`` where none is visible: a check needs what was asked for, and
    the process group set-up (``runtime/distributed.py``) refuses it there with the flag's name."""
    if want not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {want!r}")
    if want != "auto":
        return want
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_backend(want: str, device: str) -> str:
    """``"nccl"`` or ``"gloo"`` for a backend setting on a resolved ``device`` (``resolve_device``):
    ``auto`` is NCCL on CUDA, gloo on the CPU."""
    if want not in BACKENDS:
        raise ValueError(f"distributed backend must be one of {', '.join(BACKENDS)}, got {want!r}")
    if device not in DEVICES[1:]:
        raise ValueError(f"resolve_backend: device must be a resolved device ('cpu' or 'cuda'), got {device!r}")
    if want != "auto":
        return want
    return "nccl" if device == "cuda" else "gloo"
