#!/bin/sh
# Container entry of the enqueue-put stage. Configuration comes from TW_* environment variables
# (see the README); a bad value stops the process with one line naming it.
exec timerwheel stage enqueue-put "$@"
