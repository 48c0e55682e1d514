# megatron-ext for GPU clusters, on an NGC PyTorch image (CUDA, NCCL, Transformer Engine and apex
# come with the base image). The base image is a required build argument, e.g. NVIDIA's
# "nvidia/pytorch" image, tag 25.01-py3 or later, from the NGC catalog:
#
#   docker build --build-arg BASE_IMAGE=<registry>/nvidia/pytorch:25.01-py3 -t megatron-ext .
#   docker run --gpus all --ipc=host megatron-ext \
#       torchrun --nproc_per_node 8 pretrain_gpt.py --config configs/demo.yaml --bf16
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

WORKDIR /opt/megatron-ext
COPY setup.py README.md pretrain_gpt.py ./
COPY megatron_ext ./megatron_ext
COPY deepspeed_patches ./deepspeed_patches
COPY configs ./configs
COPY scripts ./scripts
COPY tools ./tools

# Keep the image's CUDA build of torch (and its TE / apex): install the pinned megatron-core and
# DeepSpeed and the pure-Python dependencies without letting pip replace torch.
RUN python -m pip install --no-cache-dir --no-deps megatron-core==0.16.1 deepspeed==0.19.8 \
 && python -m pip install --no-cache-dir pyyaml tokenizers tensorboard optuna matplotlib tqdm mup \
        hjson ninja py-cpuinfo pydantic msgpack einops \
 && python -m pip install --no-cache-dir --no-deps --ignore-requires-python -e . \
 && python -c "import megatron.core, deepspeed, megatron_ext; print('megatron-core', megatron.core.__version__)"

ENV OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore
CMD ["python", "pretrain_gpt.py", "--help"]
