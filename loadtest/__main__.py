"""``python -m loadtest``: the same as ``pdserve bench``."""

import sys

from loadtest.cli import main

sys.exit(main())
