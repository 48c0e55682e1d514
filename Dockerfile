# megatron-ext for GPU machines: CUDA torch, NCCL, Transformer Engine, and `make gpu-check`.
#
# Default base: the official PyTorch CUDA *devel* image of the project's torch pin (torch==2.13.0 in
# setup.py). pip then finds torch already satisfied and keeps the image's CUDA build, and the devel
# image's nvcc builds Transformer Engine's torch extension against it. Check that the tag exists for
# your CUDA driver before building; any CUDA 12 devel tag of torch 2.13.0 works.
#
#   docker build -t megatron-ext .
#   docker run --gpus all --ipc=host megatron-ext make gpu-check
#   docker run --gpus all --ipc=host megatron-ext \
#       torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/demo.yaml --bf16
#
# An image that brings its own torch and Transformer Engine (NVIDIA's NGC PyTorch image, 25.01-py3
# or later, from the NGC catalog) builds with KEEP_BASE_TORCH=1; see the deviations noted below:
#
#   docker build --build-arg BASE_IMAGE=<ngc-registry>/nvidia/pytorch:25.01-py3 \
#       --build-arg KEEP_BASE_TORCH=1 -t megatron-ext:ngc .
#
# apex is not installed and not needed: megatron-core 0.16.1 takes its fused Adam and multi-tensor
# kernels from Transformer Engine when TE imports, and falls back to torch otherwise
# (megatron/core/optimizer/__init__.py, optimizer.py). The GPU check reports whether apex is present.
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}
ARG KEEP_BASE_TORCH=0
# Transformer Engine's pin from setup.py's "gpu" extra (installed unless KEEP_BASE_TORCH=1).
ARG TRANSFORMER_ENGINE=transformer-engine[pytorch]==2.9.0

WORKDIR /opt/megatron-ext
COPY setup.py README.md Makefile pretrain_gpt.py ./
COPY megatron_ext ./megatron_ext
COPY deepspeed_patches ./deepspeed_patches
COPY configs ./configs
COPY scripts ./scripts
COPY tools ./tools

# `make gpu-check` needs make; slim bases lack it.
RUN command -v make >/dev/null || (apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*)

# The exact pins of setup.py, read from it (one list, no copy to drift); NO_DEPS_REQUIRES (mup) are
# installed without their own requirements (setup.py says why).
RUN for name in INSTALL_REQUIRES NO_DEPS_REQUIRES; do python -c "import ast, sys; \
t = ast.parse(open('setup.py').read()); print('\n'.join(next(ast.literal_eval(n.value) for n in t.body \
if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == sys.argv[1])))" $name > /tmp/$name.txt; done

# Default: every pin honoured (torch is already the pinned version; pip keeps it).
# KEEP_BASE_TORCH=1 deviates on purpose, because replacing an NGC image's torch with the PyPI build
#   would break the TE (and apex) compiled against it:
#   - torch: the image's build, not torch==2.13.0 (its version is printed below and by gpu-check);
#   - transformer-engine: the image's, not 2.9.0;
#   - python: NGC 25.01 ships 3.12 while setup.py asks for 3.11 (--ignore-requires-python): the
#     project's code runs on 3.12, its CI runs on 3.11.
RUN set -e; \
    if [ "$KEEP_BASE_TORCH" = "1" ]; then \
        grep -v '^torch==' /tmp/INSTALL_REQUIRES.txt > /tmp/requirements-no-torch.txt; \
        python -m pip install --no-cache-dir -r /tmp/requirements-no-torch.txt; \
    else \
        python -m pip install --no-cache-dir -r /tmp/INSTALL_REQUIRES.txt; \
        python -m pip install --no-cache-dir --no-build-isolation "$TRANSFORMER_ENGINE"; \
    fi; \
    python -m pip install --no-cache-dir --no-deps -r /tmp/NO_DEPS_REQUIRES.txt; \
    python -m pip install --no-cache-dir --no-deps --ignore-requires-python -e .; \
    python -c "import torch, megatron.core, deepspeed, megatron_ext; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'megatron-core', megatron.core.__version__)"

ENV OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
CMD ["python", "pretrain_gpt.py", "--help"]
