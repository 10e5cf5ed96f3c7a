"""The request schemas narrowed to what one deployment serves, so that a request valid against the
document is one the server takes, and a request it refuses is invalid against the document.

What pydantic derives from the request models says what any deployment could take; what this one
takes depends on its table, known only when the app starts. ``narrow`` writes that into the
components ``build_openapi`` made:

- ``additionalProperties: false`` on every request body: an option the endpoint does not know is
  refused (400 ``unknown_option``), never ignored;
- one ``anyOf`` branch per served template (``x-template`` names it): its model, size, frames,
  ``n`` up to the template's planned batch, the number of reference images, and its model's
  options (guidance and steps ranges; ``negative_prompt`` and ``true_cfg_scale`` only where the
  model takes them; ``lora`` only where its group has ``adapters:``, at most ``max_per_request``);
- ``response_format: url`` only with the job store; ``quality`` the accepted values;
- ``input_reference`` (JSON) a ``data:image/...;base64,`` URL, ``format: image-data-url``;
- a ``<Name>Form`` twin of each body for ``multipart/form-data``: a form has no ``null`` (a field
  left out is the default), its files are ``format: binary`` parts, and a model's option it does
  not take is absent rather than null.

A JSON Schema cannot say "bytes that decode as a PNG": the document names the formats (PNG, JPEG,
WebP) in the descriptions and ``format: binary`` / ``image-data-url``; a fuzzer needs a generator
of real images for those (the repository's ``schemathesis.toml`` hooks supply one).
"""

from __future__ import annotations

import copy
from typing import Any

from xema_ray.lora_pool import LoraPoolConfig
from xema_ray.models.options import OptionRules
from xema_ray.serving.api.quality import ACCEPTED, TIER_NAMES
from xema_ray.serving.api.videos import served_seconds
from xema_ray.templates import RequestTemplate

#: a JSON body's image: a data URL of one of the accepted formats (docs/api.md "Image inputs")
IMAGE_DATA_URL = {"type": "string", "format": "image-data-url", "pattern": r"^data:image/(png|jpeg|webp);base64,",
                  "description": "a 'data:image/png;base64,...' URL (PNG, JPEG or WebP)"}
#: what ``edits.data_url_upload`` takes: the URL, or OpenAI's newer ``{"image_url": URL}``
IMAGE_REFERENCE = {"anyOf": [IMAGE_DATA_URL, {"type": "object", "properties": {"image_url": IMAGE_DATA_URL},
                                              "required": ["image_url"]}]}
_BINARY = {"type": "string", "format": "binary"}
#: request schema -> (model kind, which templates: "none" without references, "some" with, "any")
REQUEST_SCHEMAS = {"ImageRequest": ("image", "none"), "ImageEditRequest": ("image", "some"),
                   "VideoRequest": ("video", "none"), "VideoCreate": ("video", "any")}
#: each body's file fields in its form twin (a list: repeated parts, ``image[]`` as well)
FORM_FILES = {"ImageEditRequest": {"image": {"type": "array", "items": _BINARY, "minItems": 1,
                                             "description": "the reference image(s), PNG, JPEG or WebP: one part "
                                                            "per file, named 'image' or 'image[]'"}},
              "VideoCreate": {"input_reference": {**_BINARY, "description": "image-to-video: the first frame, PNG, "
                                                                           "JPEG or WebP"}}}
_NULL = {"type": "null"}


def _size(t: RequestTemplate) -> str:
    return f"{t.width}x{t.height}"


def _options(rules: OptionRules, props: dict[str, Any], pool: LoraPoolConfig | None) -> dict[str, Any]:
    """A model's option rules as property constraints (a branch ANDs them with the base schema)."""
    out: dict[str, Any] = {}
    if "guidance_scale" in props:
        out["guidance_scale"] = {"minimum": rules.guidance_min, "maximum": rules.guidance_max}
    if "num_inference_steps" in props:
        out["num_inference_steps"] = {"minimum": rules.steps_min, "maximum": rules.steps_max}
    if "negative_prompt" in props and not rules.negative_prompt:
        out["negative_prompt"] = _NULL
    if "true_cfg_scale" in props and not rules.true_cfg_scale:
        out["true_cfg_scale"] = _NULL
    if "guidance_scale_2" in props:
        out["guidance_scale_2"] = ({"minimum": rules.guidance_min, "maximum": rules.guidance_max}
                                   if rules.guidance_scale_2 else _NULL)
    if "lora" in props:
        out["lora"] = _NULL if pool is None else {"maxItems": pool.max_per_request}
    return out


def _with_true_cfg(branch: dict[str, Any], rules: OptionRules) -> list[dict[str, Any]]:
    """A model with a true CFG scale takes it or ``guidance_scale``, not both (they are one scale)."""
    if not rules.true_cfg_scale:
        return [branch]
    props = branch["properties"]
    return [{**branch, "properties": {**props, "true_cfg_scale": _NULL}},
            {**branch, "properties": {**props, "guidance_scale": _NULL}}]


def _quality(props: dict[str, Any], keys: list[str], tiers: dict[str, frozenset[str]]) -> dict[str, Any]:
    """``quality``'s values the templates ``keys`` all take: OpenAI's (resolved to what is served)
    and the tier names every one of them serves (``serving/api/quality.py``)."""
    if "quality" not in props:
        return {}
    served = frozenset.intersection(*(tiers.get(k, frozenset({"lossless"})) for k in keys))
    return {"quality": {"anyOf": [{"enum": [v for v in ACCEPTED if v not in TIER_NAMES or v in served]}, _NULL]}}


def _template_branches(name: str, ours: list[RequestTemplate], props: dict[str, Any], batches: dict[str, int],
                       pools: dict[str, LoraPoolConfig], tiers: dict[str, frozenset[str]]) -> list[dict[str, Any]]:
    """One branch per template of ``ours`` (an edit's: one per model and reference count)."""
    branches: list[dict[str, Any]] = []
    if name == "ImageEditRequest":
        groups: dict[tuple[str, int], list[RequestTemplate]] = {}
        for t in ours:
            groups.setdefault((t.model, t.references), []).append(t)
        for (model, refs), ts in sorted(groups.items()):
            rules = ts[0].spec.option_rules()
            p = {"model": {"const": model}, "size": {"enum": sorted({_size(t) for t in ts}) + ["auto"]},
                 "n": {"maximum": min(batches[t.shape_key] for t in ts)},
                 "image": {"minItems": refs, "maxItems": refs}, **_options(rules, props, pools.get(model)),
                 **_quality(props, [t.shape_key for t in ts], tiers)}
            branches += _with_true_cfg({"properties": p, "x-template": sorted(t.shape_key for t in ts)}, rules)
        return branches
    defaults = {}  # VideoCreate without size: the smallest template of the model and reference count
    for t in sorted(ours, key=lambda t: (t.width * t.height, t.frames)):
        defaults.setdefault((t.model, t.references), _size(t))
    for t in sorted(ours, key=lambda t: t.shape_key):
        rules = t.spec.option_rules()
        p: dict[str, Any] = {"model": {"const": t.model}, "size": {"const": _size(t)},
                             **_options(rules, props, pools.get(t.model)), **_quality(props, [t.shape_key], tiers)}
        required = ["model", "size"]
        if "n" in props:
            p["n"] = {"maximum": batches[t.shape_key]}
        if "num_frames" in props:
            p["num_frames"] = {"const": t.frames}
            if name == "VideoRequest":
                required.append("num_frames")
        if name == "VideoCreate":  # every field but model optional (null: not given)
            seconds = served_seconds(t)
            p["seconds"] = {"anyOf": [{"const": seconds}, {"const": float(seconds)}, _NULL]}
            p["num_frames"] = {"anyOf": [p["num_frames"], _NULL]}
            p["input_reference"] = IMAGE_REFERENCE if t.references else _NULL
            if t.references:
                required.append("input_reference")
            if defaults[(t.model, t.references)] == _size(t):  # the size a job without one gets
                required.remove("size")
                p["size"] = {"anyOf": [p["size"], _NULL]}
        branches += _with_true_cfg({"properties": p, "required": required, "x-template": t.shape_key}, rules)
    return branches


def narrow(components: dict[str, Any], served: dict[str, RequestTemplate], batches: dict[str, int],
           pools: dict[str, LoraPoolConfig], url_images: bool, tiers: dict[str, frozenset[str]] | None = None) -> None:
    """Narrow the request components to ``served`` (see the module).

    Args:
        components: the document's ``components.schemas`` (changed in place; ``<Name>Form`` added).
        served: the served templates by shape key.
        batches: each template's planned batch (the most ``n`` it takes).
        pools: the adapter pool of each model whose group has ``adapters:``.
        url_images: whether ``response_format: url`` is served (the job store is configured).
        tiers: the quality tiers each template is served at (a tier named by its name that a
            template does not serve is refused there; absent: lossless only).
    """
    for name, (kind, refs) in REQUEST_SCHEMAS.items():
        schema = components.get(name)
        if schema is None:
            continue
        props = schema["properties"]
        schema["additionalProperties"] = False
        ours = [t for t in served.values() if t.spec.kind == kind
                and (refs == "any" or (refs == "some") == (t.references > 0))]
        if "n" in props and ours:
            props["n"]["maximum"] = max(batches[t.shape_key] for t in ours)
        if "response_format" in props and not url_images:
            props["response_format"]["enum"] = ["b64_json"]
        if "input_reference" in props:
            props["input_reference"] = {"anyOf": [*IMAGE_REFERENCE["anyOf"], _NULL], "default": None,
                                        "description": props["input_reference"].get("description", "")}
        if ours:
            schema["anyOf"] = _template_branches(name, ours, props, batches, pools, tiers or {})
    adapter = components.get("AdapterSource")
    if adapter is not None:
        adapter["additionalProperties"] = False
        if pools:
            adapter["properties"]["model"] = {**adapter["properties"]["model"], "enum": sorted(pools)}
    for name in (*REQUEST_SCHEMAS, "AdapterSource"):
        if name in components:
            components[f"{name}Form"] = form_schema(components[name], FORM_FILES.get(name, {}))


def _no_null(schema: Any) -> Any:
    """``schema`` as a form field: no null branch (a form leaves the field out), null -> absent."""
    if schema == _NULL:
        return False
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if not (k == "default" and v is None)}
    if "anyOf" in out:
        kept = [b for b in out["anyOf"] if b != _NULL]
        out.pop("anyOf")
        if len(kept) == 1:
            out = {**kept[0], **out}
        elif kept:
            out["anyOf"] = kept
    return out


def form_schema(schema: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
    """The ``multipart/form-data`` twin of a JSON body schema (see the module)."""
    form = copy.deepcopy(schema)
    form["properties"] = {k: _no_null(v) for k, v in form["properties"].items()}
    form["properties"].update(copy.deepcopy(files))
    for branch in form.get("anyOf", []):
        props = branch["properties"]
        for k in list(props):
            if k in files and props[k] == IMAGE_REFERENCE:
                props[k] = {}  # the file part itself (the base schema says binary)
            else:
                props[k] = _no_null(props[k])
    required = set(form.get("required", [])) | {f for f, prop in files.items() if prop.get("minItems")}
    if required:
        form["required"] = sorted(required)
    form["title"] = f"{schema.get('title', '')} (multipart/form-data)".strip()
    return form
