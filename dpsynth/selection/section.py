"""The typed config of PrivImage's semantic query and selection (Li et al., arXiv:2311.12850, §3.2-3.3,
Algorithm 2, appendix B), and the σ_q it plans.

A method that selects public pre-training data privately embeds :class:`SelectionSection` under its
own key (``privimage.selection``); :meth:`SelectionSection.settings` is what
:func:`dpsynth.selection.pipeline.run_selection` takes, :meth:`SelectionSection.query_sigma` the σ_q
of the plan's ``semantic-query`` mechanism.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dpsynth.errors import ConfigError, DataError
from dpsynth.rundir import SELECTION_FILE
from dpsynth.schema import Section
from dpsynth.selection.pipeline import SelectionSettings
from dpsynth.selection.semantic import SemanticQuerySettings


class SelectionSection(Section):
    """The semantic query and the selection (§3.2-3.3, Algorithm 2, appendix B)."""

    k: int = Field(
        3,
        ge=1,
        description="public classes queried per private image and kept per private class "
        "(appendix B: k1 = k2 = k; paper: 5 for CIFAR-10, 10 for CelebA); at most the number of public classes",
    )
    k1: int | None = Field(None, ge=1, description="override of k for the query (L2 sensitivity sqrt(k1))")
    k2: int | None = Field(None, ge=1, description="override of k for the selection (top-k2 noisy counts)")
    conditional: bool = Field(
        True,
        description="one histogram row per private class, selected images relabelled "
        "with it; false: one histogram, public labels kept (CelebA)",
    )
    collisions: Literal["share", "exclusive"] = Field(
        "share",
        description="a public class in the top-k2 of several private classes: kept by each "
        "(share, as printed) or by the one where it ranks highest (exclusive)",
    )
    query_epsilon_share: float = Field(
        0.01,
        gt=0,
        lt=1,
        description="sigma_q makes the query alone (share*eps, delta)-DP (analytic Gaussian); "
        "ignored when query_noise_multiplier is set or a selection is re-used",
    )
    query_noise_multiplier: float | None = Field(
        None, gt=0, description="sigma_q (cell noise std sqrt(k1)*sigma_q); the paper uses 484; null: from the share"
    )
    classifier: str = Field("cnn", description="semantic query classifier (dpsynth.models.classifiers)")
    classifier_preset: Literal["cpu", "gpu"] = Field("gpu", description="its width preset")
    classifier_epochs: int = Field(6, ge=1, description="epochs of Eq. 4 on the public data")
    classifier_batch_size: int = Field(128, ge=1, description="its batch size")
    classifier_lr: float = Field(1e-3, gt=0, description="its Adam learning rate")
    classifier_max_steps: int | None = Field(None, ge=1, description="cap on its steps (smoke runs)")
    cache: bool = Field(True, description="cache the semantic query classifier ($DPSYNTH_CACHE)")
    reuse: str | None = Field(
        None,
        description=f"an earlier run dir or {SELECTION_FILE} on the SAME private data: its selection (with its k, "
        "conditional and sigma_q) replaces the query, and its mechanism is charged again to this run",
    )

    def settings(self) -> SelectionSettings:
        """The pipeline's settings: k1 = k2 = k unless overridden (appendix B)."""
        query = SemanticQuerySettings(
            classifier=self.classifier,
            preset=self.classifier_preset,
            epochs=self.classifier_epochs,
            batch_size=self.classifier_batch_size,
            lr=self.classifier_lr,
            max_steps=self.classifier_max_steps,
        )
        return SelectionSettings(
            k1=self.k1 or self.k,
            k2=self.k2 or self.k,
            conditional=self.conditional,
            collisions=self.collisions,
            query=query,
            cache=self.cache,
        )

    def query_sigma(self, epsilon: float, delta: float, key: str) -> float:
        """σ_q: a re-used selection's, the configured one, or calibrated to the query's ε share.

        The calibration makes the query alone exactly (share·ε, δ)-DP (analytic Gaussian mechanism,
        :func:`dpsynth.selection.distribution.query_noise_multiplier`); the rest of the plan gets what is left.
        ``key`` (the section's dotted config key) names it in errors.
        """
        from dpsynth.selection.distribution import query_noise_multiplier, read_selection

        if self.reuse:
            try:
                return float(read_selection(self.reuse).noise_multiplier)
            except DataError as err:
                raise ConfigError(f"{key}.reuse: {err}") from None
        if self.query_noise_multiplier is not None:
            return self.query_noise_multiplier
        return query_noise_multiplier(epsilon, delta, self.query_epsilon_share)

    def check(self, epsilon: float, delta: float, key: str) -> None:
        """At load: a re-used selection must be readable (its σ_q enters the plan) and agree with
        ``query_noise_multiplier`` when both are set."""
        if not self.reuse:
            return
        reused = self.query_sigma(epsilon, delta, key)
        if self.query_noise_multiplier is not None and reused != self.query_noise_multiplier:
            raise ConfigError(
                f"{key}.query_noise_multiplier is {self.query_noise_multiplier} but the "
                f"re-used selection was released with sigma_q={reused}; drop one of them"
            )
