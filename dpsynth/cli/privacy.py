"""``dpsynth privacy epsilon|noise|verify``: the accountants from the command line (docs/contract.md).

``verify RUN_DIR`` recomputes a run's ε from its ``privacy.json`` record with dp_accounting
(:mod:`dpsynth.privacy.verify`)."""

from __future__ import annotations

import argparse
import json

from dpsynth.errors import PrivacyError
from dpsynth.privacy.accountants import ACCOUNTANTS, EPS_ERROR, compute_epsilon
from dpsynth.privacy.calibration import calibrate_noise
from dpsynth.privacy.mechanisms import SubsampledGaussian, check_count, check_delta, check_positive, check_sample_rate
from dpsynth.rundir import PRIVACY_FILE, verify_run

_ACCOUNTANT_HELP = "prv (default; upper bound of the numerical PRV accountant) or rdp"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``privacy`` command with its ``epsilon``, ``noise`` and ``verify`` subcommands."""
    privacy = subparsers.add_parser(
        "privacy",
        help="privacy accounting: epsilon, noise multiplier, verify a run",
        description=f"Compute epsilon of DP-SGD, calibrate its noise multiplier, or verify a run's {PRIVACY_FILE}.",
    )
    commands = privacy.add_subparsers(dest="privacy_command", metavar="{epsilon,noise,verify}")
    commands.required = True

    epsilon = commands.add_parser("epsilon", help="epsilon spent by T Poisson-subsampled Gaussian steps")
    epsilon.add_argument("--noise-multiplier", type=float, required=True, help="noise std / clip norm")
    _add_common(epsilon)
    epsilon.set_defaults(func=epsilon_command)

    noise = commands.add_parser("noise", help="noise multiplier that spends a target epsilon in T steps")
    noise.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    _add_common(noise)
    noise.set_defaults(func=noise_command)

    verify = commands.add_parser(
        "verify",
        help=f"recompute a run's epsilon from {PRIVACY_FILE} with dp_accounting (PLD and RDP)",
        description=f"Rebuild the dp_accounting DpEvent recorded in RUN_DIR/{PRIVACY_FILE}, compute epsilon at its "
        "delta with dp_accounting's PLD and RDP accountants, and fail when the stated epsilon is below the "
        "smaller of the two by more than 1 %%.",
    )
    verify.add_argument("run_dir", metavar="RUN_DIR", help=f"a run directory holding {PRIVACY_FILE}")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(func=verify_command)


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


def verify_command(args: argparse.Namespace) -> int:
    """Print the stated epsilon beside dp_accounting's PLD and RDP values; PrivacyError when it is lower."""
    from dpsynth.privacy.verify import failure_message

    result = verify_run(args.run_dir)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"stated epsilon = {result['stated_epsilon']:.4f} at delta = {result['delta']:g} "
            f"(neighbouring: {result['neighbouring']}; dataset size public: {result['dataset_size_public']})\n"
            + (
                f"dp_accounting PLD epsilon = {result['pld_epsilon']:.4f} "
                f"(value discretization interval {result['pld_value_discretization_interval']:g})\n"
                if result["pld_epsilon"] is not None
                else "dp_accounting PLD epsilon: none (shard-sampled steps are accounted in RDP only)\n"
            )
            + f"dp_accounting RDP epsilon = {result['rdp_epsilon']:.4f}"
        )
    if not result["ok"]:
        raise PrivacyError(failure_message(result))
    if not args.json:
        print(
            f"OK: the stated epsilon is at least the smaller independent value less "
            f"{result['relative_tolerance']:.0%} ({result['required_epsilon']:.4f})"
        )
    return 0
