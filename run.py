"""``python -m rallypoint.run``: the launcher, like ``python -m torch.distributed.run``."""

import sys

from .agent.launcher import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
