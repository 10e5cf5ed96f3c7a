#!/usr/bin/env bash
# On the GPU machine, first in every device call, from the repo root (docs/gpu-check.md):
#   bash gpu_check/gpu_prep.sh && python3 gpu_check/run.py --part 1 --out "$OUT"
# 1. checks: python3 with its headers, g++, cmake, ninja, the machine's packages the tests rely on;
# 2. installs the carried kit (.whl/, `make gpu-kit` here) offline into python3's site-packages
#    (into $XEMA_GPU_SITE=/tmp/site if that is read-only; gpu_check.py then puts it on PYTHONPATH);
# 3. builds allocator_ext (cmake + ninja, plain g++: no CUDA headers) into xema_ray/allocator/;
# 4. installs the project without dependencies (a .pth naming this tree: imports resolve here);
# 5. prints versions and writes $XEMA_GPU_PREP (/tmp/xema-gpu-prep.json; gpu-check.json embeds it).
# Exits non-zero with the reason on the first failure. Idempotent: a second call on a warm machine
# finds everything in place and only re-checks (seconds). Budget: <= 90 s.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
REC=${XEMA_GPU_PREP:-/tmp/xema-gpu-prep.json}
PY=${PYTHON:-python3}
BUILD=build/gpu
STEPS=()

record() {  # status reason
  "$PY" - "$1" "$2" "$REC" "$((SECONDS - T0))" "${SITE:-}" "${STEPS[@]}" <<'EOF' || true
import json, sys
status, reason, path, seconds, site, *steps = sys.argv[1:]
json.dump({"status": status, "reason": reason, "seconds": int(seconds), "site": site or None, "steps": steps},
          open(path, "w"), indent=1)
EOF
}
fail() { echo "gpu_prep: FAILED: $*" >&2; record failed "$*"; exit 1; }
step() { STEPS+=("$1 ($((SECONDS - T0)) s)"); echo "gpu_prep: $1 ($((SECONDS - T0)) s)"; }

# ---- 1. checks
command -v "$PY" >/dev/null || fail "no $PY on PATH"
INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])') || fail "$PY does not run"
[ -f "$INC/Python.h" ] || fail "no Python headers ($INC/Python.h): the layout solver's pybind11 module cannot build"
command -v g++ >/dev/null || fail "no g++ on PATH"
CMAKE=$(command -v cmake || echo "$(dirname "$(command -v "$PY")")/cmake")
NINJA=$(command -v ninja || echo "$(dirname "$(command -v "$PY")")/ninja")
[ -x "$CMAKE" ] || fail "no cmake (PATH or next to $PY)"
[ -x "$NINJA" ] || fail "no ninja (PATH or next to $PY)"
"$PY" -c 'import torch, transformers, huggingface_hub, safetensors, numpy, PIL, imageio, pynvml, pybind11, pytest, matplotlib, requests, regex, filelock' \
  2>/tmp/xema-prep-import.err || fail "a package the tests rely on is missing on this machine: $(tail -1 /tmp/xema-prep-import.err)"
step "checked python3 $("$PY" -c 'import platform; print(platform.python_version())'), headers, g++, cmake, ninja, machine packages"

# ---- 2. the kit, offline
[ -f .whl/manifest.json ] || fail "no .whl/manifest.json: run \`make gpu-kit\` here and name .whl in the call's carry"
"$PY" - <<'EOF' || fail "the carried kit does not match .whl/manifest.json (rerun \`make gpu-kit\`)"
import hashlib, json, pathlib, sys
m = json.loads(pathlib.Path(".whl/manifest.json").read_text())
bad = [w["file"] for w in m["wheels"] if not pathlib.Path(".whl", w["file"]).is_file()
       or hashlib.sha256(pathlib.Path(".whl", w["file"]).read_bytes()).hexdigest() != w["sha256"]]
extra = sorted({p.name for p in pathlib.Path(".whl").glob("*.whl")} - {w["file"] for w in m["wheels"]})
if bad or extra:
    sys.exit(f"missing or changed: {bad}; not in the manifest: {extra}")
EOF
if "$PY" -c 'import diffusers, pydantic, imageio_ffmpeg; assert diffusers.__version__ == "0.42.1"' 2>/dev/null; then
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  step "kit already installed"
else
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -w "$SITE" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl \
      || fail "offline install of .whl/*.whl into $SITE failed"
  else
    SITE=${XEMA_GPU_SITE:-/tmp/site}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
      || fail "offline install of .whl/*.whl into $SITE failed"
  fi
  step "kit installed into $SITE"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# ---- 3. allocator_ext
if ! ls xema_ray/allocator/_solver*.so xema_ray/allocator/libxema_alloc.so >/dev/null 2>&1; then
  mkdir -p build
  PYBIND=$("$PY" -m pybind11 --cmakedir) || fail "pybind11 has no cmake dir"
  timeout 60 "$CMAKE" -S . -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" -DCMAKE_BUILD_TYPE=Release \
    -Dpybind11_DIR="$PYBIND" -DPython_EXECUTABLE="$(command -v "$PY")" >"$BUILD.log" 2>&1 \
    || fail "cmake configure failed: $(tail -3 "$BUILD.log" 2>/dev/null)"
  timeout 150 "$CMAKE" --build "$BUILD" -j "$(nproc)" >>"$BUILD.log" 2>&1 || fail "allocator_ext build failed: $(tail -5 "$BUILD.log")"
  "$CMAKE" --install "$BUILD" --prefix "$PWD" >>"$BUILD.log" 2>&1 || fail "allocator_ext install failed: $(tail -3 "$BUILD.log")"
  step "allocator_ext built (cmake + ninja)"
else
  step "allocator_ext already built"
fi

# ---- 4. the project, no dependencies
echo "$PWD" >"$SITE/xema-ray-tree.pth" || fail "cannot write $SITE/xema-ray-tree.pth"
"$PY" -c 'import xema_ray, planner; from xema_ray.allocator import _solver; from xema_ray.allocator.runtime import default_library_path; default_library_path()' \
  2>/tmp/xema-prep-import.err || fail "the project does not import: $(tail -1 /tmp/xema-prep-import.err)"
step "project importable from $PWD (no dependencies installed)"

# ---- 5. versions
"$PY" - "$REC" "$((SECONDS - T0))" "$SITE" "${STEPS[@]}" <<'EOF' || fail "could not read versions"
import json, platform, subprocess, sys
from importlib.metadata import version
path, seconds, site, *steps = sys.argv[1:]
import torch
names = ["torch", "diffusers", "transformers", "huggingface-hub", "pydantic", "pydantic-core", "typing-extensions",
         "imageio-ffmpeg", "numpy", "safetensors", "pytest", "nvidia-ml-py"]
versions = {n: version(n) for n in names}
import shutil
smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
rec = {"status": "ok", "reason": None, "seconds": int(seconds), "site": site, "steps": steps,
       "python": platform.python_version(), "versions": versions, "cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "nvidia_smi": (smi.stdout.strip() or smi.stderr.strip()) if smi else "no nvidia-smi"}
json.dump(rec, open(path, "w"), indent=1)
print(json.dumps(rec, indent=1))
EOF
step "done"
[ $((SECONDS - T0)) -le 90 ] || echo "gpu_prep: took $((SECONDS - T0)) s, over its 90 s budget" >&2
exit 0
