#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has torch, transformers, triton, numpy, ...; not the server, GGUF,
# test-client and int4-reference packages), at the versions this checkout's environment has, for its Python
# 3.12 on x86-64, into .whl/ (ignored by git). Carry it with the run (carry [".whl"]); benchmarks/gpu_env.sh
# installs it into /tmp/site there. Run here, in the activated environment: bash benchmarks/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PKGS="fastapi starlette pydantic pydantic-core annotated-types typing-inspection annotated-doc uvicorn gguf
      openai distro jiter sniffio httpx2 httpcore2 truststore anyio typing-extensions jsonschema referencing
      rpds-py jsonschema-specifications compressed-tensors loguru opentelemetry-api xgrammar apache-tvm-ffi tiktoken
      regex"
mkdir -p .whl
for p in $PKGS; do
  v=$(python -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}' || true)  # (not installed here: the newest)
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$p${v:+==$v}" 2>&1 | grep -v "^WARNING: Location" || true
done
du -sh .whl
