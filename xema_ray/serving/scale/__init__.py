"""Scale-out: the request router choosing a replica of a model group, what each replica publishes
about its backlog, and the autoscaling policy over the dispatchers' predicted attainment."""
