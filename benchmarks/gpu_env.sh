# Sourced by the GPU benchmark scripts (run from the repository root on a lent GPU machine):
# $OUT exists, NCCL_NVLS_ENABLE=0 and unbuffered Python are set, and specserve imports from this
# checkout. fastapi/uvicorn are not on the GPU image: wheels carried in .whl (see the device tool's
# README) are installed into /tmp/site first; later calls on the same warm machine find them there.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site  # installed by an earlier call on this warm machine too
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
