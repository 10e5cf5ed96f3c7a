import sys

from planner.boot import start

start(sys.argv[1:])  # Ray starts while the planner's modules import (when the command uses Ray)

from planner.cli import main

raise SystemExit(main())
