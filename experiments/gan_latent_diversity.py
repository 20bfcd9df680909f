"""Does a conditional GAN pair keep its latents' diversity and follow its label, WITHOUT privacy, on public data?

dp-gan's projection pair (``ConditionalGenerator`` / ``ConditionalDiscriminator``) collapses to one image per class
even when trained non-privately (docs/methods/dp-gan.md, "Why the generator collapses"), so no DP recipe can fix
it. This script trains each ``architecture`` of :class:`dpsynth.models.gan.GANSpec` with plain alternating Adam
(no clipping, no noise) on the public ``glyphs-digits`` train split and reports, every ``--eval-every`` steps:

- ``z_spread``: the mean per-pixel standard deviation of the generator's output over 32 latents of one class,
  averaged over the classes (pixels in [-1, 1]); ``real_spread`` is the same over 32 real images of a class.
  A collapsed generator (one image per class) has a z-spread near 0;
- ``label_acc``: the share of generated images (``--per-class`` per class) that a CNN trained on the
  glyphs-digits train split (dpsynth's ``cnn`` classifier, :func:`dpsynth.metrics.utility.train_classifier`)
  puts in the class they were generated for; ``classifier_test_acc`` is that CNN on the glyphs-digits test split.

Only public data is read: nothing here is tuned on mnist10k or on any private split.

    OMP_NUM_THREADS=1 python experiments/gan_latent_diversity.py --steps 1000 --eval-every 250 \\
        [--architecture projection label-channels] [--out experiments/out/gan_latent_diversity.json]

``--runs DIR [DIR ...]`` instead scores the released generators of finished dp-gan runs (their
``checkpoints/released.pt``) with the same two statistics, e.g. after
``dpsynth run dp-gan/mnist10k_eps10 --set data.private=glyphs-digits`` (the public stand-in).

``--smoke`` runs a few steps of tiny networks to check that the script works; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dpsynth.contract import RELEASED_PHASE
from dpsynth.data import load_dataset
from dpsynth.metrics.protocol import TrainConfig
from dpsynth.metrics.utility import accuracy, predict, train_classifier
from dpsynth.models.gan import GAN_ARCHITECTURES, GANSpec, discriminator_loss, generator_step, sample_latents
from dpsynth.rundir import CHECKPOINTS_DIR

DATASET = "glyphs-digits"


def z_spread(generator: torch.nn.Module, num_classes: int, latents: int = 32, seed: int = 0) -> float:
    """Mean per-pixel std over ``latents`` latents of one class, averaged over the classes."""
    rng = torch.Generator().manual_seed(seed)
    spreads = []
    with torch.no_grad():
        for label in range(num_classes):
            z = torch.randn(latents, generator.z_dim, generator=rng)
            images = generator(z, torch.full((latents,), label, dtype=torch.long))
            spreads.append(images.std(dim=0).mean().item())
    return sum(spreads) / len(spreads)


def real_spread(images: torch.Tensor, labels: torch.Tensor, num_classes: int, count: int = 32) -> float:
    """The same statistic over the first ``count`` real images of each class."""
    return sum(images[labels == c][:count].std(dim=0).mean().item() for c in range(num_classes)) / num_classes


def label_accuracy(generator: torch.nn.Module, classifier: torch.nn.Module, per_class: int, seed: int = 1) -> float:
    """Share of generated images the classifier assigns to the class they were generated for."""
    rng = torch.Generator().manual_seed(seed)
    labels = torch.arange(generator.num_classes).repeat_interleave(per_class)
    with torch.no_grad():
        images = generator(torch.randn(len(labels), generator.z_dim, generator=rng), labels)
    return float((predict(classifier, images) == labels).double().mean())


def train_pair(
    spec: GANSpec,
    images: torch.Tensor,
    labels: torch.Tensor,
    classifier: torch.nn.Module,
    *,
    steps: int,
    eval_every: int,
    batch_size: int,
    lr: float,
    betas: tuple[float, float],
    loss: str,
    per_class: int,
    seed: int,
) -> list[dict]:
    """Alternating non-private Adam, one discriminator step per generator step; the scores along the way."""
    torch.manual_seed(seed)
    generator, discriminator = spec.build()
    g_opt = torch.optim.Adam(generator.parameters(), lr=lr, betas=betas)
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=lr, betas=betas)
    rng = torch.Generator().manual_seed(seed + 1)
    rows, started = [], time.time()

    def record(step: int, d_loss: float | None, g_loss: float | None) -> None:
        row = {
            "architecture": spec.architecture,
            "step": step,
            "z_spread": round(z_spread(generator, spec.num_classes), 4),
            "label_acc": round(label_accuracy(generator, classifier, per_class), 4),
            "d_loss": None if d_loss is None else round(d_loss, 4),
            "g_loss": None if g_loss is None else round(g_loss, 4),
            "seconds": round(time.time() - started, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    record(0, None, None)
    for step in range(1, steps + 1):
        index = torch.randint(0, len(images), (batch_size,), generator=rng)
        z, fake_labels = sample_latents(batch_size, spec.z_dim, spec.num_classes, rng)
        with torch.no_grad():
            fake = generator(z, fake_labels)
        d_loss = discriminator_loss(discriminator(images[index], labels[index]), discriminator(fake, fake_labels), loss)
        d_opt.zero_grad(set_to_none=True)
        d_loss.backward()
        d_opt.step()
        g_loss = generator_step(generator, discriminator, g_opt, batch_size, rng, loss)
        if step % eval_every == 0 or step == steps:
            record(step, float(d_loss.detach()), g_loss)
    return rows


def score_runs(runs: list[Path], classifier: torch.nn.Module, per_class: int) -> list[dict]:
    """The released generator of each finished run, scored like the non-private pairs."""
    rows = []
    for run in runs:
        state = torch.load(run / CHECKPOINTS_DIR / f"{RELEASED_PHASE}.pt", map_location="cpu", weights_only=False)
        spec = GANSpec(**state["spec"])
        generator = spec.build_generator()
        generator.load_state_dict(state["generator"])
        generator.eval()
        row = {
            "run": str(run),
            "architecture": spec.architecture,
            "z_spread": round(z_spread(generator, spec.num_classes), 4),
            "label_acc": round(label_accuracy(generator, classifier, per_class), 4),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--architecture", nargs="+", default=list(GAN_ARCHITECTURES), choices=GAN_ARCHITECTURES)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-4, help="Adam learning rate of both networks (DCGAN's)")
    parser.add_argument("--betas", type=float, nargs=2, default=(0.5, 0.999), help="Adam betas (DCGAN's)")
    parser.add_argument("--loss", choices=("bce", "hinge"), default="bce")
    parser.add_argument("--z-dim", type=int, default=60, help="the dp-gan/mnist10k presets' sizes by default")
    parser.add_argument("--generator-width", type=int, default=32)
    parser.add_argument("--discriminator-width", type=int, default=32)
    parser.add_argument("--discriminator-depth", type=int, default=2)
    parser.add_argument("--per-class", type=int, default=100, help="generated images per class for label_acc")
    parser.add_argument("--classifier-steps", type=int, default=600, help="CNN steps on the glyphs-digits train split")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=Path, nargs="+", default=None, help="score these finished runs instead")
    parser.add_argument("--smoke", action="store_true", help="tiny networks, a few steps: checks the script only")
    parser.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.eval_every, args.per_class, args.classifier_steps = 4, 2, 4, 4
        args.generator_width = args.discriminator_width = 4

    torch.set_num_threads(1)
    train, test = load_dataset(DATASET, "train"), load_dataset(DATASET, "test")
    images, labels = train.to_tensors()
    test_images, test_labels = test.to_tensors()
    num_classes, (channels, size, _) = train.num_classes, tuple(images.shape[1:])
    classifier = train_classifier(
        "cnn", images, labels, num_classes, TrainConfig(epochs=1, max_steps=args.classifier_steps), seed=args.seed
    ).model
    summary = {
        "dataset": DATASET,
        "train_records": len(images),
        "real_spread": round(real_spread(images, labels, num_classes), 4),
        "classifier_test_acc": round(accuracy(classifier, test_images, test_labels), 4),
        "settings": {key: value for key, value in vars(args).items() if key not in ("out", "architecture")},
    }
    print(json.dumps(summary, default=str), flush=True)
    rows = score_runs(args.runs, classifier, args.per_class) if args.runs else []
    for architecture in [] if args.runs else args.architecture:
        spec = GANSpec(
            num_classes,
            channels,
            size,
            z_dim=args.z_dim,
            generator_width=args.generator_width,
            discriminator_width=args.discriminator_width,
            discriminator_depth=args.discriminator_depth,
            architecture=architecture,
        )
        rows += train_pair(
            spec,
            images,
            labels,
            classifier,
            steps=args.steps,
            eval_every=args.eval_every,
            batch_size=args.batch_size,
            lr=args.lr,
            betas=tuple(args.betas),
            loss=args.loss,
            per_class=args.per_class,
            seed=args.seed,
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**summary, "rows": rows}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
