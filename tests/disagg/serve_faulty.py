"""The fault tests' own entry point of a two-process PD role: ``pdjax serve`` with the prefill
role's KV link wrapped in a :class:`faults.FaultyLink` and a ``fault`` control op that arms
it (:func:`faults.wrap`). Exists only in tests/: the production server has no flag that loads
code. Started by ``launch_pd(serve_command=[python, this file])``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faults import wrap  # noqa: E402

from pdjax.disagg.serve import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], link_wrapper=wrap))
