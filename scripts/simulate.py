"""make simulate: run docker-compose.yml's services as local processes on loopback, without a Docker engine.

The work is done by bench.simulation; `scripts/simulate.py --help` lists the options.
"""

import sys

from bench.simulation import main

if __name__ == "__main__":
    sys.exit(main())
