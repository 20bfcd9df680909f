"""The selection phase of a run (Li et al., PrivImage, arXiv:2311.12850, Algorithm 2, lines 2-18).

:func:`select_for_run` trains (or loads) the semantic query function on ``data.public``, then either
releases the noisy semantic distribution (one ``semantic-query`` Gaussian with the plan's σ_q) or
re-uses an earlier run's released selection, charging its mechanism again; it checkpoints the
selection, writes ``selection.json`` and ``figures/selection.png`` and returns the relabelled public
subset to pre-train on.

The phase is a loop of one release, resumed through :meth:`dpsynth.contract.RunContext.resume`: its
checkpoint carries ``"step": 1`` and the released selection. A run killed after the checkpoint reloads
it and charges nothing. A run killed between the charge and the checkpoint (the ledger one release
ahead): a re-used selection is read again from its file, uncharged; a fresh query's noisy histogram is
lost, and querying again would spend more than the plan, so the run is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dpsynth.errors import ConfigError, PrivacyError
from dpsynth.selection.distribution import QUERY_MECHANISM, Selection, read_selection, write_selection
from dpsynth.selection.pipeline import (
    SelectionResult,
    check_reusable,
    finish_selection,
    private_query_settings,
    release_selection,
)
from dpsynth.selection.section import SelectionSection
from dpsynth.selection.semantic import train_semantic_query

if TYPE_CHECKING:  # importing the selection layer loads no run machinery
    from dpsynth.contract import RunContext

#: the checkpoint phase of the released selection
SELECTION_PHASE = "selection"


def select_for_run(
    ctx: RunContext, section: SelectionSection, *, key: str, phase: str = SELECTION_PHASE
) -> SelectionResult:
    """Run, resume, or re-use and re-charge the selection of ``section`` (config key ``key``) with the plan's σ_q;
    write its released files and return it (:class:`dpsynth.selection.pipeline.SelectionResult`)."""
    from dpsynth.privacy import Gaussian

    if ctx.public is None:
        raise ConfigError(f"{key.partition('.')[0]} selects from public data: set data.public (e.g. glyphs)")
    sigma = ctx.plan.noise_multiplier(QUERY_MECHANISM)
    settings = section.settings()
    public_spec, private_spec = str(ctx.config.data.public), str(ctx.config.data.private)
    private_settings = private_query_settings(ctx.config.data)
    query = train_semantic_query(
        ctx.public, public_spec, settings.query, device=ctx.device, use_cache=settings.cache, log=ctx.log
    )
    start, saved = ctx.resume(QUERY_MECHANISM, phase)
    if saved is not None:
        selection = Selection.from_json(saved["selection"])
        ctx.log("selection: resumed from the checkpoint (already charged)")
    else:
        if section.reuse:
            selection = read_selection(section.reuse)
            if selection.noise_multiplier != sigma:
                raise PrivacyError(
                    f"the re-used selection has sigma_q={selection.noise_multiplier}, the plan {sigma}: "
                    "the file changed after the run was planned"
                )
            check_reusable(selection, ctx.public, private_spec=private_spec, private_settings=private_settings)
            if start == 0:  # else charged before the run stopped: the file is public, nothing was lost
                ctx.ledger.charge(Gaussian(QUERY_MECHANISM, sigma))
            ctx.log(f"selection: re-used {section.reuse}, its mechanism charged again")
        elif start:
            raise PrivacyError(
                f"{QUERY_MECHANISM} was charged but the run stopped before its release was checkpointed: the noisy "
                "histogram is lost and a second query would spend beyond the plan; start a new run"
            )
        else:
            selection = release_selection(
                ctx.data.train,
                ctx.public,
                query,
                private_spec=private_spec,
                private_settings=private_settings,
                settings=settings,
                noise_multiplier=sigma,
                ledger=ctx.ledger,
                noise=ctx.noise_source(),
                log=ctx.log,
            )
        ctx.checkpoints.save({"step": 1, "selection": selection.to_json()}, phase=phase)
    result = finish_selection(selection, ctx.public, query)
    log_selection(ctx, result)
    return result


def log_selection(ctx: Any, result: SelectionResult) -> None:
    """selection.json, figures/selection.png and the log lines: the noisy release and public values only."""
    selection = result.selection
    write_selection(ctx.run_dir, selection, ctx.public.labels, result.sds, result.query_accuracy)
    if result.query_accuracy is not None:
        ctx.log(f"semantic query: accuracy {result.query_accuracy:.3f} on the public set (public data only)")
    for row, classes in enumerate(selection.chosen):
        ctx.log(
            f"selection: class {selection.row_names[row]} <- "
            + ", ".join(f"{selection.semantic_names[s]} ({selection.noisy_counts[row, s]:.0f})" for s in classes)
        )
    ctx.log(
        f"selection: {result.ratio:.1%} of the {len(ctx.public)} public images selected "
        f"({len(result.subset)} pre-training images, shared classes counted once per class); "
        f"SDS full {result.sds.get('full', float('nan')):.3f}, "
        f"selected {result.sds.get('selected', float('nan')):.3f}"
    )
