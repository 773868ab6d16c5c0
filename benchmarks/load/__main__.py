"""python -m benchmarks.load: see benchmarks.load.bench."""
import sys

from benchmarks.load.bench import main

sys.exit(main())
