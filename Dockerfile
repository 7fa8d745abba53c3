# Placeholder image: the server on port 8000, serving the demo model (fetched on first start).
# The GPU image (CUDA torch, MODEL_PARALLEL_SIZE > 1 under torchrun) comes with the deployment issue.
FROM python:3.11-slim
WORKDIR /app
# a C compiler: the fused CPU kernels are built for the serving CPU at first load (else torch ops)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
EXPOSE 8000
CMD ["python", "-m", "server", "--demo", "--host", "0.0.0.0", "--port", "8000"]
