"""DP-ImgSyn(0) vs DP-ImgSyn(k) on one trained run: teacher and KD-student test accuracy.

usage: python experiments/dp_imgsyn_k.py CONFIG OUT_DIR

Trains once (teacher + DP statistics); the k = 0 and k = config releases are both free
post-processing of the same run. Both are scored by the shared evaluation (dpsynth.eval.evaluate.evaluate)
under the run's own protocol, the one `dpsynth run` and `dpsynth evaluate RUN` use: the method's KD student
(dp-imgsyn's evaluation_protocol) and the run's evaluate section. Prints one JSON row; accuracies are
mean ± std over the protocol's classifier seeds.
"""

import json
import sys

from dpsynth.context import open_run
from dpsynth.eval.evaluate import evaluate
from dpsynth.methods.families.classifier import accuracy
from dpsynth.runner import run_config, write_samples

K0_SAMPLES = "samples_k0.npz"  # inside the run directory, so that the run's protocol scores it


def student(metrics: dict) -> dict:
    """The student's accuracy entry (one classifier: dp-imgsyn's protocol trains its student model only)."""
    (model,) = [name for name in metrics["accuracy"] if name != "mean_of_models"]
    entry = metrics["accuracy"][model]
    return {"model": model, "mean": entry["mean"], "std": entry["std"], "runs": entry["runs"]}


def main(config: str, out: str) -> dict:
    run_dir = run_config(config, out=out, echo=False)
    ctx, method = open_run(run_dir, echo=False)
    privacy = json.loads((run_dir / "privacy.json").read_text())
    metrics_path = run_dir / "diagnostics" / "metrics.json"
    aligned = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if "accuracy" not in aligned:  # the config evaluated nothing at the end of the run
        aligned = evaluate(run_dir, ["accuracy"], splits=ctx.data)
    k = ctx.section.synthesis.iterations
    ctx.section.synthesis.iterations = 0
    plain = method.generate(ctx, ctx.config.generate.num)
    write_samples(run_dir / K0_SAMPLES, plain, ctx.num_classes)
    unaligned = evaluate(run_dir / K0_SAMPLES, ["accuracy"], splits=ctx.data)
    return {
        "config": config,
        "epsilon": privacy["epsilon"],
        "teacher": accuracy(method.model, ctx.data.test, max_records=method.diagnostic_records) * 100,  # as logged
        "protocol": aligned["meta"]["protocol"],
        "seeds": aligned["meta"]["seeds"],
        "student_k0": student(unaligned),
        f"student_k{k}": student(aligned),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
