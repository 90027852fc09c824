from .cli import main
from .common.quick_exit import exit_now

# sys.exit(main()) but for the interpreter's teardown of torch and transformers (common/quick_exit.py)
exit_now(main())
