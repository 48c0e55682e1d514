"""Shared helpers of the hydro tests."""
import torch

from megatron_ext.hydro.models import GPT, GPTShape
from megatron_ext.hydro.parametrization import apply_mup, param_shapes

VOCAB, SEQ = 37, 8


def gpt_factory(d_model=16, n_heads=2, parametrization="sp", dtype=torch.float64, base_d=None, **kw):
    """seed -> plain GPT (muP applied against base width ``base_d`` when parametrization='mup')."""
    def shape(d):
        return GPTShape(vocab_size=VOCAB, seq_len=SEQ, d_model=d, n_layers=1, n_heads=n_heads,
                        parametrization=parametrization, **kw)
    base = delta = None
    if parametrization == "mup":
        base = param_shapes(GPT(shape(base_d or d_model)))
        delta = param_shapes(GPT(shape(2 * (base_d or d_model))))

    def make(seed):
        torch.manual_seed(seed)
        m = GPT(shape(d_model)).to(dtype)
        if parametrization == "mup":
            apply_mup(m, base, delta)
        return m
    return make


def token_batch(seed, n=4, vocab=VOCAB, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    return x[:, :-1], x[:, 1:]

# GPTShape flags of the LLaMA-style block (as models.llama_shape), with the MLP size left to
# ffn_mult so that it scales with width (muP needs base and delta models of proportional widths).
LLAMA_KW = dict(norm="rmsnorm", activation="silu", swiglu=True, n_query_groups=2, position="rope", bias=False)


def import_transformers():
    """``transformers``, or None when it is not installed.

    transformers imports torchvision whenever one is installed, and a CUDA torchvision wheel next
    to a CPU torch raises on import. Such a torchvision is hidden first (None in ``sys.modules``
    reads as "not installed"); it is recognised from its version string without importing it,
    since a failed import leaves half-registered operators behind."""
    import importlib.util
    import os
    import re
    import sys

    if importlib.util.find_spec("transformers") is None:
        return None
    spec = None if "torchvision" in sys.modules else importlib.util.find_spec("torchvision")
    if spec is not None and spec.submodule_search_locations and torch.version.cuda is None:
        path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
        try:
            with open(path, encoding="utf-8") as fh:
                cuda_build = re.search(r"__version__\s*=\s*['\"][^'\"]*\+cu\d+", fh.read()) is not None
        except OSError:
            cuda_build = False
        if cuda_build:
            sys.modules["torchvision"] = None
    import transformers
    return transformers
