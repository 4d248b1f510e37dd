"""The commands of the ``ktcore`` CLI."""
