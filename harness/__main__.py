"""``python -m harness ...``: see :mod:`harness.cli`."""

import sys

from harness.cli import main

sys.exit(main())
