# llamaserve: the OpenAI-compatible server on port 8000.
#
#   docker build -t llamaserve .
#   docker run -p 8000:8000 -e LLAMASERVE_API_KEY=change-me llamaserve               # the demo model, no volume
#   docker run -p 8000:8000 -e LLAMASERVE_API_KEY=change-me -v ~/.llama/checkpoints:/checkpoints:ro \
#       -e INFERENCE_MODEL=Llama3.2-3B-Instruct llamaserve                           # /checkpoints/<model>
#
# CUDA: `--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128` installs CUDA torch
# (its wheels carry the CUDA runtime, so the slim base works; the host needs the NVIDIA driver and
# container toolkit: `docker run --gpus all -e LLAMASERVE_DEVICE=cuda ...`). `--build-arg
# BASE_IMAGE=...` swaps the base for another Debian-based Python 3.11 image (e.g. a CUDA one).
#
# The C kernels (engine/kernels/csrc/) are compiled here, in the builder stage, once per
# x86-64 level (v2 SSE4.2, v3 AVX2+FMA, v4 AVX-512); at start the server loads the highest level
# the CPU's flags allow (LLAMASERVE_PREBUILT_KERNELS, engine/kernels/build.py). Why not keep the
# compiler and build -march=native at first load, as outside the image: measured on this
# project's 2-core Xeon (AVX-512, AMX), the v4 build's decode step was within noise of the native
# build's (tiny config, one thread: bf16 batch 1 10.6 vs 11.6 ms, fp32 15.7 vs 16.0 ms; batch 8
# 13.5 vs 15.2 and 27.1 vs 27.2 ms, best of 12 on a loaded machine), while gcc + libc6-dev add
# about 200 MB to the image, 3-4 s of compiling to every fresh container's first load, and a
# compiler to the attack surface. A CPU below v2, or not x86-64, runs the torch path (same maths).

ARG BASE_IMAGE=python:3.11-slim

# --------------------------------------------------------------------------- builder
FROM ${BASE_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_EXTRA_INDEX_URL=${TORCH_INDEX_URL} \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# only what the package needs (.dockerignore keeps tests, bench and caches out of the context)
COPY pyproject.toml README.md ./
COPY server/ server/
COPY compat/ compat/
COPY engine/ engine/
# the README's install command, so CI (which runs it) proves this step
RUN pip install torch==2.13.0 .
# kernels per x86-64 level, and the demo model fetched and converted now rather than at each start
RUN if [ "$(uname -m)" = x86_64 ]; then python -m engine.kernels.build prebuild /opt/llamaserve/kernels; fi \
    && mkdir -p /opt/llamaserve/kernels \
    && python -m engine.loading.demo /opt/llamaserve/cache \
    && rm -rf /opt/llamaserve/cache/downloads

# --------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}
RUN groupadd --gid 10001 llamaserve \
    && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin llamaserve \
    && mkdir /checkpoints && chown 10001:10001 /checkpoints
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/llamaserve /opt/llamaserve
COPY docker/entrypoint.sh /usr/local/bin/llamaserve-entrypoint
# Every dir the server writes by default belongs to its user (the rest of /opt/llamaserve stays
# root's, read-only to it): the Batch API's store, private to the server (0700). Mount a volume
# here to keep batches across containers; a named volume takes this owner and mode. A dir it
# cannot write takes only the Batch API down (503 with the reason), never the server.
# tests/e2e/test_image_user_e2e.py runs the server as this user against these lines.
RUN install -d -o 10001 -g 10001 -m 0700 /opt/llamaserve/cache/batches
# LLAMASERVE_HOST: bind every interface explicitly, so the published port is reachable whatever the
# server's own default; set LLAMASERVE_API_KEY to require a key from clients.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    LLAMASERVE_HOST=0.0.0.0 \
    LLAMASERVE_PORT=8000 \
    LLAMASERVE_CHECKPOINT_ROOTS=/checkpoints \
    LLAMASERVE_CACHE_DIR=/opt/llamaserve/cache \
    LLAMASERVE_BATCH_DIR=/opt/llamaserve/cache/batches \
    LLAMASERVE_PREBUILT_KERNELS=/opt/llamaserve/kernels
VOLUME ["/checkpoints"]
USER 10001:10001
WORKDIR /home/llamaserve
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('LLAMASERVE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["llamaserve-entrypoint"]
