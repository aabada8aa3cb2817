"""No-op mutation run: which tests of a transform still pass when the transform does nothing?

For each transform key below, its own test files run in a fresh pytest process with the
``noop_mutation`` plugin and ``AUTODEPLOY_NOOP_TRANSFORM=<key>``: the transform then returns the
model untouched with zero matches (see ``tests/noop_mutation.py``). A test that still passes
cannot tell the transform from the identity. That is right only for a test meant to see nothing
happen (a near miss asserting zero matches and the graph left alone, a config validation, a test
of an op or helper the transform uses); those are listed in ``INTENDED`` with the reason. Any
other survivor is a defect of the test and is marked so in the table (and in the exit status).

Not collected by pytest (the name does not start with ``test_``) and not part of CI: it runs
each file set once per key, several minutes in all on a small machine.

Usage, from the repository root::

    .venv/bin/python tests/run_noop_mutations.py                     # every key below
    .venv/bin/python tests/run_noop_mutations.py fuse_gemms match_rope_pattern
    .venv/bin/python tests/run_noop_mutations.py --control fuse_gemms  # also run unmutated first
    .venv/bin/python tests/run_noop_mutations.py --list

Prints a markdown table (transform key, tests run, failed under no-op, survivors and whether
each is intended). Exit status 1 if any survivor is not intended, a test errored in
collection, or (with ``--control``) a test fails even without the mutation.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)

# key -> its own test files (relative to tests/), or test node ids where a file tests several keys
KEYS: Dict[str, List[str]] = {
    # post_export cleanups
    "cleanup_assert_metadata": ["transforms/test_cleanup_assert_metadata.py"],
    "cleanup_noop_cast": ["transforms/test_cleanup_noop_cast.py"],
    "cleanup_noop_slice": ["transforms/test_cleanup_noop_slice.py"],
    "cleanup_noop_add": ["transforms/test_cleanup_noop_add.py"],
    "cleanup_noop_mul": ["transforms/test_cleanup_noop_mul.py"],
    "cleanup_noop_view": ["transforms/test_cleanup_noop_view.py"],
    # pattern_matcher
    "match_eager_attention": ["transforms/test_match_eager_attention.py"],
    "match_sdpa_attention": ["transforms/test_match_sdpa_attention.py"],
    "match_handwritten_attention": ["transforms/test_match_handwritten_attention.py"],
    "match_repeat_kv": ["transforms/test_match_repeat_kv.py"],
    "match_rope_pattern": ["transforms/test_match_rope_pattern.py"],
    "match_rmsnorm_pattern": ["transforms/test_match_rmsnorm_pattern.py"],
    "match_l2norm_pattern": ["transforms/test_match_l2norm_pattern.py"],
    "match_swiglu_pattern": ["transforms/test_match_swiglu_pattern.py"],
    "match_moe_pattern": ["transforms/test_match_moe_pattern.py"],
    "match_linear_simple": ["transforms/test_match_linear_simple.py"],
    # post_load_fusion
    "fuse_gemms": ["transforms/test_fuse_gemms.py"],
    "fuse_gemms_mixed_children": ["transforms/test_fuse_gemms_mixed_children.py"],
    "fuse_swiglu": ["transforms/test_fuse_swiglu.py"],
    "fuse_silu_mul": ["transforms/test_fuse_silu_mul.py"],
    "fuse_add_rms_norm": ["transforms/test_fuse_add_rms_norm.py"],
    "fuse_rmsnorm": ["transforms/test_fuse_rmsnorm.py"],
    "fuse_l2norm": ["transforms/test_fuse_l2norm.py"],
    "fuse_moe": ["transforms/test_fuse_moe.py"],
    "select_moe_backend": ["transforms/test_select_moe_backend.py"],
    "fuse_gdn_gating": ["transforms/test_fuse_gdn_gating.py"],
    "fold_constants": ["transforms/test_fold_constants.py"],
    "optimize_rope": ["transforms/test_optimize_rope.py"],
    "select_linear_backend": ["transforms/test_select_linear_backend.py",
                              "transforms/test_select_linear_backend_gemv.py"],
    # cache_init / compile
    "insert_cached_attention": ["transforms/test_insert_cached_attention.py"],
    "insert_cached_mla_attention": ["transforms/test_insert_cached_mla_attention.py"],
    "fuse_rope_into_trtllm_mla": ["transforms/test_fuse_rope_into_trtllm_mla.py"],
    "fuse_rope_into_trtllm_attention": ["transforms/test_fuse_rope_into_trtllm_attention.py"],
    "detect_sharding": ["distributed/test_sharding.py", "distributed/test_sharding_kv_replication.py",
                        "distributed/test_expert_parallel.py", "distributed/test_sharding_quantized.py",
                        "distributed/test_sharding_mla.py"],
    "sharding_transform_executor": ["distributed/test_sharding.py::test_two_ranks_hold_their_slices_and_match_hf",
                                    "distributed/test_sharding_quantized.py::"
                                    "test_two_ranks_of_an_fp8_model_hold_their_slices_and_match_the_float_reference"],
    "fuse_trtllm_attn_quant_fp8": ["transforms/test_fuse_trtllm_attn_quant_fp8.py"],
    "mlir_elementwise_fusion": ["transforms/test_mlir_elementwise_fusion.py"],
    "resize_kv_cache": ["transforms/test_resize_kv_cache.py"],
    "insert_cached_causal_conv": ["transforms/test_insert_cached_causal_conv.py"],
    "insert_cached_ssm_attention": ["transforms/test_insert_cached_ssm_attention.py"],
    "insert_cached_delta_rule": ["transforms/test_insert_cached_delta_rule.py"],
    "insert_cached_gated_delta_rule": ["transforms/test_insert_cached_gated_delta_rule.py"],
    "insert_cached_linear_attention": ["transforms/test_insert_cached_linear_attention.py"],
    "insert_cached_diagonal_recurrence": ["transforms/test_insert_cached_diagonal_recurrence.py"],
    "insert_cached_wkv": ["transforms/test_insert_cached_wkv.py"],
    "insert_cached_mlstm": ["transforms/test_insert_cached_mlstm.py"],
    "insert_cached_cca_conv": ["transforms/test_insert_cached_cca_conv.py"],
    "insert_cached_residual_add": ["transforms/test_insert_cached_residual_add.py", "runtime/test_hidden_states.py"],
    "initialize_mrope_delta_cache": ["transforms/test_initialize_mrope_delta_cache.py"],
    "gather_logits_before_lm_head": ["transforms/test_gather_logits_before_lm_head.py"],
    "cleanup_identity_dtype_cast": ["transforms/test_cleanup_identity_dtype_cast.py"],
    "fuse_causal_conv_activation": ["transforms/test_fuse_causal_conv_activation.py"],
    # quantization (issue 15)
    "quantize_fp8_linear_from_config": ["models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-fp8]",
                                        "models/test_quantized_loading.py::test_engine_generates_the_reference_tokens[fp8]",
                                        "models/test_quantized_loading.py::test_missing_scale_tensor_is_named"],
    "quantize_nvfp4_linear_from_config": ["models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-nvfp4]",
                                          "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[nemotron-nvfp4]",
                                          "models/test_quantized_loading.py::test_wrong_scale_shape_is_named"],
    "quantize_finegrained_fp8_linear_from_config": [
        "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-fp8_block]",
        "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[qwen3-fp8_block]", "models/test_quantized_loading.py::test_wrong_weight_dtype_is_named"],
    "quantize_int4_linear_from_config": [
        "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-gptq]",
        "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-awq]",
        "models/test_quantized_loading.py::test_quantized_checkpoint_loads_into_canonical_ops[llama-ct_int4]",
        "models/test_quantized_loading.py::test_engine_generates_the_reference_tokens[gptq]", "models/test_quantized_loading.py::test_act_order_gptq_is_refused",
        "models/test_quantized_loading.py::test_gptq_desc_act_config_is_refused"],
    # quantized MoE (issue 17)
    "quantize_mxfp4_moe_from_config": ["models/test_mxfp4_moe_loading.py"],
    "fuse_mxfp4_moe": ["models/test_mxfp4_moe_loading.py::test_logits_equal_the_dequantized_reference[decoded]"],
    "quantize_fp8_moe_from_config": ["models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[qwen3_moe-fp8-decoded-auto]",
                                     "models/test_quant_expert_moe_loading.py::test_missing_input_scale_is_named"],
    "quantize_finegrained_fp8_moe_from_config": [
        "models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[deepseek_v3-fp8_block-decoded-auto]",
        "models/test_quant_expert_moe_loading.py::test_a_layer_left_float_stays_a_float_moe[fp8_block]", "models/test_quant_expert_moe_loading.py::test_scale_of_another_block_shape_is_named"],
    "quantize_nvfp4_moe_from_config": ["models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[qwen3_moe-nvfp4-kept-auto]",
                                       "models/test_quant_expert_moe_loading.py::test_an_expert_missing_from_a_layer_is_named"],
    "fuse_fp8_moe": ["models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[qwen3_moe-fp8-decoded-auto]"],
    "fuse_finegrained_fp8_moe": ["models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[qwen3_moe-fp8_block-decoded-auto]"],
    "fuse_nvfp4_moe": ["models/test_quant_expert_moe_loading.py::test_logits_equal_the_dequantized_reference[deepseek_v3-nvfp4-decoded-auto]",
                       "models/test_quant_expert_moe_loading.py::test_a_layer_left_float_stays_a_float_moe[nvfp4]"],
    "fuse_fp8_linear": ["models/test_quantized_loading.py::test_fuse_quantized_linear_decodes_once[fp8]",
                        "transforms/test_fuse_fp8_linear_scaled_mm.py"],
    "fuse_finegrained_fp8_linear": ["models/test_quantized_loading.py::test_fuse_quantized_linear_decodes_once[fp8_block]"],
    "fuse_nvfp4_linear": ["models/test_quantized_loading.py::test_fuse_quantized_linear_decodes_once[nvfp4]"],
    "quantize_weights": ["transforms/test_quantize_weights.py"],
    "fuse_int4_linear": ["transforms/test_weight_only_backend.py::test_packed_backend[int4]", "transforms/test_weight_only_backend.py::test_dequantized_backend_is_exact[int4]",
                         "transforms/test_weight_only_backend.py::test_reference_backend_is_a_no_op", "transforms/test_weight_only_backend.py::test_shape_the_kernel_refuses_is_decoded_instead",
                         "transforms/test_weight_only_backend.py::test_auto_backend_builds_and_generates"],
    "fuse_int8_linear": ["transforms/test_weight_only_backend.py::test_packed_backend[int8]", "transforms/test_weight_only_backend.py::test_dequantized_backend_is_exact[int8]"],
    "fuse_fp8_gemms": ["transforms/test_quant_gemm_fusion.py::test_fuse_quant_gemms_on_llama[fp8]", "transforms/test_quant_gemm_fusion.py::test_equal_weight_scales_keep_the_scalar[fp8]",
                       "transforms/test_quant_gemm_fusion.py::test_different_input_scales_are_left_alone[fp8]", "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_with_bias_positive_control",
                       "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_input_with_another_user_is_left_alone", "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_mixed_bias_is_left_alone",
                       "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_shared_weights_are_fused_once", "transforms/test_quant_gemm_fusion.py::test_llm_generates_the_reference_tokens[fp8]",
                       "transforms/test_quant_gemm_fusion.py::test_other_formats_are_left_alone"],
    "fuse_fp4_gemms": ["transforms/test_quant_gemm_fusion.py::test_fuse_quant_gemms_on_llama[nvfp4]", "transforms/test_quant_gemm_fusion.py::test_equal_weight_scales_keep_the_scalar[nvfp4]",
                       "transforms/test_quant_gemm_fusion.py::test_different_input_scales_are_left_alone[nvfp4]", "transforms/test_quant_gemm_fusion.py::test_nvfp4_swiglu_then_gemms_pipeline_order",
                       "transforms/test_quant_gemm_fusion.py::test_llm_generates_the_reference_tokens[nvfp4]"],
    "fuse_finegrained_fp8_swiglu": ["transforms/test_quant_gemm_fusion.py::test_fuse_quant_swiglu_on_llama[fp8_block]",
                                    "transforms/test_quant_gemm_fusion.py::test_finegrained_swiglu_straddling_tile_is_left_alone",
                                    "transforms/test_quant_gemm_fusion.py::test_finegrained_swiglu_gate_with_another_user_is_left_alone"],
    "fuse_nvfp4_swiglu": ["transforms/test_quant_gemm_fusion.py::test_fuse_quant_swiglu_on_llama[nvfp4]", "transforms/test_quant_gemm_fusion.py::test_nvfp4_swiglu_different_input_scales_are_left_alone",
                          "transforms/test_quant_gemm_fusion.py::test_nvfp4_swiglu_then_gemms_pipeline_order", "transforms/test_quant_gemm_fusion.py::test_llm_generates_the_reference_tokens[nvfp4]"],
    "fuse_rmsnorm_quant_fp8": ["transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[llama-fp8-native]",
                               "transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[llama-fp8-torch]",
                               "transforms/test_quant_norm_fusion.py::test_differing_scales_leave_that_norm_alone", "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[control]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-user]", "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[scales-differ]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-format]", "transforms/test_quant_norm_fusion.py::test_compiled_norms_are_left_alone",
                               "transforms/test_quant_norm_fusion.py::test_fp8_nemotron_is_a_near_miss",
                               # per-group (fine-grained) FP8
                               "transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[llama-fp8_block-native]",
                               "transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[llama-fp8_block-torch]",
                               "transforms/test_quant_norm_fusion.py::test_fp8_group_norm_ops_equal_the_norm_then_the_group_quantization",
                               *(f"transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[{c}]"
                                 for c in ("control", "add-control", "default-size", "group-sizes-differ", "other-user",
                                           "mixed-with-static"))],
    "fuse_rmsnorm_quant_nvfp4": ["transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[llama-nvfp4-native]",
                                 "transforms/test_quant_norm_fusion.py::test_norm_feeding_equal_scale_quants_fuses[qwen3-nvfp4-torch]",
                                 "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-format-nvfp4]",
                                 "transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[other-format-nvfp4]"],
    "fuse_relu2_quant_nvfp4": ["transforms/test_quant_norm_fusion.py::test_relu2_feeding_nvfp4_quant_fuses", "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu2-control]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu-times-relu]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu-cubed]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu-read-elsewhere]",
                               "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[square-read-elsewhere]"],
    # tensor parallelism (issue 16)
    "fuse_allreduce_residual_rmsnorm": ["distributed/test_fuse_allreduce_residual_rmsnorm.py"],
    "apply_sharding_hints": ["distributed/test_apply_sharding_hints.py"],
    # the transformers mode (issue 19)
    "build_and_load_factory_model": ["models/test_transformers_mode.py"],
    "detect_hf_attn_layers": ["models/test_transformers_mode.py"],
    "transformers_replace_cached_attn": ["models/test_transformers_mode.py"],
}

# Survivors that are meant to survive a no-op of their transform: node-id prefix -> why.
INTENDED: Dict[str, str] = {
    # all-reduce + RMSNorm fusions (issue 16)
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_op_at_world_size_one_is_the_unfused_add_norm": "the fused ops, not the transform",
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_two_ranks_ops_sum_then_norm": "the fused ops on two ranks, not the transform",
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_norm_in_another_dtype_is_left_alone": "near miss (the Gemma dtype exclusion)",
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_an_all_reduce_read_elsewhere_is_not_folded_into_the_add_norm": "near miss",
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_compiled_norms_are_left_alone": "near miss (no all-reduce twin of the compile backend)",
    "distributed/test_fuse_allreduce_residual_rmsnorm.py::test_plain_norm_whose_sum_is_read_before_it_is_left_alone": "near miss",
    # MLA (issue 18)
    "transforms/test_insert_cached_mla_attention.py::test_export_emits_torch_mla_for_each_layer":
        "the export route, before the transform",
    "transforms/test_insert_cached_mla_attention.py::test_expanded_route_caches_per_head_keys_and_values":
        "near miss: no torch_mla in the graph",
    "transforms/test_insert_cached_mla_attention.py::test_mla_disabled_keeps_the_model_exact_in_recompute_mode":
        "near miss: the transform switched off",
    "transforms/test_insert_cached_mla_attention.py::test_route_declines_a_biased_or_replaced_kv_b_proj":
        "the export route's helper",
    "transforms/test_fuse_rope_into_trtllm_mla.py::test_logits_equal_the_unfused_graph":
        "numerics against the unfused graph (test_structure is the one that sees the fusion)",
    # detect_sharding: these call the planning function directly (the transform's numerics are the 2-rank tests')
    "distributed/test_sharding.py::test_plan_splits_attention_by_heads_and_the_mlp_and_leaves_the_rest":
        "the planning function, called directly",
    "distributed/test_sharding.py::test_sizes_the_world_size_does_not_divide_are_an_error_naming_those_that_do":
        "the planning function, called directly",
    "distributed/test_sharding.py::test_a_projection_with_another_reader_is_left_whole": "the planning function",
    "distributed/test_sharding_kv_replication.py::test_kv_heads_fewer_than_ranks_are_replicated":
        "the planning function, called directly",
    "distributed/test_sharding_kv_replication.py::"
    "test_a_tied_lm_head_shares_the_embedding_slice_or_stays_whole_with_it": "the planning function",
    "transforms/test_mlir_elementwise_fusion.py::test_min_ops_leaves_short_subgraphs": "near miss: min_ops",
    "transforms/test_mlir_elementwise_fusion.py::test_near_misses_left_alone": "near misses, 0 matches",
    "transforms/test_mlir_elementwise_fusion.py::test_partition_alone_needs_no_xdsl": "the partition function, called directly",
    "transforms/test_fuse_trtllm_attn_quant_fp8.py::test_other_activation_quantizations_are_left_alone[nvfp4]":
        "near miss: NVFP4 activations are left alone",
    "distributed/test_expert_parallel.py::test_plan_splits_whole_experts_when_the_world_size_divides_them":
        "the planning function, called directly",
    "distributed/test_expert_parallel.py::"
    "test_inside_the_experts_each_rank_computes_its_share_and_rank_zero_adds_the_down_biases":
        "the planning and executing functions, called directly (a no-op run of the key fails it at the plan)",
    **{f"distributed/test_sharding_quantized.py::{name}": "the planning function, called directly" for name in (
        "test_quantized_linears_split_with_the_scales_of_their_format[fp8]",
        "test_quantized_linears_split_with_the_scales_of_their_format[gptq]",
        "test_quantized_linears_split_with_the_scales_of_their_format[nvfp4]",
        "test_fine_grained_fp8_blocks_a_split_would_cut_stay_whole",
        "test_an_mlp_whose_gate_has_another_reader_stays_whole",
        "test_fewer_experts_than_ranks_split_inside_the_experts")},
    **{f"distributed/test_sharding_mla.py::{name}": "the planning function, called directly" for name in (
        "test_mla_splits_by_heads_and_keeps_the_latent_whole",
        "test_a_query_with_another_reader_leaves_the_layer_whole",
        "test_heads_the_world_size_does_not_divide_are_an_error")},
    "transforms/test_fuse_rope_into_trtllm_attention.py::test_logits_equal_the_unfused_graph":
        "numerics against the unfused graph (test_structure is the one that sees the fusion)",
    # quantization (issue 15): near misses and settings that must leave the graph alone
    "transforms/test_fuse_fp8_linear_scaled_mm.py::test_op_equals_the_canonical_op": "the op, not the transform",
    "transforms/test_fuse_fp8_linear_scaled_mm.py::test_fake_kernel": "the op, not the transform",
    "transforms/test_quantize_weights.py::test_config_checks_and_the_quantization_shortcut": "config validation",
    "transforms/test_weight_only_backend.py::test_reference_backend_is_a_no_op": "near miss: backend reference asks for no change",
    "transforms/test_quant_gemm_fusion.py::test_different_input_scales_are_left_alone": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_input_with_another_user_is_left_alone": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_fp8_gemms_mixed_bias_is_left_alone": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_other_formats_are_left_alone": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_finegrained_swiglu_straddling_tile_is_left_alone[48-False]": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_finegrained_swiglu_gate_with_another_user_is_left_alone": "near miss",
    "transforms/test_quant_gemm_fusion.py::test_nvfp4_swiglu_different_input_scales_are_left_alone": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-user]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[scales-differ]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-format]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[other-format-nvfp4]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu-cubed]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[relu-read-elsewhere]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_near_misses_are_left_alone[square-read-elsewhere]": "near miss",
    "transforms/test_quant_norm_fusion.py::test_compiled_norms_are_left_alone": "near miss",
    "transforms/test_quant_norm_fusion.py::test_fp8_nemotron_is_a_near_miss": "near miss",
    "transforms/test_quant_norm_fusion.py::test_fp8_group_norm_ops_equal_the_norm_then_the_group_quantization":
        "the fused ops, not the transform",
    "transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[group-sizes-differ]":
        "near miss",
    "transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[other-user]":
        "near miss",
    "transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[mixed-with-static]":
        "near miss",
    "transforms/test_quant_norm_fusion.py::test_fp8_group_norms_fuse_and_near_misses_are_left_alone[other-format-nvfp4]":
        "near miss",
    "transforms/test_select_moe_backend.py::test_near_misses_are_left_alone": "near miss",
    # near misses: the test asserts zero matches and the graph left alone
    "transforms/test_cleanup_assert_metadata.py::test_graph_without_asserts_is_left_alone": "near miss",
    "transforms/test_cleanup_noop_cast.py::test_dtype_changing_and_copying_casts_stay": "near miss",
    "transforms/test_cleanup_noop_slice.py::test_partial_and_strided_slices_stay": "near miss",
    "transforms/test_cleanup_noop_slice.py::test_slice_bounded_by_another_dynamic_length_stays": "near miss",
    "transforms/test_cleanup_noop_add.py::test_dtype_or_shape_changing_adds_stay": "near miss",
    "transforms/test_cleanup_noop_add.py::test_add_zero_whose_source_is_mutated_later_stays": "near miss",
    "transforms/test_cleanup_noop_add.py::test_add_zero_whose_source_is_mutated_through_a_view_stays": "near miss",
    "transforms/test_cleanup_noop_add.py::test_add_zero_that_makes_a_tensor_contiguous_is_left_alone": "near miss",
    "transforms/test_cleanup_noop_mul.py::test_scaling_dtype_changing_and_floor_division_stay": "near miss",
    "transforms/test_cleanup_noop_mul.py::test_mul_one_whose_source_is_mutated_later_stays": "near miss",
    "transforms/test_cleanup_noop_mul.py::test_mul_one_whose_source_is_mutated_through_a_view_stays": "near miss",
    "transforms/test_cleanup_noop_mul.py::test_mul_one_that_makes_a_tensor_contiguous_is_left_alone": "near miss",
    "transforms/test_cleanup_noop_view.py::test_shape_or_dtype_changing_views_stay": "near miss",
    "transforms/test_cleanup_noop_view.py::test_contiguous_of_non_contiguous_tensor_stays_and_graph_runs": "near miss",
    "transforms/test_cleanup_noop_view.py::test_view_written_in_place_is_kept_and_numerics_hold": "near miss",
    "transforms/test_cleanup_identity_dtype_cast.py::test_nothing_to_remove_is_a_zero_match": "near miss",
    "transforms/test_cleanup_identity_dtype_cast.py::test_stage_is_compile":
        "config: the transform's stage (runs no transform)",
    "transforms/test_match_eager_attention.py::test_softmax_over_queries_is_left_alone": "near miss",
    "transforms/test_match_eager_attention.py::test_returned_probabilities_keep_the_eager_math": "near miss",
    "transforms/test_match_eager_attention.py::test_inplace_scaled_scores_read_again_keep_the_eager_math": "near miss",
    "transforms/test_match_eager_attention.py::test_rank3_attention_is_left_alone": "near miss",
    "transforms/test_match_sdpa_attention.py::test_dropout_is_left_alone": "near miss",
    "transforms/test_match_sdpa_attention.py::test_is_causal_with_different_query_and_key_lengths_is_left_alone":
        "near miss (SDPA's top-left causal mask is not torch_attention's bottom-right one)",
    "transforms/test_match_sdpa_attention.py::test_rank3_sdpa_is_left_alone": "near miss",
    "transforms/test_match_handwritten_attention.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_match_repeat_kv.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_match_repeat_kv.py::test_tiling_is_really_a_different_head_assignment":
        "guard of the near miss above (runs no transform)",
    "transforms/test_match_rope_pattern.py::test_off_centre_rotate_half_is_left_alone": "near miss",
    "transforms/test_match_rope_pattern.py::test_q_and_k_with_different_tables_are_left_alone": "near miss",
    "transforms/test_match_rope_pattern.py::test_rope_ops_equal_hf_functions":
        "op test: the replacement ops equal HF's functions (runs no transform)",
    "transforms/test_match_rmsnorm_pattern.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_match_l2norm_pattern.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_match_swiglu_pattern.py::test_near_misses_left_alone": "near miss",
    "transforms/test_match_moe_pattern.py::test_export_route_emits_the_same_canonical_op":
        "near miss: the export route already emits the canonical op, the matcher must find nothing",
    "transforms/test_match_moe_pattern.py::test_gelu_gated_experts_left_alone": "near miss",
    "transforms/test_match_moe_pattern.py::test_cross_wired_experts_left_alone": "near miss",
    "transforms/test_match_linear_simple.py::test_computed_weight_is_left_alone": "near miss",
    "transforms/test_fuse_gemms.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fuse_gemms.py::test_different_weight_dtypes_left_alone": "near miss",
    "transforms/test_fuse_gemms_mixed_children.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fuse_gemms_mixed_children.py::test_llama_pipeline_leaves_all_linear_parents_to_fuse_gemms":
        "near miss: on llama every linear parent is fuse_gemms' (asserts 0 matches here)",
    "transforms/test_fuse_swiglu.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fuse_silu_mul.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fuse_gdn_gating.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fold_constants.py::test_nothing_to_fold_in_a_plain_llama": "near miss: nothing constant in the graph",
    "transforms/test_fuse_gdn_gating.py::test_op_equals_hf_expression_and_dtypes":
        "op test: the fused op against HF's expression (runs no transform)",
    "transforms/test_fuse_add_rms_norm.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_fuse_rmsnorm.py::test_graph_without_norms_is_a_zero_match": "near miss",
    "transforms/test_fuse_rmsnorm.py::test_native_kernel_matches_the_reference_and_declines_what_it_cannot_take":
        "op test: the native kernel against the reference op (runs no transform)",
    "transforms/test_fuse_rmsnorm.py::test_invalid_backend_is_a_config_error": "config validation",
    "transforms/test_fuse_l2norm.py::test_graph_without_l2_norms_is_a_zero_match": "near miss",
    "transforms/test_fuse_l2norm.py::test_native_op_matches_the_reference_and_falls_back_where_the_kernel_cannot_run":
        "op test: the native op against the reference op (runs no transform)",
    "transforms/test_fuse_l2norm.py::test_invalid_backend_is_a_config_error": "config validation",
    "transforms/test_fuse_moe.py::test_input_dependent_weights_left_alone": "near miss",
    "transforms/test_select_linear_backend.py::test_onednn_leaves_bf16_and_computed_weights_alone": "near miss",
    "transforms/test_select_linear_backend.py::test_bf16_weights_left_alone": "near miss",
    "transforms/test_select_linear_backend.py::test_computed_weight_left_alone": "near miss",
    "transforms/test_select_linear_backend_gemv.py::test_near_misses_are_left_alone": "near miss",
    "transforms/test_select_linear_backend_gemv.py::test_float16_overflow_is_computed_in_float32":
        "op test: dual_linear itself (runs no transform)",
    "transforms/test_select_linear_backend_gemv.py::test_config_errors_and_memory_expectation": "config validation",
    "transforms/test_resize_kv_cache.py::test_explicit_num_pages_is_kept": "near miss: a user's num_pages is kept",
    "transforms/test_resize_kv_cache.py::test_explicit_min_pool_with_large_token_budget_is_kept":
        "near miss: a user's num_pages is kept",
    "transforms/test_resize_kv_cache.py::test_free_mem_ratio_is_validated": "config validation",
    "transforms/test_insert_cached_causal_conv.py::test_a_graph_without_convs_is_left_alone": "near miss",
    "transforms/test_insert_cached_causal_conv.py::test_an_uncacheable_graph_is_left_for_recompute": "near miss",
    "transforms/test_insert_cached_causal_conv.py::test_without_the_transform_the_consistency_check_falls_back_to_recompute":
        "the transform switched off is the test's premise (the safety net catches the uncached conv)",
    "transforms/test_insert_cached_ssm_attention.py::test_a_graph_with_convs_but_no_scan_is_left_alone": "near miss",
    "transforms/test_insert_cached_gated_delta_rule.py::test_a_graph_without_delta_rules_is_left_alone": "near miss",
    "transforms/test_insert_cached_linear_attention.py::test_a_graph_without_linear_attention_is_left_alone": "near miss",
    "transforms/test_insert_cached_diagonal_recurrence.py::test_a_graph_without_a_diagonal_recurrence_is_left_alone": "near miss",
    "transforms/test_insert_cached_wkv.py::test_a_graph_without_wkv_is_left_alone": "near miss",
    "transforms/test_insert_cached_mlstm.py::test_a_graph_without_mlstm_is_left_alone": "near miss",
    "transforms/test_insert_cached_cca_conv.py::test_a_graph_without_cca_convs_is_left_alone": "near miss",
    "transforms/test_insert_cached_residual_add.py::test_hf_hidden_states_convention":
        "reference check: HF's output_hidden_states convention the other tests rely on (runs no transform)",
    "transforms/test_insert_cached_residual_add.py::test_capture_op_writes_only_the_step_rows":
        "op test: the capture op itself (runs no transform)",
    "runtime/test_hidden_states.py::test_a_build_that_captures_nothing_refuses_the_request":
        "near miss: a build without layers must refuse the request (the transform is not asked to capture)",
    "transforms/test_initialize_mrope_delta_cache.py::test_plain_rope_model_is_left_alone": "near miss",
    "transforms/test_initialize_mrope_delta_cache.py::test_detection_follows_the_models_rotary_embedding":
        "helper test: mRoPE detection from the model (runs no transform)",
    "transforms/test_fuse_causal_conv_activation.py::test_near_misses_left_alone": "near miss",
    "transforms/test_fuse_causal_conv_activation.py::test_cached_conv_with_gelu_left_alone": "near miss",
    "transforms/test_fuse_causal_conv_activation.py::test_real_qwen3_next_already_passes_silu_into_the_conv":
        "near miss: HF models pass the activation into the conv already (0 matches)",
    "transforms/test_fuse_causal_conv_activation.py::test_stage_is_compile_before_compile_model":
        "config: the transform's stage and place (runs no transform)",
    # apply_sharding_hints: these call its planning functions directly (the transform itself is seen by the
    # world-size-1 lowering test, the shard_layers test and the 2-rank test)
    "distributed/test_apply_sharding_hints.py::test_the_hint_op_is_a_linear_and_names_the_modes_it_allows":
        "the op, not the transform",
    "distributed/test_apply_sharding_hints.py::test_hints_give_the_plan_detection_gives": "the planning function",
    "distributed/test_apply_sharding_hints.py::test_the_executor_inserts_the_collectives_the_hints_ask_for":
        "the planning function, then the executor",
    "distributed/test_apply_sharding_hints.py::test_the_moe_model_splits_whole_experts_and_keeps_its_router":
        "the planning function",
    "distributed/test_apply_sharding_hints.py::test_a_min_local_shape_above_the_local_slice_replicates":
        "the planning helper (column_split)",
    "distributed/test_apply_sharding_hints.py::test_sizes_the_world_size_does_not_split_are_an_error_naming_those_that_do":
        "the planning helper",
    "distributed/test_apply_sharding_hints.py::test_a_hint_mode_that_means_nothing_is_an_error_naming_the_modes":
        "the op's and the planning helper's validation",
    # the transformers mode: helpers and configuration, no transform runs
    "models/test_transformers_mode.py::test_cached_attention_outside_a_step_is_an_error":
        "the attention function, called without the pipeline",
    "models/test_transformers_mode.py::test_graph_transforms_are_refused_in_transformers_mode":
        "configuration validation (runs no transform)",
    "models/test_transformers_mode.py::test_probe_records_what_the_cached_op_cannot_honour":
        "the probe helper, called directly",
}


@dataclass
class KeyResult:
    key: str
    files: List[str]
    passed: List[str] = field(default_factory=list)
    failed: List[str] = field(default_factory=list)
    skipped: List[str] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)  # collection errors, crashes
    control_failed: List[str] = field(default_factory=list)
    seconds: float = 0.0


def _node_id(case: ET.Element) -> str:
    """``transforms/test_x.py::test_y[param]`` from a junit testcase (classname is the dotted path)."""
    classname, name = case.get("classname", ""), case.get("name", "")
    parts = classname.split(".")
    # classname: tests.transforms.test_x (module) or tests.transforms.test_x.TestClass
    mod_end = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    path = "/".join(p for p in parts[: mod_end + 1] if p != "tests") + ".py"
    return "::".join([path, *parts[mod_end + 1:], name])


def _run_pytest(files: List[str], key: Optional[str], marker: str, timeout: int) -> Tuple[Dict[str, str], str, float]:
    """Run ``files`` (with ``key`` made a no-op, or unmutated for None); node id -> outcome."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("AUTODEPLOY_NOOP_TRANSFORM", None)
    env.pop("_AUTODEPLOY_NOOP_ACTIVE", None)
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker]
    if key is not None:
        env["AUTODEPLOY_NOOP_TRANSFORM"] = key
        args += ["-p", "noop_mutation"]
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        start = time.perf_counter()
        try:
            done = subprocess.run([*args, f"--junitxml={xml}", *[os.path.join(TESTS, f) for f in files]],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            tail = (done.stdout + done.stderr)[-3000:]
        except subprocess.TimeoutExpired as err:
            tail = f"timed out after {timeout}s: {str(err.stdout)[-2000:]}"
        seconds = time.perf_counter() - start
        outcomes: Dict[str, str] = {}
        if os.path.exists(xml):
            for case in ET.parse(xml).getroot().iter("testcase"):
                kinds = {child.tag for child in case}
                outcome = ("error" if "error" in kinds else "failed" if "failure" in kinds
                           else "skipped" if "skipped" in kinds else "passed")
                outcomes[_node_id(case)] = outcome
    return outcomes, tail, seconds


def _intended(node_id: str) -> Optional[str]:
    base = node_id.split("[", 1)[0]
    for prefix, reason in INTENDED.items():
        if base == prefix or node_id == prefix:
            return reason
    return None


def run_key(key: str, marker: str, timeout: int, control: bool) -> KeyResult:
    result = KeyResult(key, KEYS[key])
    if control:
        outcomes, tail, _ = _run_pytest(KEYS[key], None, marker, timeout)
        result.control_failed = sorted(n for n, o in outcomes.items() if o in ("failed", "error"))
        if not outcomes:
            result.errors.append(f"control run collected nothing: {tail[-500:]}")
    outcomes, tail, result.seconds = _run_pytest(KEYS[key], key, marker, timeout)
    if not outcomes:
        result.errors.append(f"no test ran: {tail[-500:]}")
    for node, outcome in sorted(outcomes.items()):
        {"passed": result.passed, "failed": result.failed, "skipped": result.skipped,
         "error": result.failed}[outcome].append(node)
    return result


def markdown(results: List[KeyResult]) -> str:
    lines = ["| transform | tests run | failed under no-op | survivors (intended?) |",
             "|---|---|---|---|"]
    for r in results:
        survivors = []
        for node in r.passed:
            reason = _intended(node)
            short = node.split("::", 1)[1]
            survivors.append(f"`{short}`: {reason}" if reason else f"`{short}`: **DEFECT (not intended)**")
        if r.skipped:
            survivors.append(f"skipped: {', '.join('`' + n.split('::', 1)[1] + '`' for n in r.skipped)}")
        if r.errors:
            survivors.append("**ERROR**: " + "; ".join(e.replace("\n", " ")[:300] for e in r.errors))
        if r.control_failed:
            survivors.append("**fails without the mutation**: " + ", ".join(r.control_failed))
        ran = len(r.passed) + len(r.failed)
        lines.append(f"| `{r.key}` | {ran} | {len(r.failed)} | {'<br>'.join(survivors) or '-'} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keys", nargs="*", help="transform keys (default: every key of KEYS)")
    parser.add_argument("--list", action="store_true", help="print the key -> test files mapping and exit")
    parser.add_argument("--control", action="store_true", help="also run each file set unmutated first")
    parser.add_argument("-m", dest="marker", default="not slow and not gpu", help="pytest -m expression")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest process")
    opts = parser.parse_args(argv)
    if opts.list:
        for key, files in KEYS.items():
            print(f"{key}: {' '.join(files)}")
        return 0
    unknown = [k for k in opts.keys if k not in KEYS]
    if unknown:
        parser.error(f"unknown keys {unknown}; known: {sorted(KEYS)}")
    results = []
    for key in opts.keys or list(KEYS):
        r = run_key(key, opts.marker, opts.timeout, opts.control)
        print(f"{key}: {len(r.failed)} failed, {len(r.passed)} survived, {len(r.skipped)} skipped "
              f"({r.seconds:.0f}s)", file=sys.stderr, flush=True)
        results.append(r)
    print(markdown(results))
    bad = any(r.errors or r.control_failed or any(_intended(n) is None for n in r.passed) for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
