"""The ``rigctl`` command: argument parsing, rendering and exit codes only; the work is in the library.

One module per command group; each imports :mod:`rigctl.cli.common` (consoles, global options,
inventory) and never this package. :mod:`rigctl.cli.app` puts the groups together. Command modules
import the libraries a command needs inside that command, so that ``rigctl --help`` and each command
pay only for what they use. :mod:`rigctl.cli.main` is the entry point, apart from the command modules (which
import this package) and importing nothing heavy: :func:`~rigctl.cli.main.main` may start loading the
inventory before the app (typer, rich and every command module) is imported.
"""
