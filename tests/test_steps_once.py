"""A request's step count is resolved once, at the API; the layout is armed through a typed call."""

from __future__ import annotations

import ast
import re

from tests.source_scan import ROOT

#: where "not given" may still mean the template's steps, each with its reason: the API maps a request
#: onto its template (``serving/api/options.resolve_options``) and every layer below carries an ``int``
STEPS_RESOLVED_AT: dict[str, str] = {
    "xema_ray/serving/api/": "the API: where a request meets its template, its step count is resolved once",
    "xema_ray/templates.py": "the schema: a template made without steps takes its model's reference count",
    "xema_ray/plan.py": "the schema: plan entries and execution configs",
    "xema_ray/models/options.py": "the model's option rules check the request's raw fields for the API "
                                  "(not given: nothing to check)",
    "xema_ray/sim/simulate.py": "the simulator's front door: an arrival trace's request without steps, mapped onto "
                                "its plan as the API maps an HTTP request",
}
#: rooms whose state is passed in calls, never parked per thread (the worker used to hand the batch's
#: steps to the layout, and the layout's report back, through a ``threading.local``)
NO_THREAD_LOCAL_ROOMS = ("xema_ray/runtime", "xema_ray/allocator")


def _is_steps(node: ast.AST) -> bool:
    """``steps``, ``x.steps``, ``arm_steps``: a name for a step count."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "steps" or name.endswith("_steps")


def _steps_fallbacks(tree: ast.AST) -> list[tuple[int, str]]:
    """``steps is None`` / ``steps is not None`` tests and ``steps or ...`` fallbacks in ``tree``."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Compare) and _is_steps(node.left) and len(node.ops) == 1
                and isinstance(node.ops[0], ast.Is | ast.IsNot)
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and _is_steps(node.values[0]):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_steps_are_resolved_once_at_the_api() -> None:
    offenders = []
    for path in sorted((ROOT / "xema_ray").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if any(rel.startswith(allowed) for allowed in STEPS_RESOLVED_AT):
            continue
        offenders += [f"{rel}:{line}: {text}" for line, text in _steps_fallbacks(ast.parse(path.read_text()))]
    assert offenders == [], ("'not given means the template's steps' decided below the API (resolve it in "
                             "serving/api/options.resolve_options and carry the int):\n" + "\n".join(offenders))


def test_the_steps_check_finds_a_fallback() -> None:
    found = _steps_fallbacks(ast.parse("a = steps or t.steps\nif batch.steps is None: pass\nb = n or 1\n"))
    assert [line for line, _ in found] == [1, 2]


def test_no_thread_local_in_the_runtime_or_the_allocator() -> None:
    hits = [f"{p.relative_to(ROOT)}" for room in NO_THREAD_LOCAL_ROOMS for p in sorted((ROOT / room).rglob("*.py"))
            if "threading.local" in p.read_text() or re.search(r"from threading import .*\blocal\b", p.read_text())]
    assert hits == [], f"per-thread state in {hits}: pass it in the call (e.g. ArmLayout(layout_ref, steps))"


def test_the_layout_is_armed_with_the_steps_and_yields_its_report() -> None:
    import inspect

    from xema_ray.runtime.engine import ArmLayout

    params = list(inspect.signature(ArmLayout.__call__).parameters)
    assert params == ["self", "layout_ref", "steps"]
    assert "RequestReport" in str(inspect.signature(ArmLayout.__call__).return_annotation)


def test_every_layer_below_the_api_carries_the_steps_as_a_required_int() -> None:
    import dataclasses
    import inspect

    from xema_ray.runtime.engine import Batch, ExecutionEngine
    from xema_ray.scheduling.batch import Pending
    from xema_ray.scheduling.batch_key import BatchKey
    from xema_ray.scheduling.dispatcher import Dispatcher
    from xema_ray.serving.api.options import RequestOptions
    from xema_ray.serving.messages import GroupRequest
    from xema_ray.serving.jobs.store import JobRecord

    for model in (RequestOptions, GroupRequest, JobRecord, Batch):
        field = model.model_fields["steps"]
        assert field.is_required() and field.annotation in (int, "int"), f"{model.__name__}.steps: {field}"
    # below the group, the steps travel in the request's batch key (``xema_ray.scheduling.batch_key``)
    steps = next(f for f in dataclasses.fields(BatchKey) if f.name == "steps")
    assert steps.type in (int, "int") and steps.default is dataclasses.MISSING
    pending = next(f for f in dataclasses.fields(Pending) if f.name == "key")
    assert pending.type in (BatchKey, "BatchKey") and pending.default is dataclasses.MISSING
    for fn, name, annotations in ((Dispatcher.submit, "key", (BatchKey, "BatchKey")),
                                  (ExecutionEngine.run_pipeline, "steps", (int, "int"))):
        p = inspect.signature(fn).parameters[name]
        assert p.default is inspect.Parameter.empty and p.annotation in annotations, f"{fn.__qualname__}: {p}"
