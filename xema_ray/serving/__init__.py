"""Serving (paper §4, §8): the Ray Serve application, in four rooms and a little glue.

- ``api/``: the HTTP ingress (Router), its schemas, validation, errors, auth, OpenAPI, health;
- ``group/``: a model's GPU worker set behind one Serve deployment (``ModelGroup``), the
  worker-set seam, what crosses between Router and group, its metrics;
- ``jobs/``: the video job store (SQLite / Redis), job progress, the ``/v1/videos`` lifecycle;
- ``scale/``: replica routing, the published replica summary, autoscaling;
- here: ``config`` (the app's one typed config), ``startup`` (its checks), ``ray_env``.

The dispatch policy itself is ``xema_ray.scheduling``, shared with the simulator.
"""
