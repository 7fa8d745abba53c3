"""Exposure rules: who may reach the registry, what a registration may ask of the machine, and the
warning an operator gets for listening beyond loopback without a key.

Without any key, registering, hot-switching and unloading models is open only to loopback clients
(the operator's own machine, or a proxy on it that does its own authentication), unless
`allow_remote_admin` says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from typing import TYPE_CHECKING

from server.errors import ApiError

if TYPE_CHECKING:
    from server.config import ServerConfig
    from server.model_spec import ModelSpec

MAX_REGISTERED_SEQ_LEN = 1 << 21  # tokens; the largest Llama context is 10M, served nowhere on one box


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for wildcard and every other address."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def exposure_warning(config: ServerConfig) -> str | None:
    """The loud start-up warning for a server that anyone on the network can use."""
    if is_loopback(config.host) or config.api_key is not None:
        return None
    admin = ("and so can register or delete models (allow_remote_admin is on)" if config.allow_remote_admin
             else "registering and deleting models stays loopback-only")
    return (f"listening on {config.host} without an API key: anyone who can reach port {config.port} can run "
            f"inference, {admin}. Set --api-key (and --admin-api-key), or --host 127.0.0.1.")


def machine_ranks(device: str) -> int:
    """How many model-parallel ranks this machine can run: GPUs on CUDA, cores on CPU."""
    if device == "cuda":
        import torch  # only here: the server's modules stay importable without torch

        return max(torch.cuda.device_count(), 1)
    return os.cpu_count() or 1


def check_registration_bounds(spec: ModelSpec, device: str) -> None:
    """A registration may not ask for more ranks than the machine has, nor an absurd context."""
    if spec.model_parallel_size is not None:
        ranks = machine_ranks(device)
        if spec.model_parallel_size > ranks:
            raise ApiError(400, f"model_parallel_size {spec.model_parallel_size} exceeds the {ranks} "
                           f"{'GPUs' if device == 'cuda' else 'CPU cores'} of this machine",
                           param="model_parallel_size", code="invalid_value")
    if spec.max_seq_len is not None and spec.max_seq_len > MAX_REGISTERED_SEQ_LEN:
        raise ApiError(400, f"max_seq_len {spec.max_seq_len} exceeds this server's limit of {MAX_REGISTERED_SEQ_LEN}",
                       param="max_seq_len", code="invalid_value")
