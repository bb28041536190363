"""``python -m worldserve`` is the ``worldserve`` command."""

import sys

from worldserve.cli import main

sys.exit(main())
