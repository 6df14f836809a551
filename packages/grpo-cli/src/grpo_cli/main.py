"""The `grpo` command line.

`grpo --help` and `grpo config show/list` import no torch; `grpo config validate`, `train` and
`eval` import it for one check only (the optimizer and scheduler are built on a dummy parameter,
grpo_train.config.checks); Ray, vLLM and transformers are imported only once `grpo train` /
`grpo eval` has a valid config. Config errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from grpo_cli.configs import CONFIG_DIR, DEFAULT_CONFIG

EXIT_CONFIG_ERROR = 2

# Set before Ray or vLLM start in this process or any it spawns (see SETUP-NOTES: Ray under
# `uv run` would try to rebuild the environment in every worker).
_RUNTIME_ENV_DEFAULTS = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CONFIGURE_LOGGING": "0",
    "WANDB_SILENT": "true",
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo",
        description="RL post-training of language models with GRPO. "
        f"With no --config, `grpo train` runs the offline demo ({DEFAULT_CONFIG}).",
    )
    parser.add_argument("--version", action="store_true", help="print package versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def add_config_args(p: argparse.ArgumentParser, required: bool = False) -> None:
        p.add_argument(
            "--config",
            "-c",
            default=None if required else DEFAULT_CONFIG,
            required=required,
            help="YAML file or built-in config name (default: %(default)s)",
        )
        p.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides: a.b=v sets, +a.b=v adds, ~a.b deletes"
        )

    train = sub.add_parser("train", help="run GRPO training")
    add_config_args(train)
    train.add_argument(
        "--run-dir",
        default=None,
        help="run folder (default: <logger.log_dir>/<config name>); an existing run folder with checkpoints is resumed",
    )

    ev = sub.add_parser("eval", help="validate a model or checkpoint on the config's validation set")
    add_config_args(ev)
    ev.add_argument("--checkpoint", default=None, help="checkpoint folder to evaluate (default: the config's model)")

    config = sub.add_parser("config", help="show or validate configs")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_sub.add_parser("show", help="print the resolved YAML")
    show.add_argument("name", nargs="?", default=DEFAULT_CONFIG)
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    validate = config_sub.add_parser("validate", help="check a config and exit 0, or print the problem and exit 2")
    validate.add_argument("name", nargs="?", default=DEFAULT_CONFIG)
    validate.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    config_sub.add_parser("list", help="list the built-in configs")

    plan = sub.add_parser(
        "plan",
        help="print where every actor runs and what each GPU holds, without loading a "
        "model; exit 2 when the plan does not fit",
    )
    add_config_args(plan)
    plan.add_argument(
        "--gpu-memory-gb", type=float, default=None, help="memory of each GPU (default: cluster.gpu_memory_gb, else 80)"
    )

    plot = sub.add_parser("plot", help="plot reward, accuracy and KL of a run folder")
    plot.add_argument("run_dir")
    return parser


def _load(name: str, overrides: list[str], check: bool = True, optimizers: bool = True):
    """The validated config and its resolved dict; with `check`, also the checks that build the
    optimizer (unless `optimizers` is false: `grpo train` runs that one beside Ray's start) and
    look up the environments (grpo_train.config.checks)."""
    from grpo_train.config import load_config  # here, not at the top: `grpo --help` loads no schema

    config, raw = load_config(name, overrides, [CONFIG_DIR])
    if check:
        from grpo_train.config.checks import check_config  # torch for the optimizer check: validate only

        check_config(config, _config_file(name), optimizers=optimizers)
    return config, raw


def _config_file(name: str) -> str:
    from grpo_train.config.loader import find_config  # here: `grpo --help` loads no config code

    return str(find_config(name, [CONFIG_DIR]))


def _cmd_config(args: argparse.Namespace) -> int:
    if args.config_command == "list":
        for path in sorted(CONFIG_DIR.glob("*.yaml")):
            print(path.name)
        return 0
    config, raw = _load(args.name, args.overrides, check=args.config_command == "validate")
    if args.config_command == "show":
        import yaml

        print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    else:
        print(f"{args.name}: OK")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    config, raw = _load(args.config, args.overrides, optimizers=False)  # train checks the optimizers itself
    for key, value in _RUNTIME_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from grpo_train.run import train  # heavy: torch, Ray, vLLM

    run_name = Path(args.config).stem
    return train(config, raw, run_name=run_name, run_dir=args.run_dir, config_file=_config_file(args.config))


def _cmd_eval(args: argparse.Namespace) -> int:
    config, raw = _load(args.config, args.overrides)
    for key, value in _RUNTIME_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from grpo_train.run import evaluate  # heavy: torch, Ray, vLLM

    return evaluate(config, raw, checkpoint=args.checkpoint)


def _cmd_plan(args: argparse.Namespace) -> int:
    config, raw = _load(args.config, args.overrides)
    from grpo_train.plan import PlanError, make_plan  # no torch, no Ray

    memory = args.gpu_memory_gb or config.cluster.gpu_memory_gb or 80.0
    try:
        plan = make_plan(config, gpu_memory_gb=memory)
    except PlanError as exc:
        print(f"grpo: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    print(plan.render())
    return EXIT_CONFIG_ERROR if plan.problems else 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from grpo_train.plotting import plot_run  # here: `grpo --help` imports no plotting code

    print(plot_run(Path(args.run_dir)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.version:
        from importlib.metadata import version

        for pkg in ("grpo-cli", "grpo-train", "grpo-kernels", "grpo-data", "grpo-envs"):
            print(f"{pkg} {version(pkg)}")
        return 0
    if args.command is None:  # bare `grpo` runs the offline demo
        args = _build_parser().parse_args(["train"])
    handlers = {"config": _cmd_config, "train": _cmd_train, "eval": _cmd_eval, "plan": _cmd_plan, "plot": _cmd_plot}
    from grpo_train.config.errors import ConfigError  # here: `grpo --help` imports no grpo_train

    try:
        return handlers[args.command](args)
    except ConfigError as exc:
        print(f"grpo: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


if __name__ == "__main__":
    sys.exit(main())
