"""``dpsynth privacy epsilon|noise``: the accountants from the command line (docs/contract.md)."""

from __future__ import annotations

import argparse
import json

from dpsynth.privacy.accountants import ACCOUNTANTS, EPS_ERROR, compute_epsilon
from dpsynth.privacy.calibration import calibrate_noise
from dpsynth.privacy.mechanisms import SubsampledGaussian, check_count, check_delta, check_positive, check_sample_rate

_ACCOUNTANT_HELP = "prv (default; upper bound of the numerical PRV accountant) or rdp"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``privacy`` command with its ``epsilon`` and ``noise`` subcommands."""
    privacy = subparsers.add_parser(
        "privacy",
        help="privacy accounting: epsilon or noise multiplier",
        description="Compute epsilon of DP-SGD, or calibrate its noise multiplier.",
    )
    commands = privacy.add_subparsers(dest="privacy_command", metavar="{epsilon,noise}")
    commands.required = True

    epsilon = commands.add_parser("epsilon", help="epsilon spent by T Poisson-subsampled Gaussian steps")
    epsilon.add_argument("--noise-multiplier", type=float, required=True, help="noise std / clip norm")
    _add_common(epsilon)
    epsilon.set_defaults(func=epsilon_command)

    noise = commands.add_parser("noise", help="noise multiplier that spends a target epsilon in T steps")
    noise.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    _add_common(noise)
    noise.set_defaults(func=noise_command)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sample-rate", type=float, required=True, help="Poisson sampling rate q in (0, 1]")
    parser.add_argument("--steps", type=int, required=True, help="number of steps T >= 1")
    parser.add_argument("--delta", type=float, required=True, help="delta in (0, 1)")
    parser.add_argument("--accountant", choices=ACCOUNTANTS, default="prv", help=_ACCOUNTANT_HELP)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def epsilon_command(args: argparse.Namespace) -> int:
    """Print epsilon for ``--noise-multiplier/--sample-rate/--steps/--delta``."""
    sigma = check_positive(args.noise_multiplier, "noise multiplier")
    delta, sample_rate, steps = _common(args)
    epsilon = compute_epsilon([SubsampledGaussian("dpsgd", sigma, sample_rate, steps)], delta, args.accountant)
    _emit(args, epsilon, sigma, delta, sample_rate, steps)
    return 0


def noise_command(args: argparse.Namespace) -> int:
    """Print the noise multiplier that spends ``--epsilon`` (epsilon shown is what it really spends)."""
    target = check_positive(args.epsilon, "epsilon")
    delta, sample_rate, steps = _common(args)
    sigma = calibrate_noise(target, delta, sample_rate, steps, accountant=args.accountant)
    epsilon = compute_epsilon([SubsampledGaussian("dpsgd", sigma, sample_rate, steps)], delta, args.accountant)
    _emit(args, epsilon, sigma, delta, sample_rate, steps, target_epsilon=target)
    return 0


def _common(args: argparse.Namespace) -> tuple[float, float, int]:
    return check_delta(args.delta), check_sample_rate(args.sample_rate), check_count(args.steps, "steps", minimum=1)


def _emit(
    args: argparse.Namespace,
    epsilon: float,
    sigma: float,
    delta: float,
    sample_rate: float,
    steps: int,
    target_epsilon: float | None = None,
) -> None:
    result = {
        "epsilon": epsilon,
        "delta": delta,
        "noise_multiplier": sigma,
        "sample_rate": sample_rate,
        "steps": steps,
        "accountant": args.accountant,
    }
    if target_epsilon is not None:
        result["target_epsilon"] = target_epsilon
    if args.accountant == "prv":
        result["epsilon_error"] = EPS_ERROR
    if args.json:
        print(json.dumps(result))
        return
    bound = " (upper bound)" if args.accountant == "prv" else ""
    print(
        f"epsilon = {epsilon:.4f}{bound} at delta = {delta:g} for noise multiplier {sigma:.4f}, "
        f"sample rate {sample_rate:g}, {steps} steps ({args.accountant} accountant)"
    )
