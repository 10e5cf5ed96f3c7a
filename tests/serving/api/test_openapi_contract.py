"""The OpenAPI document tells the truth: schemathesis runs every phase and every check (the CLI's
``--checks all``) against the Router's own document, in process (``from_asgi``, no Ray), and finds
no failure. Also the pieces of the contract one by one: 405 with ``Allow``, ``quality``'s values,
adapter paths under the deployment's roots."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.scenarios.factories import plan_entry
from tests.serving.api.router_harness import RouterHarness, running_router
from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.serving.jobs.store import JobStoreConfig
from xema_ray.templates import RequestTemplate

pytestmark = pytest.mark.slow

FLUX = RequestTemplate(model="tiny-flux2", width=64, height=64, steps=2)
FLUX_EDIT = FLUX.with_(references=1, reference_width=64, reference_height=64)
QWEN = RequestTemplate(model="tiny-qwen-image", width=64, height=64, steps=2)
LTX = RequestTemplate(model="tiny-ltx2", width=64, height=64, frames=9, steps=2)
LTX_I2V = LTX.with_(references=1, reference_width=64, reference_height=64)
REPO = Path(__file__).resolve().parents[3]

#: examples per operation and phase: what keeps the fuzz under a minute on 2 CPUs (the CLI run
#: against ``make serve`` in BENCHMARKS.md uses schemathesis' default of 100)
MAX_EXAMPLES = 4
#: denoising steps a generated request runs at most here (5..200 become 4, before it is sent: still
#: valid, and a 200-step request would take the whole budget); the document keeps the models' real ranges
FUZZ_MAX_STEPS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterHarness]:
    roots = tmp_path_factory.mktemp("adapters")
    plans = {t.shape_key: plan_entry(t, batch=b, latency_s=0.5, slo_s=60.0)
             for t, b in ((FLUX, 2), (FLUX_EDIT, 2), (QWEN, 1), (LTX, 1), (LTX_I2V, 1))}
    with running_router(plans, wait_window_s=0.05, jobs=JobStoreConfig(path=str(tmp_path_factory.mktemp("jobs"))),
                        adapters={"tiny-flux2": LoraPoolConfig(roots=(roots,), slots=2, max_rank=8)}) as h:
        h.adapter_root = roots  # type: ignore[attr-defined]
        yield h


def _doc(served: RouterHarness) -> dict:
    r = served.get("/openapi.json")
    assert r.status == 200, r.body[:300]
    return json.loads(r.body)


def test_schemathesis_checks_all_finds_no_failure(served: RouterHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase schemathesis runs (examples, coverage, fuzzing, stateful over the links it infers)
    with every check (``--checks all``: positive data accepted, negative data rejected, undeclared
    methods 405 with Allow, statuses, headers and bodies as documented, ...): 0 failures."""
    import schemathesis
    from schemathesis.config import SchemathesisConfig
    from schemathesis.engine import Status, events, from_schema

    monkeypatch.chdir(REPO)  # the repository's schemathesis.toml: its hooks draw real images
    config = SchemathesisConfig.from_path(str(REPO / "schemathesis.toml"))
    config.projects.override.checks.update(included_check_names=["all"])  # as the CLI's --checks all
    config.projects.override.generation.update(max_examples=MAX_EXAMPLES, deterministic=True)

    config.projects.override.update(request_timeout=120)  # a CPU request under load takes seconds

    @schemathesis.hook
    def before_call(ctx, case, kwargs):  # type: ignore[no-untyped-def]
        meta = getattr(case, "meta", None)
        if meta is None or not meta.generation.mode.is_positive:
            return  # a negative case is refused before it runs: left exactly as generated
        body = getattr(case, "body", None)
        body = getattr(body, "body", body)  # a form with content types wraps its fields
        steps = body.get("num_inference_steps") if isinstance(body, dict) else None
        if isinstance(steps, int) and not isinstance(steps, bool) and FUZZ_MAX_STEPS < steps <= 200:
            body["num_inference_steps"] = FUZZ_MAX_STEPS  # still valid: the case stays what it was

    doc = _doc(served)
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", served.asgi_app(), config=config)
        failures: list[str] = []
        unmutated: list[str] = []  # schemathesis' own false positive (_unmutated_negative)
        mislabelled: list[str] = []  # labelled positive, rejected by the document itself (_document_rejects)
        errors: list[str] = []
        cases = 0
        for event in from_schema(schema).execute():
            if isinstance(event, events.ScenarioFinished):
                for case_id, checks in event.recorder.checks.items():
                    cases += 1
                    for c in checks:
                        if c.status != Status.FAILURE or c.failure_info is None:
                            continue
                        line = (f"{event.label} {event.phase} [{case_id}] {c.name}: {c.failure_info.failure.title}: "
                                f"{c.failure_info.failure.message[:300]} <- {c.failure_info.code_sample[:3000]}")
                        case = event.recorder.cases[case_id].value
                        if _unmutated_negative(c.name, case.meta):
                            unmutated.append(line)
                        elif c.name == "positive_data_acceptance" and _document_rejects(doc, case):
                            mislabelled.append(line)
                        else:
                            failures.append(line)
            elif isinstance(event, events.NonFatalError | events.FatalError):
                errors.append(str(getattr(event, "info", event)))
    finally:
        schemathesis.hooks.unregister(before_call)
    print(f"\nschemathesis --checks all in process: {cases} cases, {len(failures)} failures, {len(errors)} errors, "
          f"{len(unmutated)} cases labelled negative with nothing negated, {len(mislabelled)} cases labelled "
          "positive that the document rejects", *unmutated, *mislabelled, sep="\n")
    assert not errors, errors
    assert cases > 50 and failures == [], "\n".join(sorted(set(failures)))


def _unmutated_negative(check: str, meta) -> bool:  # type: ignore[no-untyped-def]
    """A case schemathesis labels negative although it negated nothing (no mutation; its own
    description "Positive test case"): a request valid against the document, which the server
    rightly accepts. schemathesis flips a body to negative when it tries to negate it, even when it
    falls back to a positive value (its ``has_only_additional_properties_in_non_body_parameters``
    says so), and its re-check of a form as sent cannot read a file part, so such a case with an
    image upload is reported (schemathesis issue #2983, open, for the stateful phase). Counted and
    printed, not failed; any case that negated something still fails the test."""
    data = getattr(getattr(meta, "phase", None), "data", None)
    return (check == "negative_data_rejection" and getattr(data, "mutations", None) == ()
            and getattr(data, "description", None) == "Positive test case")


def _as_sent(value: object) -> object:
    """A generated body as JSON Schema sees it: a file part (``Binary``) is a string."""
    from schemathesis.generation.value import Binary

    if isinstance(value, Binary):
        return ""
    if isinstance(value, dict):
        return {k: _as_sent(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_sent(v) for v in value]
    return value


def _document_rejects(doc: dict, case) -> bool:  # type: ignore[no-untyped-def]
    """Whether the case's body is invalid against the operation's own request schema in ``doc``.
    schemathesis' stateful phase overlays literals it found in the application's source
    ("constants", e.g. ``"redis"`` into a form's ``num_inference_steps``) onto a positive case,
    checking each against the property's schema in the one ``anyOf`` branch it came from, which
    leaves the base schema's ``type`` out; its whole-body re-check cannot read a file part and
    passes. Such a case is not valid data, and the server is right to refuse it: counted and
    printed, not failed. So is a form whose file field holds a text part or bytes that are not a
    PNG, JPEG or WebP (an overlaid literal in place of the hooks' images): the document's schema
    says ``format: binary`` and its description names the formats. A case the document accepts
    that the server refuses still fails."""
    import jsonschema_rs

    op = doc["paths"].get(case.operation.path, {}).get(case.method.lower(), {})
    content = op.get("requestBody", {}).get("content", {})
    media = case.media_type or next(iter(content), None)
    schema = content.get(media, {}).get("schema") if media else None
    body = getattr(case.body, "body", case.body)  # a form with content types wraps its fields
    if schema is None or not isinstance(body, dict):
        return False
    validator = jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]})
    return not validator.is_valid(_as_sent(body)) or not all(_is_image_file(v) for v in _file_parts(doc, schema, body))


def _file_parts(doc: dict, schema: dict, body: dict) -> list[object]:
    """The values of a form's file fields (``format: binary``, or an array of them)."""
    name = schema.get("$ref", "").rsplit("/", 1)[-1]
    props = doc["components"]["schemas"].get(name, {}).get("properties", {})
    out: list[object] = []
    for field, prop in props.items():
        if field not in body:
            continue
        if prop.get("format") == "binary":
            out.append(body[field])
        elif prop.get("items", {}).get("format") == "binary":
            out += body[field] if isinstance(body[field], list) else [body[field]]
    return out


def _is_image_file(value: object) -> bool:
    """A file part the document describes: bytes of a PNG, JPEG or WebP (what a JSON Schema cannot
    say; the descriptions do). A text part, or bytes of anything else, is not one."""
    import io

    from PIL import Image
    from schemathesis.generation.value import Binary

    if not isinstance(value, Binary):
        return False
    try:
        with Image.open(io.BytesIO(value.data)) as im:
            return im.format in ("PNG", "JPEG", "WEBP")
    except Exception:
        return False


def test_a_case_the_document_rejects_is_told_apart_from_one_it_accepts(served: RouterHarness) -> None:
    """The filter above names only schema-invalid bodies: the CI run's case (a form's
    ``num_inference_steps: "redis"``) is rejected by the document; the same form with an integer is not."""
    import io
    from types import SimpleNamespace

    from PIL import Image
    from schemathesis.generation.value import Binary

    doc = _doc(served)
    op = SimpleNamespace(path="/v1/images/edits")
    png = io.BytesIO()
    Image.new("RGB", (64, 64)).save(png, format="PNG")
    form = {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64", "image": [Binary(png.getvalue())],
            "num_inference_steps": 4}
    ok = SimpleNamespace(operation=op, method="POST", media_type="multipart/form-data", body=form)
    bad = SimpleNamespace(operation=op, method="POST", media_type="multipart/form-data",
                          body={**form, "num_inference_steps": "redis"})
    assert not _document_rejects(doc, ok) and _document_rejects(doc, bad)
    for not_an_image in (["mitigations"], [Binary(b"\x89PNG")]):  # a text part; bytes that decode as nothing
        assert _document_rejects(doc, SimpleNamespace(**{**vars(ok), "body": {**form, "image": not_an_image}}))
    ltx = SimpleNamespace(operation=SimpleNamespace(path="/v1/videos"), method="POST", media_type="application/json",
                          body={"model": "tiny-ltx2", "prompt": "p", "size": "64x64"})
    assert not _document_rejects(doc, ltx)
    assert _document_rejects(doc, SimpleNamespace(**{**vars(ltx), "body": {**ltx.body, "input_reference": "mitigations"}}))


def test_an_undeclared_method_is_405_with_allow(served: RouterHarness) -> None:
    from tests.serving.api.asgi_client import call

    for method, path, allow in (("TRACE", "/healthz", "GET"), ("PUT", "/v1/videos", "GET, POST"),
                                ("PATCH", "/v1/adapters/x", "DELETE")):
        r = served.run(call(served.app, method, path))
        assert r.status == 405, (method, path, r.body[:200])
        assert r.headers["allow"] == allow and r.json()["error"]["code"] == "method_not_allowed"


def test_the_document_is_the_deployments(served: RouterHarness) -> None:
    doc = _doc(served)
    c = doc["components"]["schemas"]
    image = c["ImageRequest"]
    assert image["additionalProperties"] is False and image["properties"]["model"]["enum"] == ["tiny-flux2",
                                                                                              "tiny-qwen-image"]
    branches = {b["x-template"]: b["properties"] for b in image["anyOf"]}
    assert branches[FLUX.shape_key]["n"] == {"maximum": 2} and branches[FLUX.shape_key]["negative_prompt"] == \
        {"type": "null"}
    assert branches[FLUX.shape_key]["lora"] == {"maxItems": 2} and branches[QWEN.shape_key]["lora"] == {"type": "null"}
    assert set(image["properties"]["quality"]["anyOf"][0]["enum"]) >= {"high", "low", "auto", "hd", "lossless"}
    create = c["VideoCreate"]
    i2v = next(b for b in create["anyOf"] if b["x-template"] == LTX_I2V.shape_key)
    assert "input_reference" in i2v["required"]
    assert "null" not in json.dumps(c["VideoCreateForm"]["properties"]["seed"])  # a form has no null
    assert c["AdapterSource"]["properties"]["model"]["enum"] == ["tiny-flux2"]
    delete = doc["paths"]["/v1/adapters/{name}"]["delete"]["parameters"]
    assert next(p for p in delete if p["name"] == "model")["schema"]["enum"] == ["tiny-flux2", "tiny-ltx2",
                                                                                 "tiny-qwen-image"]


@pytest.mark.parametrize("quality", ["high", "low", "auto", "hd", "medium", "standard", "lossless"])
def test_openai_quality_values_are_served(served: RouterHarness, quality: str) -> None:
    r = served.post("/v1/images/generations", {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64",
                                               "quality": quality})
    assert r.status == 200, r.body[:300]


def test_error_raised_if_quality_is_not_an_accepted_value(served: RouterHarness) -> None:
    r = served.post("/v1/images/generations", {"model": "tiny-flux2", "prompt": "a fox", "size": "64x64",
                                               "quality": "ultra"})
    assert r.status == 422, r.body[:300]
    err = r.json()["error"]
    assert err["param"] == "quality" and "'high'" in err["message"] and "'lossless'" in err["message"]


def test_error_raised_if_an_adapter_path_is_outside_the_roots(served: RouterHarness, tmp_path: Path) -> None:
    """The same 403 for a file that exists, one that does not, and a link inside the roots that
    resolves outside them: the answer tells nothing about the server's files."""
    outside = tmp_path / "real.safetensors"
    outside.write_bytes(b"x")
    link = served.adapter_root / "link.safetensors"  # type: ignore[attr-defined]
    link.symlink_to(outside)
    answers = []
    for path in (outside, tmp_path / "missing.safetensors", link, Path("/etc/passwd")):
        r = served.post("/v1/adapters", {"name": "style", "model": "tiny-flux2", "path": str(path)})
        assert r.status == 403, r.body[:300]
        answers.append(r.json()["error"])
    assert all(a == answers[0] for a in answers) and answers[0]["param"] == "path"
    assert answers[0]["code"] == "adapter_path_refused"


def test_the_openai_client_sends_quality_and_gets_a_422_naming_it(served: RouterHarness) -> None:
    """``images.generate(quality=...)`` of the official client: OpenAI's values are served, any
    other value is a 422 naming ``quality``."""
    import openai

    client = openai.OpenAI(base_url=f"{served.serve_http()}/v1", api_key="unused", max_retries=0, timeout=120)
    for quality in ("high", "low", "auto", "hd"):
        img = client.images.generate(model="tiny-flux2", prompt="a fox", size="64x64", quality=quality,  # type: ignore[arg-type]
                                     response_format="b64_json")
        assert img.data and img.data[0].b64_json, quality
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.images.generate(model="tiny-flux2", prompt="a fox", size="64x64", quality="ultra")  # type: ignore[arg-type]
    assert e.value.body["param"] == "quality" and "'high'" in e.value.body["message"]  # type: ignore[index]
