"""The launcher and command line: `specdec` (cli), the command lines of every process (launch) and
the device check (gpucheck). The top layer: it may import every package below it."""
