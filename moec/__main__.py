"""``python -m moec``: the same as the ``moec`` command."""

import sys

from moec.cli import main

sys.exit(main())
