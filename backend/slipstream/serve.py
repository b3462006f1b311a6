"""``python -m slipstream.serve [options]`` = ``slipstream serve [options]``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
