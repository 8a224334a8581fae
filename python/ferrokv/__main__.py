"""``python -m ferrokv ...``: the ``ferrokv`` command (``ferrokv.cli``)."""

import sys

from ferrokv.cli import main

sys.exit(main())
