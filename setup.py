"""megatron-ext: Helix, ResiHP and Hydro inside a megatron-core / DeepSpeed GPT pretraining loop."""
from setuptools import find_packages, setup

# Exact pins: megatron-core and DeepSpeed internals are patched (megatron_ext/compat,
# deepspeed_patches) and each patch checks these versions at apply() time.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "megatron-core==0.16.1",
    "deepspeed==0.19.8",
    "pyyaml==6.0.4",
    "numpy==2.4.6",
    "tokenizers==0.23.3",
    # Megatron-LM's --tokenizer-type SentencePieceTokenizer / Llama2Tokenizer and TikTokenizer, through
    # megatron-core's own wrappers (HuggingFaceTokenizer also needs transformers: the dev extra).
    "sentencepiece==0.2.3",
    "tiktoken==0.14.0",
    "tensorboard==2.21.0",
    "optuna==5.0.0",
    "matplotlib==3.11.2",
    "tqdm==4.70.1",
]

# Installed without their own requirements (`pip install --no-deps`: the Makefile and the Dockerfile
# read this list). mup 1.0.0 requires torchvision, pandas and seaborn for its coord_check plots and its
# tests, which the project never imports: megatron_ext.hydro uses mup's shape, layer, init and optim
# modules, which import only torch and pyyaml (pinned above). torchvision must stay out: no build of it
# matches the pinned CPU torch (PyPI's fails to import beside it, "operator torchvision::nms does not
# exist"), and transformers imports torchvision whenever it is installed, so with it no Hugging Face
# export would load. `make setup` removes a torchvision an older environment holds.
NO_DEPS_REQUIRES = [
    "mup==1.0.0",
]

setup(
    name="megatron-ext",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["megatron_ext", "megatron_ext.*", "deepspeed_patches", "deepspeed_patches.*"]),
    py_modules=["pretrain_gpt"],
    # The cluster simulator's embedded default trace (sources and licences: data/NOTICE.md).
    package_data={"megatron_ext.cluster": ["data/*.csv", "data/*.csv.gz", "data/*.md", "data/*.txt"]},
    install_requires=INSTALL_REQUIRES,
    # Training-loop extensions: importing the module registers its config section and factory.
    entry_points={"megatron_ext.extensions": [
        "timeline = megatron_ext.pipeline.extension",
        "ft = megatron_ext.ft.config",
        "resihp = megatron_ext.resihp.extension",
        "helix = megatron_ext.helix.extension",
        "squeeze = megatron_ext.hydro.squeezer.extension",
        "moe-aux-loss = megatron_ext.runtime.moe_aux_loss",
    ]},
    extras_require={
        # GPU clusters only; never needed on CPU. No apex: megatron-core uses TE's fused kernels.
        "gpu": ["transformer-engine[pytorch]==2.9.0"],
        # --wandb-project (wandb is imported only then).
        "wandb": ["wandb==0.31.0"],
        # transformers: tools/convert_checkpoint.py and its test (pulls no torch; brings safetensors);
        # wandb: the logging tests read its offline files.
        "dev": ["pytest==9.2.0", "pytest-xdist==3.8.0", "hypothesis==6.170.17", "transformers==5.24.0",
                "wandb==0.31.0"],
    },
)
