"""``python -m mtpkit``: the same command line as ``mtpkit``."""

import sys

from .cli import main

sys.exit(main())
