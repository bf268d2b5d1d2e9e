"""`python -m snapguard.cli`: the same as the `snapguard` command."""

import sys

from . import main

sys.exit(main())
