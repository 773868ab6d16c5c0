"""python -m benchmarks.run: see benchmarks.run.bench."""
import sys

from benchmarks.run.bench import main

sys.exit(main())
