"""/v1/models: list, get, register (POST) and unregister (DELETE), over the ModelRegistry.

Model objects are OpenAI's (`id`, `object: "model"`, `created`, `owned_by`) plus ours (`status`,
`llama_model`, `max_seq_len`, `checkpoint_dir`, `metadata`, `load_time_s`, `memory_bytes`, and
`error` when failed) plus vLLM's (`max_model_len`, `root`, `parent`) plus the names Llama Stack's client reads (`identifier`, `provider_id`,
`provider_resource_id`, `type`, `model_type`), so both SDKs parse them.

POST accepts our body and the one `llama-stack-client models register` sends:
  {"model_id" | "model", "checkpoint_dir"?, "llama_model"?, "provider_model_id"?, "provider_id"?,
   "model_type"? ("llm"), "model_parallel_size"?, "max_seq_len"?, "quantization"?, "keep_alive"?, "speculative_config"?,
   "skip_initialize"? | "skip_load"?, "metadata"?: {the same settings, plus anything else}}
(`metadata` may also be that object as a JSON string, as the `models register --metadata` CLI sends it.)
A setting may sit at the top level or in `metadata`; both with different values is a 400.
Without skip_initialize the call returns once the model is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from aiohttp import web

from compat import limits
from compat.protocol import validation_param
from engine.config import launched_by_torchrun
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.types import InvalidRequest
from server.app_keys import CONFIG_KEY
from server.errors import ApiError
from server.model_spec import ModelSpec, parse_keep_alive
from server.registry import REGISTRY_KEY, ModelInfo, ModelRegistry
from server.safety import check_registration_bounds

_T = TypeVar("_T")

ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
PathText = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
ParallelSize = Annotated[int, msgspec.Meta(ge=0, le=1024)]  # 0: one rank per checkpoint shard
SeqLen = Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]


class QuantizationConfig(msgspec.Struct, kw_only=True):
    """Llama Stack's meta-reference form: {"type": "fp8_mixed"}."""

    type: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


Quantization = Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | QuantizationConfig


class _Settings(msgspec.Struct, kw_only=True):
    """The settings that may appear at the top level or inside `metadata`."""

    llama_model: ModelName | None = None
    checkpoint_dir: PathText | None = None
    skip_initialize: bool | None = None
    skip_load: bool | None = None  # the spelling later Llama Stack code used
    model_parallel_size: ParallelSize | None = None
    max_seq_len: SeqLen | None = None
    quantization: Quantization | None = None
    keep_alive: str | int | float | None = None  # seconds, "5m", "never": how long it stays loaded while idle
    speculative_config: dict[str, Any] | str | None = None  # vLLM's spelling (engine/spec/config.py)


class RegisterModelRequest(_Settings, kw_only=True, forbid_unknown_fields=True):
    model_id: ModelName | None = None
    model: ModelName | None = None  # OpenAI's name for the same thing
    # llama-stack-client's CLI sends the --metadata JSON as a string, and null without the flag
    metadata: dict[str, Any] | str | None = {}
    provider_model_id: ModelName | None = None  # Llama Stack: the base descriptor when it differs
    provider_id: str | None = None  # Llama Stack: accepted, there is one provider here
    model_type: str | None = None  # Llama Stack: only "llm" is served


class MetadataSettings(_Settings, kw_only=True):
    """`metadata` read for the settings it carries; other keys are kept as they are."""


_REQUEST_DECODER = msgspec.json.Decoder(RegisterModelRequest)


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: ModelName
    lora_path: PathText  # under a checkpoint root, absolute or relative to one
    base_model_name: ModelName | None = None  # None: the one registered model
    load_inplace: bool = False  # replace an adapter of that name (else a 400, as vLLM answers)


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /v1/unload_lora_adapter body."""

    lora_name: ModelName
    lora_int_id: int | None = None  # vLLM accepts it; names are unique here


_LOAD_LORA_DECODER = msgspec.json.Decoder(LoadLoraAdapterRequest)
_UNLOAD_LORA_DECODER = msgspec.json.Decoder(UnloadLoraAdapterRequest)


# Which of these need the admin key is server/auth.py's rule (POST and DELETE under /v1/models).
def add_model_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models, name="models.list")
    app.router.add_post("/v1/models", register_model, name="models.register")
    # Ids may contain '/' (meta-llama/Llama-3.2-3B-Instruct), so the id takes the rest of the path.
    app.router.add_get(r"/v1/models/{model_id:.+}", get_model, name="models.get")
    app.router.add_delete(r"/v1/models/{model_id:.+}", delete_model, name="models.unregister")
    # vLLM's runtime LoRA routes (behind the admin gate too, server/auth.py)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter, name="lora.load")
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter, name="lora.unload")


async def list_models(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return _json({"object": "list", "data": [_with_progress(model_object(info), registry) for info in registry.list()]})


async def get_model(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return _json(_with_progress(model_object(registry.get(request.match_info["model_id"])), registry))


def _with_progress(body: dict[str, Any], registry: ModelRegistry) -> dict[str, Any]:
    """A model being loaded (first load or hot-switch) shows its loading stage, sizes and rate."""
    progress = registry.load_progress(body["id"])
    if progress is not None:
        body["loading_progress"] = progress
    return body


def refuse_under_torchrun(action: str) -> None:
    """Under torchrun every rank loaded its shard of the configured model at launch and follows only
    that model's steps: another model, a hot switch or an unload would leave the other ranks behind
    (or stopped), so the model set is fixed for the job's life."""
    if launched_by_torchrun():
        raise ApiError(400, f"{action} is not supported under torchrun: the ranks serve the model they were "
                       "launched with; restart the torchrun job with another --model instead",
                       code="unsupported_under_torchrun")


async def delete_model(request: web.Request) -> web.Response:
    refuse_under_torchrun("unloading a model")
    model_id = request.match_info["model_id"]
    await request.app[REGISTRY_KEY].unregister(model_id)
    return _json({"id": model_id, "object": "model", "deleted": True})


async def register_model(request: web.Request) -> web.Response:
    refuse_under_torchrun("registering or hot-switching a model")
    registry = request.app[REGISTRY_KEY]
    body = _decode(_REQUEST_DECODER.decode, await request.read(), prefix="")
    if not isinstance(body.metadata, dict):
        body.metadata = _metadata_object(body.metadata or "")
    if body.metadata.get("base_model") is not None:  # a LoRA adapter over a registered model
        return _json(model_object(await _register_adapter(body, registry)))
    spec, load = _spec_from_request(body, registry)
    config = request.app.get(CONFIG_KEY)
    check_registration_bounds(spec, config.engine.device if config is not None else "cpu")
    info = await registry.register(spec, load=load)
    return _json(model_object(info))


async def _register_adapter(body: RegisterModelRequest, registry: ModelRegistry) -> ModelInfo:
    """{"model_id", "checkpoint_dir": <adapter folder>, "metadata": {"base_model", "skip_initialize"?}}."""
    meta = _decode(lambda m: msgspec.convert(m, MetadataSettings), body.metadata, prefix="metadata")
    base_model = body.metadata["base_model"]
    if not isinstance(base_model, str) or not base_model:
        raise ApiError(400, "metadata.base_model must be a registered model id", param="metadata.base_model",
                       code="invalid_value")
    model_id = _one("model_id", body.model_id, "model", body.model)
    checkpoint_dir = _one("checkpoint_dir", body.checkpoint_dir, "metadata.checkpoint_dir", meta.checkpoint_dir)
    if model_id is None or checkpoint_dir is None:
        missing = "model_id" if model_id is None else "checkpoint_dir"
        raise ApiError(400, f"{missing} is required to register an adapter", param=missing, code="invalid_value")
    skip = any(flag for flag in (body.skip_initialize, body.skip_load, meta.skip_initialize, meta.skip_load))
    return await registry.register_adapter(model_id, checkpoint_dir, base_model, metadata=dict(body.metadata),
                                           load=not skip)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's route: load an adapter now (errors as vLLM gives them: 400 for a name in use or a bad
    adapter); it is then served as the model `lora_name` and listed with its parent."""
    refuse_under_torchrun("loading a LoRA adapter")
    registry = request.app[REGISTRY_KEY]
    body = _decode(_LOAD_LORA_DECODER.decode, await request.read(), prefix="")
    if registry.adapters.has(body.lora_name) and not body.load_inplace:
        raise ApiError(400, f"The lora adapter {body.lora_name!r} has already been loaded.", param="lora_name",
                       code="invalid_value")
    new = not registry.adapters.has(body.lora_name)
    try:
        await registry.register_adapter(body.lora_name, body.lora_path, body.base_model_name, metadata={}, load=True,
                                        param="lora_path")
    except ApiError:
        if new:
            registry.adapters.forget_failed(body.lora_name)  # as vLLM: an adapter that did not load is not kept
        raise
    return web.Response(text=f"Success: LoRA adapter {body.lora_name!r} added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    refuse_under_torchrun("unloading a LoRA adapter")
    registry = request.app[REGISTRY_KEY]
    body = _decode(_UNLOAD_LORA_DECODER.decode, await request.read(), prefix="")
    if not registry.adapters.has(body.lora_name):
        raise ApiError(404, f"The lora adapter {body.lora_name!r} cannot be found.", param="lora_name",
                       code="model_not_found")
    await registry.unregister(body.lora_name)
    return web.Response(text=f"Success: LoRA adapter {body.lora_name!r} removed successfully.")


def model_object(info: ModelInfo) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": info.owned_by,
        "status": info.status,
        "llama_model": info.llama_model,
        "max_seq_len": info.max_seq_len,
        "checkpoint_dir": info.checkpoint_dir,
        "metadata": info.metadata,
        "load_time_s": info.load_time_s,
        "memory_bytes": info.memory_bytes,
        "sampling_defaults": info.sampling_defaults,
        "weights": info.weights,
        "keep_alive_s": info.keep_alive_s,
        "speculative_config": info.speculative_config,
        "identifier": info.id,
        "provider_id": info.owned_by,
        "provider_resource_id": info.llama_model or info.id,
        "type": "model",
        "model_type": "llm",
        # vLLM's names: what was loaded (`root`), the base of an adapter (`parent`), the context length
        "root": info.checkpoint_dir,
        "parent": info.parent,
        "max_model_len": info.max_seq_len,
        "input_modalities": info.input_modalities,  # null until loaded
    }
    if info.error is not None:
        body["error"] = info.error
    return body


def _spec_from_request(body: RegisterModelRequest, registry: ModelRegistry) -> tuple[ModelSpec, bool]:
    if not isinstance(body.metadata, dict):
        body.metadata = _metadata_object(body.metadata or "")
    meta = _decode(lambda m: msgspec.convert(m, MetadataSettings), body.metadata, prefix="metadata")
    if body.model_type is not None and body.model_type != "llm":
        raise ApiError(400, f"model_type {body.model_type!r} is not served here; only 'llm'", param="model_type",
                       code="invalid_value")
    model_id = _one("model_id", body.model_id, "model", body.model)
    if model_id is None:
        raise ApiError(400, "model_id is required", param="model_id", code="invalid_value")
    provider_model = body.provider_model_id if body.provider_model_id != model_id else None
    llama_model = _one("llama_model", body.llama_model, "metadata.llama_model", meta.llama_model)
    llama_model = _one("llama_model", llama_model, "provider_model_id", provider_model)
    checkpoint_dir = _one("checkpoint_dir", body.checkpoint_dir, "metadata.checkpoint_dir", meta.checkpoint_dir)
    quantization = _one(
        "quantization", _quantization(body.quantization), "metadata.quantization", _quantization(meta.quantization)
    )
    skip = any(flag for flag in (body.skip_initialize, body.skip_load, meta.skip_initialize, meta.skip_load))
    path = registry.locate_checkpoint(model_id, checkpoint_dir=checkpoint_dir, llama_model=llama_model)
    spec = ModelSpec(
        model_id=model_id,
        checkpoint_dir=path,
        llama_model=llama_model,
        metadata=dict(body.metadata),
        model_parallel_size=_one(
            "model_parallel_size", body.model_parallel_size, "metadata.model_parallel_size", meta.model_parallel_size
        ),
        max_seq_len=_one("max_seq_len", body.max_seq_len, "metadata.max_seq_len", meta.max_seq_len),
        quantization=quantization,
        trusted=False,
        keep_alive_s=_keep_alive(_one("keep_alive", body.keep_alive, "metadata.keep_alive", meta.keep_alive),
                                 "metadata.keep_alive" if meta.keep_alive is not None else "keep_alive"),
        speculative_config=_speculative(body, meta, model_id, registry),
    )
    return spec, not skip


def _speculative(body: RegisterModelRequest, meta: MetadataSettings, model_id: str,
                 registry: ModelRegistry) -> SpeculativeConfig | None:
    """The model's speculative_config (top level or in metadata), checked: a draft model must be registered
    already (its tokenizer is compared when the target loads)."""
    where = "metadata.speculative_config" if meta.speculative_config is not None else "speculative_config"
    value = _one("speculative_config", body.speculative_config, "metadata.speculative_config", meta.speculative_config)
    try:
        config = parse_speculative_config(value, where=where)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=exc.param, code="invalid_value") from None
    if config is not None and config.method == "draft_model" and config.model != model_id and not registry.has_model(config.model or ""):
        raise ApiError(400, f"{where}.model {config.model!r} is not a registered model; register the draft first",
                       param=f"{where}.model", code="model_not_found")
    return config


def _keep_alive(value: str | int | float | None, param: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=param, code="invalid_value") from None


def _metadata_object(text: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(text) if text.strip() else {}
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"metadata is a string but not JSON: {exc}", param="metadata", code="invalid_value") from exc
    if not isinstance(value, dict):
        raise ApiError(400, "metadata must be a JSON object", param="metadata", code="invalid_value")
    return value


def _quantization(value: str | QuantizationConfig | None) -> str | None:
    return value.type if isinstance(value, QuantizationConfig) else value


def _one(name: str, value: _T | None, other_name: str, other: _T | None) -> _T | None:
    """One setting given in two places: they must agree."""
    if value is not None and other is not None and value != other:
        raise ApiError(400, f"{other_name} ({other!r}) contradicts {name} ({value!r})", param=other_name,
                       code="invalid_value")
    return value if value is not None else other


def _decode(decode: Any, data: Any, *, prefix: str) -> Any:
    """Decode with msgspec; a ValidationError becomes a 400 whose param is the field's path
    (under `prefix` for the metadata object, which is converted on its own)."""
    try:
        decoded = decode(data)
    except RecursionError:
        raise ApiError(400, limits.too_deep().args[0], code="invalid_json") from None
    except msgspec.ValidationError as exc:
        message, path = validation_param(str(exc))
        param = ".".join(p for p in (prefix, path) if p) or None
        if prefix and path:
            message = message.replace(path, param)  # compat names the field without our prefix
        raise ApiError(400, message, param=param, code="invalid_value") from exc
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    try:
        limits.check_nesting(decoded)
    except InvalidRequest as exc:
        raise ApiError(400, str(exc), param=prefix or None, code="invalid_json") from None
    return decoded


def _json(body: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
