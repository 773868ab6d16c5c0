"""The `specdec` command (cli: up, demo, secrets, distill, ...) and the device check (gpucheck).
The top layer: it may import every package below it, the tools included. The command lines of
every process are specdec.runtime.launch."""
