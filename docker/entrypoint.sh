#!/bin/sh
# The image's entry point: llamaserve with the container's arguments. With no arguments and no model
# configured (INFERENCE_MODEL / INFERENCE_CHECKPOINT_DIR, their LLAMASERVE_ spellings, or a run.yaml
# in LLAMASERVE_CONFIG) it serves the demo model baked into the image.
set -eu
if [ "$#" -eq 0 ] && [ -z "${INFERENCE_MODEL:-}${INFERENCE_CHECKPOINT_DIR:-}${LLAMASERVE_MODEL:-}${LLAMASERVE_CHECKPOINT_DIR:-}${LLAMASERVE_CONFIG:-}" ]; then
    set -- --demo
fi
exec llamaserve "$@"
