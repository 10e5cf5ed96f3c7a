"""Request templates: the (model, height, width, frames, steps, batch) a request is served as.

The paper (§2.1) plans per template because the operator sequence, tensor shapes and lifetimes
are fixed by it. Validation lives here so every entry point (CLI, planner, HTTP API) rejects the
same shapes with the same message.

Paper resolutions that a model cannot take are mapped to the nearest valid size (ties go up, so
memory is never under-estimated); ``PAPER_RESOLUTION_MAP`` records each mapping:

======================  ==============  ==========================================================
paper                   ours            why
======================  ==============  ==========================================================
CogVideoX 900p 1600x900  1600x896        latent height 900/8 = 112.5; patch 2 needs an even latent
CogVideoX 1080p 1920x1080 1920x1088      latent height 135 is odd; 1072 and 1088 tie, take 1088
LTX-2 480p 854x480      864x480         LTX-2 needs multiples of 32; 864 is nearest to 16:9's 853
LTX-2 720p 1280x720     1280x704        720 is not a multiple of 32; 704 and 736 tie, 704 is what
                                        the LTX-2 pipeline and docs/measured-facts.md use
LTX-2 1080p 1920x1080   1920x1088       1088 is the nearest multiple of 32
======================  ==============  ==========================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer, model_validator

if TYPE_CHECKING:
    from xema_ray.models.base import ModelSpec


class RequestTemplate(BaseModel):
    """One servable request shape.

    Example:
        >>> t = RequestTemplate(model="cogvideox-5b", height=720, width=1280, frames=49)
        >>> t.key
        'cogvideox-5b/1280x720x49/s50/b1'
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(description="Registry name: flux2, cogvideox-5b, ltx2, wan2.2-t2v-a14b (or a tiny-* variant).")
    height: int = Field(gt=0, description="Output height in pixels.")
    width: int = Field(gt=0, description="Output width in pixels.")
    frames: int = Field(default=1, ge=1, description="Output frames; 1 for image models.")
    steps: int = Field(default=50, ge=1, le=1000, description="Denoising steps.")
    batch: int = Field(default=1, ge=1, le=256, description="Requests executed together.")
    references: int = Field(default=0, ge=0, le=16, description="Reference images each request conditions on "
                            "(Flux.2 edits: appended to the sequence; image-to-video: the first frame); 0 = none.")
    reference_width: int = Field(default=0, ge=0, description="Width each reference is encoded at (0 without "
                                 "references; defaults to the output width).")
    reference_height: int = Field(default=0, ge=0, description="Height each reference is encoded at (0 without "
                                  "references; defaults to the output height).")

    @model_validator(mode="before")
    @classmethod
    def _default_reference_size(cls, data: object) -> object:
        # a template with references encodes them at its output size unless it names another
        if isinstance(data, dict) and data.get("references"):
            data = dict(data)
            data["reference_width"] = data.get("reference_width") or data.get("width", 0)
            data["reference_height"] = data.get("reference_height") or data.get("height", 0)
        return data

    @model_serializer(mode="wrap")
    def _drop_unused_reference_fields(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # a template without references dumps as it always did: plan tables, config hashes and
        # profile-store keys written before templates had references stay valid
        out: dict[str, Any] = handler(self)
        if not self.references:
            for name in ("references", "reference_width", "reference_height"):
                out.pop(name, None)
        return out

    @model_validator(mode="after")
    def _check_against_model(self) -> RequestTemplate:
        spec = self.spec
        spec.validate_shape(self.height, self.width, self.frames)
        if self.references == 0 and (self.reference_width or self.reference_height):
            raise ValueError(f"reference_width/reference_height ({self.reference_width}x{self.reference_height}) "
                             "need references >= 1")
        spec.reference_inputs().validate(self)
        return self

    @property
    def spec(self) -> ModelSpec:
        from xema_ray.models import get_model_spec

        return get_model_spec(self.model)

    @property
    def key(self) -> str:
        """Stable string key used by plan tables, profile stores and file names."""
        return f"{self.shape_key}/s{self.steps}/b{self.batch}"

    @property
    def shape_key(self) -> str:
        """Key without steps and batch: what a client request maps onto. A template with reference
        images says how many and at what size (``tiny-flux2/64x64x1/ref2@64x64``): requests with
        another count are another template, so batches never mix them."""
        base = f"{self.model}/{self.width}x{self.height}x{self.frames}"
        if self.references:
            base += f"/ref{self.references}@{self.reference_width}x{self.reference_height}"
        return base

    def latent_shape(self) -> tuple[int, ...]:
        """Shape of the latent the denoiser works on (batch included), as the pipeline builds it."""
        return self.spec.latent_shape(self)

    def token_counts(self) -> dict[str, int]:
        """Sequence lengths per stream (e.g. ``{"image": 4096, "text": 512}``) for one request."""
        return self.spec.token_counts(self)

    @property
    def latent_length(self) -> int:
        """Latent tokens of one request's image or video stream: the L_i of the paper's skewed
        request mix (Figure 10, p_i ∝ exp(α L_i / L_max))."""
        counts = self.spec.token_counts(self.with_(batch=1))
        return counts["video"] if "video" in counts else counts["image"]

    def with_(self, **changes: int | str) -> RequestTemplate:
        """A validated copy with some fields changed (``model_copy`` would skip validation)."""
        return RequestTemplate(**{**self.model_dump(), **changes})


#: the frame counts the paper's videos are planned at (§9.1)
PAPER_FRAMES = (49, 65, 81)


class PaperResolution(BaseModel):
    """How a resolution named in the paper maps onto a valid size for one model."""

    model_config = ConfigDict(frozen=True)

    model: str
    name: str
    paper_width: int
    paper_height: int
    width: int
    height: int
    reason: str = ""
    #: the frame counts the paper plans this resolution at (an image: 1)
    frames: tuple[int, ...] = PAPER_FRAMES


PAPER_RESOLUTION_MAP: list[PaperResolution] = [
    *(
        PaperResolution(model="flux2", name=f"{s}px", paper_width=s, paper_height=s, width=s, height=s, frames=(1,))
        for s in (256, 512, 768, 1024, 1280, 2048)
    ),
    PaperResolution(model="cogvideox-5b", name="720p", paper_width=1280, paper_height=720, width=1280, height=720),
    PaperResolution(
        model="cogvideox-5b",
        name="900p",
        paper_width=1600,
        paper_height=900,
        width=1600,
        height=896,
        reason="latent height 112.5 is not an integer; patch size 2 needs an even latent size",
    ),
    PaperResolution(
        model="cogvideox-5b",
        name="1080p",
        paper_width=1920,
        paper_height=1080,
        width=1920,
        height=1088,
        reason="latent height 135 is odd; patch size 2 needs an even latent size (1072/1088 tie, go up)",
    ),
    PaperResolution(
        model="ltx2",
        name="480p",
        paper_width=854,
        paper_height=480,
        width=864,
        height=480,
        reason="LTX-2 needs multiples of 32; 864 is the nearest to 854",
    ),
    PaperResolution(
        model="ltx2",
        name="720p",
        paper_width=1280,
        paper_height=720,
        width=1280,
        height=704,
        reason="LTX-2 needs multiples of 32; 704/736 tie, 704 is the size the LTX-2 pipeline documents",
    ),
    PaperResolution(
        model="ltx2",
        name="1080p",
        paper_width=1920,
        paper_height=1080,
        width=1920,
        height=1088,
        reason="LTX-2 needs multiples of 32; 1088 is the nearest to 1080",
    ),
]


def paper_templates(steps: int = 50) -> list[RequestTemplate]:
    """The paper's templates (§9.1): 6 Flux.2 images, 9 CogVideoX-5B and 9 LTX-2 videos.

    The paper calls them "21 request templates" but enumerates 6 + 3×3 + 3×3 = 24; all 24 are here.
    """
    out: list[RequestTemplate] = []
    for res in PAPER_RESOLUTION_MAP:
        for f in res.frames:
            out.append(RequestTemplate(model=res.model, height=res.height, width=res.width, frames=f, steps=steps))
    return out


def tiny_templates(steps: int = 4) -> list[RequestTemplate]:
    """Small templates of the tiny models: what tests, CI and the CPU demo serve."""
    return [
        RequestTemplate(model="tiny-flux2", height=64, width=64, steps=steps),
        RequestTemplate(model="tiny-flux2", height=128, width=128, steps=steps),
        RequestTemplate(model="tiny-cogvideox", height=64, width=64, frames=9, steps=steps),
        # 17 frames, as deployments/xema.yaml serves it (an odd latent frame count: tiny CogVideoX
        # decodes even ones to the wrong length), so that `--templates tiny` plans what `make serve` serves
        RequestTemplate(model="tiny-cogvideox", height=96, width=128, frames=17, steps=steps),
        RequestTemplate(model="tiny-ltx2", height=64, width=64, frames=9, steps=steps),
        RequestTemplate(model="tiny-ltx2", height=96, width=128, frames=17, steps=steps),
    ]


def model_templates(model: str, steps: int | None = None) -> list[RequestTemplate]:
    """The templates a model's spec names (``ModelSpec.reference_sizes``, e.g. Wan2.2's 480p and
    720p at 81 frames) at its reference step count; empty for a model that names none.

    Example:
        >>> [t.key for t in model_templates("wan2.2-t2v-a14b")]
        ['wan2.2-t2v-a14b/832x480x81/s40/b1', 'wan2.2-t2v-a14b/1280x720x81/s40/b1']
    """
    from xema_ray.models import get_model_spec

    spec = get_model_spec(model)
    n = spec.reference_steps if steps is None else steps
    required = spec.reference_inputs().required_references
    refs = {"references": required} if required else {}
    return [RequestTemplate(model=model, width=w, height=h, frames=f, steps=n, **refs) for w, h, f in spec.reference_sizes]


NAMED_TEMPLATE_SETS = {"paper": paper_templates, "tiny": tiny_templates}


def named_templates(name: str, steps: int | None = None) -> list[RequestTemplate]:
    """A named set ("paper" or "tiny") or a registered model's own templates (``model_templates``);
    ``steps`` overrides each set's default."""
    from xema_ray.models import MODEL_NAMES

    if name in MODEL_NAMES:
        found = model_templates(name, steps)
        if found:
            return found
    try:
        make = NAMED_TEMPLATE_SETS[name]
    except KeyError:
        raise ValueError(f"unknown template set {name!r}; known: {sorted(NAMED_TEMPLATE_SETS)} or a model "
                         "that names its templates") from None
    return make() if steps is None else make(steps=steps)
