"""Faults and abuse, measured: each `python -m benchmarks.faults.<module>`.

gray_bench (hung and slow replicas, 4x overload), attack_bench (first-token latency while another
client sends huge prompts; `--gateway-only` runs gateway_attack: a huge HTTP body against the limit).
"""
