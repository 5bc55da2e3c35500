"""`python -m tuning.autotune`: see `tuning.autotune.cli`."""

import sys

from tuning.autotune.cli import main

sys.exit(main())
