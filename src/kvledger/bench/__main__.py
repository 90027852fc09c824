"""``python -m kvledger.bench``: same as ``kvledger bench``."""

import sys

from . import main

sys.exit(main())
