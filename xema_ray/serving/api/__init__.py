"""The HTTP front door: the Router (Ray Serve + FastAPI), request schemas and validation, errors,
auth, middlewares, the OpenAPI document, the Router's view of its groups' health, and what the
Router does for the video job API (``video_jobs.py``, over the job store in ``jobs/``)."""
