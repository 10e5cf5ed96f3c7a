"""The request options a model's pipeline takes, and the ranges it accepts: checked per request
before admission, so that a request whose options the pipeline would refuse is answered 4xx
naming the field and the range, and never reaches (and fails) the batch it would join.

Each ``ModelSpec`` answers ``option_rules()`` from what its diffusers pipeline does:

| model | guidance_scale | negative_prompt | true_cfg_scale | guidance_scale_2 |
| --- | --- | --- | --- | --- |
| Flux.2 | guidance-distilled: an embedding input, any value in [0, 50] | no (no CFG pass) | no | no |
| CogVideoX | CFG when > 1 (``do_classifier_free_guidance = guidance_scale > 1``) | yes | no | no |
| LTX-2 | >= 1 (1 disables video CFG; audio CFG keeps running) | yes | no | no |
| Wan2.2 | CFG when > 1 (A14B: the high-noise expert's) | yes | no | A14B: the low-noise expert's (default: ``guidance_scale``) |
| Qwen-Image | is the true CFG scale (true CFG when > 1 and a negative prompt is given) | yes | yes | no |

Memory: a model that runs CFG is traced with its negative prompt already in the batch (the
spec's ``prompt_embeddings`` carry ``negative_prompt_embeds`` at the template's shape: CFG
doubles the transformer batch, or Qwen-Image's second call), so a client's own negative prompt
changes values, never shapes: the template's trace, plan and layout stand as they are.

Example:
    >>> r = OptionRules(guidance_min=1.0, negative_prompt=True)
    >>> r.check("tiny-ltx2", guidance_scale=0.0)
    Traceback (most recent call last):
    ...
    xema_ray.models.options.OptionRefused: guidance_scale=0.0 is out of range for tiny-ltx2: accepted [1, 50] (1 disables video classifier-free guidance)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

#: the widest guidance range the API takes for any model (the request schemas' bound)
GUIDANCE_MAX = 50.0
#: the most denoising steps one request may ask for (the request schemas' bound)
STEPS_MAX = 200


class OptionRefused(ValueError):
    """A request option the model's pipeline does not take, or a value outside its range.

    ``status`` is 422 for a value out of the model's range, 400 for an option the model does not
    take at all. Every value sits in ``args``: it may cross a process boundary by pickle."""

    def __init__(self, message: str, param: str, status: int = 422) -> None:
        super().__init__(message, param, status)
        self.param = param
        self.status = status

    def __str__(self) -> str:
        return str(self.args[0])


def _fmt(x: float) -> str:
    return f"{x:g}"


class OptionRules(BaseModel):
    """What a model's pipeline accepts for the per-request options (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    guidance_min: float = Field(default=0.0, ge=0.0, description="smallest guidance_scale the pipeline takes")
    guidance_max: float = Field(default=GUIDANCE_MAX, le=GUIDANCE_MAX, description="largest guidance_scale")
    guidance_note: str = Field(default="", description="what guidance_scale means for this model")
    negative_prompt: bool = Field(default=False, description="runs classifier-free guidance: takes a negative prompt")
    true_cfg_scale: bool = Field(default=False, description="the pipeline has a true_cfg_scale (Qwen-Image)")
    guidance_scale_2: bool = Field(default=False, description="the pipeline has a second expert with its own "
                                                              "guidance_scale_2 (Wan2.2 A14B; same range as "
                                                              "guidance_scale, default guidance_scale)")
    steps_min: int = Field(default=1, ge=1, description="fewest denoising steps a request may ask for")
    steps_max: int = Field(default=STEPS_MAX, ge=1, le=STEPS_MAX, description="most denoising steps")

    def describe(self) -> str:
        """One line for the OpenAPI document and ``/v1/templates``."""
        g = f"guidance_scale in [{_fmt(self.guidance_min)}, {_fmt(self.guidance_max)}]"
        if self.guidance_note:
            g += f" ({self.guidance_note})"
        takes = [n for n, ok in (("negative_prompt", self.negative_prompt), ("true_cfg_scale", self.true_cfg_scale),
                                 ("guidance_scale_2", self.guidance_scale_2)) if ok]
        return (f"{g}; num_inference_steps in [{self.steps_min}, {self.steps_max}]; "
                + (f"takes {', '.join(takes)}" if takes else "no negative_prompt (no classifier-free guidance pass)"))

    def check(self, model: str, guidance_scale: float | None = None, negative_prompt: str | None = None,
              true_cfg_scale: float | None = None, steps: int | None = None,
              takers: dict[str, list[str]] | None = None, guidance_scale_2: float | None = None) -> None:
        """Raise ``OptionRefused`` naming the first option ``model`` cannot take as given.

        Args:
            model: the model's name (for the message).
            guidance_scale, negative_prompt, true_cfg_scale, steps, guidance_scale_2: the request's
                values (None: not given).
            takers: option -> the served models that take it, for the message of a 400.
        """
        takers = takers or {}
        for name, given, ok in (("negative_prompt", negative_prompt, self.negative_prompt),
                                ("true_cfg_scale", true_cfg_scale, self.true_cfg_scale),
                                ("guidance_scale_2", guidance_scale_2, self.guidance_scale_2)):
            if given is not None and not ok:
                who = takers.get(name)
                raise OptionRefused(f"{model} does not take {name}"
                                    + (f"; served models that do: {', '.join(who)}" if who else
                                       "; no served model takes it"), name, 400)
        for name, value in (("guidance_scale", guidance_scale), ("true_cfg_scale", true_cfg_scale),
                            ("guidance_scale_2", guidance_scale_2)):
            if value is not None and not (self.guidance_min <= value <= self.guidance_max):
                note = f" ({self.guidance_note})" if self.guidance_note else ""
                raise OptionRefused(f"{name}={value!r} is out of range for {model}: accepted "
                                    f"[{_fmt(self.guidance_min)}, {_fmt(self.guidance_max)}]{note}", name)
        if steps is not None and not (self.steps_min <= steps <= self.steps_max):
            raise OptionRefused(f"num_inference_steps={steps} is out of range for {model}: accepted "
                                f"[{self.steps_min}, {self.steps_max}]", "num_inference_steps")
