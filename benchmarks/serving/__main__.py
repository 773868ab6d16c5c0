"""python -m benchmarks.serving: see benchmarks.serving.bench."""
import sys

from benchmarks.serving.bench import main

sys.exit(main())
