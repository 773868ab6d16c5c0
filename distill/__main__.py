"""python -m distill --help"""
import sys

from distill.cli import main

sys.exit(main())
