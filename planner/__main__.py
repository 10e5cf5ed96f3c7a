import os
import sys

from planner.boot import start
from planner.cluster_fit import NoRoom
from xema_ray.hash_seed import reexec_seeded

if sys.argv[1:2] == ["plan"]:
    reexec_seeded()  # layouts are solved from the stream of a PYTHONHASHSEED=0 process (xema_ray.hash_seed)

try:
    start(sys.argv[1:])  # Ray starts while the planner's modules import (when the command uses Ray)
except NoRoom as e:  # the cluster has no room for one planning task: said within seconds
    print(f"planner: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(3)  # the import thread may hold the import lock: no interpreter shutdown to wait for

from planner.cli import main

raise SystemExit(main())
