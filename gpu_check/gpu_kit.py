"""`make gpu-kit`: the wheels the GPU machine lacks, fetched here (where the registry is) into an
ignored ``.whl/`` that the device tool carries, with a manifest.

Pins come from gpu_check/gpu-kit.txt (one version each; a stale wheel of another version is removed:
two versions stop the machine's whole offline install). Each is fetched ``--no-deps`` as a cp312
manylinux x86-64 wheel. Checks: every wheel's own requirements (``Requires-Dist`` without an
extra) are on the machine (gpu_check/gpu_device_packages.txt) or in the kit; the kit is at most
48 MiB and the tree that travels (tracked and untracked-not-ignored files) plus the kit at most
the device tool's 64 MiB; the kit installs offline for cp312 (as gpu_prep.sh will). Writes ``.whl/manifest.json`` (``KitManifest``); exits 1 naming what
failed.

Example:
    python3 gpu_check/gpu_kit.py                       # .whl/ and .whl/manifest.json
    python3 gpu_check/gpu_kit.py --record bench/results/gpu/kit.json
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
KIT_LIMIT = 48 * MIB
TRAVEL_LIMIT = 64 * MIB
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


class Wheel(BaseModel):
    name: str
    version: str
    file: str
    bytes: int
    sha256: str
    requires: list[str]


class KitManifest(BaseModel):
    """``.whl/manifest.json``: what the kit holds and the sizes checked against the device tool's limits."""

    python: str = "cp312"
    platforms: list[str] = list(PLATFORMS)
    wheels: list[Wheel]
    kit_bytes: int
    tree_bytes: int
    total_bytes: int
    kit_limit_bytes: int = KIT_LIMIT
    travel_limit_bytes: int = TRAVEL_LIMIT
    unmet_requirements: list[str]
    ok: bool


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[norm(name)] = version.strip()
    return out


def tree_bytes() -> int:
    """Bytes of what travels besides carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def wheel_meta(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1).strip()  # type: ignore[union-attr]
    version = re.search(r"^Version: (.+)$", text, re.M).group(1).strip()  # type: ignore[union-attr]
    requires = [r.strip() for r in re.findall(r"^Requires-Dist: (.+)$", text, re.M) if "extra ==" not in r]
    return name, version, requires


def requirement_name(req: str) -> str:
    return norm(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0])


def offline_install_problems(kit: Path) -> list[str]:
    """Install the kit as the GPU machine will (offline, no deps), for cp312 manylinux, into a
    scratch folder: one version each, every wheel installable there."""
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *[a for pl in PLATFORMS for a in ("--platform", pl)], "--target", target, *map(str, sorted(kit.glob("*.whl")))]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    return [] if proc.returncode == 0 else [f"offline cp312 install failed: {proc.stderr.strip()[-800:]}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pins", type=Path, default=REPO / "gpu_check" / "gpu-kit.txt")
    p.add_argument("--device-packages", type=Path, default=REPO / "gpu_check" / "gpu_device_packages.txt")
    p.add_argument("--dir", type=Path, default=REPO / ".whl")
    p.add_argument("--record", type=Path, default=None, help="also write the manifest here (a committed copy)")
    args = p.parse_args(argv)
    wanted = pins(args.pins)
    args.dir.mkdir(exist_ok=True)
    for whl in args.dir.glob("*.whl"):  # one version each: drop what the pins no longer name
        name, version, _ = wheel_meta(whl)
        if wanted.get(norm(name)) != version:
            print(f"removing {whl.name} (not pinned)")
            whl.unlink()
    have = {norm(wheel_meta(w)[0]) for w in args.dir.glob("*.whl")}
    missing = [f"{n}=={v}" for n, v in wanted.items() if n not in have]
    if missing:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.12", "--implementation", "cp", *[a for pl in PLATFORMS for a in ("--platform", pl)],
               "-d", str(args.dir), *missing]
        print(" ".join(cmd))
        subprocess.run(cmd, check=True)
    wheels = []
    for whl in sorted(args.dir.glob("*.whl")):
        name, version, requires = wheel_meta(whl)
        wheels.append(Wheel(name=norm(name), version=version, file=whl.name, bytes=whl.stat().st_size,
                            sha256=hashlib.sha256(whl.read_bytes()).hexdigest(), requires=requires))
    device = {norm(line.strip()) for line in args.device_packages.read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    kit = {w.name for w in wheels}
    # importlib-metadata: diffusers lists it but imports it only on Python < 3.8
    unmet = sorted({f"{w.name}: {r}" for w in wheels for r in w.requires
                    if requirement_name(r) not in device | kit | {"importlib-metadata"}})
    kit_b, tree_b = sum(w.bytes for w in wheels), tree_bytes()
    problems = []
    if kit != set(wanted):
        problems.append(f"kit holds {sorted(kit)}, pins name {sorted(wanted)}")
    if kit_b > KIT_LIMIT:
        problems.append(f"kit is {kit_b / MIB:.1f} MiB > {KIT_LIMIT / MIB:.0f} MiB")
    if kit_b + tree_b > TRAVEL_LIMIT:
        problems.append(f"tree + kit is {(kit_b + tree_b) / MIB:.1f} MiB > {TRAVEL_LIMIT / MIB:.0f} MiB")
    problems += [f"unmet requirement {u}" for u in unmet]
    problems += offline_install_problems(args.dir)
    manifest = KitManifest(wheels=wheels, kit_bytes=kit_b, tree_bytes=tree_b, total_bytes=kit_b + tree_b,
                           unmet_requirements=unmet, ok=not problems)
    text = manifest.model_dump_json(indent=1)
    (args.dir / "manifest.json").write_text(text)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(text)
    for w in wheels:
        print(f"  {w.bytes / MIB:6.2f} MiB  {w.file}")
    print(f"kit {kit_b / MIB:.1f} MiB (<= {KIT_LIMIT / MIB:.0f}), tree {tree_b / MIB:.1f} MiB, "
          f"tree + kit {(kit_b + tree_b) / MIB:.1f} MiB (<= {TRAVEL_LIMIT / MIB:.0f}): {args.dir / 'manifest.json'}")
    for problem in problems:
        print(f"gpu-kit: {problem}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
