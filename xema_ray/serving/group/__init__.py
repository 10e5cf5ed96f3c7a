"""A model's GPU worker set behind one Serve deployment: ``ModelGroup`` (schedule -> execute ->
complete), the worker-set seam (Ray actors or in-process), what crosses between the Router and a
group, preemption bookkeeping, the static allocator's counters, metrics."""
