"""python -m draft_service --help"""
from __future__ import annotations

from draft_service.role import ROLE
from specdec.hosting.serve import main
from specdec.procs import exit_now

if __name__ == "__main__":
    exit_now(main(ROLE))
