"""The ``dpsynth`` command line. ``--json`` prints one JSON object on stdout and nothing else;
progress and logs go to stderr; bad input exits non-zero with one line ``error: ...``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from dpsynth import __version__, rundir
from dpsynth.errors import DPSynthError

DEMO_PRESET = "demo"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports bad usage as a single ``error: ...`` line (exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def emit(result: Any, as_json: bool, text: Callable[[Any], str] | None = None) -> None:
    """Print ``result`` as one JSON object (``--json``) or as readable text."""
    if as_json:
        print(json.dumps(result, allow_nan=False))
    else:
        print(text(result) if text else json.dumps(result, indent=2))


def cmd_run(args: argparse.Namespace) -> int:
    from dpsynth.api import Synthesizer
    from dpsynth.runner import default_run_dir

    synth = Synthesizer.from_config(args.config, args.set, num_examples=args.num_examples)
    if args.dry_run:
        return _print_dry_run(synth, args.num_examples, args.json)
    if args.nproc is not None and args.nproc > 1:
        _exec_torchrun(args)
    synth.fit(out=args.out or default_run_dir(synth.settings), resume=args.resume, echo=True)
    from dpsynth.dpsgd.distributed import launched_world_size

    if launched_world_size() <= 1 or os.environ.get("RANK", "0") == "0":  # rank 0's lines only
        _finish_run(synth.run_dir)
    return 0


def _finish_run(run_dir: Any) -> None:
    """The summary line on stderr, then the run directory alone on stdout (scripts read that one line)."""
    from dpsynth.runner import summary_line

    print(summary_line(run_dir), file=sys.stderr, flush=True)
    print(str(run_dir))


def _exec_torchrun(args: argparse.Namespace) -> None:
    """``dpsynth run --nproc N``: become ``torchrun --standalone --nproc_per_node N -m dpsynth run ...``."""
    from dpsynth.dpsgd.distributed import launched_world_size

    if launched_world_size() > 1:
        raise DPSynthError("--nproc: already running under torchrun; drop --nproc")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    command += ["-m", "dpsynth", "run", args.config, *[f"--set={item}" for item in args.set]]
    command += [f"--out={args.out}"] if args.out else []
    command += ["--resume"] if args.resume else []
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)


def _print_dry_run(synth: Any, num_examples: int | None, as_json: bool) -> int:
    """The resolved config and the privacy plan; reads no private data and writes nothing."""
    import yaml

    from dpsynth.config import describe_scaling

    settings = synth.settings
    plan = synth.plan(num_examples if settings.auto is None else settings.auto.num_examples).to_json()
    scaling = describe_scaling(settings)

    def text(result: dict[str, Any]) -> str:
        plan = result["plan"]
        lines = [
            yaml.safe_dump(result["config"], sort_keys=False).rstrip(),
            "",
            *([*scaling, ""] if scaling else []),
            (
                f"privacy plan (target eps={plan['target_epsilon']}, delta={plan['delta']}, "
                f"accountant {plan['accountant']}):"
                if plan["guarantee"] == "dp"
                else "privacy plan: NO DIFFERENTIAL PRIVACY GUARANTEE (an explicit unsound opt-in; the "
                "mechanisms are listed for transparency and no eps is claimed):"
            ),
            f"  {'mechanism':<24}{'kind':<22}{'sigma':>10}{'steps':>8}{'q':>10}{'eps alone':>11}",
        ]
        for m in plan["mechanisms"]:
            sigma = "-" if m["noise_multiplier"] is None else f"{m['noise_multiplier']:.4g}"
            alone = "-" if m["epsilon_alone"] is None else f"{m['epsilon_alone']:.4g}"
            mark = "  (sigma calibrated)" if m["calibrated"] else ""
            lines.append(
                f"  {m['name']:<24}{m['kind']:<22}{sigma:>10}{m['steps']:>8}{m['sample_rate']:>10.4g}{alone:>11}{mark}"
            )
        if plan["guarantee"] == "dp":
            lines.append(f"  composed eps: {plan['epsilon']:.4f} of the target {plan['target_epsilon']}")
        else:
            lines.append("  composed eps: none claimed (guarantee: none)")
        if num_examples is None and settings.auto is None:
            lines.append(
                "  N is the registry's expected train size: each record's hold-out and max_train draws are keyed "
                "on its content, so the run re-plans on the N it loads (sigma and q may differ slightly)"
            )
        return "\n".join(lines)

    result, text = _with_estimate({"config": synth.config, "plan": plan}, text, synth.settings, num_examples)
    if settings.auto is not None:
        result["auto"] = _scaling_json(settings.auto)
    emit(result, as_json, text)
    return 0


def _scaling_json(auto: Any) -> dict[str, Any]:
    """What the scaling rule planned for: N, the shape, every key it set (value, why) and the keys you kept."""
    return {
        "num_examples": auto.num_examples,
        "image_shape": auto.image_shape,
        "time_budget_s": auto.time_budget_s,
        "set": auto.applied,
        "kept": auto.user_keys,
        "why": auto.why,
    }


def _with_estimate(
    result: dict[str, Any], text: Callable[[Any], str], config: Any, num_examples: int | None
) -> tuple[dict[str, Any], Callable[[Any], str]]:
    """A dry run's result and text with the private-training estimate appended (``estimate``: parameters,
    activation memory per example, peak memory per device, GPU hours; :mod:`dpsynth.dpsgd.estimate`)."""
    from dpsynth.data.sizes import planned_train_size
    from dpsynth.dpsgd.estimate import estimate_run
    from dpsynth.methods import get_method

    try:
        size = planned_train_size(config.data) if num_examples is None else num_examples
        estimate = estimate_run(get_method(config.method)(), config, size)
    # A data path whose image shape is not declared, a plugin's network that torch cannot trace on the meta
    # device (NotImplementedError, RuntimeError), or a network that cannot take the planned shape (ValueError: a
    # map too small to normalise): the plan still stands, the estimate says why it is missing.
    except (DPSynthError, NotImplementedError, RuntimeError, ValueError) as exc:
        missing = _one_line(str(exc))
        return {**result, "estimate": {"estimate": True, "unavailable": missing}}, (
            lambda r: f"{text(r)}\n\nprivate training estimate: not available ({missing})"
        )
    return {**result, "estimate": estimate.to_json()}, lambda r: f"{text(r)}\n\n{estimate.text()}"


def cmd_demo(args: argparse.Namespace) -> int:
    from dpsynth.api import Synthesizer

    out = args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    _finish_run(Synthesizer.from_config(DEMO_PRESET, args.set).fit(out=out, echo=True).run_dir)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from dpsynth.api import Synthesizer

    print(str(Synthesizer.load(args.run_dir).generate(args.num, args.out, format=args.format)))
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from dpsynth.config import common_keys, method_keys

    rows = method_keys(args.method) + (common_keys() if args.all else [])

    def table(items: list[dict[str, Any]]) -> str:
        return "\n".join(f"{r['key']} = {json.dumps(r['default'])}  ({r['type']})  {r['description']}" for r in items)

    emit({"method": args.method, "keys": rows}, args.json, lambda res: table(res["keys"]))
    return 0


def cmd_config_list(args: argparse.Namespace) -> int:
    from dpsynth.config import list_presets

    emit({"presets": list_presets()}, args.json, lambda res: "\n".join(res["presets"]))
    return 0


def cmd_config_reference(args: argparse.Namespace) -> int:
    from dpsynth.config import reference_markdown

    print(reference_markdown())
    return 0


def cmd_datasets(args: argparse.Namespace) -> int:
    from dpsynth.data import list_datasets

    rows = [_as_dict(info) for info in list_datasets()]

    def table(items: list[dict[str, Any]]) -> str:
        lines = [f"{'name':<16}{'size':>8}  {'shape':<12}{'classes':>8}  source / licence"]
        for r in items:
            shape = "x".join(str(s) for s in r["shape"]) if r.get("shape") else "-"
            size = r["size"] if r.get("size") is not None else "-"
            lines.append(f"{r['name']:<16}{size:>8}  {shape:<12}{r['classes']:>8}  {r['source']} / {r['licence']}")
        return "\n".join(lines)

    emit({"datasets": rows}, args.json, lambda res: table(res["datasets"]))
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from dpsynth.methods import all_methods

    rows = [
        {"name": m.name, "summary": m.summary, "paper": m.paper}
        for m in sorted(all_methods().values(), key=lambda m: m.name)
    ]
    emit({"methods": rows}, args.json, lambda res: "\n".join(f"{r['name']:<18}{r['summary']}" for r in res["methods"]))
    return 0


def _as_dict(info: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(info) if dataclasses.is_dataclass(info) else dict(info)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="dpsynth",
        description="dpsynth: differentially private synthetic image data with a proven (ε, δ) guarantee.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'dpsynth COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"dpsynth {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)

    demo = sub.add_parser(
        "demo",
        help="run the end-to-end demo on built-in MNIST (under 10 min on 2 CPUs)",
        description="Train the demo method on mnist10k, generate samples, evaluate, write a report.",
    )
    demo.add_argument("--out", help="run directory (default runs/demo-TIMESTAMP)")
    demo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    demo.set_defaults(func=cmd_demo)

    run = sub.add_parser(
        "run",
        help="train a method from a YAML config and write a run directory",
        description="Run CONFIG.yaml: train under the privacy budget, generate samples, write "
        f"{rundir.CONFIG_FILE}, {rundir.PRIVACY_FILE}, {rundir.SAMPLES_FILE.removesuffix('.npz')}.npz/png, "
        f"{rundir.LOG_FILE}, {rundir.CHECKPOINTS_DIR}/, {rundir.REPORT_FILE}.",
    )
    run.add_argument(
        "config", help="YAML config path, or a packaged preset such as dpdm/mnist10k_eps10 (see 'dpsynth config list')"
    )
    run.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, dotted, e.g. --set privacy.epsilon=1 (repeatable)",
    )
    run.add_argument("--out", help="run directory (default runs/<config name>)")
    run.add_argument("--resume", action="store_true", help="continue an interrupted run in --out (same ledger)")
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config and the privacy plan; read no private data, write nothing",
    )
    run.add_argument(
        "--num-examples",
        type=int,
        metavar="N",
        help="with --dry-run: the private train size, for a dataset whose size is not registered",
    )
    run.add_argument("--json", action="store_true", help="with --dry-run: print one JSON object")
    run.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train with N processes (one per GPU, or CPU processes): runs "
        "'torchrun --standalone --nproc_per_node N -m dpsynth run ...' (docs/gpu.md)",
    )
    run.set_defaults(func=cmd_run)

    config = sub.add_parser("config", help="presets and config keys: list, show, reference")
    config_sub = config.add_subparsers(
        dest="config_command", metavar="ACTION", parser_class=OneLineParser, required=True
    )
    show = config_sub.add_parser("show", help="every key of a method's section with its default, type and meaning")
    show.add_argument("method", help="method id (see 'dpsynth methods')")
    show.add_argument("--all", action="store_true", help="also the common keys (data, privacy, generate, ...)")
    show.add_argument("--json", action="store_true", help="print one JSON object")
    show.set_defaults(func=cmd_config_show)
    listing = config_sub.add_parser("list", help="the presets shipped inside the package")
    listing.add_argument("--json", action="store_true", help="print one JSON object")
    listing.set_defaults(func=cmd_config_list)
    reference = config_sub.add_parser(
        "reference", help="print the Markdown config reference (docs/config-reference.md)"
    )
    reference.set_defaults(func=cmd_config_reference)

    gen = sub.add_parser("generate", help="draw labelled samples from a trained run (no privacy cost)")
    gen.add_argument("run_dir", help="run directory")
    gen.add_argument("--num", type=int, required=True, help="number of samples")
    gen.add_argument(
        "--out",
        help=f"output .npz (default RUN_DIR/{rundir.SAMPLES_FILE}; "
        f"RUN_DIR/{rundir.DPIMAGEBENCH_SAMPLES} for dpimagebench)",
    )
    gen.add_argument(
        "--format",
        choices=("native", "dpimagebench"),
        default="native",
        help="native: images uint8 NHWC, labels, soft_labels; dpimagebench: DPImageBench's gen.npz "
        "(x float32 NCHW in [0, 1], y int64), readable by its eval.py",
    )
    gen.set_defaults(func=cmd_generate)

    ds = sub.add_parser("datasets", help="list the datasets dpsynth can load")
    ds.add_argument("--json", action="store_true", help="print one JSON object")
    ds.set_defaults(func=cmd_datasets)

    methods = sub.add_parser("methods", help="list the registered synthesis methods")
    methods.add_argument("--json", action="store_true", help="print one JSON object")
    methods.set_defaults(func=cmd_methods)

    from dpsynth.cli.bench import register as register_bench
    from dpsynth.cli.docs import register as register_docs
    from dpsynth.cli.evaluate import register as register_evaluate
    from dpsynth.cli.pretrain import register as register_pretrain
    from dpsynth.cli.privacy import register as register_privacy
    from dpsynth.cli.report import register as register_report

    register_privacy(sub)
    register_evaluate(sub)
    register_report(sub)
    register_bench(sub)
    register_pretrain(sub)
    register_docs(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    warnings.showwarning = _warning_line
    try:
        return int(args.func(args) or 0)
    except DPSynthError as exc:
        print(f"error: {_one_line(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted; resume with 'dpsynth run CONFIG --out DIR --resume'", file=sys.stderr)
        return 130


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _warning_line(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
    print(f"warning: {_one_line(str(message))}", file=sys.stderr)
