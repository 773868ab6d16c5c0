"""python -m draft_service --help"""
from __future__ import annotations

from draft_service.role import ROLE
from model_service.serve import main
from specdec.runtime.procs import exit_now

if __name__ == "__main__":
    exit_now(main(ROLE))
