"""Calls ``sys.exit()`` at import: the process that loads plugins must survive it."""

import sys

sys.exit("this plugin exits at import on purpose")
