"""ServerConfig: the one place settings are merged, flags > env > run.yaml > defaults.

Every option is declared once in OPTIONS (its name, type, run.yaml section and help); the CLI
flags, `LLAMASERVE_<NAME>` environment variables and run.yaml keys are all derived from it.
The meta-reference environment variables (INFERENCE_MODEL, MODEL_PARALLEL_SIZE, ...) are read at the
env level, below their LLAMASERVE_ spellings.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Sequence

import msgspec
import yaml

from engine.config import EngineConfig
from engine.spec.config import SpeculativeConfig, parse_speculative_config
from engine.types import InvalidRequest
from server.errors import ApiError
from server.model_spec import ModelSpec, parse_keep_alive
from server.paths import find_checkpoint_dir

ENV_PREFIX = "LLAMASERVE_"
DEFAULT_CHECKPOINT_ROOT = "~/.llama/checkpoints"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names where it came from."""


@dataclass(frozen=True, slots=True)
class LoraModule:
    """A LoRA adapter named by the operator: served as model `name` over `base_model` (None: the one
    model the server serves)."""

    name: str
    path: Path
    base_model: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # another address without an api key logs a warning (server/safety.py)
    port: int = 8000
    api_key: str | None = None
    admin_api_key: str | None = None
    allow_remote_admin: bool = False  # with no key, registry routes still accept non-loopback clients
    api_keys_file: Path | None = None  # NAME KEY lines; build_config reads it into named_api_keys
    named_api_keys: tuple[tuple[str, str], ...] = ()  # (owner name, key): server/auth.py
    models: list[ModelSpec] = field(default_factory=list)
    checkpoint_roots: list[Path] = field(default_factory=lambda: [Path(DEFAULT_CHECKPOINT_ROOT).expanduser()])
    memory_budget_bytes: int | None = None  # None: no limit beyond what the engines report
    evict_idle_lru: bool = False
    load_wait_timeout_s: float = 30.0  # a request for a loading model waits this long, then 503
    # seconds an idle model (no request in flight) stays loaded before it is unloaded to `registered`
    # (math.inf: never, today's default); a model's own metadata.keep_alive wins
    keep_alive: float = math.inf
    max_batch_request_items: int = 256  # prompts in one /v1/batch/* call
    max_body_bytes: int = 32 << 20
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish
    stream_write_timeout_s: float = 30.0  # a streaming client that takes no data this long is dropped
    max_stream_duration_s: float = 3600.0  # a stream ends with an error event after this long
    # Browsers and connections (server/browser_guard.py, server/connections.py)
    allowed_hosts: tuple[str, ...] = ()  # Host names a keyless server answers besides IP addresses, localhost and --host
    body_read_timeout_s: float = 60.0  # a request body that sends nothing for this long is dropped (408)
    keepalive_timeout_s: float = 75.0  # an idle connection, or one that never sends a request, is closed after this
    max_connections: int = 1024  # open connections; one more is answered 503 and closed
    log_format: Literal["json", "console"] = "json"
    log_level: str = "info"
    chat_template: Path | None = None  # a Jinja chat template overriding the checkpoint's
    demo: bool = False
    demo_cache_dir: Path | None = None
    demo_weights: str = "float32"  # engine.loading.demo.DEMO_WEIGHTS: float32 (dequantized) or native (as shipped)
    batch_dir: Path | None = None  # Batch API storage; None: a temporary dir (the CLI sets a durable one)
    batch_max_file_bytes: int = 200 * 10**6  # OpenAI's limit for a batch input file
    batch_max_requests: int = 50_000  # lines of one batch input file, as OpenAI
    batch_max_in_flight: int = 0  # batch sequences (n x prompts) in the engine at once; 0: twice max_batch_size (BatchService)
    batch_retention_s: int = 30 * 24 * 3600  # files (unless asked for less) and finished batches; 0: until deleted
    batch_quota_files: int = 10_000  # files one API key may keep (uploads and outputs); 0: no limit
    batch_quota_bytes: int = 10 * 10**9  # bytes of files one API key may keep; 0: no limit
    batch_quota_batches: int = 1_000  # batches one API key may keep (finished ones until purged); 0: no limit
    # LoRA adapters registered at start (--lora-modules, run.yaml models with metadata.base_model),
    # each loaded on its base by its first request (server/adapters.py)
    lora_modules: tuple[LoraModule, ...] = ()
    # Stored Responses (server/response_store.py, beside the batch store), per API key; 0: no bound
    responses_max_stored: int = 10_000
    responses_max_bytes: int = 10**9
    responses_retention_s: int = 30 * 24 * 3600
    # Images in requests (server/media.py): decoding bounds, and which hosts an http(s) image URL may name
    max_image_bytes: int = 20 << 20  # one image, as sent (after base64 decoding, or as fetched)
    max_image_pixels: int = 4096 * 4096  # one image's width x height, read from its header before decoding
    max_images_per_request: int = 8  # over a whole conversation (each prompt of a batch call on its own)
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name ('*': any); empty: data: URLs only
    allow_private_media_addresses: bool = False  # let those hosts resolve to loopback, private or link-local addresses
    media_fetch_timeout_s: float = 10.0  # one image fetch, redirects included
    engine: EngineConfig = field(default_factory=EngineConfig)


# --------------------------------------------------------------------------- option table
def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false), got {text!r}")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """'16GiB', '8G', '500MB' or a plain integer -> bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"expected a size like 16GiB or 8000000000, got {text!r}")
    unit = (match.group(2) or "").lower().rstrip("b") if (match.group(2) or "").lower() != "b" else ""
    return int(float(match.group(1)) * _UNITS[unit])


def _paths(text: str) -> list[Path]:
    return [Path(part).expanduser() for part in text.split(":") if part]


def _names(text: str | list[str]) -> tuple[str, ...]:
    """'a.example, b.example' (flag, env) or a YAML list -> ('a.example', 'b.example')."""
    parts = text.split(",") if isinstance(text, str) else text
    return tuple(part.strip() for part in parts if part.strip())


def _lora_modules(text: str | list[str]) -> tuple[LoraModule, ...]:
    """'sql=/adapters/sql, chat=chat-v2' (flag, env; commas or spaces) or a YAML list of 'name=path'
    -> LoRA modules over the one served model (vLLM's --lora-modules name=path)."""
    parts = text.replace(",", " ").split() if isinstance(text, str) else text
    out = []
    for part in parts:
        name, sep, path = part.strip().partition("=")
        if not sep or not name or not path:
            raise ValueError(f"LoRA module {part!r} is not name=path")
        out.append(LoraModule(name, Path(path).expanduser()))
    return tuple(out)


def parse_speculative(value: str | Mapping[str, Any], where: str = "speculative_config") -> SpeculativeConfig | None:
    """vLLM's --speculative-config JSON (flag, env) or a run.yaml mapping -> SpeculativeConfig;
    ValueError naming the field."""
    try:
        return parse_speculative_config(value, where=where)
    except InvalidRequest as exc:
        raise ValueError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # ServerConfig / EngineConfig field; flag --name-with-dashes; env LLAMASERVE_NAME
    parse: Callable[[str], Any]  # text (env, flag) -> value
    section: Literal["server", "engine", "auth"]
    help: str
    meta_env: str | None = None  # the meta-reference spelling, read below LLAMASERVE_<NAME>
    short: str | None = None


OPTIONS: tuple[Option, ...] = (
    Option("host", str, "server", "interface to listen on"),
    Option("port", int, "server", "port to listen on"),
    Option("api_key", str, "auth", "require 'Authorization: Bearer KEY' on every route but /health"),
    Option("admin_api_key", str, "auth", "key for POST/DELETE /v1/models (default: the api key)"),
    Option("allow_remote_admin", _bool, "auth", "without an admin key, let non-loopback clients register, "
           "switch and delete models (default: loopback only)"),
    Option("api_keys_file", Path, "auth", "file of inference keys, one 'NAME KEY' per line ('#' comments): each "
           "name owns its Batch API files and batches, unseen by other keys; keys sharing a name share them"),
    Option("checkpoint_roots", _paths, "server", "where checkpoints live (colon-separated in env/yaml string; "
           "the flag --checkpoint-root repeats)"),
    Option("memory_budget_bytes", parse_bytes, "server", "bytes all loaded models may use, e.g. 64GiB"),
    Option("evict_idle_lru", _bool, "server", "unload the least recently used idle model to make room"),
    Option("load_wait_timeout_s", float, "server", "how long a request waits for a loading model before 503"),
    Option("keep_alive", parse_keep_alive, "server", "how long an idle model stays loaded: seconds, a duration "
           "(5m, 1h) or never (the default); the next request reloads it. A model's metadata.keep_alive wins"),
    Option("max_batch_request_items", int, "server", "most prompts in one /v1/batch/* request"),
    Option("max_body_bytes", parse_bytes, "server", "largest request body (413 beyond)"),
    Option("drain_timeout_s", float, "server", "on SIGTERM, how long in-flight requests may finish"),
    Option("stream_write_timeout_s", float, "server", "drop a streaming client that takes no data for this long"),
    Option("max_stream_duration_s", float, "server", "end any stream (with an error event) after this long"),
    Option("allowed_hosts", _names, "server", "without an API key, the Host names answered besides IP addresses, "
           "localhost and --host, comma-separated (others get 400: DNS rebinding); '*' answers any"),
    Option("body_read_timeout_s", float, "server", "drop a client whose request body sends nothing for this long (408)"),
    Option("keepalive_timeout_s", float, "server", "close a connection idle this long, or one that never sends a "
           "request"),
    Option("max_connections", int, "server", "most open connections; one more is answered 503 and closed"),
    Option("log_format", str, "server", "json or console"),
    Option("log_level", str, "server", "debug, info, warning, error"),
    Option("chat_template", Path, "server", "Jinja chat template file overriding the checkpoint's"),
    Option("demo", _bool, "server", "serve a small demo model (downloaded or built once)"),
    Option("demo_cache_dir", Path, "server", "where the demo checkpoint is cached"),
    Option("demo_weights", str, "server", "demo weights: float32 (its GGUF dequantized) or native (its Q4_1 / Q8_0 "
           "blocks served as shipped, docs/quantization.md)"),
    Option("batch_dir", Path, "server", "Batch API files and state (SQLite); batches resume from it after a "
           "restart (default: <cache dir>/batches)"),
    Option("batch_max_file_bytes", parse_bytes, "server", "largest batch input file, e.g. 200MB"),
    Option("batch_max_requests", int, "server", "most requests (lines) in one batch input file"),
    Option("batch_max_in_flight", int, "server", "most batch sequences (n x prompts of each item) in the engine at "
           "once; online requests preempt them either way (0: enough to fill the engine)"),
    Option("batch_retention_s", int, "server", "seconds Batch API files (unless their upload asks for less) and "
           "finished batches are kept, then purged (default 30 days; 0: until deleted)"),
    Option("batch_quota_files", int, "server", "files one API key may keep, uploads and batch outputs (0: no limit)"),
    Option("batch_quota_bytes", parse_bytes, "server", "bytes of files one API key may keep, e.g. 10GB (0: no limit)"),
    Option("batch_quota_batches", int, "server", "batches one API key may keep, finished ones until they are "
           "purged (0: no limit)"),
    Option("responses_max_stored", int, "server", "stored Responses (store: true) one API key keeps; past it "
           "its oldest are deleted (0: no limit)"),
    Option("responses_max_bytes", parse_bytes, "server", "bytes of stored Responses one API key keeps, e.g. 1GB; "
           "past it its oldest are deleted (0: no limit)"),
    Option("responses_retention_s", int, "server", "seconds a stored Response is kept (default 30 days; 0: until "
           "deleted)"),
    Option("max_image_bytes", parse_bytes, "server", "largest image in a request, as sent or fetched (400 beyond)"),
    Option("max_image_pixels", int, "server", "most pixels (width x height) of an image in a request (400 beyond)"),
    Option("max_images_per_request", int, "server", "most images in one conversation (400 beyond)"),
    Option("allowed_media_domains", _names, "server", "hosts an http(s) image URL may name, comma-separated ('*': "
           "any); the server fetches them (bounded by max_image_bytes, media_fetch_timeout_s, 3 redirects). Empty "
           "(the default): images come as data: URLs only"),
    Option("allow_private_media_addresses", _bool, "server", "let allowed media hosts resolve to loopback, private "
           "or link-local addresses (default: refused)"),
    Option("media_fetch_timeout_s", float, "server", "longest fetch of one image URL, redirects included"),
    Option("device", str, "engine", "cpu or cuda"),
    Option("dtype", str, "engine", "float32, bfloat16, float16 or float64"),
    Option("model_parallel_size", int, "engine", "model-parallel ranks per model (0: one per checkpoint shard, "
           "as Llama Stack means it)", meta_env="MODEL_PARALLEL_SIZE"),
    Option("max_batch_size", int, "engine", "sequences per engine step", meta_env="MAX_BATCH_SIZE"),
    Option("max_seq_len", int, "engine", "cap on the context length", meta_env="MAX_SEQ_LEN"),
    Option("max_num_batched_tokens", int, "engine", "token budget of one engine step"),
    Option("max_prefill_chunk_tokens", int, "engine", "tokens a prompt chunk may take past max_num_batched_tokens "
           "when nothing else runs in its step (a lone long prompt in fewer steps; 0: never past the budget)"),
    Option("block_size_tokens", int, "engine", "KV cache block size"),
    Option("kv_cache_bytes", parse_bytes, "engine", "KV cache size (default: derived)"),
    Option("kv_cache_memory_fraction", float, "engine", "CUDA: fraction of free memory for the KV cache"),
    Option("cpu_kv_cache_bytes", parse_bytes, "engine", "CPU: KV cache size"),
    # Admission by sequences (n x prompts of each request) and by priority (engine/config.py).
    Option("max_waiting_requests", int, "engine", "online sequences (n x prompts of each request) waiting beyond "
           "which the server answers 429"),
    Option("max_waiting_batch_sequences", int, "engine", "Batch API sequences waiting beyond which batch items wait "
           "and retry; a bound of their own, so a batch never takes online requests' room"),
    Option("max_sequences_per_request", int, "engine", "most sequences (n x prompts) one request may ask for, "
           "and never more than either waiting bound; more is a 400 naming n or prompt"),
    Option("enable_prefix_caching", _bool, "engine", "reuse KV blocks of shared prompt prefixes"),
    Option("quantization", str, "engine", "quantization type, e.g. fp8_mixed (bf16: none, bfloat16 weights, as "
           "Llama Stack means it)", meta_env="QUANTIZATION_TYPE"),
    Option("max_loras", int, "engine", "LoRA adapters running at once (others wait their turn); 0 serves none"),
    Option("max_lora_rank", int, "engine", "the largest rank a LoRA adapter may have"),
    Option("lora_modules", _lora_modules, "server", "LoRA adapters to serve over the model, name=path[,name=path] "
           "(each loaded by its first request)"),
    Option("batch_invariant", _bool, "engine", "greedy tokens and logprobs that do not depend on what else is "
           "batched (linears row by row, decode attention split per sequence; slower at many rows)"),
    Option("cpu_kernels", _bool, "engine", "CPU: fused C kernels for norms, RoPE and paged attention (built once "
           "with the system C compiler; off: torch ops only)"),
    Option("debug_log_io", _bool, "engine", "log raw prompts and raw outputs", meta_env="LLAMA_MODELS_DEBUG"),
    Option("speculative_config", parse_speculative, "engine", "speculative decoding for every model, as vLLM "
           "spells it: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
           "\"prompt_lookup_min\": 2}' or '{\"model\": \"<registered id>\", \"num_speculative_tokens\": 4}' "
           "(a model's own speculative_config wins)"),
    Option("seed", int, "engine", "seed for random demo weights and unseeded sampling"),
    Option("mp_step_timeout_s", float, "engine", "model parallel: once loaded, the longest wait in one collective "
           "(a hung worker then fails the model instead of stalling it)"),
)
_BY_NAME = {option.name: option for option in OPTIONS}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


# --------------------------------------------------------------------------- run.yaml
class _Section(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


_YAML_TYPES: dict[Callable[[str], Any], Any] = {
    int: int, float: float, _bool: bool, str: str, Path: str, parse_bytes: int | str, _paths: str | list[str],
    _names: str | list[str], parse_keep_alive: str | int | float, _lora_modules: str | list[str],
    parse_speculative: str | dict[str, Any],
}


def _section_struct(section: str) -> type:
    """A typed Struct per run.yaml section, derived from OPTIONS so the two can't disagree."""
    fields = [(o.name, _YAML_TYPES[o.parse] | msgspec.UnsetType, msgspec.UNSET) for o in OPTIONS if o.section == section]
    return msgspec.defstruct(f"{section.title()}Section", fields, bases=(_Section,), forbid_unknown_fields=True)


ServerSection = _section_struct("server")
EngineSection = _section_struct("engine")
AuthSection = _section_struct("auth")


class ModelMetadata(msgspec.Struct):
    """Known keys of a model's `metadata` (others are kept as given)."""

    llama_model: str | None = None
    skip_initialize: bool | None = None
    skip_load: bool | None = None
    checkpoint_dir: str | None = None
    model_parallel_size: int | None = None
    max_seq_len: int | None = None
    quantization: str | None = None
    keep_alive: str | int | float | None = None
    speculative_config: str | dict[str, Any] | None = None


class ModelEntry(msgspec.Struct, forbid_unknown_fields=True):
    model_id: str
    checkpoint_dir: str | None = None
    llama_model: str | None = None
    model_parallel_size: int | None = None
    max_seq_len: int | None = None
    quantization: str | None = None
    keep_alive: str | int | float | None = None  # as metadata.keep_alive
    speculative_config: str | dict[str, Any] | None = None  # as metadata.speculative_config
    metadata: dict[str, Any] = {}


class RunYaml(msgspec.Struct, forbid_unknown_fields=True):
    version: int | str | None = None
    server: ServerSection = msgspec.field(default_factory=ServerSection)  # type: ignore[valid-type]
    engine: EngineSection = msgspec.field(default_factory=EngineSection)  # type: ignore[valid-type]
    auth: AuthSection = msgspec.field(default_factory=AuthSection)  # type: ignore[valid-type]
    models: list[ModelEntry] = []


def load_run_yaml(path: Path) -> RunYaml:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return msgspec.convert(raw or {}, RunYaml)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {_yaml_message(str(exc))}") from None


def _yaml_message(message: str) -> str:
    """msgspec's "... - at `$.server`" -> name the bad key the way a run.yaml reader sees it."""
    match = re.match(r"Object contains unknown field `(?P<key>[^`]+)`(?: - at `\$\.?(?P<path>[^`]*)`)?", message)
    if match:
        where = f"{match.group('path')}." if match.group("path") else ""
        return f"unknown key '{where}{match.group('key')}'"
    return message.replace("`$.", "`").replace("`$`", "the top level")


# --------------------------------------------------------------------------- merge
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every option, defaulting to None so that only flags given on the line override."""
    for option in OPTIONS:
        flag = "--" + option.name.replace("_", "-")
        if option.name == "checkpoint_roots":
            parser.add_argument("--checkpoint-root", dest="checkpoint_roots", action="append", default=None,
                                type=lambda t: Path(t).expanduser(), help=option.help)
            continue
        if option.parse is _bool:
            parser.add_argument(flag, dest=option.name, action=argparse.BooleanOptionalAction, default=None, help=option.help)
        else:
            parser.add_argument(flag, dest=option.name, default=None, help=option.help, metavar=option.name.upper())
    parser.add_argument("--config", type=Path, default=None, help="run.yaml with server, engine, auth and models sections")
    parser.add_argument("--model", default=None, help="model id to serve (also a llama-models descriptor)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="checkpoint dir of --model")
    parser.add_argument("--llama-model", default=None, help="descriptor of --model's base architecture")


def build_config(args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Merge flags > env > run.yaml > defaults into one ServerConfig."""
    env = os.environ if env is None else env
    flags = vars(args) if args is not None else {}
    config_path = flags.get("config") or (Path(env[ENV_PREFIX + "CONFIG"]) if env.get(ENV_PREFIX + "CONFIG") else None)
    run_yaml = load_run_yaml(Path(config_path)) if config_path else RunYaml()

    values: dict[str, Any] = {}
    for section in ("server", "engine", "auth"):
        for name, value in msgspec.structs.asdict(getattr(run_yaml, section)).items():
            if value is not msgspec.UNSET:
                values[name] = _from_yaml(name, value, f"{config_path}: {section}.{name}")
    for option in OPTIONS:
        for var in filter(None, (option.meta_env, ENV_PREFIX + option.name.upper())):  # LLAMASERVE_ wins
            if env.get(var) is not None:
                values[option.name] = _parse(option, env[var], var)
    for option in OPTIONS:
        if flags.get(option.name) is not None:
            value = flags[option.name]
            values[option.name] = value if not isinstance(value, str) else _parse(option, value, "--" + option.name.replace("_", "-"))

    adapters = [entry for entry in run_yaml.models if entry.metadata.get("base_model")]  # LoRA adapters
    run_yaml.models = [entry for entry in run_yaml.models if not entry.metadata.get("base_model")]
    values["lora_modules"] = tuple(values.get("lora_modules", ())) + tuple(
        _lora_module_from_entry(entry, f"{config_path}: models[{entry.model_id}]") for entry in adapters
    )
    models = _models(run_yaml, Path(config_path) if config_path else None, env, flags, values)
    return _assemble(values, models)


def _lora_module_from_entry(entry: ModelEntry, source: str) -> LoraModule:
    directory = entry.checkpoint_dir or entry.metadata.get("checkpoint_dir")
    if not directory:
        raise ConfigError(f"{source}: a LoRA adapter (metadata.base_model) needs checkpoint_dir, its folder")
    return LoraModule(entry.model_id, Path(directory).expanduser(), str(entry.metadata["base_model"]),
                      dict(entry.metadata))


def _parse(option: Option, text: str, source: str) -> Any:
    try:
        return option.parse(text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _from_yaml(name: str, value: Any, source: str) -> Any:
    """Values the typed section Structs already checked; only paths and sizes still need parsing."""
    option = _BY_NAME[name]
    if option.parse is _names:
        return _names(value)
    if option.parse in (_lora_modules, parse_speculative):
        return _parse(option, value, source)
    if isinstance(value, list):
        return [Path(v).expanduser() for v in value]
    if option.parse in (Path, _paths, parse_bytes, parse_keep_alive):
        return _parse(option, value, source)
    return value


def _models(run_yaml: RunYaml, config_path: Path | None, env: Mapping[str, str], flags: dict, values: dict) -> list[ModelSpec]:
    roots = values.get("checkpoint_roots") or ServerConfig().checkpoint_roots
    by_id: dict[str, ModelSpec] = {}
    for i, entry in enumerate(run_yaml.models):
        spec = _spec_from_entry(entry, roots, f"{config_path}: models[{i}]")
        by_id[spec.model_id] = spec
    env_model = env.get(ENV_PREFIX + "MODEL") or env.get("INFERENCE_MODEL")
    env_dir = env.get(ENV_PREFIX + "CHECKPOINT_DIR") or env.get("INFERENCE_CHECKPOINT_DIR")
    if env_model or env_dir:
        entry = ModelEntry(model_id=env_model or Path(env_dir).name.removesuffix(".gguf"), checkpoint_dir=env_dir,
                           llama_model=env.get(ENV_PREFIX + "LLAMA_MODEL"))
        by_id[entry.model_id] = _spec_from_entry(entry, roots, "INFERENCE_MODEL/INFERENCE_CHECKPOINT_DIR")
    if flags.get("model") or flags.get("checkpoint_dir"):
        directory = flags.get("checkpoint_dir")
        entry = ModelEntry(model_id=flags.get("model") or Path(directory).name.removesuffix(".gguf"),
                           checkpoint_dir=str(directory) if directory else None, llama_model=flags.get("llama_model"))
        by_id[entry.model_id] = _spec_from_entry(entry, roots, "--model/--checkpoint-dir")
    return list(by_id.values())


def _spec_from_entry(entry: ModelEntry, roots: Sequence[Path], source: str) -> ModelSpec:
    try:
        known = msgspec.convert(entry.metadata, ModelMetadata)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: metadata: {_yaml_message(str(exc))}") from None
    llama_model = entry.llama_model or known.llama_model
    directory = entry.checkpoint_dir or known.checkpoint_dir
    if directory:
        checkpoint_dir = Path(directory).expanduser()
    else:
        try:
            checkpoint_dir = find_checkpoint_dir([entry.model_id, llama_model or ""], roots, trusted=True,
                                                 model_id=entry.model_id)
        except ApiError as exc:
            raise ConfigError(f"{source}: {exc.message}") from None
    keep_alive = entry.keep_alive if entry.keep_alive is not None else known.keep_alive
    try:
        keep_alive_s = None if keep_alive is None else parse_keep_alive(keep_alive)
    except ValueError as exc:
        raise ConfigError(f"{source}: keep_alive: {exc}") from None
    speculative = entry.speculative_config if entry.speculative_config is not None else known.speculative_config
    try:
        speculative_config = None if speculative is None else parse_speculative(speculative)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return ModelSpec(
        model_id=entry.model_id,
        checkpoint_dir=checkpoint_dir,
        llama_model=llama_model,
        metadata=dict(entry.metadata),
        model_parallel_size=entry.model_parallel_size or known.model_parallel_size,
        max_seq_len=entry.max_seq_len or known.max_seq_len,
        quantization=entry.quantization or known.quantization,
        trusted=True,  # named by the operator, not by an API caller
        keep_alive_s=keep_alive_s,
        speculative_config=speculative_config,
    )


def should_load(spec: ModelSpec) -> bool:
    """Config models load at start unless their metadata says skip_initialize (or skip_load)."""
    return not (spec.metadata.get("skip_initialize") or spec.metadata.get("skip_load"))


def _assemble(values: dict[str, Any], models: list[ModelSpec]) -> ServerConfig:
    engine_values = {k: v for k, v in values.items() if k in _ENGINE_FIELDS}
    server_values = {k: v for k, v in values.items() if k not in _ENGINE_FIELDS}
    try:
        engine = EngineConfig(**engine_values)
        config = ServerConfig(models=models, engine=engine, **server_values)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    _validate(config)
    if config.api_keys_file is not None:
        config = dataclasses.replace(config, named_api_keys=read_api_keys(config.api_keys_file, config))
    return config


_KEY_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def read_api_keys(path: Path, config: ServerConfig) -> tuple[tuple[str, str], ...]:
    """(name, key) per 'NAME KEY' line of `path`; errors name the line, never a key."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the API keys file: {getattr(exc, 'strerror', None) or exc}") from None
    seen = {config.api_key: "--api-key", config.admin_api_key: "--admin-api-key"}
    keys = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ConfigError(f"{path}: line {line_no}: expected 'NAME KEY'")
        name, key = fields
        if not _KEY_NAME.match(name):
            raise ConfigError(f"{path}: line {line_no}: the name must be 1-64 letters, digits, '.', '_' or '-'")
        if key in seen:
            raise ConfigError(f"{path}: line {line_no}: the same key as {seen[key]}; every key must differ")
        seen[key] = f"line {line_no}"
        keys.append((name, key))
    if not keys:
        raise ConfigError(f"{path}: no keys (a server meant to need keys would accept none)")
    return tuple(keys)


def _validate(config: ServerConfig) -> None:
    checks = [
        (config.log_format in ("json", "console"), "log_format must be json or console"),
        (config.engine.device in ("cpu", "cuda"), "device must be cpu or cuda"),
        (config.engine.dtype in (None, "float32", "bfloat16", "float16", "float64"),
         "dtype must be float32, bfloat16, float16 or float64"),
        (0 < config.port < 65536, "port must be in 1..65535"),
        (config.max_batch_request_items >= 1, "max_batch_request_items must be >= 1"),
        (config.max_body_bytes >= 1024, "max_body_bytes must be >= 1024"),
        (config.drain_timeout_s >= 0, "drain_timeout_s must be >= 0"),
        (config.batch_max_requests >= 1 and config.batch_max_file_bytes >= 1,
         "batch_max_requests and batch_max_file_bytes must be >= 1"),
        (config.batch_max_in_flight >= 0, "batch_max_in_flight must be >= 0"),
        (config.batch_retention_s >= 0, "batch_retention_s must be >= 0 (0: keep until deleted)"),
        (min(config.batch_quota_files, config.batch_quota_bytes, config.batch_quota_batches) >= 0,
         "batch_quota_files, batch_quota_bytes and batch_quota_batches must be >= 0 (0: no limit)"),
        (min(config.responses_max_stored, config.responses_max_bytes, config.responses_retention_s) >= 0,
         "responses_max_stored, responses_max_bytes and responses_retention_s must be >= 0 (0: no limit)"),
        (config.stream_write_timeout_s > 0, "stream_write_timeout_s must be > 0"),
        (config.max_stream_duration_s > 0, "max_stream_duration_s must be > 0"),
        (config.body_read_timeout_s > 0 and config.keepalive_timeout_s > 0,
         "body_read_timeout_s and keepalive_timeout_s must be > 0"),
        (config.max_connections >= 1, "max_connections must be >= 1"),
        (min(config.max_image_bytes, config.max_image_pixels, config.max_images_per_request) >= 1
         and config.media_fetch_timeout_s > 0,
         "max_image_bytes, max_image_pixels, max_images_per_request and media_fetch_timeout_s must be > 0"),
        (config.engine.model_parallel_size >= 0, "model_parallel_size must be >= 0 (0: one rank per checkpoint shard)"),
        (config.engine.max_batch_size >= 1, "max_batch_size must be >= 1"),
        (config.engine.max_loras >= 0 and config.engine.max_lora_rank >= 1,
         "max_loras must be >= 0 and max_lora_rank >= 1"),
        (min(config.engine.max_waiting_requests, config.engine.max_waiting_batch_sequences,
             config.engine.max_sequences_per_request) >= 1,
         "max_waiting_requests, max_waiting_batch_sequences and max_sequences_per_request must be >= 1"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
