"""`python -m engine.estimate`: see engine/estimate/cli.py."""

import sys

from engine.estimate.cli import main

sys.exit(main())
