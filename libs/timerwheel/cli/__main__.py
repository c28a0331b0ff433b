"""``python -m timerwheel.cli``: the ``timerwheel`` command."""

import sys

from timerwheel.cli import main

sys.exit(main())
