#!/usr/bin/env python3
"""Load time and resident memory of one model written in each checkpoint layout (issue 30).

    python bench/load_formats.py                      # the 1.1B 'big1b' config, bfloat16 files
    python bench/load_formats.py --size tiny          # a smoke run (bench/common.py's 'tiny')
    python bench/load_formats.py --workdir /data/fmt  # keep the written checkpoints (reused when present)

One random model (bench/common.py CONFIGS, bfloat16 weights) is written as Meta ships it
(params.json + consolidated.00.pth), as a Hugging Face folder (config.json + model.safetensors, q/k
permuted as transformers' converter does) and as a GGUF file (BF16 matrices, F32 norms: llama.cpp's
own BF16 layout). Each layout is then loaded in a fresh process through engine.loader.load_engine
(what the registry calls: resolve, read, reshard, prepare for the CPU backend) in bfloat16, and one
16-token prompt is run to its first token (a mapped load pages its weights in there); the script
prints both times and the process's resident-memory high-water mark (VmHWM) above what
importing torch and the engine cost, next to the weights' size. MiB/s is the weights' bytes over
load plus first token. The GGUF file is converted by
`llamaserve import-gguf` first (timed and measured on its own row), then the converted dir loads as
the Meta layout does.

Reading it: a layout that maps its file (torch.load(mmap=True), safetensors through
engine/quant/shard_file.py) and needs no dtype change should stay near 1x the weights' bytes; 2x
means a second copy was made somewhere. Load rate is the weights' bytes over the load time (the
roofline here is the page cache or the disk, which this script does not measure: compare layouts
with each other on one machine, warm cache, quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import CONFIGS, Results, add_results_arguments  # noqa: E402

LAYOUTS = ("meta", "hf", "gguf")


# --------------------------------------------------------------------------- writing
def _state(config: str, seed: int):
    import torch

    from bench.common import model_args
    from engine.loading.checkpoint import random_state_dict

    args = model_args(config)
    return args, random_state_dict(args, seed=seed, dtype=torch.bfloat16)


def write_layouts(config: str, workdir: Path) -> dict[str, Path]:
    """The three layouts of one model under `workdir` (written once; reused when complete)."""
    paths = {"meta": workdir / "meta", "hf": workdir / "hf", "gguf": workdir / "gguf" / "model.gguf"}
    done = workdir / f"complete-{config}"
    if done.exists():
        return paths
    import torch

    from engine.loading.hf_checkpoint import CONFIG_FILE
    from engine.quant.shard_file import save_shard

    args, state = _state(config, seed=0)
    started_s = time.monotonic()
    paths["meta"].mkdir(parents=True, exist_ok=True)
    torch.save(state, paths["meta"] / "consolidated.00.pth")
    (paths["meta"] / "params.json").write_text(json.dumps(args.to_params()))
    _write_tokenizer(paths["meta"])
    paths["hf"].mkdir(parents=True, exist_ok=True)
    save_shard(paths["hf"] / "model.safetensors", {}, _hf_names(state, args))  # a plain safetensors file
    (paths["hf"] / CONFIG_FILE).write_text(json.dumps(_hf_config(args)))
    _write_tokenizer(paths["hf"])
    paths["gguf"].parent.mkdir(parents=True, exist_ok=True)
    _write_gguf(paths["gguf"], state, args)
    done.write_text("")
    print(f"wrote the {config} model in 3 layouts under {workdir} in {time.monotonic() - started_s:.1f} s", flush=True)
    return paths


def _hf_permute(w, n_heads: int):
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2).contiguous()


def _hf_names(state, args) -> dict:
    out = {"model.embed_tokens.weight": state["tok_embeddings.weight"], "model.norm.weight": state["norm.weight"]}
    if "output.weight" in state:
        out["lm_head.weight"] = state["output.weight"]
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
             "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for key, value in state.items():
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            rest = rest.removesuffix(".weight")
            if rest == "attention.wq":
                value = _hf_permute(value, args.n_heads)
            elif rest == "attention.wk":
                value = _hf_permute(value, args.kv_heads)
            out[f"model.layers.{i}.{names[rest]}.weight"] = value
    return out


def _hf_config(args) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": args.dim, "intermediate_size": args.ffn_hidden_dim,
            "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.kv_heads, "vocab_size": args.vocab_size, "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta, "tie_word_embeddings": args.tie_word_embeddings,
            "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def _byte_tokens() -> list[str]:
    from engine.tokenizers.hf import gpt2_byte_decoder

    by_byte = {b: c for c, b in gpt2_byte_decoder().items()}
    return ["<|endoftext|>"] + [by_byte[b] for b in range(256)]


def _write_tokenizer(folder: Path) -> None:
    """A 257-token byte-level tokenizer.json: the bench measures weights, not the tokenizer."""
    tokens = _byte_tokens()
    spec = {"version": "1.0", "added_tokens": [{"id": 0, "content": tokens[0], "special": True, "single_word": False,
                                                "lstrip": False, "rstrip": False, "normalized": False}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "vocab": {t: i for i, t in enumerate(tokens)}, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": tokens[0], "add_bos_token": False}))


def _write_gguf(path: Path, state, args) -> None:
    import gguf
    import numpy as np
    import torch

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(args.n_layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(args.dim)
    writer.add_feed_forward_length(args.ffn_hidden_dim)
    writer.add_head_count(args.n_heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_rope_freq_base(args.rope_theta)
    writer.add_layer_norm_rms_eps(args.norm_eps)
    writer.add_vocab_size(args.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tokens = _byte_tokens()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    names = {"tok_embeddings.weight": "token_embd.weight", "norm.weight": "output_norm.weight", "output.weight": "output.weight"}
    layer = {"attention.wq": "attn_q", "attention.wk": "attn_k", "attention.wv": "attn_v", "attention.wo": "attn_output",
             "feed_forward.w1": "ffn_gate", "feed_forward.w2": "ffn_down", "feed_forward.w3": "ffn_up",
             "attention_norm": "attn_norm", "ffn_norm": "ffn_norm"}
    for key, value in state.items():  # Meta's q/k row order is ggml's: written as they are
        if key.startswith("layers."):
            _, i, rest = key.split(".", 2)
            name = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        else:
            name = names[key]
        if value.dim() == 2:  # BF16 bits as llama.cpp stores them
            writer.add_tensor(name, value.view(torch.int16).numpy().view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(name, value.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# --------------------------------------------------------------------------- measuring (one process per layout)
def _rss_peak_bytes() -> int:
    """This process's resident high-water mark (VmHWM). Not getrusage's ru_maxrss: Linux carries that
    over from the parent across fork and exec, so a child of the process that wrote the model would
    start at the writer's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # kB
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def child(layout: str, path: Path, dtype: str) -> dict:
    """Runs in a fresh process: the load's time (and the first token's, which pages in whatever a
    mapped load left on disk) and the RSS high-water above the imports' baseline."""
    import asyncio
    from types import SimpleNamespace

    import torch  # noqa: F401  (the baseline includes torch and the engine's modules)

    from engine.config import EngineConfig
    from engine.loader import load_engine
    from engine.types import EngineRequest, SamplingParams

    baseline = _rss_peak_bytes()
    started_s = time.monotonic()
    if layout == "gguf-import":
        from engine.loading.gguf_import import import_gguf

        import_gguf(path, path.parent / "imported", progress=False, dtype=torch.bfloat16)
        return {"seconds": time.monotonic() - started_s, "first_token_seconds": 0.0,
                "rss_peak_bytes": _rss_peak_bytes() - baseline}
    spec = SimpleNamespace(model_id="bench", checkpoint_dir=path, llama_model=None, allowed_roots=(),
                           model_parallel_size=None, max_seq_len=None, quantization=None)
    config = EngineConfig(dtype=dtype, max_seq_len=256, block_size_tokens=16, max_batch_size=1, cpu_kv_cache_bytes=1 << 20)

    async def run() -> dict:
        engine = await asyncio.to_thread(load_engine, spec, config)
        loaded_s = time.monotonic()
        try:
            request = EngineRequest("r", list(range(1, 17)), SamplingParams(temperature=0.0, max_tokens=1))
            async for _ in engine.generate(request):
                pass
            return {"seconds": loaded_s - started_s, "first_token_seconds": time.monotonic() - loaded_s,
                    "rss_peak_bytes": _rss_peak_bytes() - baseline}
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def measure(layout: str, path: Path, dtype: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, __file__, "--child", layout, str(path), "--dtype", dtype],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{layout}: the load failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="big1b", choices=sorted(CONFIGS), help="model config (bench/common.py)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (bfloat16: the files' own, no conversion)")
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "PATH"), help=argparse.SUPPRESS)
    add_results_arguments(parser)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], Path(args.child[1]), args.dtype)))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory(prefix="load_formats-") as tmp:
        workdir = args.workdir or Path(tmp)
        paths = write_layouts(args.size, workdir)
        file_bytes = (paths["meta"] / "consolidated.00.pth").stat().st_size
        results = Results("load_formats", context={"config": args.size, "dtype": args.dtype})
        print(f"{args.size}: {file_bytes / 2**20:.0f} MiB of bfloat16 weights; load average {os.getloadavg()[0]:.2f} "
              "(numbers taken on a busy machine are not comparable)")
        print(f"{'layout':<22}{'load s':>9}{'MiB/s':>9}{'1st token s':>13}{'RSS peak MiB':>14}{'x weights':>11}")
        runs = [("meta", paths["meta"]), ("hf", paths["hf"]), ("gguf-import", paths["gguf"]),
                ("gguf (imported dir)", paths["gguf"].parent / "imported")]
        for name, path in runs:
            row = measure("gguf-import" if name == "gguf-import" else "load", path, args.dtype)
            rate = file_bytes / 2**20 / (row["seconds"] + row["first_token_seconds"])
            ratio = row["rss_peak_bytes"] / file_bytes
            print(f"{name:<22}{row['seconds']:>9.2f}{rate:>9.0f}{row['first_token_seconds']:>13.2f}"
                  f"{row['rss_peak_bytes'] / 2**20:>14.0f}{ratio:>11.2f}", flush=True)
            results.add("load_seconds", round(row["seconds"], 3), "s", layout=name)
            results.add("first_token_seconds", round(row["first_token_seconds"], 3), "s", layout=name)
            results.add("rss_peak_above_baseline", row["rss_peak_bytes"], "B", layout=name, of_weights=round(ratio, 3))
        results.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
