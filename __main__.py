"""``python -m rallypoint`` is the ``rallypoint`` command."""

import sys

from .cli import main

sys.exit(main())
