"""Offline tools that run the real serving worker (paper §6, §7.2): above ``runtime``, never under it.

- ``verify``: ``xema verify``, the worker's own load + execute on the meta device, counted;
- ``seeded_trace``: that trace in a child process under the serving workers' string-hash seed;
- ``layout_solve``: a plan entry's static layout solved from that stream (the artifact it writes
  is ``xema_ray.allocator.artifact``, which the worker loads);
- ``profiler``: the segment-reuse latency profiler, on the execution engine.
"""
