"""The ``fedge`` command line (``main``), its deploy and certificate commands, and its progress display."""
