"""``python -m fastppo`` is the ``fastppo`` command."""

import sys

from .cli import main

sys.exit(main())
