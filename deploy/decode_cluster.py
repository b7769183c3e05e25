"""Deploy nanocp on a Ray cluster: the same code as `nanocp deploy` (see `--help`).

python deploy/decode_cluster.py --address auto --gpus-per-node 8          # one decode instance per GPU
python deploy/decode_cluster.py --cpu-instances 4 --port 8000            # local Ray, 4 CPU instances
"""

from __future__ import annotations

import sys

from nanocp.cli import main

if __name__ == "__main__":
    sys.exit(main(["deploy", *sys.argv[1:]]))
