"""``python -m rigctl.cli``: the ``rigctl`` command."""

from rigctl.cli import main

main()
