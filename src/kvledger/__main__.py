from .cli import main
from .common.fast_exit import exit_now

exit_now(main())
