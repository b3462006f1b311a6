"""``python -m slipstream.server [options]`` = ``slipstream serve [options]``."""

import sys

from slipstream.server.launch.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
