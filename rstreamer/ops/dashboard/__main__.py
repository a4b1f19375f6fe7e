"""``python -m rstreamer.ops.dashboard``: the same as ``rstreamer dashboard``."""
import sys

from . import main

raise SystemExit(main(sys.argv[1:]))
