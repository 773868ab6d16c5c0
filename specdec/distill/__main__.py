"""python -m specdec.distill --help"""
import sys

from specdec.distill.cli import main

sys.exit(main())
