"""The `fthsdp` command: `fthsdp <subcommand> ...`.

Each subcommand lives in the module that implements it, as a `cli(argv) -> int`
function, and is imported only when used (jax start-up is not free).
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("fthsdp.cli", "train_cli", "train one replica (no fault tolerance) on a config"),
    "run": ("fthsdp.launch.local", "cli", "run a fault-tolerant job locally: lighthouse + N replicas + faults"),
    "ray": ("fthsdp.launch.ray", "cli", "run a fault-tolerant job on a Ray cluster: actors, placement groups, faults"),
    "replica": ("fthsdp.replica.process", "main", "start one process of one replica (flags or FTHSDP_* env vars; for "
                "slurm, Kubernetes, Ray)"),
    "lighthouse": ("fthsdp.control.lighthouse", "cli", "serve quorums and failure detection over gRPC"),
    "relay": ("fthsdp.control.relay", "cli", "carry many replicas' lighthouse sessions to the lighthouse on one "
              "stream (fan-in at hundreds of replicas)"),
    "status": ("fthsdp.control.lighthouse_client", "status_cli", "show a lighthouse's jobs, quorums and replicas"),
    "dashboard": ("fthsdp.observe.dashboard", "cli", "serve a live web page and /metrics of a lighthouse's jobs"),
}


def train_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="fthsdp train", description="Train one replica on a config.")
    parser.add_argument("--config", default="base", help="config file or name under configs/ (default: base)")
    parser.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")
    parser.add_argument("overrides", nargs="*", help="section.field=value, e.g. train.steps=100 optim.lr=1e-3")
    args = parser.parse_args(argv)

    from fthsdp import config as config_lib
    from fthsdp import logs

    try:
        cfg = config_lib.load(args.config, args.overrides)
    except ValueError as e:
        parser.error(str(e))
    from fthsdp.devices import enable_compilation_cache, force_host_devices

    force_host_devices(cfg.launch.devices_per_replica)
    logs.setup(file=f"{cfg.train.out_dir}/train.log")
    enable_compilation_cache()
    from fthsdp.step.train import train

    from fthsdp.errors import EXIT_JOB_FATAL, JobFatalError

    progress = not args.no_progress and sys.stderr.isatty()
    try:
        train(cfg, progress=progress)
    except JobFatalError as e:  # (a diverged run: optim.nonfinite_limit) said plainly, no traceback
        print(f"fthsdp train: {e}", file=sys.stderr)
        return EXIT_JOB_FATAL
    return 0


def main(argv: list[str] | None = None) -> int:
    from fthsdp.logs import take_format_option

    argv = take_format_option(list(sys.argv[1:] if argv is None else argv))  # --log-format on every command
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fthsdp <command> [args]\n\ncommands:")
        for name, (_, _, help_text) in SUBCOMMANDS.items():
            print(f"  {name:<12} {help_text}")
        print("\nevery command takes --log-format text|json (JSON lines, also for the processes it starts)")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"fthsdp: unknown command {name!r}; commands: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[name]
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
