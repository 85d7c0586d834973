"""``python -m rigctl.cli``: the ``rigctl`` command."""

from rigctl.cli.main import main

main()
