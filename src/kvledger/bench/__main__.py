"""``python -m kvledger.bench``: same as ``kvledger bench``."""

from ..common.quick_exit import exit_now
from . import main

# sys.exit(main()) but for the interpreter's teardown of torch and transformers (common/quick_exit.py)
exit_now(main())
