import sys

from dpsynth.cli import main

if __name__ == "__main__":
    sys.exit(main())
