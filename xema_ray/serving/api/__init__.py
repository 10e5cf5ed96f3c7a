"""The HTTP front door: the Router (Ray Serve + FastAPI), request schemas and validation, errors,
auth, middlewares, the OpenAPI document, the Router's view of its groups' health."""
