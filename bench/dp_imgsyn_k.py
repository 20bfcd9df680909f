"""DP-ImgSyn(0) vs DP-ImgSyn(k) on one trained run: teacher and KD-student test accuracy.

usage: python bench/dp_imgsyn_k.py CONFIG OUT_DIR

Trains once (teacher + DP statistics); the k = 0 and k = config releases are both free
post-processing of the same run. Prints one JSON row.
"""

import json
import sys

import numpy as np

from dpsynth.contract import Samples
from dpsynth.methods.dp_imgsyn import STATS_PHASE, evaluate_student
from dpsynth.runner import open_run, run_config


def main(config: str, out: str) -> dict:
    run_dir = run_config(config, out=out, echo=False)
    ctx, method = open_run(run_dir, echo=False)
    stored = ctx.checkpoints.load(phase=STATS_PHASE)
    privacy = json.loads((run_dir / "privacy.json").read_text())
    with np.load(run_dir / "samples.npz") as archive:
        aligned = Samples(archive["images"], archive["labels"], archive["soft_labels"])
    k = ctx.section["synthesis"]["iterations"]
    ctx.section["synthesis"]["iterations"] = 0
    plain = method.generate(ctx, len(aligned.images))
    student = ctx.section["student"]
    return {
        "config": config,
        "epsilon": privacy["epsilon"],
        "teacher": stored["teacher_test_accuracy"] * 100,
        "student_k0": evaluate_student(plain, ctx.data.test, student, ctx.device),
        f"student_k{k}": evaluate_student(aligned, ctx.data.test, student, ctx.device),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
