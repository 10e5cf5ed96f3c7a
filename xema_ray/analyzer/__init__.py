"""The Memory Analyzer (paper §3.3, §7.2): the shape-only run of a real pipeline on the meta device.

- ``tracer``: the ``TorchDispatchMode`` that records every device allocation;
- ``assembly``: the one assembly of a traced pipeline call (``assembled``), shared by analysis,
  confirmation and ``xema verify`` (the serving worker's own call, traced);
- ``run``: a template's pipeline traced end to end (``trace_template``);
- ``mitigated``: the same with a plan's mitigations applied (``trace_with_mitigations``);
- ``steps``: three traced denoising steps replicated to all of them, the request cut into phases
  (``expand_steps``);
- ``block_replay`` / ``replay_rules``: a DiT block called again with the same signature replays
  its recorded allocations instead of running; the rules say which mitigation hooks allow it;
- ``meta_memo``: memoised meta kernels.

The trace it produces is ``xema_ray.memory``'s data. The analyzer may apply mitigation
primitives; they never import it.
"""
