"""Training a noise-conditional score network on whole records: with DP-SGD, or with the paper's unsound loop.

"Learning Differentially Private Probabilistic Models for Privacy-Preserving Image Generation" (Liu, Ge, Wang,
Zhuang, Liu), §4.1, Fig. 4a, Algorithm 1: the NCSN RefineNet (:mod:`dpsynth.models.refinenet`; Song & Ermon,
arXiv:1907.05600) over a noise ladder, trained with a score-matching objective
(:mod:`dpsynth.diffusion.score_matching`) on records ``clean`` [N, C, H, W] (e.g. label-embedded images,
:mod:`dpsynth.diffusion.label_rows`). :class:`RefineNetSection` and :class:`ScoreTrainingSection` are the config
keys of the network and of its training; :func:`score_network` declares it to the dry run's estimate.

* :func:`train_score_network` (sound): DP-SGD through the shared driver :func:`dpsynth.dpsgd.training.train_private`
  — Poisson batches, per-example clipping, Gaussian noise at the plan's σ, the run's accountant; each record's
  noise levels, noises and projections are its own row of per-record draws.
* :func:`train_randomized_response` (NO guarantee): Algorithm 1 as published — uniform batches, Eq. 6
  randomized response on the sliced-score-matching projection vectors (:mod:`dpsynth.privacy.randomized_response`),
  plain gradient steps without clipping or noise. Nothing in it can be accounted, so it does not go through
  ``train_private``: it is not a private training loop, and a run using it has ledger guarantee ``"none"``.
  Each step charges one nominal pure-ε entry, listed for transparency only, before the step reads the data.
  Its checkpoint (phase = the mechanism's name) carries ``"step"``, checked against the ledger by
  :meth:`dpsynth.contract.RunContext.resume`.
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Literal

import torch
from pydantic import Field
from tqdm import tqdm

from dpsynth.contract import RunContext
from dpsynth.data.resident import ResidentRecords
from dpsynth.diffusion.schedules import tensors_on
from dpsynth.diffusion.score_matching import ScoreMatchingLoss, draw_perturbation
from dpsynth.dpsgd.ema import EMA
from dpsynth.dpsgd.estimate import PrivateNetwork
from dpsynth.dpsgd.section import DPSGDSection
from dpsynth.dpsgd.training import PrivateTraining, make_optimizer, train_private
from dpsynth.models.refinenet import RefineNet, build_refinenet
from dpsynth.privacy.mechanisms import PureEpsilon
from dpsynth.privacy.randomized_response import randomized_response
from dpsynth.privacy.record_draws import Draws, GeneratorDraws
from dpsynth.schema import Section


class RefineNetSection(Section):
    """The NCSN RefineNet score network (Fig. 4a)."""

    preset: Literal["cpu", "paper"] = Field(
        "cpu", description="RefineNet width preset: cpu (w=32, ~2M), paper (w=128, ~30M, Fig. 4a)"
    )
    width: int | None = Field(None, ge=1, description="override of the preset's width w (null: the preset's)")

    def build(self, channels: int, sigmas: torch.Tensor) -> RefineNet:
        """The network over ``channels`` input channels and the ladder ``sigmas`` (random init)."""
        return build_refinenet(self.preset, channels, sigmas, self.width)


class ScoreTrainingSection(DPSGDSection):
    """Optimisation; clip_norm, noise_multiplier and multiplicity are DP-SGD settings only (the randomized-response
    loop uses B, the length, the optimizer, EMA and checkpoints)."""

    objective: Literal["dsm", "ssm"] = Field(
        "dsm", description="dsm: denoising score matching; ssm: sliced (Eq. 7; required by randomized-response)"
    )
    multiplicity: int = Field(1, ge=1, description="K noise draws per example, averaged before clipping (dp-sgd only)")

    def randomized_response_conflict(self, top_k: int) -> tuple[str, str] | None:
        """``(key, why)`` of the first key the randomized-response loop (Algorithm 1 with Eq. 6 over a cosine
        neighbourhood of ``top_k``) cannot honour, or None: it perturbs sliced-score-matching projections, one
        per example, and adds no noise."""
        conflicts = {
            "objective": (
                self.objective != "ssm",
                "perturbs the sliced-score-matching projections, so it needs objective ssm",
            ),
            "batch_size": (self.batch_size < top_k, f"needs at least privacy.top_k = {top_k} projections per batch"),
            "noise_multiplier": (
                self.noise_multiplier is not None,
                "adds no Gaussian noise; expected null (it is a dp-sgd setting)",
            ),
            "multiplicity": (
                self.multiplicity != 1,
                "draws one projection per example; expected 1 (it is a dp-sgd setting)",
            ),
        }
        wrong = [(key, f"randomized-response {why}") for key, (broken, why) in conflicts.items() if broken]
        return wrong[0] if wrong else None


def score_network(
    key: str,
    model: RefineNetSection,
    sigmas: torch.Tensor,
    shape: tuple[int, int, int],
    training: ScoreTrainingSection,
    sample_calls: int,
) -> PrivateNetwork:
    """The :class:`PrivateNetwork` of a RefineNet over records of ``shape`` trained with DP-SGD by ``training``
    (K = ``multiplicity`` rows per example; sliced score matching differentiates the input: the exact path)."""

    def inputs(rows: int) -> tuple[torch.Tensor, ...]:
        return torch.zeros(rows, *shape), torch.zeros(rows, dtype=torch.long)

    return PrivateNetwork(
        key=key,
        build=lambda: model.build(shape[0], sigmas),
        inputs=inputs,
        training=training.private_training(),
        rows_per_example=training.multiplicity,
        exact=training.objective == "ssm",
        sample_calls=sample_calls,
    )


@dataclasses.dataclass(frozen=True)
class PaperResponse:
    """Eq. 6 as the paper trains with it: nominal ``epsilon``, cosine neighbourhood ``k``; ``label`` (what the run
    is) heads the ledger note saying that no guarantee holds."""

    epsilon: float
    k: int
    label: str


def train_score_network(
    ctx: RunContext,
    model: torch.nn.Module,
    loss_fn: ScoreMatchingLoss,
    clean: torch.Tensor,
    training: ScoreTrainingSection,
    mechanism: str,
    response: PaperResponse | None = None,
    desc: str = "DP-SGD",
) -> torch.nn.Module:
    """Train ``model`` on the score-matching loss of ``clean`` (row i: the i-th record of ``ctx.data.train``) for the
    plan's ``mechanism``; return the released (EMA) network.

    Without ``response``: DP-SGD at the plan's σ (calibrated before any data was read, so the run spends exactly its
    plan), each example seen with ``training.multiplicity`` noise draws averaged before clipping. With it: the
    paper's Algorithm 1 (:func:`train_randomized_response`), under guarantee "none"."""
    if response is not None:
        return train_randomized_response(ctx, model, loss_fn, clean, training.private_training(), mechanism, response)
    shape, levels, copies = tuple(clean.shape[1:]), len(loss_fn.sigmas), training.multiplicity

    def perturbed(rows: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        drawn = draw_perturbation(draws, copies, shape, levels, projections=loss_fn.differentiates_input)
        return {"u": rows, **drawn}

    resident = ResidentRecords(lambda: (clean, None), ctx.device)  # copied at the first fixed-shape step only

    def make_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        return perturbed(clean[indices], draws)

    def device_batch(indices: torch.Tensor, draws: Draws) -> dict[str, torch.Tensor]:
        return perturbed(resident(indices)[0], draws)

    settings = training.private_training(ctx.plan.noise_multiplier(mechanism))
    keys = ctx.data.train.record_keys
    engine = train_private(
        ctx,
        model,
        tensors_on(loss_fn, ctx.device),  # its noise levels beside the model: a captured step copies no table
        make_batch,
        keys,
        settings,
        mechanism=mechanism,
        desc=desc,
        device_batch=device_batch,
    )
    return engine.ema_model if engine.ema_model is not None else model


def train_randomized_response(
    ctx: RunContext,
    model: torch.nn.Module,
    loss_fn: ScoreMatchingLoss,
    clean: torch.Tensor,
    settings: PrivateTraining,
    mechanism: str,
    response: PaperResponse,
) -> torch.nn.Module:
    """Algorithm 1 with Eq. 6 (``response``) for the plan's repeats of ``mechanism``; returns the released (EMA)
    network. Batches and projections come from the run's ``augmentation`` stream (fresh after a resume); the
    responses, like DP noise, never from the run seed."""
    epsilon, k, label = response.epsilon, response.k, response.label
    ctx.ledger.note(
        f"{label}: trained with the paper's randomized response (Eq. 6, nominal epsilon {epsilon:g}, "
        f"k = {k}) on data-independent projection vectors, without clipping or noise. This gives NO "
        "differential privacy guarantee, so no epsilon is claimed for this run."
    )
    count, total = len(clean), ctx.plan.mechanism(mechanism).repeats
    optimizer = make_optimizer(list(model.parameters()), settings)
    ema = EMA(model, settings.ema_decay) if settings.ema_decay else None
    start, state = ctx.resume(mechanism, mechanism)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
    batches = ctx.rng("augmentation", index=start)
    responses = torch.Generator().manual_seed(secrets.randbits(63))
    shape, levels = tuple(clean.shape[1:]), len(loss_fn.sigmas)
    ctx.log(f"{label}: randomized response (NO guarantee), {total} steps, B={settings.batch_size}, k={k}")
    for step in tqdm(range(start, total), initial=start, total=total, desc=label, leave=False):
        indices = torch.randperm(count, generator=batches)[: settings.batch_size]
        single = draw_perturbation(GeneratorDraws(len(indices), batches), 1, shape, levels, projections=True)
        drawn = {key: value.squeeze(1) for key, value in single.items()}
        drawn["v_r"], _ = randomized_response(drawn["v"], epsilon, k, responses)
        drawn = {key: value.to(ctx.device) for key, value in drawn.items()}
        ctx.ledger.charge(PureEpsilon(mechanism, epsilon))  # recorded before the step uses the data
        loss = loss_fn.batch_losses(model, clean[indices].to(ctx.device), drawn).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if ema is not None:
            ema.update(model)
        if (step + 1) % settings.checkpoint_every == 0 or step + 1 == total:
            ctx.checkpoints.save(
                {
                    "step": step + 1,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "ema": ema.state_dict() if ema else None,
                },
                phase=mechanism,
            )
    return ema.model if ema is not None else model
