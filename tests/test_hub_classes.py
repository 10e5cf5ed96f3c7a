"""Hub classes hold their collaborators; no class is built from feature mixins."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.source_scan import ROOT

#: the hub classes (``path:Class``), each with what it holds instead of inheriting: at most one base
#: class (``Generic[...]`` aside), and that base a real abstraction of ``HUB_BASES``, never a feature mixed in
HUB_CLASSES: dict[str, str] = {
    "xema_ray/serving/group/model_group.py:ModelGroup": "holds GroupAdapters (adapters), SummaryPublisher "
                                                        "(publisher), the Dispatcher, the WorkerSet, JobLifecycle",
    "xema_ray/runtime/worker.py:Worker": "holds WorkerAdapters (adapters), the ExecutionEngine, the residency manager",
    "xema_ray/serving/api/router.py:Router": "holds AdapterAdmin (adapter_admin), GroupHealth, VideoJobs and typed "
                                            "GroupHandles",
    "xema_ray/models/base.py:ModelSpec": "returns its ReferenceInputs (reference_inputs) instead of inheriting them",
    "xema_ray/scheduling/dispatcher.py:Dispatcher": "holds StepPreemption and SloAdmission over one DispatchState",
}
#: the only bases a hub class may have, each with the abstraction it is
HUB_BASES: dict[str, str] = {
    "WorkerBase": "the worker interface a worker set calls (vLLM's WorkerBase): Worker and EmulatedWorker implement it",
    "ABC": "ModelSpec is the abstract spec each model implements",
}
#: classes of xema_ray/ and planner/ with more than one base, each with its reason: every other class
#: has at most one (a feature is a collaborator held in a field, not a base class mixed in)
MULTIPLE_BASES: dict[str, str] = {
    "xema_ray/allocator/oom.py:ArenaOutOfMemory": "torch's OutOfMemoryError and MemoryError: what callers catch",
    "xema_ray/runtime/out_of_memory.py:DeviceOutOfMemory": "torch's OutOfMemoryError and MemoryError: what callers catch",
    "xema_ray/placement.py:WeightHome": "a str Enum (its values are JSON strings)",
    "xema_ray/serving/group/worker_set.py:WorkerSet": "an ABC generic over its kind of worker handle",
    "planner/model.py:RefiningModel": "a Protocol extending the PlannerModel protocol",
}
#: bases that only make a class generic, abstract or a protocol (no state, no feature)
TYPING_BASES = ("Generic", "Protocol")


def _bases_of(source: str) -> dict[str, list[str]]:
    """Each class of ``source`` -> its base classes by name (``Other[P]`` as ``Other``, ``abc.ABC`` as ``ABC``)."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases]
            out[node.name] = [b.rpartition(".")[2] for b in bases]
    return out


def _classes(paths: list[Path]) -> dict[str, list[str]]:
    """``path:Class`` -> its base classes, for every class of ``paths``."""
    return {f"{path.relative_to(ROOT).as_posix()}:{name}": bases
            for path in paths for name, bases in _bases_of(path.read_text()).items()}


def _library_classes() -> dict[str, list[str]]:
    return _classes(sorted(p for top in ("xema_ray", "planner") for p in (ROOT / top).rglob("*.py")))


def test_hub_classes_have_at_most_one_base_and_it_is_an_abstraction() -> None:
    classes = _library_classes()
    missing = sorted(set(HUB_CLASSES) - set(classes))
    assert missing == [], f"HUB_CLASSES names classes that are gone: {missing}"
    assert all(HUB_CLASSES.values()) and all(HUB_BASES.values()), "every hub and every allowed base says why"
    real = {hub: [b for b in bases if b not in TYPING_BASES] for hub, bases in classes.items() if hub in HUB_CLASSES}
    bad = {hub: bases for hub, bases in sorted(real.items()) if len(bases) > 1 or any(b not in HUB_BASES for b in bases)}
    assert bad == {}, ("hub classes built from features (hold a collaborator in a typed field instead, or name "
                       f"the abstraction in HUB_BASES): {bad}")


def test_no_library_class_is_built_from_feature_mixins() -> None:
    classes = _library_classes()
    assert all(MULTIPLE_BASES.values()), "every class allowed several bases says why"
    stale = sorted(set(MULTIPLE_BASES) - set(classes))
    assert stale == [], f"MULTIPLE_BASES names classes that are gone: {stale}"
    mixed = {c: bases for c, bases in sorted(classes.items())
             if len([b for b in bases if b not in TYPING_BASES]) > 1 and c not in MULTIPLE_BASES}
    assert mixed == {}, f"classes with several bases (hold each feature as a collaborator): {mixed}"


def test_the_base_finder_reads_generic_and_dotted_bases() -> None:
    src = "class A(Feature, Other[P]):\n    pass\nclass B(abc.ABC, Generic[T]):\n    pass\nclass C:\n    pass\n"
    assert _bases_of(src) == {"A": ["Feature", "Other"], "B": ["ABC", "Generic"], "C": []}
