"""python -m target_service --help"""
from __future__ import annotations

import sys

from specdec.hosting.serve import main
from target_service.role import ROLE

if __name__ == "__main__":
    sys.exit(main(ROLE))
