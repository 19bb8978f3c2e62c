"""``python -m optimum_dmx``: the same as the ``optimum-dmx`` command."""

import sys

from .cli import main

sys.exit(main())
