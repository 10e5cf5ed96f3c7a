"""A model's GPU worker set behind one Serve deployment: ``ModelGroup`` (schedule -> execute ->
complete) and its ``ModelGroupConfig``, the worker-set seam (Ray actors or in-process), preemption
bookkeeping, the static allocator's counters, metrics, and what a replica publishes for the request
router and the autoscaler (``replica_stats.py``). What crosses to the Router is ``serving/messages.py``."""
