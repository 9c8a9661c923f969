"""One replica: its process entry point, the Manager's step loop, the pure step state machine,
and the group of processes a multi-process replica runs as.

`python -m fthsdp.replica` starts one process of one replica (same as `fthsdp replica`).
"""
