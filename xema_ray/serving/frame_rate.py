"""The frame rate a video template is encoded at, read by every room that counts in seconds of video:
the API (``seconds`` <-> frames, a job's duration), the group's metrics (the realtime factor). At the
bottom of ``serving/``: the API and the group both reach it, and it imports no room of ``serving/``."""

from __future__ import annotations

from xema_ray.runtime.requests import DEFAULT_VIDEO_FPS
from xema_ray.templates import RequestTemplate


def video_fps(t: RequestTemplate) -> float:
    """The frame rate the engine encodes ``t``'s model at."""
    return float(getattr(t.spec, "frame_rate", DEFAULT_VIDEO_FPS))
