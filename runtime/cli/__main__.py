"""`python -m runtime.cli ...`: the `hetps` command without the console script."""

import sys

from runtime.cli.app import main

sys.exit(main())
