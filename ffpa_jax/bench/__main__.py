import sys

from ffpa_jax.bench.cli import main

sys.exit(main())
