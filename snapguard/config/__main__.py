"""`python -m snapguard.config template|markdown`: the Debian config template, or the config
reference, rendered from the table of keys."""

from .keys import main

raise SystemExit(main())
