"""``python -m rallypoint`` is the ``rallypoint`` command."""

import sys

from rallypoint.cli import main

sys.exit(main())
