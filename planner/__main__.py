import sys

from planner.boot import start
from xema_ray.hash_seed import reexec_seeded

if sys.argv[1:2] == ["plan"]:
    reexec_seeded()  # layouts are solved from the stream of a PYTHONHASHSEED=0 process (xema_ray.hash_seed)

start(sys.argv[1:])  # Ray starts while the planner's modules import (when the command uses Ray)

from planner.cli import main

raise SystemExit(main())
