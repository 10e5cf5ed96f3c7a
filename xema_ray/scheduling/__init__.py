"""The dispatch policy (paper §4, Figure 3): batching, step-level preemption, admission.

Pure: no I/O and no clock. The live model group (``xema_ray.serving.group``) and the simulator
(``xema_ray.sim``) both drive the same ``Dispatcher``, as vLLM's scheduler sits under its engine.

- ``dispatcher.py``: ``Dispatcher``, the one entry point: queues, batches, EDF, SP-group placement.
- ``batch.py``: what it works with: ``DispatchPlan``, ``Pending``, ``Assignment``.
- ``batch_key.py``: what a batch cannot mix (``BatchKey``: steps, guidance, quality tier), the
  batching policy (``by_key`` or ``mixed``) and the one price of a batch as it runs (``batch_seconds``).
- ``preemption_policy.py``: step-level preemption (``PreemptionPolicy``, its decisions).
- ``admission.py``: SLO-aware admission (late requests set aside or shed; ``Refused``).
"""
