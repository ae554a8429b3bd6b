import sys

from pdjax.experiments.cli import main

sys.exit(main())
