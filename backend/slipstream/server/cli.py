"""Where the ``slipstream`` command lived before ``slipstream.server.launch.cli``.

A console script is written at install time: an environment installed before the move (an
editable install keeps its script until it is reinstalled) still imports ``main`` from here.
"""

from slipstream.server.launch.cli import main  # noqa: F401
