# Placeholder image: CPU torch, the server on port 8000. The GPU image comes with the deployment issue.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && pip install --no-cache-dir .
EXPOSE 8000
CMD ["python", "-m", "server", "--demo", "--host", "0.0.0.0", "--port", "8000"]
