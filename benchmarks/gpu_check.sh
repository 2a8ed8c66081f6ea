#!/usr/bin/env bash
# The ~350M-parameter transformer benchmark on one accelerator, within about 8 minutes.
#
#   bash benchmarks/gpu_check.sh [extra benchmarks/transformer.py flags]
#
# Runs from the repository root with the machine's own `python3` (jax, flax, optax and
# orbax preinstalled). jstrategy is installed from this checkout as the README says
# (`pip install .`) into a virtual environment that sees the machine's packages, with
# --no-deps and without build isolation, because the machine has no network: its own JAX
# is what runs. Where pip cannot build there, the checkout is imported instead, and the
# first lines say which. Prints device information, then one table row per configuration as soon as it
# is measured: mixed_bfloat16 first (the MFU target), then float32, each under
# OneDeviceStrategy and MirroredStrategy over all devices. A persistent compilation cache
# lets the second strategy reuse the first one's program on a single GPU. With $OUT set,
# a copy of everything printed goes to "$OUT/transformer_gpu.txt".
#
# Extra flags are passed on and override the defaults below, e.g. `--strategies
# one_device` or `--batch-size 8`. GPU_CHECK_TIMEOUT (seconds, default 470) bounds the
# benchmark; rows printed before it expires are kept.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PYTHON="${PYTHON:-python3}"
VENV="${TMPDIR:-/tmp}/jstrategy-gpu-check"
if "$PYTHON" -m venv --system-site-packages "$VENV" >/dev/null 2>&1 \
  && "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation . >/dev/null 2>&1; then
  PYTHON="$VENV/bin/python"
  echo "jstrategy installed from this checkout into $VENV (pip install --no-deps .)"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "pip could not install this checkout offline here: importing it from $PWD"
fi
LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && LOG="$OUT/transformer_gpu.txt"
fi

{
  echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) =="
  command -v nvidia-smi >/dev/null 2>&1 \
    && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit \
      --format=csv 2>&1
  "$PYTHON" - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version())
for name in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "numpy"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as e:  # a missing package is reported, not fatal
        print(f"{name}: not importable ({type(e).__name__}: {e})")
try:
    import jax
    print("devices:", [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()])
    print("default backend:", jax.default_backend())
except Exception as e:
    print(f"jax devices unavailable: {type(e).__name__}: {e}")
EOF
  echo
  CACHE="$(mktemp -d "${TMPDIR:-/tmp}/jstrategy_xla_cache.XXXXXX")"
  timeout -k 10 "${GPU_CHECK_TIMEOUT:-470}" "$PYTHON" benchmarks/transformer.py \
    --size 350m --dtypes mixed_bfloat16,float32 --strategies one_device,mirrored \
    --steps 20 --warmup 3 --compilation-cache "$CACHE" "$@"
  status=$?
  [ "$status" = 124 ] && echo "(stopped after ${GPU_CHECK_TIMEOUT:-470}s; rows above are complete)"
  rm -rf "$CACHE"
  echo "== exit status $status =="
  exit "$status"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
