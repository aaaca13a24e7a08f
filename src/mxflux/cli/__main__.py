"""`python -m mxflux.cli`: the `mxflux` command (what `mxflux bench step` starts its settings with)."""

import sys

from . import main

sys.exit(main())
