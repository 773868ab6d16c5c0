"""python -m target_service --help"""
from __future__ import annotations

from model_service.serve import main
from specdec.runtime.procs import exit_now
from target_service.role import ROLE

if __name__ == "__main__":
    exit_now(main(ROLE))
