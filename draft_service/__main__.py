"""python -m draft_service --help"""
from __future__ import annotations

import sys

from draft_service.role import ROLE
from specdec.hosting.serve import main

if __name__ == "__main__":
    sys.exit(main(ROLE))
