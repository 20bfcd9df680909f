"""Private selection of public pre-training data: PrivImage's semantic query, DP semantic distribution and
selection (Li et al., arXiv:2311.12850), and the selection phase of a run. See docs/methods/privimage.md."""

from dpsynth.selection.distribution import (
    QUERY_MECHANISM,
    Selection,
    private_semantic_distribution,
    query_noise_multiplier,
    read_selection,
    select_public_classes,
    semantic_distribution_similarity,
    semantic_histogram,
    write_selection,
)
from dpsynth.selection.phase import SELECTION_PHASE, log_selection, select_for_run
from dpsynth.selection.pipeline import (
    SelectionResult,
    SelectionSettings,
    check_reusable,
    private_query_settings,
    release_selection,
    reuse_selection,
    run_selection,
)
from dpsynth.selection.section import SelectionSection
from dpsynth.selection.semantic import SemanticQuery, SemanticQuerySettings, train_semantic_query

__all__ = [
    "QUERY_MECHANISM",
    "SELECTION_PHASE",
    "Selection",
    "SelectionResult",
    "SelectionSection",
    "SelectionSettings",
    "SemanticQuery",
    "SemanticQuerySettings",
    "check_reusable",
    "log_selection",
    "private_query_settings",
    "private_semantic_distribution",
    "query_noise_multiplier",
    "read_selection",
    "release_selection",
    "reuse_selection",
    "run_selection",
    "select_for_run",
    "select_public_classes",
    "semantic_distribution_similarity",
    "semantic_histogram",
    "train_semantic_query",
    "write_selection",
]
