"""Scale-out: the request router choosing a replica of a model group, the summary each replica
publishes about its backlog (the group publishes it: ``group/replica_stats.py``), and the
autoscaling policy over the dispatchers' predicted attainment."""
