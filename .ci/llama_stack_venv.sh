#!/usr/bin/env bash
# Creates, once, the venv from which tests/e2e/test_llama_stack_server_e2e.py runs `llama stack run`,
# and prints its path. llama-stack 0.7 needs Python >= 3.12 and pins that clash with the
# llama-stack-client 0.2.x of the main environment, so it lives apart (and without torch).
set -euo pipefail
venv="${LLAMA_STACK_TEST_VENV:-/work/venvs/llama-stack}"
# mcp 2 dropped McpError, which llama-stack 0.7.3 imports at start-up.
requirements=("llama-stack==0.7.3" "mcp<2")
stamp="$venv/.llamaserve-requirements"

if [ -x "$venv/bin/llama" ] && [ "$(cat "$stamp" 2>/dev/null)" = "${requirements[*]}" ]; then
    echo "$venv"
    exit 0
fi

find_python() {
    local candidate
    for candidate in python3.12 python3.13 "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3; do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "no Python >= 3.12 found for llama-stack 0.7" >&2
    return 1
}

python="$(find_python)"
"$python" -m venv "$venv" >&2
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${requirements[@]}" >&2
echo "${requirements[*]}" > "$stamp"
echo "$venv"
