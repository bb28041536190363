"""``python -m worldserve`` is the ``worldserve`` command."""

import sys

from worldserve.tools.cli import main

sys.exit(main())
