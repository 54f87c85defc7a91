#!/usr/bin/env bash
# A minimal flash-attn 2.8.3 (forward + split-KV forward, bf16, head dims 128 and 64) from its sdist, installed where
# `--attention auto` finds it. Options and what is compiled out: tools/build_flash_attn.py's docstring.
#   tools/build_flash_attn.sh --fetch                # where PyPI is reachable: .gpu/wheels/flash_attn-2.8.3.tar.gz
#   tools/build_flash_attn.sh --arch 90              # on the CUDA machine (about 2 minutes on 16 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/build_flash_attn.py "$@"
