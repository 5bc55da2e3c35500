"""`python -m tuning.autotune_tiers`: the tier measurement, which lives in `tuning.autotune.tiers`
(`python -m tuning.autotune --tiers-only` runs it too); this name is kept so that the command
keeps working."""

import sys

from tuning.autotune.tiers import main

if __name__ == "__main__":
    sys.exit(main())
