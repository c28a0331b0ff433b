import sys

from timerwheel_operator.main import main

sys.exit(main())
