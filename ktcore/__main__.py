"""``python -m ktcore ...``: the ``ktcore`` command (for launchers that take a module, and for running ktcore in
another environment's interpreter)."""

from ktcore.commands.cli import main

main(prog_name="ktcore")
