#!/usr/bin/env bash
# The GPU device check: bash benchmarks/gpu/check.sh [--dry-run] [OUT_DIR] [--sections a,b]
# (OUT_DIR defaults to benchmarks/results/). Writes gpu_check.json and gpu_check.txt there
# (gpu_check_dry_run.* with --dry-run) and prints the summary; exit status 1 when a section crashed.
#
# The GPU machine has torch, transformers and triton but not kvfleet, nor the network
# to install it: the repository goes on PYTHONPATH instead. kvfleet's offline LLM also
# imports two small pure-Python packages that may be missing there, gguf and
# prometheus_client; when they are, they are taken from this checkout's .venv if it
# was carried along (their folders under .venv/lib/python3.*/site-packages/), linked
# into a folder of their own so that nothing else of the CPU venv (its torch) shadows
# the machine's packages.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO"

# The project's environment where there is one (the CPU machines), else the machine's
# python; KVFLEET_CHECK_PYTHON overrides both.
if [[ -n "${KVFLEET_CHECK_PYTHON:-}" ]]; then
  PYTHON="$KVFLEET_CHECK_PYTHON"
elif [[ -x .venv/bin/python ]]; then
  PYTHON=.venv/bin/python
else
  PYTHON="$(command -v python3 || command -v python)"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

missing=$("$PYTHON" - <<'EOF'
import importlib.util
print(" ".join(name for name in ("gguf", "prometheus_client") if importlib.util.find_spec(name) is None))
EOF
)
if [[ -n "$missing" ]]; then
  deps="$(mktemp -d)"
  trap 'rm -rf "$deps"' EXIT
  for name in $missing; do
    found=$(ls -d .venv/lib/python3.*/site-packages/"$name" 2>/dev/null | head -n 1 || true)
    if [[ -z "$found" ]]; then
      echo "check.sh: python package '$name' is missing and no carried .venv provides it;" \
           "carry .venv/lib/python3.11/site-packages/$name or pip install it" >&2
      exit 2
    fi
    ln -s "$REPO/$found" "$deps/$name"
  done
  export PYTHONPATH="$PYTHONPATH:$deps"
  echo "check.sh: using the carried $missing" >&2
fi

"$PYTHON" -m benchmarks.gpu.check "$@"
