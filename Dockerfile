# Placeholder image: the server on port 8000, serving the demo model (fetched on first start).
# The GPU image (CUDA torch, MODEL_PARALLEL_SIZE > 1 under torchrun) comes with the deployment issue.
FROM python:3.11-slim
WORKDIR /app
# a C compiler: the fused CPU kernels are built for the serving CPU at first load (else torch ops)
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
EXPOSE 8000
# A container must listen on 0.0.0.0 to be reachable through its published port. Without an API key
# the server logs a security warning and keeps model registration/deletion to loopback clients;
# pass LLAMASERVE_API_KEY (and LLAMASERVE_ADMIN_API_KEY) for anything beyond a private demo.
CMD ["python", "-m", "server", "--demo", "--host", "0.0.0.0", "--port", "8000"]
