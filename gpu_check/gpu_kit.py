"""`make gpu-kit`: the wheels the GPU machine lacks, fetched here (where the registry is) into an
ignored ``.whl/`` that each device call carries, with a manifest.

Pins come from gpu_check/gpu-kit.txt (one version each; a stale wheel of another version is removed:
two versions stop the machine's whole offline install). Each is fetched ``--no-deps`` as a cp312
manylinux x86-64 wheel. Checks: every wheel's own requirements (``Requires-Dist`` without an
extra, markers evaluated for CPython 3.12 on Linux x86-64) are met by version specifier: by the
kit's pinned version, or by the machine's version where gpu_check/gpu_device_packages.txt records
one (torch, transformers, huggingface_hub, ...); a requirement on a machine package whose version
was never read there is listed ``unverified`` (gpu_prep.sh's kit step checks every specifier
there, against what is installed). The project's own requirements on those packages
(pyproject.toml) are checked the same way. The kit is at most
48 MiB and the tree that travels (tracked and untracked-not-ignored files) plus the kit at most
the 64 MiB a call carries; the kit installs offline for cp312 (as gpu_prep.sh will). Writes ``.whl/manifest.json`` (``KitManifest``); exits 1 naming what
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
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version
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
    """``.whl/manifest.json``: what the kit holds and the sizes checked against what a call carries."""

    python: str = "cp312"
    platforms: list[str] = list(PLATFORMS)
    wheels: list[Wheel]
    kit_bytes: int
    tree_bytes: int
    total_bytes: int
    kit_limit_bytes: int = KIT_LIMIT
    travel_limit_bytes: int = TRAVEL_LIMIT
    unmet_requirements: list[str]
    unverified_requirements: list[str] = []
    waived_requirements: list[str] = []
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


#: the GPU machine's interpreter, for requirement markers (python3 3.12 on Linux x86-64)
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_system": "Linux",
                  "sys_platform": "linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
WAIVERS = REPO / "gpu_check" / "gpu-kit-waivers.txt"


def waivers(path: Path = WAIVERS) -> dict[tuple[str, str], str]:
    """gpu_check/gpu-kit-waivers.txt: (owner, requirement name) -> why the machine needs neither.

    Lines are ``owner: name  # reason``; a waiver without a reason is refused (a waived requirement
    is one the prep's kit step on the machine skips too, so each needs its argument).
    """
    out: dict[tuple[str, str], str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        body, _, reason = line.partition("#")
        if not body.strip():
            continue
        owner, sep, name = body.partition(":")
        if not sep or not name.strip() or not reason.strip():
            raise ValueError(f"{path}:{n}: a waiver is `owner: requirement-name  # reason`, got {line!r}")
        out[(norm(owner.strip()), norm(name.strip()))] = reason.strip()
    return out


def device_packages(path: Path) -> dict[str, str | None]:
    """gpu_check/gpu_device_packages.txt: name -> version read there (None: on the machine, version not read)."""
    out: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version.strip() or None
    return out


def check_requirement(req: str, kit: dict[str, str], device: dict[str, str | None], owner: str = "",
                      waived: dict[tuple[str, str], str] | None = None) -> tuple[str, str | None]:
    """("ok" | "unmet" | "unverified" | "not-needed" | "waived", why) of one requirement of ``owner``
    against the kit's pinned versions, then the machine's known ones, by specifier; a requirement
    gpu_check/gpu-kit-waivers.txt waives for ``owner`` is "waived" with its reason."""
    try:
        r = Requirement(req)
    except InvalidRequirement as e:
        return "unmet", f"{req}: not a requirement ({e})"
    if r.marker is not None and not r.marker.evaluate(DEVICE_MARKERS):
        return "not-needed", None
    name = norm(r.name)
    if (norm(owner), name) in (waived or {}):
        return "waived", (waived or {})[(norm(owner), name)]
    have = kit.get(name) or device.get(name)
    if have is None:
        return ("unverified", f"{req}: {name} is on the machine, its version not read") if name in device else (
            "unmet", f"{req}: {name} is neither on the machine nor in the kit")
    try:
        ok = r.specifier.contains(Version(have.split("+")[0]), prereleases=True)
    except InvalidVersion:
        return "unverified", f"{req}: {name} {have} is not a version"
    source = "kit" if name in kit else "machine"
    return ("ok", None) if ok else ("unmet", f"{req}: the {source} has {name} {have}")


def project_requirements() -> list[str]:
    """pyproject.toml's [project] dependencies (what the GPU tests import of them is on the machine or in the kit)."""
    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


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
    p.add_argument("--waivers", type=Path, default=WAIVERS)
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
    device = device_packages(args.device_packages)
    kit_versions = {w.name: w.version for w in wheels}
    kit = set(kit_versions)
    waived = waivers(args.waivers)
    unmet, unverified, waived_here = set(), set(), set()
    checks = [(w.name, r) for w in wheels for r in w.requires]
    # the project's requirements on what the machine has (the serving stack's, absent there, are not the GPU tests')
    checks += [("xema-ray", r) for r in project_requirements() if requirement_name(r) in device or requirement_name(r) in kit]
    for owner, r in checks:
        verdict, why = check_requirement(r, kit_versions, device, owner, waived)
        if verdict == "unmet":
            unmet.add(f"{owner}: {why}")
        elif verdict == "unverified":
            unverified.add(f"{owner}: {why}")
        elif verdict == "waived":
            waived_here.add(f"{owner}: {r} ({why})")
    kit_b, tree_b = sum(w.bytes for w in wheels), tree_bytes()
    problems = []
    if kit != set(wanted):
        problems.append(f"kit holds {sorted(kit)}, pins name {sorted(wanted)}")
    if kit_b > KIT_LIMIT:
        problems.append(f"kit is {kit_b / MIB:.1f} MiB > {KIT_LIMIT / MIB:.0f} MiB")
    if kit_b + tree_b > TRAVEL_LIMIT:
        problems.append(f"tree + kit is {(kit_b + tree_b) / MIB:.1f} MiB > {TRAVEL_LIMIT / MIB:.0f} MiB")
    problems += [f"unmet requirement {u}" for u in sorted(unmet)]
    problems += offline_install_problems(args.dir)
    manifest = KitManifest(wheels=wheels, kit_bytes=kit_b, tree_bytes=tree_b, total_bytes=kit_b + tree_b,
                           unmet_requirements=sorted(unmet), unverified_requirements=sorted(unverified),
                           waived_requirements=sorted(waived_here),
                           ok=not problems)
    text = manifest.model_dump_json(indent=1)
    (args.dir / "manifest.json").write_text(text)
    if args.record is not None:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(text)
    for w in wheels:
        print(f"  {w.bytes / MIB:6.2f} MiB  {w.file}")
    print(f"kit {kit_b / MIB:.1f} MiB (<= {KIT_LIMIT / MIB:.0f}), tree {tree_b / MIB:.1f} MiB, "
          f"tree + kit {(kit_b + tree_b) / MIB:.1f} MiB (<= {TRAVEL_LIMIT / MIB:.0f}): {args.dir / 'manifest.json'}")
    for u in sorted(unverified):
        print(f"gpu-kit: unverified here (gpu_prep.sh checks it there): {u}")
    for problem in problems:
        print(f"gpu-kit: {problem}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
