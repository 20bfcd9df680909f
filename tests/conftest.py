import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("OMP_NUM_THREADS", "2")


def run_cli(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python -m dpsynth ARGS`` in a subprocess, as a user would."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # OMP_NUM_THREADS: set above, or by make test
    return subprocess.run(
        [sys.executable, "-m", "dpsynth", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli_in_process(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """``dpsynth ARGS`` through :func:`dpsynth.cli.main` in this process, with stdout and stderr captured: what
    :func:`run_cli` returns, without a new interpreter importing torch for every call (seconds each). A ``cwd``
    is this process's working directory for the call (each xdist worker is a process of its own, running one
    test at a time). An exception that ``main`` does not turn into an error line fails with exit status 1 and
    its traceback on stderr, as the process would.
    """
    import contextlib
    import io
    import traceback
    import warnings

    import torch

    from dpsynth.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    threads, showwarning = torch.get_num_threads(), warnings.showwarning
    with _working_directory(cwd), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception:
            traceback.print_exc()
            code = 1
        finally:
            torch.set_num_threads(threads)
            warnings.showwarning = showwarning
    return subprocess.CompletedProcess(["dpsynth", *args], code, stdout.getvalue(), stderr.getvalue())


@contextmanager
def _working_directory(path: Path | None) -> Iterator[None]:
    """``path`` as the working directory inside the block (None: unchanged); contextlib.chdir from Python 3.11."""
    previous = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


@pytest.fixture
def cli():
    """The command line in this process (:func:`run_cli_in_process`); tests of the process itself (the entry
    point, an installed wheel, a working directory) call :func:`run_cli`."""
    return run_cli_in_process


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0, result.stdout
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


# A tiny UNet config and a random re-initialisation (the real init zeroes the output layers, so a
# fresh model predicts zeros), shared by the diffusion-layer tests.
TINY_UNET = {
    "base_channels": 8,
    "channel_mult": (1, 2),
    "num_res_blocks": 1,
    "attention_levels": (1,),
    "num_head_channels": 8,
    "max_groups": 4,
}


def randomize(model, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def interrupt_after_steps(config_path, out, stop_after: int, overrides=None) -> None:
    """Run ``config_path`` until ``stop_after`` DP-SGD steps were taken, then raise KeyboardInterrupt
    mid-run, as a user's Ctrl-C would (the caller expects it)."""
    from dpsynth import dpsgd
    from dpsynth.runner import run_config

    original = dpsgd.DPSGDEngine.step
    calls = {"n": 0}

    def step(self, batch, *args, **kwargs):
        if calls["n"] == stop_after:
            raise KeyboardInterrupt
        calls["n"] += 1
        return original(self, batch, *args, **kwargs)

    dpsgd.DPSGDEngine.step = step
    try:
        run_config(config_path, overrides, out=out, echo=False)
    finally:
        dpsgd.DPSGDEngine.step = original


# ------------------------------------------------------------------ the two tiers
# `train`: tests that train a method or a classifier for real, run a run end to end, start processes that
# import torch, or compute for seconds (the long tier). `make test-fast` (pytest -m "not train and not slow")
# runs the rest, the unit tier, in under two minutes; `make test` runs both. A whole file is named with None,
# else the names of its test functions in the long tier; every method's contract class (dpsynth.testing) runs
# its smoke config in the three tests of _CONTRACT_RUNS.
_CONTRACT_RUNS = {
    "test_smoke_run_killed_resumed_spends_exactly_the_plan",
    "test_one_inserted_record_moves_the_clipped_sum_by_at_most_the_clip_norm",
    "test_dry_run_plans_without_reading_data",
}
TRAIN_TIER: dict[str, set[str] | None] = {
    "bench/test_bench_run.py": None,
    "test_pip_install.py": None,
    "data/test_empty_class_runs.py": None,
    "dpsgd/test_device_builders.py": None,
    "dpsgd/test_resume_ledger_ahead.py": None,
    "methods/test_empty_class_methods.py": None,
    "cli/test_pretrain.py": None,
    "dpsgd/test_allocator.py": None,
    "eval/test_private_console.py": None,
    "methods/test_dpdm.py": None,
    "methods/test_privimage.py": None,
    "methods/test_privimage_reuse_settings.py": None,
    "metrics/test_protocol.py": None,
    "privacy/test_crosscheck.py": None,
    "test_distributed_run.py": None,
    "test_presets.py": {"test_config_list_and_dry_run_by_preset_name_write_nothing"},
    "test_resume_changes.py": None,
    "test_run_ledger_invariant.py": None,
    "test_run_pipeline.py": None,
    "test_runner.py": None,
    "bench/test_bench.py": {
        "test_a_cell_not_run_here_keeps_the_figures_recorded_in_the_results_json",
        "test_a_run_past_its_budget_is_stopped_and_its_own_peak_memory_measured",
        "test_an_unreadable_or_unmatched_results_json_gives_the_fresh_table",
        "test_cli_reports_a_bad_suite_in_one_line_and_dry_run_writes_nothing",
        "test_every_packaged_suite_loads_and_each_cell_runs_its_own_epsilon",
        "test_runs_get_pipeline_seeds_by_cost_and_only_the_evaluation_overrides_they_need",
    },
    "cli/test_cli.py": {"test_the_installed_entry_point_prints_one_error_line_and_fails"},
    "cli/test_privacy.py": {"test_noise_spends_the_target_by_opacus_too", "test_subprocess_json_and_errors"},
    "data/test_builtins.py": {"test_glyph_classes_look_different", "test_glyph_generation_is_fast"},
    "data/test_flat_folder.py": {"test_dpsynth_run_releases_from_a_flat_folder"},
    "diffusion/test_score_matching.py": {
        "test_engine_per_example_gradients_of_the_sliced_loss_equal_an_example_by_example_reference"
    },
    "dpsgd/test_distributed_engine.py": {
        "test_all_reduced_clipped_sum_equals_the_single_process_sum",
        "test_two_gloo_ranks_equal_the_single_process_engine",
    },
    "dpsgd/test_estimate.py": {
        "test_dry_run_of_a_path_dataset_says_why_there_is_no_estimate",
        "test_dry_run_prints_the_estimate_and_json_carries_it",
        "test_every_method_declares_the_networks_it_trains_with_dpsgd",
    },
    "dpsgd/test_fine_tuning.py": {"test_every_strategy_gives_the_exact_update_of_the_selected_parameters"},
    "dpsgd/test_sampler.py": {
        "test_sharded_samples_are_global_indices_whose_union_has_the_law",
        "test_the_law_holds_when_a_sample_needs_several_blocks_of_uniforms",
    },
    "dpsgd/test_taps.py": {"test_refinenet_update_with_k_copies_and_virtual_batches_matches_the_exact_path"},
    "dpsgd/test_training.py": {"test_batches_are_sampled_at_the_rate_the_ledger_records"},
    "eval/test_array_runs.py": {
        "test_dpsgd_baseline_is_a_separate_release_beside_chance_and_majority",
        "test_evaluate_dpsgd_baseline_key_trains_it_at_the_end_of_the_run",
    },
    "eval/test_audit.py": {
        "test_audit_run_canary_mirrors_the_runs_dp_sgd",
        "test_dp_sgd_lower_bound_stays_below_the_claim",
    },
    "eval/test_evaluate.py": {
        "test_evaluate_bare_npz_writes_metrics_json",
        "test_private_val_refuses_without_the_ledger_state",
    },
    "kernels/test_mean_embedding_method.py": {
        "test_sigma_is_calibrated_for_the_target_and_an_independent_accountant_agrees"
    },
    "kernels/test_moment_matching.py": {"test_trainer_lowers_the_loss_and_the_generated_means_approach_the_target"},
    "methods/test_dp_feta.py": {
        "test_a_run_killed_between_its_ledger_and_a_central_checkpoint_resumes_and_ends_on_the_plan",
        "test_a_run_whose_every_release_was_lost_skips_the_warm_up_and_ends_on_the_plan",
        "test_an_empty_class_gives_a_finite_central_image",
        "test_means_divide_the_sums_by_the_public_expected_class_count_never_the_realised_one",
        "test_noise_std_on_the_sums_is_sigma_c_times_the_bound",
        "test_plan_composes_the_release_with_dp_adam_and_calibrates_only_dp_adam",
        "test_the_release_is_charged_query_by_query_and_resumes_without_charging_twice",
        "test_the_release_reads_the_private_noise_source_not_the_run_seed",
        "test_the_warm_up_trains_on_the_release_once_and_a_resumed_run_restores_it",
    },
    "methods/test_dp_gan.py": {
        "test_a_pre_trained_run_starts_both_networks_from_the_public_gan",
        "test_engine_runs_with_the_planned_sigma_and_clip_norm_and_generator_follows_the_schedule",
        "test_paired_fakes_get_their_own_latent_per_record_and_step",
        "test_plan_is_t_subsampled_gaussian_steps_at_b_over_n",
        "test_smoke_run_with_the_label_channel_architecture",
    },
    "methods/test_dp_imgsyn.py": {
        "test_a_reopened_run_restores_the_released_state_and_aligns_from_it",
        "test_a_run_killed_after_the_statistics_charge_was_stored_is_refused_on_resume",
        "test_a_run_killed_while_the_statistics_are_read_releases_them_once_on_resume",
        "test_released_statistics_carry_noise_of_std_sigma_c",
    },
    "methods/test_dpsgd_classifier.py": {"test_a_reopened_run_scores_with_the_released_weights"},
    "methods/test_dp_kernel.py": {
        "test_the_plan_is_one_subsampled_gaussian_over_all_steps",
        "test_a_run_killed_with_releases_charged_past_its_checkpoint_resumes_on_the_plan",
    },
    "methods/test_dp_ldm.py": {
        "test_a_lora_run_trains_only_the_adapters_and_releases_a_plain_unet_that_moved_from_the_public_model"
    },
    "methods/test_dppm.py": {
        "test_a_paper_mode_run_killed_between_ledger_and_checkpoint_resumes_at_the_ledger_and_ends_on_its_plan",
        "test_dpsgd_mode_is_dp_within_the_target_and_names_the_unsound_claim",
        "test_generate_and_resume_work_on_a_paper_mode_run",
        "test_paper_mode_claims_no_epsilon_anywhere",
        "test_paper_mode_dry_run_prints_the_plan_and_says_no_guarantee",
        "test_the_loss_attack_scores_the_released_score_model_in_both_modes",
        "test_the_method_canary_audit_retrains_with_canaries_and_leaves_the_run_alone",
    },
    "methods/test_gs_wgan.py": {
        "test_a_finished_run_keeps_no_critic_and_resumes_without_retraining",
        "test_a_run_killed_after_a_charged_step_resumes_and_ends_on_the_plan",
        "test_plan_is_t_shard_sampled_steps_with_the_calibrated_sigma",
    },
    "methods/test_pdp_diffusion.py": {
        "test_resume_of_a_finished_run_neither_retrains_nor_recharges",
        "test_smoke_run_end_to_end",
    },
    "methods/test_pdp_latent.py": {"test_a_latent_run_decodes_its_samples_and_a_second_run_reuses_the_cached_backbone"},
    "methods/test_pe.py": {
        "test_a_run_killed_after_round_one_was_charged_resumes_and_ends_on_its_plan",
        "test_classes_come_from_the_metadata_the_threshold_falls_back_and_each_round_is_one_charge",
        "test_dpsynth_pretrain_builds_the_api_ahead_of_the_run",
    },
    "methods/test_plugin_method.py": {"test_the_plugin_runs_by_name_from_the_command_line"},
    "metrics/test_distributed_fid.py": {"test_gathered_features_equal_one_process_features_in_order"},
    "metrics/test_fidelity.py": {"test_fid_kid_precision_recall_on_the_real_network"},
    "metrics/test_utility.py": {"test_real_to_real_accuracy_on_mnist10k_is_high"},
    "models/test_autoencoder.py": {
        "test_a_second_call_reuses_the_cached_backbone_and_a_changed_public_set_or_config_rebuilds_it",
        "test_a_short_training_on_public_glyphs_reconstructs_held_out_glyphs_far_better_than_the_mean_image",
    },
    "privacy/test_bounded_sum.py": {"test_the_dp_event_of_the_releases_round_trips_through_verify"},
    "privacy/test_calibration.py": {"test_prior_leaves_less_budget_hence_more_noise", "test_total_lands_in_band"},
    "privacy/test_composition.py": {
        "test_adding_a_mechanism_never_lowers_epsilon",
        "test_more_steps_never_lower_epsilon",
    },
    "privacy/test_ledger.py": {
        "test_ledger_calibrate_uses_what_is_left",
        "test_max_steps_is_cached_until_another_mechanism_changes",
    },
    "privacy/test_shard_sampled.py": {"test_ledger_states_the_shard_relation_and_verify_recomputes_it"},
    "privacy/test_verify.py": {
        "test_privacy_json_carries_the_composed_event_and_the_neighbouring_relation",
        "test_verify_a_real_run",
        "test_verify_fails_when_the_record_is_missing_or_changed",
        "test_verify_fails_when_the_stated_epsilon_is_lowered",
    },
    "selection/test_privimage_selection.py": {
        "test_ledger_composes_the_query_with_fine_tuning",
        "test_selection_package_imports_no_method",
    },
    "test_auto_presets.py": {
        "test_auto_preset_dry_runs_on_own_data",
        "test_cheapest_auto_runs_end_to_end_through_the_api",
        "test_cheapest_auto_runs_end_to_end_through_the_cli",
        "test_dp_imgsyn_auto_subsamples_its_statistics_at_a_million_images_and_refuses_a_full_pass",
        "test_your_own_value_wins_over_the_rule_and_is_listed_as_kept",
    },
    "test_config.py": {"test_presets_resolve_by_name_and_every_preset_loads"},
    "test_rundir.py": {"test_restore_refuses_a_state_of_another_budget", "test_run_file_names_are_spelled_once"},
}
# The longest files of the long tier, longest first: started first, so that no core idles at the end of a
# two-process run waiting for one of them (pytest-xdist hands out work in collection order).
LONGEST_FIRST = (
    "bench/test_bench_run.py",
    "methods/test_dp_ldm.py",
    "methods/test_pdp_diffusion.py",
    "methods/test_latent_seeds.py",
    "test_auto_presets.py",
    "methods/test_dppm.py",
    "methods/test_privimage.py",
    "methods/test_dpdm.py",
    "privacy/test_crosscheck.py",
    "test_distributed_run.py",
    "methods/test_dp_feta.py",
    "metrics/test_protocol.py",
    "methods/test_pdp_latent.py",
    "test_run_ledger_invariant.py",
)
TESTS_DIR = Path(__file__).resolve().parent


def _in_train_tier(item: pytest.Item) -> bool:
    relative = Path(str(item.path)).resolve().relative_to(TESTS_DIR).as_posix()
    function = getattr(item, "originalname", item.name)
    if function in _CONTRACT_RUNS and item.cls is not None:  # every method's contract runs its smoke config
        return True
    if relative not in TRAIN_TIER:
        return False
    names = TRAIN_TIER[relative]
    return names is None or function in names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    for item in items:
        if _in_train_tier(item):
            item.add_marker(pytest.mark.train)

    def order(item: pytest.Item) -> tuple[int, int]:
        if item.get_closest_marker("xdist_group") is not None:  # test_pip_install.py: minutes, mostly pip's; one
            return (-1, 0)  # worker starts it at once while the other takes the rest of the suite beside it
        relative = Path(str(item.path)).resolve().relative_to(TESTS_DIR).as_posix()
        if relative in rank:
            return (0, rank[relative])
        return (1, 0) if item.get_closest_marker("train") else (2, 0)

    items.sort(key=order)  # stable: collection order within each group
