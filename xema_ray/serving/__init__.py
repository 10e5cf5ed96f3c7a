"""Serving (paper §4, §8): the Ray Serve application, in five rooms and a few modules at the root.

Each folder and each module at the root is a room, ranked in ``tests/test_layering.py``
(``SERVING_LAYERS``, with the reason for each rank); imports between rooms run down the ranks:

- ``messages`` (what crosses between the Router and a group), ``frame_rate``, ``replica_bind``:
  the words every room speaks, importing no room;
- ``jobs/``: the video job store (SQLite / Redis), job progress, a group's job lifecycle;
- ``scale/``: replica routing, the replica summary, autoscaling (policies over summaries);
- ``group/``: a model's GPU worker set behind one Serve deployment (``ModelGroup``, its
  ``ModelGroupConfig``), the worker-set seam, what it publishes for routing and scaling, metrics;
- ``stats``: ``/v1/stats``'s answer and the Stats deployment that keeps its counters;
- ``console/``: the operator view's data, read from the groups, the summaries and the stats;
- ``api/``: the HTTP ingress (Router), its schemas, validation, errors, auth, the video job API;
- ``config`` (the app's one typed config, over every room's), ``ray_env``, ``startup``.

The dispatch policy itself is ``xema_ray.scheduling``, shared with the simulator.
"""
