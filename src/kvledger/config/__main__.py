"""``python -m kvledger.config [--write]``: docs/settings.md's tables, printed or written."""

import sys

from .docs import settings_markdown, write_settings_doc

if "--write" in sys.argv[1:]:
    print("docs/settings.md: " + ("regenerated" if write_settings_doc() else "current"))
else:
    print(settings_markdown())
