#!/usr/bin/env bash
# On the GPU machine, first in every device call, from the repo root (docs/gpu-check.md):
#   bash gpu_check/gpu_prep.sh; python3 gpu_check/run.py --part 1 --until T1 --out "$OUT"
# Steps (names are gpu_check/gpu_plan.py's PREP_STEPS; a test names the ones it needs). A step that fails
# is recorded with its reason and every step depending on it is recorded `skipped`; the others still
# run, and gpu_check/run.py skips only the tests that need a failed step:
#   machine_packages  the machine's packages the tests import (torch, transformers, huggingface_hub, ...)
#   kit               the carried wheels (.whl/, `make gpu-kit` here) installed offline, each wheel's
#                     requirements checked against the versions installed there (specifiers, not names)
#   headers           Python.h (the layout solver's pybind11 module)
#   toolchain         g++, cmake, ninja, pybind11's cmake dir
#   allocator         allocator_ext built (cmake + ninja, plain g++) into xema_ray/allocator/ and loadable
#                     (needs headers, toolchain)
#   project           this tree importable (a .pth naming it; needs machine_packages, kit)
#   shm               the tmpfs shared weight segments live in ($XEMA_SHM_DIR, else /dev/shm): its size
#                     recorded, and enlarged (remount) where it is below $XEMA_GPU_SHM_BYTES (32 GiB: the
#                     largest segment a GPU test makes is 23.8 GiB, Flux.2's 18 offloaded blocks); fails
#                     only when it stays below that
# Writes $XEMA_GPU_PREP (/tmp/xema-gpu-prep.json): status (ok / failed), reason (the first failure),
# steps [{name, status, reason, seconds}], site, versions, nvidia_smi, shm {dir, size_bytes_before,
# size_bytes, free_bytes}. Exits 1 if a step failed (run.py
# still runs: call it with `;`, not `&&`). Idempotent: on a warm machine every step finds its work done.
# Rehearsals (tests/test_gpu_check.py): XEMA_GPU_PREP_PLANT=<step> makes that step fail; XEMA_GPU_KIT_PINS
# names another pins file than gpu_check/gpu-kit.txt (the CPU venv's versions), XEMA_GPU_KIT_WAIVERS another
# waivers file than gpu_check/gpu-kit-waivers.txt. Budget: <= 90 s.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$SECONDS
REC=${XEMA_GPU_PREP:-/tmp/xema-gpu-prep.json}
PY=${PYTHON:-python3}
BUILD=build/gpu
STEPS_FILE=$(mktemp /tmp/xema-prep-steps.XXXXXX)
SITE=""
SHM_DIR=${XEMA_SHM_DIR:-/dev/shm}
SHM_BEFORE=""
SHM_SIZE=""
SHM_FREE=""
declare -A STATE=()

emit() {  # name status reason seconds
  "$PY" -c 'import json, sys; print(json.dumps({"name": sys.argv[1], "status": sys.argv[2], "reason": sys.argv[3] or None, "seconds": int(sys.argv[4])}))' \
    "$1" "$2" "$3" "$4" >>"$STEPS_FILE" 2>/dev/null || echo "{\"name\": \"$1\", \"status\": \"$2\", \"reason\": null, \"seconds\": $4}" >>"$STEPS_FILE"
}

# run_step NAME "DEPS" FUNCTION: skipped if a dependency did not succeed; failed with the function's last
# stderr line (or a planted failure); ok otherwise
run_step() {
  local name=$1 deps=$2 fn=$3 t=$SECONDS dep
  for dep in $deps; do
    if [ "${STATE[$dep]:-}" != ok ]; then
      STATE[$name]=skipped
      emit "$name" skipped "needs $dep (${STATE[$dep]:-not run})" 0
      echo "gpu_prep: $name skipped (needs $dep)"
      return
    fi
  done
  local err errf
  errf=$(mktemp /tmp/xema-prep-err.XXXXXX)
  if [ "${XEMA_GPU_PREP_PLANT:-}" = "$name" ]; then
    echo "planted failure (XEMA_GPU_PREP_PLANT=$name, a rehearsal)" >"$errf"
  elif $fn >/dev/null 2>"$errf"; then  # not in a subshell: what a step sets (SITE, CMAKE) stays set
    STATE[$name]=ok
    emit "$name" ok "" $((SECONDS - t))
    echo "gpu_prep: $name ok ($((SECONDS - t)) s)"
    rm -f "$errf"
    return
  fi
  err=$(tail -3 "$errf" | tr '\n' ' ')
  rm -f "$errf"
  STATE[$name]=failed
  emit "$name" failed "${err:-failed}" $((SECONDS - t))
  echo "gpu_prep: $name FAILED: $err" >&2
}

machine_packages() {
  command -v "$PY" >/dev/null || { echo "no $PY on PATH" >&2; return 1; }
  "$PY" -c 'import torch, transformers, huggingface_hub, safetensors, numpy, PIL, imageio, pynvml, pytest, matplotlib, requests, regex, filelock, packaging' \
    || { echo "a package the tests import is missing on this machine" >&2; return 1; }
}

kit_installed() {  # every pin of gpu_check/gpu-kit.txt installed at its version
  "$PY" - <<'EOF'
import os, pathlib, sys
from importlib.metadata import PackageNotFoundError, version
for line in pathlib.Path(os.environ.get("XEMA_GPU_KIT_PINS", "gpu_check/gpu-kit.txt")).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, pin = (s.strip() for s in line.split("=="))
        try:
            if version(name) != pin:
                sys.exit(1)
        except PackageNotFoundError:
            sys.exit(1)
EOF
}

kit() {
  SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  if ! kit_installed; then
    [ -f .whl/manifest.json ] || { echo "no .whl/manifest.json: run \`make gpu-kit\` here and name .whl in the call's carry" >&2; return 1; }
    "$PY" - <<'EOF' || return 1
import hashlib, json, pathlib, sys
m = json.loads(pathlib.Path(".whl/manifest.json").read_text())
bad = [w["file"] for w in m["wheels"] if not pathlib.Path(".whl", w["file"]).is_file()
       or hashlib.sha256(pathlib.Path(".whl", w["file"]).read_bytes()).hexdigest() != w["sha256"]]
extra = sorted({p.name for p in pathlib.Path(".whl").glob("*.whl")} - {w["file"] for w in m["wheels"]})
if bad or extra:
    sys.exit(f"the carried kit does not match .whl/manifest.json (rerun `make gpu-kit`): missing or changed {bad}; not in the manifest {extra}")
EOF
    if [ -w "$SITE" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade .whl/*.whl >&2 \
        || { echo "offline install of .whl/*.whl into $SITE failed" >&2; return 1; }
    else  # read-only: a folder of its own, which run.py puts on every test's path (the record's site)
      SITE=${XEMA_GPU_SITE:-/tmp/site}
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl >&2 \
        || { echo "offline install of .whl/*.whl into $SITE failed" >&2; return 1; }
    fi
  fi
  # every kit wheel's own requirements, by specifier, against what is installed here now; a requirement
  # gpu_check/gpu-kit-waivers.txt waives (with its reason) is skipped here as `make gpu-kit` skips it
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - <<'EOF'
import os, pathlib, re, sys
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
waived = set()
for line in pathlib.Path(os.environ.get("XEMA_GPU_KIT_WAIVERS", "gpu_check/gpu-kit-waivers.txt")).read_text().splitlines():
    body, _, reason = line.partition("#")
    owner, sep, dep = body.partition(":")
    if sep and dep.strip() and reason.strip():
        waived.add((norm(owner.strip()), norm(dep.strip())))
bad = []
for line in pathlib.Path(os.environ.get("XEMA_GPU_KIT_PINS", "gpu_check/gpu-kit.txt")).read_text().splitlines():
    name = line.split("#", 1)[0].split("==")[0].strip()
    if not name:
        continue
    for r in map(Requirement, requires(name) or []):
        if r.marker is not None and not r.marker.evaluate({"extra": ""}):
            continue
        if (norm(name), norm(r.name)) in waived:
            continue
        try:
            have = version(r.name)
        except PackageNotFoundError:
            bad.append(f"{name} needs {r}: not installed")
            continue
        if not r.specifier.contains(have, prereleases=True):
            bad.append(f"{name} needs {r}: {have} installed")
if bad:
    sys.exit("; ".join(bad))
EOF
}

headers() {
  local inc
  inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])') || return 1
  [ -f "$inc/Python.h" ] || { echo "no Python headers ($inc/Python.h): the layout solver's pybind11 module cannot build" >&2; return 1; }
}

toolchain() {
  command -v g++ >/dev/null || { echo "no g++ on PATH" >&2; return 1; }
  CMAKE=$(command -v cmake || echo "$(dirname "$(command -v "$PY")")/cmake")
  NINJA=$(command -v ninja || echo "$(dirname "$(command -v "$PY")")/ninja")
  [ -x "$CMAKE" ] || { echo "no cmake (PATH or next to $PY)" >&2; return 1; }
  [ -x "$NINJA" ] || { echo "no ninja (PATH or next to $PY)" >&2; return 1; }
  PYBIND=$("$PY" -m pybind11 --cmakedir) || { echo "pybind11 is missing or has no cmake dir" >&2; return 1; }
}

allocator() {
  if ! ls xema_ray/allocator/_solver*.so xema_ray/allocator/libxema_alloc.so >/dev/null 2>&1; then
    mkdir -p build
    timeout 60 "$CMAKE" -S . -B "$BUILD" -G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA" -DCMAKE_BUILD_TYPE=Release \
      -Dpybind11_DIR="$PYBIND" -DPython_EXECUTABLE="$(command -v "$PY")" >"$BUILD.log" 2>&1 \
      || { echo "cmake configure failed: $(tail -3 "$BUILD.log" 2>/dev/null)" >&2; return 1; }
    timeout 150 "$CMAKE" --build "$BUILD" -j "$(nproc)" >>"$BUILD.log" 2>&1 \
      || { echo "allocator_ext build failed: $(tail -5 "$BUILD.log")" >&2; return 1; }
    "$CMAKE" --install "$BUILD" --prefix "$PWD" >>"$BUILD.log" 2>&1 \
      || { echo "allocator_ext install failed: $(tail -3 "$BUILD.log")" >&2; return 1; }
  fi
  # loadable without the package's own imports (the kit may be missing: that is another step's failure)
  "$PY" - <<'EOF'
import ctypes, glob, importlib.util, sys
[solver] = glob.glob("xema_ray/allocator/_solver*.so")
spec = importlib.util.spec_from_file_location("_solver", solver)
spec.loader.exec_module(importlib.util.module_from_spec(spec))
ctypes.CDLL("xema_ray/allocator/libxema_alloc.so")
EOF
}

project() {
  if ! "$PY" -c 'import os, sys, xema_ray; sys.exit(os.path.dirname(os.path.dirname(os.path.abspath(xema_ray.__file__))) != os.getcwd())' 2>/dev/null; then
    echo "$PWD" >"$SITE/xema-ray-tree.pth" || { echo "cannot write $SITE/xema-ray-tree.pth" >&2; return 1; }
  fi
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c 'import xema_ray, planner, xema_ray.runtime.worker'
}

shm_bytes() {  # size|avail of the file system holding $1, in bytes
  df -B1 --output="$2" "$1" 2>/dev/null | tail -1 | tr -d ' '
}

shm() {
  local want=${XEMA_GPU_SHM_BYTES:-34359738368}
  SHM_BEFORE=$(shm_bytes "$SHM_DIR" size)
  [ -n "$SHM_BEFORE" ] || { echo "$SHM_DIR: no file system to read a size from" >&2; return 1; }
  # tmpfs's size is a limit, not memory taken: raising it reserves nothing
  if [ "$SHM_BEFORE" -lt "$want" ]; then
    mount -o remount,size="$want" "$SHM_DIR" >/dev/null 2>&1 || true
  fi
  SHM_SIZE=$(shm_bytes "$SHM_DIR" size)
  SHM_FREE=$(shm_bytes "$SHM_DIR" avail)
  [ "$SHM_SIZE" -ge "$want" ] || { echo "$SHM_DIR is $SHM_SIZE bytes, below the $want a GPU test's shared segment needs, and could not be enlarged (mount -o remount,size=$want $SHM_DIR)" >&2; return 1; }
}

run_step machine_packages "" machine_packages
run_step kit "" kit
run_step headers "" headers
run_step toolchain "" toolchain
run_step allocator "headers toolchain" allocator
run_step project "machine_packages kit" project
run_step shm "" shm

"$PY" - "$REC" "$((SECONDS - T0))" "$SITE" "$STEPS_FILE" "$SHM_DIR" "$SHM_BEFORE" "$SHM_SIZE" "$SHM_FREE" <<'EOF'
import json, pathlib, platform, shutil, subprocess, sys
from importlib.metadata import PackageNotFoundError, version
path, seconds, site, steps_file, shm_dir, *shm_figures = sys.argv[1:]
steps = [json.loads(line) for line in pathlib.Path(steps_file).read_text().splitlines() if line.strip()]
failed = [s for s in steps if s["status"] == "failed"]
def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None
names = ["torch", "diffusers", "transformers", "huggingface-hub", "tokenizers", "pydantic", "pydantic-core",
         "typing-extensions", "imageio-ffmpeg", "numpy", "safetensors", "pytest", "nvidia-ml-py", "pybind11"]
smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") else None
def project_unmet():
    """pyproject's requirements on what is installed here, by specifier (recorded, not a failure: the
    serving stack's packages are absent by design and a GPU test that needs a newer one fails on its own)."""
    try:
        import tomllib
        from packaging.requirements import Requirement
        deps = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]["dependencies"]
    except Exception as e:  # noqa: BLE001 -- recorded
        return [f"not checked: {type(e).__name__}: {e}"]
    out = []
    for r in map(Requirement, deps):
        have = v(r.name)
        if have is not None and (r.marker is None or r.marker.evaluate()) and not r.specifier.contains(have.split("+")[0], prereleases=True):
            out.append(f"{r}: {have} installed")
    return out
rec = {"status": "failed" if failed else "ok",
       "reason": "; ".join(f"{s['name']}: {s['reason']}" for s in failed) or None,
       "seconds": int(seconds), "site": site or None, "steps": steps, "python": platform.python_version(),
       "versions": {n: v(n) for n in names}, "project_requirements_unmet": project_unmet(),
       "nvidia_smi": (smi.stdout.strip() or smi.stderr.strip()) if smi else "no nvidia-smi",
       "shm": {"dir": shm_dir, **{k: int(x) if x.isdigit() else None for k, x in
                                  zip(("size_bytes_before", "size_bytes", "free_bytes"), shm_figures)}}}
pathlib.Path(path).write_text(json.dumps(rec, indent=1))
print(json.dumps({k: rec[k] for k in ("status", "reason", "seconds", "site")}))
EOF
rm -f "$STEPS_FILE"
[ $((SECONDS - T0)) -le 90 ] || echo "gpu_prep: took $((SECONDS - T0)) s, over its 90 s budget" >&2
for s in "${STATE[@]}"; do [ "$s" = ok ] || exit 1; done
exit 0
