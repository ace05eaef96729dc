"""`python -m moeswap.planner ...`: the `moeswap plan` command without the top-level dispatcher."""

import sys

from .cli import main

sys.exit(main())
