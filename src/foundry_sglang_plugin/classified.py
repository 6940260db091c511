"""Every ``ServerArgs`` field and every declared ``SGLANG_*`` switch of SGLang 0.5.23, classified.

Each is exactly one of:

* fingerprinted: its value changes what the decode graphs contain or the memory laid out under them,
  so an archive is valid only for the value it was saved with (:func:`archive.fingerprint`; a switch
  counts only where it is set);
* refused: Foundry cannot promise a correct restore with it on, so :func:`support.check_supported`
  refuses the launch (fields with a rule of their own there, or, generically, any value but off/empty
  for a field and any value but the default for a switch);
* irrelevant, with the reason.

A field or switch a later SGLang adds and this module does not name is fingerprinted (a changed
value then costs a SAVE, never a wrong restore), and tests/sglang/test_sglang_classification.py
fails until it is classified here. The lists were made from SGLang 0.5.23's field namespaces
(``namespace_of(ServerArgs)``) and the section headings of ``sglang/srt/environ.py``.
"""

from __future__ import annotations

#: ServerArgs fields whose value changes what is captured or the memory under it: in the fingerprint.

SERVER_FINGERPRINTED = frozenset(
    """
        attention_backend attn_cp_size attn_dp_size base_gpu_id bf16_gemm_backend boundary_reduction
        c128_page_size chunked_prefill_size context_length cp_strategy cpu_offload_gb cuda_graph_bs_decode
        cuda_graph_bs_prefill cuda_graph_config cuda_graph_max_bs_decode cuda_graph_max_bs_prefill
        cuda_graph_max_seq_len_prefill cuda_graph_prefill_max_context dcp_comm_backend dcp_replicate_q_proj
        dcp_size decode_attention_backend decrypted_config_file decrypted_draft_config_file deepep_config
        deepep_dispatcher_output_dtype deepep_mode deepep_v2_mode device
        disable_aiter_allreduce_fusion_in_decode disable_aiter_allreduce_fusion_in_prefill
        disable_attn_tp_gather disable_chunked_prefix_cache disable_cuda_graph_padding
        disable_custom_all_reduce disable_flashinfer_autotune disable_flashinfer_cutlass_moe_fp4_allgather
        disable_hybrid_swa_memory disable_overlap_schedule disable_radix_cache disable_shared_experts_fusion
        dp_size dsa_decode_backend dsa_paged_mqa_logits_backend dsa_prefill_backend dsa_topk_backend
        dsa_triton_union dsv4_attn_backend dsv4_prefill_backend dtype dwdp_size elastic_ep_initial_size
        enable_amd_monokernel enable_attn_tp_input_scattered enable_broadcast_mm_inputs_process
        enable_cp_decode_attn_tp enable_cp_tp_group_sharing enable_cudagraph_gc
        enable_decoder_swa_bounded_replay enable_deepseek_v4_fp4_indexer enable_dense_mlp_attn_tp
        enable_deterministic_inference enable_dp_attention_local_control_broadcast
        enable_dsa_cache_layer_split enable_dsa_fused_indexer enable_encoder_swa_bounded_replay enable_eplb
        enable_flexkv enable_fp32_lm_head enable_fused_qk_norm_rope enable_hierarchical_cache enable_hisparse
        enable_int8_mamba_checkpoint enable_kv_cache_sharding enable_layernorm_sp
        enable_layerwise_nvtx_marker enable_lean_attention enable_linear_replayssm
        enable_linear_replayssm_spec enable_linker_mla_dedup enable_lmcache
        enable_mamba_cache_stochastic_rounding enable_megamoe_for_layernorm_sp enable_mis enable_mixed_chunk
        enable_mm_global_cache enable_multimodal enable_page_major_kv_layout
        enable_precise_embedding_interpolation enable_prefill_cp enable_prefix_mm_cache
        enable_scattered_sconv enable_session_radix_cache enable_shared_experts_attn_tp
        enable_single_batch_overlap enable_tf32_matmul enable_torch_compile enable_torch_compile_debug_mode
        enable_torch_symm_mem enable_two_batch_overlap enable_unified_cache_external_linker
        enable_unified_memory enable_w4a4_mxfp4_megamoe enable_waterfill
        enforce_disable_flashinfer_allreduce_fusion enforce_shared_experts_fusion ep_dispatch_algorithm
        ep_join_rank_offset ep_num_redundant_experts ep_size eplb_algorithm
        eplb_min_rebalancing_utilization_threshold eplb_rebalance_layers_per_chunk
        eplb_rebalance_num_iterations expert_balancedness_report_mode
        expert_distribution_recorder_buffer_size expert_distribution_recorder_mode
        flashinfer_a2a_dispatch_type flashinfer_autotune_skip_ops flashinfer_mla_disable_ragged
        flashinfer_mxfp4_moe_precision flexkv_config_file fp4_gemm_runner_backend fp8_gemm_runner_backend
        fuseep_mode gc_threshold gpu_id_step hicache_host_memory_fraction hicache_host_memory_mode
        hicache_io_backend hicache_mem_layout hicache_ratio hicache_size hicache_storage_backend
        hicache_storage_backend_extra_config hicache_storage_prefetch_policy
        hicache_storage_prefetch_retry_max_attempts hicache_storage_prefetch_retry_poll_interval
        hicache_write_policy hisparse_config init_expert_location int8_mamba_ckpt_size is_embedding
        json_model_override_args kt_cpuinfer kt_max_deferred_experts_per_token kt_method kt_num_gpu_experts
        kt_threadpool_count kt_weight_path kv_cache_dtype linear_attn_backend linear_attn_decode_backend
        linear_attn_prefill_backend linear_attn_verify_backend linear_replayssm_cache_len lmcache_config_file
        load_format mamba_backend mamba_cache_philox_rounds mamba_full_memory_ratio mamba_max_states_per_path
        mamba_radix_cache_strategy mamba_ssm_dtype mamba_track_interval max_ep_size max_mamba_cache_size
        max_prefill_tokens max_running_requests max_total_tokens mem_fraction_static mm_attention_backend
        mm_enable_dp_encoder mm_feature_transport mm_global_cache_backend mm_process_config
        model_config_parser model_impl model_path modelopt_checkpoint_restore_path modelopt_quant
        moe_a2a_backend moe_dense_tp_size moe_dp_size moe_runner_backend num_continuous_decode_steps
        offload_group_size offload_mode offload_num_in_group offload_prefetch_step page_size
        ple_offload_backend ple_offload_dir ple_offload_embedding pp_async_batch_depth
        pp_max_micro_batch_size pp_size pre_warm_nccl prefill_attention_backend
        prefill_kv_cache_dequant_dtype prefill_max_requests prefill_only_disable_kv_cache qsa_indexer_dtype
        quantization quantization_param_path quantize_and_serve radix_cache_backend radix_eviction_policy
        radix_eviction_policy_config revision rl_on_policy_target rl_quant_profile sampling_backend
        shared_experts_tp_size swa_full_tokens_ratio swa_prefix_tails tbo_token_distribution_threshold
        torch_compile_max_bs tp_size triton_attention_num_kv_splits triton_attention_reduce_in_fp32
        triton_attention_split_tile_size unified_cache_external_linker_backend
        unified_cache_external_linker_config uses_mamba_radix_cache
    """.split()
)

#: ServerArgs fields with a refusal rule of their own in :func:`support.check_supported`.

SERVER_REFUSED_BY_RULE = frozenset(
    """
        cuda_graph_backend_decode cuda_graph_backend_prefill disable_cuda_graph disable_decode_cuda_graph
        disable_prefill_cuda_graph disaggregation_mode dllm_algorithm enable_aiter_allreduce_fusion
        enable_dp_attention enable_dp_lm_head enable_flashinfer_allreduce_fusion
        enable_fused_moe_sum_all_reduce enable_lora enable_memory_saver enable_mscclpp enable_pdmux
        enable_return_aux_hidden_states enable_return_hidden_states enable_symm_mem
        flashinfer_allreduce_fusion_backend lora_paths nnodes return_hidden_states_mode speculative_algorithm
        startup_weight_load_mode uno_lora_path use_ray
    """.split()
)

#: ServerArgs fields refused when set to anything but off/empty: reason -> names.

SERVER_REFUSED: dict[str, tuple[str, ...]] = {
    "runs torch's profiler (CUPTI) through the capture, where Foundry holds CUPTI to count captures": (
        "enable_profile_cuda_graph",
    ),
    "adds outputs to the decode graphs (routed experts, indexer top-k, auxiliary hidden states)": tuple(
        """
            aux_hidden_state_capture enable_return_indexer_topk enable_return_routed_experts
            return_aux_hidden_state_layer_ids
        """.split()
    ),
    "moves weights or experts after capture, or recaptures (CPU weight backup, paged experts, elastic EP, PD role switch)": tuple(
        """
            elastic_ep_backend enable_elastic_expert_backup enable_paged_experts enable_pd_role_switch
            enable_weights_cpu_backup ep_join_mode
        """.split()
    ),
    "hooks the forward pass with dumps or canaries that a restored graph does not contain": tuple(
        """
            debug_tensor_dump_input_file debug_tensor_dump_layers debug_tensor_dump_output_folder
            forward_hooks kv_canary kv_canary_real_data msprobe_dump_config
        """.split()
    ),
    "replaces the full decode graph with a breakable or mega-kernel path": tuple(
        """
            debug_cuda_graph enable_nvidia_megakernel
        """.split()
    ),
    "routes tensor-parallel collectives outside torch symmetric memory (all-to-all LM head, quantized or NVLS communication)": tuple(
        """
            enable_nccl_nvls enable_quant_communications enable_tp_lm_head_all_to_all
        """.split()
    ),
    "runs a disaggregated role whose graphs and pools Foundry does not persist": tuple(
        """
            decoupled_spec_role encoder_only language_model_only language_only
        """.split()
    ),
}

#: ServerArgs fields that change nothing Foundry persists: reason -> names.

SERVER_IRRELEVANT: dict[str, tuple[str, ...]] = {
    "host-side serving, logging, metrics, scheduling policy or loading transport: nothing inside a decode graph or under it": tuple(
        """
            abort_on_priority_when_disabled admin_api_key allow_auto_truncate allowed_media_domains api_key
            asr_max_buffer_seconds asr_max_concurrent_sessions batch_notify_size bucket_e2e_request_latency
            bucket_inter_token_latency bucket_time_to_first_token chat_template
            checkpoint_engine_wait_weights_before_ready completion_template
            constrained_json_disable_any_whitespace constrained_json_max_whitespace_cnt
            constrained_json_whitespace_pattern crash_dump_folder custom_sigquit_handler custom_weight_loader
            decode_log_interval default_chat_template_kwargs default_priority_value delete_ckpt_after_loading
            detokenizer_worker_num disable_fast_image_processor disable_outlines_disk_cache
            disable_priority_preemption disable_tokenizer_batch_decode dist_init_addr dist_timeout
            download_dir dynamic_batch_tokenizer_batch_size dynamic_batch_tokenizer_batch_timeout
            enable_cache_report enable_custom_logit_processor enable_dynamic_batch_tokenizer
            enable_dynamic_chunking enable_forward_pass_metrics enable_http2 enable_http_worker_reuseport
            enable_metrics enable_metrics_for_all_schedulers enable_mfu_metrics enable_p2p_check
            enable_prefill_delayer enable_priority_scheduling
            enable_request_time_stats_logging enable_response_store enable_ssl_refresh
            enable_streaming_session enable_strict_thinking enable_tokenizer_batch_encode enable_trace
            enable_watermark engine_info_bootstrap_port export_metrics_to_file export_metrics_to_file_dir
            extra_metric_labels fastapi_root_path file_storage_path forward_pass_metrics_ipc_name
            forward_pass_metrics_worker_id gated_launch_port gc_warning_threshold_secs
            generation_tokens_buckets grammar_backend grpc_mode grpc_port grpc_response_timeout_secs
            grpc_worker_threads hf_chat_template_name host http2_initial_connection_window_size
            http2_max_concurrent_streams image_processor_backend incremental_streaming_output
            kv_canary_sweep_interval kv_events_config limit_mm_data_per_request load_balance_method
            load_publish_endpoint load_snapshot_publish_interval log_level log_level_http log_requests
            log_requests_format log_requests_level log_requests_target max_queued_requests
            media_url_max_file_size_mb min_free_slots_delay mlx_enable_sampling mm_io_worker_num
            mm_preprocess_cache_size_mb mm_processor_worker_num model_checksum model_loader_extra_config
            modelexpress_config modelopt_checkpoint_save_path modelopt_export_path nccl_port node_rank
            numa_node otlp_service_name otlp_traces_endpoint port preferred_sampling_params
            prefill_decode_interval prefill_decode_interval_min_bs prefill_delayer_forward_passes_buckets
            prefill_delayer_max_delay_ms prefill_delayer_max_delay_passes prefill_delayer_queue_min_ratio
            prefill_delayer_token_usage_low_watermark prefill_delayer_wait_seconds_buckets
            priority_scheduling_preemption_threshold prompt_tokens_buckets random_seed reasoning_parser
            remote_instance_weight_loader_backend remote_instance_weight_loader_seed_instance_ip
            remote_instance_weight_loader_seed_instance_service_port
            remote_instance_weight_loader_send_weights_group_ports
            remote_instance_weight_loader_start_seed_via_transfer_engine retraction_policy return_input_ids
            return_output_ids sampling_defaults sampling_mask_max_tokens schedule_conservativeness
            schedule_low_priority_values_first schedule_policy scheduler_recv_interval served_model_name
            show_time_cost sidecar sidecar_args skip_server_warmup skip_tokenizer_init sleep_on_idle
            smg_grpc_mode smg_http_sidecar_port soft_watchdog_timeout ssl_ca_certs ssl_certfile ssl_keyfile
            ssl_keyfile_password stat_loggers stream_interval stream_response_default_include_usage
            strip_thinking_cache tokenizer_backend tokenizer_metrics_allowed_custom_labels
            tokenizer_metrics_custom_labels_header tokenizer_mode tokenizer_path tokenizer_worker_num
            tool_call_parser tool_server trace_modules trust_mm_content_hashes trust_remote_code
            trust_request_chat_template uvicorn_access_log_exclude_prefixes warmups watchdog_timeout
            watermark_config watermark_context_window watermark_default_enabled watermark_enforce_all
            watermark_key watermark_key_b watermark_max_probability watermark_mixing_probability
            weight_cache_mode weight_cache_socket weight_cache_timeout weight_loader_disable_mmap
            weight_loader_drop_cache_after_load weight_loader_prefetch_checkpoints
            weight_loader_prefetch_num_threads weight_version
        """.split()
    ),
    "read only with a feature Foundry refuses (speculative decoding, LoRA, PD/encoder disaggregation, PD multiplexing, dLLM, elastic EP, paged experts)": tuple(
        """
            decoupled_spec_bind_endpoint decoupled_spec_connect_endpoints decoupled_spec_rank
            disaggregation_bootstrap_port disaggregation_decode_allocation_policy
            disaggregation_decode_enable_offload_kvcache disaggregation_decode_enable_radix_cache
            disaggregation_decode_extra_slots disaggregation_decode_host_receive_threshold
            disaggregation_decode_polling_interval disaggregation_decode_retraction_backup
            disaggregation_enable_kv_checksum disaggregation_ib_device disaggregation_transfer_backend
            dllm_algorithm_config dllm_fdfo elastic_ep_scale_timeout enable_adaptive_dispatch_to_encoder
            enable_draft_weights_cpu_backup enable_lora_overlap_loading enable_multi_layer_eagle
            encoder_bootstrap_port encoder_register_urls encoder_transfer_backend encoder_urls
            experts_shared_outer_loras lora_backend lora_drain_wait_threshold lora_eviction_policy
            lora_strict_loading lora_target_modules lora_use_virtual_experts max_loaded_loras
            max_lora_chunk_size max_lora_rank max_loras_per_batch mooncake_ib_device
            num_reserved_decode_tokens optimistic_prefill_attempts paged_experts_num_resident
            pdmux_config_path sm_group_num spec_trace_dir speculative_accept_threshold_acc
            speculative_accept_threshold_single speculative_adaptive speculative_adaptive_config
            speculative_attention_mode speculative_boundary_reduction speculative_dflash_block_size
            speculative_domino_candidate_pool_size speculative_draft_attention_backend
            speculative_draft_kv_cache_dtype speculative_draft_load_format speculative_draft_model_path
            speculative_draft_model_quantization speculative_draft_model_revision speculative_draft_sink_size
            speculative_draft_window_size speculative_dsa_topk_backend
            speculative_dspark_align_verify_tokens_to_graph_tier speculative_dspark_block_size
            speculative_dspark_confidence_sts_path speculative_dspark_sps_table_path speculative_eagle_topk
            speculative_enable_w4a4_mxfp4_megamoe speculative_moe_a2a_backend speculative_moe_runner_backend
            speculative_ngram_capacity speculative_ngram_external_corpus_max_tokens
            speculative_ngram_external_corpus_path speculative_ngram_external_sam_budget
            speculative_ngram_match_type speculative_ngram_max_bfs_breadth speculative_ngram_max_trie_depth
            speculative_ngram_min_bfs_breadth speculative_num_draft_tokens speculative_num_steps
            speculative_token_map speculative_use_block_verification speculative_use_rejection_sampling
        """.split()
    ),
    "SGLang's own bookkeeping of which value was given explicitly; the value itself is classified": tuple(
        """
            _radix_eviction_policy_explicitly_set _speculative_draft_quantization_explicitly_set
            _swa_full_tokens_ratio_explicitly_set
        """.split()
    ),
}

#: SGLANG_* switches whose value (when set) changes kernels, shapes or memory: in the fingerprint.

ENV_FINGERPRINTED = frozenset(
    """
        SGLANG_AITER_ASM_PREFILL_HD128 SGLANG_AITER_PAGED_PREFILL_ASM SGLANG_AITER_UNIFIED_DRAFT_EXTEND
        SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN SGLANG_BLACKWELL_OVERLAP_SHARED_EXPERTS_OUTSIDE_SBO
        SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS SGLANG_CHECK_KV_PAGE_INVARIANTS
        SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
        SGLANG_COMPACTION_MAX_PAGES_PER_MOVE SGLANG_CPU_QUANTIZATION SGLANG_CRASH_ON_TRITON_LOAD_AFTER_READY
        SGLANG_CUSTOM_ALL_REDUCE_V2_MAX_SIZE_KB SGLANG_DATA_PARALLEL_BUDGET_INTERVAL
        SGLANG_DEBUG_HISPARSE_SKIP_IO SGLANG_DEBUG_MEMORY_POOL SGLANG_DEBUG_POISON_POOL
        SGLANG_DEBUG_REVERT_PR SGLANG_DEEPEP_BF16_DISPATCH SGLANG_DEEPEP_LL_COMBINE_SEND_NUM_SMS
        SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK SGLANG_DEEPEP_V2_ENABLE_PREFILL_EXPAND
        SGLANG_DEEPEP_V2_NUM_MAX_DISPATCH_TOKENS_PER_RANK SGLANG_DEEPEP_V2_NUM_SMS
        SGLANG_DEEPGEMM_MASKED_MEMORY_BUDGET_FRACTION SGLANG_DEEPGEMM_PDL SGLANG_DEEPGEMM_SANITY_CHECK
        SGLANG_DEEPGEMM_STANDARD_LAYOUT SGLANG_DETERMINISTIC_NCCL_NCHANNELS SGLANG_DG_USE_NVRTC
        SGLANG_DISABLED_MODEL_ARCHS SGLANG_DISABLE_AITER_FUSED_FP8_DSA_INDEXER
        SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP SGLANG_DISABLE_DSA_INDEXER_FUSION
        SGLANG_DISABLE_FUSED_MAMBA_SLOT_OPS SGLANG_DISABLE_HISPARSE_PREFETCH
        SGLANG_DISABLE_KDA_PREFILL_GRAPH_EXTEND SGLANG_DISABLE_LAZY_COMPACTION SGLANG_DISABLE_LEAN_ATTENTION
        SGLANG_DISABLE_M3_FP8_ATTN_GEMM SGLANG_DISABLE_MSA SGLANG_DISABLE_MSA_V1_Q8KV4
        SGLANG_DISABLE_STATIC_WATERFILL SGLANG_DSA_FUSE_TOPK SGLANG_DSA_HIP_DISABLE_PRESHUFFLE
        SGLANG_DSA_MQA_LOGITS_FREE_MEM_FRACTION SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD
        SGLANG_DSA_TOPK_BROADCAST SGLANG_DSA_TOPK_FLASHINFER_DETERMINISTIC
        SGLANG_DSA_TOPK_FLASHINFER_TIE_BREAK SGLANG_DSV41_ENGRAM_HOST_TABLE_LAYOUT SGLANG_DSV41_FUSED_WO_A
        SGLANG_DSV41_REASONING_EFFORT SGLANG_DSV4_COMPRESSED_KV_LAYOUT SGLANG_DSV4_COMPRESS_STATE_DTYPE
        SGLANG_DSV4_DECODER_TAIL_GRAPH_MAX_ROWS SGLANG_DSV4_DECODER_TAIL_GRAPH_MIN_PREFILL_TOKENS
        SGLANG_DSV4_DENSE_MXSCALE SGLANG_DSV4_DENSE_MXSCALE_SHAPES SGLANG_DSV4_FLYDSL_DECODE
        SGLANG_DSV4_FLYDSL_DECODE_H128 SGLANG_DSV4_FLYDSL_DECODE_SOURCE SGLANG_DSV4_FP4_DEQUANT
        SGLANG_DSV4_FP4_EXPERTS SGLANG_DSV4_FP8_DECODE_SPLIT_CTX SGLANG_DSV4_FP8_DECODE_SPLIT_MODEL
        SGLANG_DSV4_FP8_HCA_PERSIST SGLANG_DSV4_FP8_HCA_PERSIST_MIN_ROWS SGLANG_DSV4_KV_LAYOUT
        SGLANG_DSV4_REASONING_EFFORT SGLANG_DSV4_UNIFIED_KV_FP8 SGLANG_DSV4_USE_BF16_KV_QUANT_SOURCE
        SGLANG_DYNAMIC_CHUNKING_SMOOTH_FACTOR SGLANG_EAGER_INPUT_NO_COPY SGLANG_ENABLE_ASYNC_ASSERT
        SGLANG_ENABLE_BF16_SPLITK_GEMM SGLANG_ENABLE_COLOCATED_BATCH_GEN SGLANG_ENABLE_DELAY_SAMPLE
        SGLANG_ENABLE_DETERMINISTIC_INFERENCE SGLANG_ENABLE_DISAGG_PREFILL_CONTINUOUS_INPUT_POLLING
        SGLANG_ENABLE_DSA_Q8KV8_BORN_FP8_Q SGLANG_ENABLE_DSA_Q8KV8_KV_CAT_FUSION
        SGLANG_ENABLE_DSA_Q8KV8_QPREP_OVERLAP SGLANG_ENABLE_DSA_Q8KV8_TOPK_LENGTH
        SGLANG_ENABLE_DSV41_ENGRAM_HOST_TABLE SGLANG_ENABLE_EMBED_REPLICATION
        SGLANG_ENABLE_FAST_INPUT_LOGPROBS SGLANG_ENABLE_FLUX3_PRIMS_TS_AUTOTUNE
        SGLANG_ENABLE_FP8_GEMM_CONFIG_TUNE SGLANG_ENABLE_GDN_DECODE_FUSED_PROJ_CONV
        SGLANG_ENABLE_HICACHE_SWA_TAIL_ONLY_BACKUP SGLANG_ENABLE_JIT_DEEPGEMM
        SGLANG_ENABLE_KV_SHARD_ZERO_SM_GATHER SGLANG_ENABLE_LOGPROB_CHUNK SGLANG_ENABLE_LORA_CSGMV_SPLIT_K
        SGLANG_ENABLE_MOE_DEFERRED_FINALIZE SGLANG_ENABLE_MTP_BOUNDARY_KV_FIX
        SGLANG_ENABLE_MUSE_SPARK_AG_NORM_FUSION SGLANG_ENABLE_MUSE_SPARK_FINALIZE_AR
        SGLANG_ENABLE_NAN_LOGITS_CHECK SGLANG_ENABLE_PCG_DSV2_DUAL_STREAM SGLANG_ENABLE_PREFILL_WAR_READ_DONE
        SGLANG_ENABLE_QWEN4_PLE_FUSION SGLANG_ENABLE_QWEN_DEEPEP_SHARED_OVERLAP SGLANG_ENABLE_SINGLE_CG_DRAFT
        SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE
        SGLANG_ENABLE_TORCH_COMPILE SGLANG_ENABLE_TORCH_INFERENCE_MODE
        SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK
        SGLANG_ENABLE_WAITING_PREFIX_REFRESH SGLANG_ENABLE_WAR_BARRIER SGLANG_ENABLE_WEIGHT_LOADER_V2
        SGLANG_EPLB_HEATMAP_COLLECTION_INTERVAL SGLANG_EPLB_P2P_BATCH_CHUNK_SIZE SGLANG_EXACT_CHUNK_FILL
        SGLANG_EXPERIMENTAL_DSA_KPOOL_METADATA_FUSION SGLANG_EXPERIMENTAL_LORA_OPTI
        SGLANG_EXPERIMENTAL_ONLINE_C128_MTP SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR
        SGLANG_EXPERT_LOCATION_UPDATER_CANARY SGLANG_EXPERT_LOCATION_UPDATER_LOG_INPUT
        SGLANG_EXPERT_LOCATION_UPDATER_LOG_METRICS SGLANG_EXTERNAL_MM_MODEL_ARCH
        SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE SGLANG_EXTERNAL_MODEL_PACKAGE SGLANG_FLASHINFER_AUTOTUNE_CACHE
        SGLANG_FLASHINFER_AUTOTUNE_EXTEND SGLANG_FLASHINFER_CUTEDSL_NVFP4_W4A16
        SGLANG_FLASHINFER_DECODE_SPLIT_TILE_SIZE SGLANG_FLASHINFER_MEGAMOE_COMBINE_DTYPE
        SGLANG_FLASHINFER_MEGAMOE_IN_KERNEL_FC2_REDUCE SGLANG_FLASHINFER_MEGAMOE_MAX_TOKENS_PER_RANK
        SGLANG_FLASHINFER_MOE_FUSED_FINALIZE SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK
        SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION SGLANG_FLASHINFER_PREFILL_SPLIT_TILE_SIZE
        SGLANG_FLASHINFER_USE_PAGED SGLANG_FLASHINFER_WORKSPACE_SIZE SGLANG_FORCE_COARSE_WAR_BARRIER
        SGLANG_FORCE_CONFIDENTIAL_COMPUTE SGLANG_FORCE_CPU_IMAGE_PREPROCESSING
        SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PULL_SIZE_KB SGLANG_FORCE_CUSTOM_ALL_REDUCE_V2_PUSH_SIZE_KB
        SGLANG_FORCE_FP8_MARLIN SGLANG_FORCE_FUSED_OP_BACKEND SGLANG_FORCE_LEAN_GRID_CU_MULT
        SGLANG_FORCE_MXFP8_BLOCK_CONVERT_DENSE SGLANG_FP4_IGNORED_LAYERS SGLANG_FP8_IGNORED_LAYERS
        SGLANG_FP8_PAGED_MQA_LOGITS_TORCH SGLANG_GDN_DECODE_FUSION_VERIFY_REAL_TENSORS
        SGLANG_GEMMA_OUT_OF_PLACE_POSITION_MUTATION SGLANG_GLM_NEXTN_MOE_PTPC
        SGLANG_HICACHE_BUFFER_ANCHOR_LOCK_CAP SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE
        SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO
        SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL
        SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR
        SGLANG_HICACHE_HF3FS_CONFIG_PATH SGLANG_HICACHE_HOST_PARALLEL_ALLOC_THREADS
        SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR
        SGLANG_HICACHE_NIXL_USE_DIRECT_IO SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM
        SGLANG_HICACHE_TMA_TRANSFER SGLANG_HIP_DSPARK_DRAFT_RAW_METADATA SGLANG_HIP_DSV41_INDEX_K_PAGE8
        SGLANG_HIP_DSV4_C4_INDEXER_ROWGROUP SGLANG_HIP_FFN_NORM_MXFP8 SGLANG_HIP_FP4_INDEXER_ROWGROUP
        SGLANG_HIP_MHC_BOUNDARY_WIDE_TILE SGLANG_HIP_SHARED_ACT_MXFP8 SGLANG_HIP_WO_A_MXFP8
        SGLANG_HUGEPAGE_SIZE SGLANG_HUMMING_INPUT_QUANT_CONFIG SGLANG_HUMMING_MOE_GEMM_TYPE
        SGLANG_HUMMING_ONLINE_QUANT_CONFIG SGLANG_HUMMING_USE_F16_ACCUM SGLANG_IMAGE_MAX_PIXELS
        SGLANG_INIT_NEW_TOKEN_RATIO SGLANG_INKLING_DEFAULT_REASONING_EFFORT SGLANG_INKLING_RS_MM_PREPROCESS
        SGLANG_INT4_WEIGHT SGLANG_INVARIANT_CHECK SGLANG_IN_DEEPGEMM_PRECOMPILE_STAGE
         SGLANG_IS_FLASHINFER_AVAILABLE SGLANG_JIT_DEEPGEMM_FAST_WARMUP
        SGLANG_JIT_DEEPGEMM_PRECOMPILE SGLANG_K3_AR_FUSION SGLANG_K3_FUSED_FRONT SGLANG_K3_RADIX4_TOPK
        SGLANG_K3_SP_ATTN_RES SGLANG_K3_SP_COLLECTIVE SGLANG_KDA_PREFILL_GRAPH_MAX_SEQS
        SGLANG_KIMI_K3_VIT_CUDA_GRAPH_CACHE_CAPACITY SGLANG_KIMI_K3_VIT_CUDA_GRAPH_MAX_SEQLEN
        SGLANG_KIMI_K3_VIT_CUDA_GRAPH_MIN_HITS SGLANG_LAZY_COMPACTION_MAX_MOVES_PER_CALL
        SGLANG_LOAD_SNAPSHOT_USE_ZMQ SGLANG_LOGPROB_CHUNK_SIZE SGLANG_LOG_EXPERT_LOCATION_METADATA
        SGLANG_M3_ALLOW_CUSTOM_AR SGLANG_MAMBA_CONV_DTYPE SGLANG_MAMBA_SSM_DTYPE SGLANG_MAX_KV_CHUNK_CAPACITY
        SGLANG_MAX_NEW_TOKENS_LIMIT SGLANG_MINICPM_DENSE_AS_SPARSE SGLANG_MINICPM_FORCE_DENSE
        SGLANG_MINICPM_FUSE_TOPK SGLANG_MINIMAX_M3_FUSED_MOE_COMBINE SGLANG_MINIMAX_M3_FUSED_SWIGLU_MXFP8
        SGLANG_MINIMAX_M3_INDEXER_CP SGLANG_MINIMAX_M3_INDEX_TOPK_FREQ SGLANG_MINIMAX_NPU_NATIVE_ATTN
        SGLANG_MINIMAX_NPU_NATIVE_INDEXER SGLANG_MINIMAX_NPU_PREFILL_FIA SGLANG_MINIMAX_VIT_TOKEN_BLOCK
        SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR SGLANG_MLA_DECODE_TUNE SGLANG_MLA_DEDUP_CHUNK_TOKENS
        SGLANG_MM_AVOID_RETOKENIZE SGLANG_MM_BUFFER_SIZE_MB SGLANG_MM_FEATURE_CACHE_MB
        SGLANG_MM_ITEM_MEM_POOL_RECYCLE_INTERVAL_SEC SGLANG_MM_PRECOMPUTE_HASH SGLANG_MM_SKIP_COMPUTE_HASH
        SGLANG_MOE_COPY_WEIGHT_VIEWS_BEFORE_H2D SGLANG_MOE_DEFERRED_FINALIZE_MAX_TOKENS
        SGLANG_MOE_NVFP4_DISPATCH SGLANG_MOE_PADDING SGLANG_NATIVE_MOVE_KV_CACHE
        SGLANG_NCCL_ALL_GATHER_IN_OVERLAP_SCHEDULER_SYNC_BATCH SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS
        SGLANG_NIXL_EP_BF16_DISPATCH SGLANG_NIXL_EP_NUM_MAX_DISPATCH_TOKENS_PER_RANK
        SGLANG_NVFP4_CKPT_FP8_GEMM_IN_ATTN SGLANG_NVFP4_CKPT_FP8_NEXTN_MOE
        SGLANG_ONE_VISIBLE_DEVICE_PER_PROCESS SGLANG_OPT_BF16_FP32_GEMM_ALGO
        SGLANG_OPT_CUDA_GRAPH_FILL_FAST_PATH SGLANG_OPT_DEEPGEMM_HC_PRENORM SGLANG_OPT_DEEPGEMM_MEGA_GATE
        SGLANG_OPT_DEEPGEMM_MEGA_MOE_FUSE_SHARED_EXPERTS SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK
        SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS SGLANG_OPT_DG_COMPACT_EAGER SGLANG_OPT_DG_MASKED_M_CAP
        SGLANG_OPT_DSV41_BF16_INDEX_LOGITS SGLANG_OPT_DSV41_DSPARK_MID_FOLD
        SGLANG_OPT_DSV41_DSPARK_PREPARE_INPUTS_ONCE SGLANG_OPT_DSV41_ENGRAM_HOST_STAGING
        SGLANG_OPT_DSV41_ENGRAM_PEER_SHARDS SGLANG_OPT_DSV41_MEGA_MHC_PREFILL
        SGLANG_OPT_DSV41_POST_FORWARD_CUDA_GRAPH SGLANG_OPT_DSV41_SAMPLING_ACCEPT_GRAPH
        SGLANG_OPT_DSV41_TARGET_METADATA_EARLY SGLANG_OPT_DSV41_TARGET_VERIFY_METADATA_GLUE
        SGLANG_OPT_DSV4_NONPAGED_INDEXER SGLANG_OPT_DSV4_NONPAGED_INDEXER_MIN_QUERY_TOKENS
        SGLANG_OPT_ENGRAM_EXTEND_HASH SGLANG_OPT_FLASHMLA_SPARSE_PREFILL
        SGLANG_OPT_FLUX3_PRIMS_TS_TUNING_BUCKETS SGLANG_OPT_FP8_WO_A_FUSED_INVROPE SGLANG_OPT_FP8_WO_A_GEMM
        SGLANG_OPT_FUSE_MHC_POST_PRE SGLANG_OPT_FUSE_WQA_WKV SGLANG_OPT_GATE_GEMV_MODE
        SGLANG_OPT_HIP_FLYDSL_MXFP8 SGLANG_OPT_HIP_OPUS_SPARSE_PREFILL SGLANG_OPT_HOPPER_BLOCK_FP8_BF16
        SGLANG_OPT_INKLING_MXFP8_FUSED_QUANT_STORE SGLANG_OPT_LINEARIZED_SHARED_SINK
        SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK SGLANG_OPT_MASK_DP_PAD_MOE SGLANG_OPT_MINIMAX_M3_FP8_INDEX_CACHE
        SGLANG_OPT_MOE_QUANT_ONCE SGLANG_OPT_Q8KV8_QPREP_VARIANT SGLANG_OPT_RELEASE_PREFILL_SWA
        SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW SGLANG_OPT_SM120_DIRECT_SWA_KV SGLANG_OPT_SM120_MTP_ROUTER_TOP22
        SGLANG_OPT_SM120_NVFP4_PHASE_LAYOUT SGLANG_OPT_UNIFIED_CACHE_FREE_OUT_OF_WINDOW_SLOTS
        SGLANG_OPT_USE_AITER_BATCHED_GEMM SGLANG_OPT_USE_BF16_ROUTER_GEMM SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2
        SGLANG_OPT_USE_FLASHINFER_MHC SGLANG_OPT_USE_FUSED_GATE_TOPK SGLANG_OPT_USE_FUSED_HASH_TOPK
        SGLANG_OPT_USE_GATE_TOPK_JIT SGLANG_OPT_USE_GUMBEL_SAMPLE SGLANG_OPT_USE_INKLING_CUSTOM_AR
        SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV_NORM
        SGLANG_OPT_USE_INKLING_FUSED_AR_SHARED SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE
        SGLANG_OPT_USE_INKLING_FUSED_LOG_TAU SGLANG_OPT_USE_INKLING_MULTI_STREAM_OVERLAP
        SGLANG_OPT_USE_INKLING_REL_PROJ_DISPATCH SGLANG_OPT_USE_INKLING_SHARED_FUSED_MOE
        SGLANG_OPT_USE_INKLING_SHEARED_BIAS SGLANG_OPT_USE_JIT_INDEXER_METADATA
        SGLANG_OPT_USE_JIT_KERNEL_GROUPED_TOPK SGLANG_OPT_USE_MINIMAX_DECODE_TOPK_RADIX
        SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE SGLANG_OPT_USE_MINIMAX_FP8_Q_EPILOGUE
        SGLANG_OPT_USE_MINIMAX_FUSED_KV_INDEX_STORE SGLANG_OPT_USE_MINIMAX_GLUON_PREFILL
        SGLANG_OPT_USE_MSA_DECODE_UNDER_GRAPH SGLANG_OPT_USE_MULTI_STREAM_OVERLAP
        SGLANG_OPT_USE_ONLINE_COMPRESS SGLANG_OPT_USE_TILELANG_INDEXER SGLANG_OPT_USE_TILELANG_MHC_POST
        SGLANG_OPT_USE_TILELANG_MHC_PRE SGLANG_OPT_USE_TOPK_V2 SGLANG_PHASE_CHECKER_DEBUG
        SGLANG_PLUGINS SGLANG_PPLX_NUM_MAX_DISPATCH_TOKENS_PER_RANK SGLANG_PP_COMM_OVERLAP
        SGLANG_PP_PARALLEL_DEEPGEMM_WARMUP SGLANG_PP_SKIP_PURE_CHUNKED_OUTPUT_COMM
        SGLANG_PREFETCH_BLOCK_SIZE_MB SGLANG_PREFILL_DELAYER_MAX_DELAY_PASSES
        SGLANG_PREFILL_DELAYER_MAX_PREFILL_BS_WINDOW_SIZE SGLANG_PREFILL_DELAYER_TOKEN_USAGE_LOW_WATERMARK
        SGLANG_PREFILL_TILE_BUDGET SGLANG_PREFILL_TILE_BUDGET_MODE SGLANG_QUANT_ALLOW_DOWNCASTING
        SGLANG_QWEN4_PLE_FILE_DIR SGLANG_QWEN4_PLE_FILE_PREFETCH SGLANG_QWEN4_PLE_FILE_RSS_BUDGET_GB
        SGLANG_QWEN4_PLE_FILE_RSS_INTERVAL_S SGLANG_QWEN4_PLE_FILE_SKIP_DEVICE_CHECK SGLANG_RADIX_FORCE_MISS
        SGLANG_RESIZE_RESAMPLE SGLANG_RETRACT_DECODE_STEPS SGLANG_RETURN_ORIGINAL_LOGPROB
        SGLANG_ROCM_MXFP8_AITER_PRESHUFFLE SGLANG_ROPE_CACHE_ALIGN SGLANG_ROPE_CACHE_FP32
        SGLANG_ROPE_CACHE_SAFETY_MARGIN SGLANG_SAIL_GPU_ARCH SGLANG_SANITIZE_NAN_LOGITS
        SGLANG_SHARED_EXPERT_TP1 SGLANG_SKIP_SOFTMAX_DECODE_THRESHOLD_SCALE_FACTOR
        SGLANG_SKIP_SOFTMAX_PREFILL_THRESHOLD_SCALE_FACTOR SGLANG_SM120_FLASHMLA_BACKEND
        SGLANG_SORT_WEIGHT_FILES SGLANG_SPEC_EXPANSION_SAFETY_FACTOR SGLANG_SWA_EVICTION_INTERVAL
        SGLANG_SYNC_TOKEN_IDS_ACROSS_TP SGLANG_TBO_DEBUG SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY
        SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE SGLANG_TRITON_COMPACT_EXTEND_ATTENTION
        SGLANG_TRITON_DECODE_ATTN_STATIC_KV_SPLITS SGLANG_TRITON_DECODE_SPLIT_TILE_SIZE
        SGLANG_TRITON_DENSE_PREFILL_ATTN SGLANG_TRITON_FP8_PREFILL_ATTN
        SGLANG_TRITON_LOAD_WARNING_THRESHOLD_GB SGLANG_TRITON_SLOW_COMPILE_THRESHOLD_SECS
        SGLANG_TRTLLM_MHA_DECODE_SEQ_LEN_SPLITS SGLANG_TRTLLM_MOE_PDL_MAX_TOKENS
        SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND SGLANG_USE_1STAGE_ALLREDUCE SGLANG_USE_ATTN_TP_NGRAM
        SGLANG_USE_CUDA_IPC_TRANSPORT SGLANG_USE_CUSTOM_ROUTER_SUM SGLANG_USE_CUSTOM_TRITON_KERNEL_CACHE
        SGLANG_USE_DEEPGEMM_BMM SGLANG_USE_HND_KVCACHE SGLANG_USE_IPC_POOL_HANDLE_CACHE
        SGLANG_USE_SAGE_ATTENTION_IMPL SGLANG_USE_SGL_FA3_KERNEL SGLANG_VALIDATE_MAMBA_REPLAY_STATE_INDICES
        SGLANG_VIT_ENABLE_CUDA_GRAPH SGLANG_VIT_ENABLE_VECTORIZED_POS_EMBED SGLANG_VLM_CACHE_SIZE_MB
    """.split()
)

#: SGLANG_* switches refused when set to anything but their default: reason -> names.

ENV_REFUSED: dict[str, tuple[str, ...]] = {
    "an out-of-tree platform (SGLang's platform plugins) brings its own device and graph backend": (
        "SGLANG_PLATFORM",
    ),
    "re-carves, borrows or pre-allocates graph or symmetric memory, or resizes the KV pool after capture": tuple(
        """
            SGLANG_ENABLE_GRAPH_POOL_BORROW SGLANG_ENABLE_GRAPH_POOL_PRECARVE
            SGLANG_ENABLE_POST_CAPTURE_KV_SIZING SGLANG_MEMORY_SAVER_CUDA_GRAPH
            SGLANG_SYMM_MEM_PREALLOC_GB_SIZE
        """.split()
    ),
    "breakable or de-duplicated CUDA graphs instead of one full graph per shape": tuple(
        """
            SGLANG_ENABLE_CUDA_GRAPH_DEDUP SGLANG_USE_BREAKABLE_CUDA_GRAPH
        """.split()
    ),
    "all-reduce over PCIe IPC buffers of other processes, which no archive can hold": tuple(
        """
            SGLANG_ENABLE_PCIE_IPC_ALLREDUCE
        """.split()
    ),
    "simulation and KV-canary test modes that change what runs inside the decode graphs": tuple(
        """
            SGLANG_DSPARK_SIMULATE_FOLD SGLANG_KV_CANARY_ENABLE_MHA_V SGLANG_KV_CANARY_ENABLE_TOKEN_ORACLE
            SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT
            SGLANG_KV_CANARY_PERTURB_NEXT_TOKEN_SWAP_PROB SGLANG_KV_CANARY_PERTURB_REAL_KV_POST_FORWARD_PROB
            SGLANG_KV_CANARY_PERTURB_REAL_KV_UNUSED_CACHE_PROB SGLANG_KV_CANARY_PERTURB_REAL_KV_USED_PROB
            SGLANG_KV_CANARY_PERTURB_REQ_TO_TOKEN_PROB SGLANG_KV_CANARY_PERTURB_TARGET_GROUP
            SGLANG_KV_CANARY_PERTURB_WARMUP_STEPS SGLANG_KV_CANARY_RING_CAPACITY
            SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS SGLANG_KV_CANARY_SWA_DIVERGENCE_STATS_INTERVAL
            SGLANG_SIMULATE_ACC_GREEDY SGLANG_SIMULATE_ACC_LEN SGLANG_SIMULATE_ACC_METHOD
            SGLANG_SIMULATE_ACC_TOKEN_MODE SGLANG_SIMULATE_ROUND_ROBIN_EXPERTS
            SGLANG_SIMULATE_UNIFORM_EXPERTS
        """.split()
    ),
}

#: SGLANG_* switches that change nothing Foundry persists: reason -> names.

ENV_IRRELEVANT: dict[str, tuple[str, ...]] = {
    "which local rank pre-compiles DeepGEMM's kernels, a per-process fact (kernels are the carried caches')": (
        "SGLANG_IS_FIRST_RANK_ON_NODE",
    ),
    "host side only (HTTP, logging, IPC, ports, CI, crash handling, grammar, tracing, metrics, polling, timeouts, test fault injection, JIT logs)": tuple(
        """
            SGLANG_AUTO_NUMA_BIND SGLANG_BACKUP_PORT_BASE SGLANG_BATCH_TOKENIZER_OUTPUTS
            SGLANG_CRASH_ON_JIT_COMPILE SGLANG_CRASH_ON_NUMA_BIND_FAILURE SGLANG_CUDA_COREDUMP
            SGLANG_CUDA_COREDUMP_BEFORE_CRASH SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS
            SGLANG_CUDA_COREDUMP_DIR SGLANG_DEBUG_SYMM_MEM SGLANG_DEEPEP_V2_TRACE_CONTIG
            SGLANG_DEEPEP_V2_TRACE_MASKED SGLANG_DEFAULT_THINKING SGLANG_DETECT_SLOW_RANK
            SGLANG_DIAG_BYPASS_HEALTH_GENERATE SGLANG_DISABLE_OUTLINES_DISK_CACHE
            SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE SGLANG_EMBEDDINGS_SPARSE_HEAD SGLANG_EMPTY_CACHE_INTERVAL
            SGLANG_ENABLE_CUDA_GRAPH_CAPTURE_TRACE SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
            SGLANG_ENABLE_METRICS_DEVICE_TIMER SGLANG_ENABLE_METRICS_DP_ATTENTION
            SGLANG_ENABLE_NVTX_OPERATIONS SGLANG_ENABLE_NVTX_SCHEDULER SGLANG_ENABLE_RANK_CONSENSUS_CHECKER
            SGLANG_ENABLE_REQUEST_DECOMPRESSION SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES
            SGLANG_ENABLE_RESPONSE_TEMPLATE_TURN_GRAMMAR SGLANG_EXA_INCLUDE_HIGHLIGHTS SGLANG_EXA_NUM_RESULTS
            SGLANG_EXA_SEARCH_TYPE SGLANG_EXPOSE_OWN_ENV_VARS SGLANG_FORCE_SHUTDOWN
            SGLANG_FORCE_STREAM_INTERVAL SGLANG_FORWARD_UNKNOWN_TOOLS SGLANG_GDN_DECODE_FUSION_LOG_LAYER_HITS
            SGLANG_GRAMMAR_MAX_POLL_ITERATIONS SGLANG_GRAMMAR_POLL_INTERVAL SGLANG_GRAPH_BATCH_CAPTURE
            SGLANG_GRPC_PORT SGLANG_GRPC_WORKER_THREADS SGLANG_HTTP_SERVER_APP_PATH SGLANG_IS_IN_CI
            SGLANG_IS_IN_CI_AMD SGLANG_JIT_BENCHMARK_DISABLE_LOG_BANDWIDTH
            SGLANG_JIT_BENCHMARK_DISABLE_LOG_FLOPS SGLANG_JIT_CACHE_DEBUG SGLANG_JIT_CACHE_KEEP
            SGLANG_JIT_FORCE_RECOMPILE SGLANG_JIT_KERNEL_RUN_FULL_TESTS SGLANG_JIT_LOG_LEVEL
            SGLANG_JIT_LOG_RESOURCE_USAGE SGLANG_KILLPG_ON_SCHEDULER_EXCEPTION SGLANG_LOG_DECODE_GRAPH_KEY
            SGLANG_LOG_FORWARD_ITERS SGLANG_LOG_GC SGLANG_LOG_LAZY_COMPACTION_STATS
            SGLANG_LOG_LAZY_COMPACTION_STATS_INTERVAL_SEC SGLANG_LOG_MS SGLANG_LOG_PICKLE_IPC_OBJECTS
            SGLANG_LOG_REQUEST_EXCEEDED_MS SGLANG_LOG_REQUEST_HEADERS SGLANG_LOG_SCHEDULER_STATUS_INTERVAL
            SGLANG_LOG_SCHEDULER_STATUS_TARGET SGLANG_MAX_BATCH_REQS_PER_HTTP_REQ SGLANG_MAX_THINK_TOKENS
            SGLANG_MEM_PROFILE_MAX_ENTRIES SGLANG_NUMA_BIND_V2 SGLANG_OTLP_EXPORTER_MAX_EXPORT_BATCH_SIZE
            SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS SGLANG_PARALLEL_PROMPT_ENCODE
            SGLANG_PARALLEL_PROMPT_ENCODE_MIN_CHARS SGLANG_PATCH_TOKENIZER SGLANG_PCIE_IPC_MAX_NUMEL
            SGLANG_PORT SGLANG_PROFILE_BY_STAGE_DECODE_MIN_BS SGLANG_PROFILE_RECORD_SHAPES SGLANG_PROFILE_V2
            SGLANG_PROFILE_WITH_STACK SGLANG_PYSPY_DUMP_BEFORE_CRASH SGLANG_RAY_BUNDLE_INDICES
            SGLANG_RECORD_STEP_TIME SGLANG_REQUEST_STATE_WAIT_TIMEOUT SGLANG_REQ_RUNNING_TIMEOUT
            SGLANG_REQ_WAITING_TIMEOUT SGLANG_ROLE_NAMESPACES SGLANG_ROLE_NAMESPACES_OUT
            SGLANG_RUST_BUILD_MODE SGLANG_RUST_SERVER SGLANG_SCHEDULER_DECREASE_PREFILL_IDLE
            SGLANG_SCHEDULER_MAX_RECV_PER_POLL SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DECODE
            SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_DEFAULT SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_NONE
            SGLANG_SCHEDULER_RECV_SKIPPER_WEIGHT_TARGET_VERIFY SGLANG_SCHEDULER_SKIP_ALL_GATHER
            SGLANG_SET_CPU_AFFINITY SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK SGLANG_TCP_STORE_PORT
            SGLANG_TEST_CRASH_AFTER_STREAM_OUTPUTS SGLANG_TEST_DISAGG_FAILURE_PROB
            SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB SGLANG_TEST_FORCE_OPTIMISTIC_PREFILL_RETRY_PROB
            SGLANG_TEST_HICACHE_H2D_DELAY_CYCLES SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL SGLANG_TEST_MAX_RETRY
            SGLANG_TEST_METRICS_FILE SGLANG_TEST_PD_DISAGG_BACKEND SGLANG_TEST_PD_DISAGG_DEVICES
            SGLANG_TEST_REQUEST_TIME_STATS SGLANG_TEST_RETRACT SGLANG_TEST_RETRACT_INTERVAL
            SGLANG_TEST_RETRACT_NO_PREFILL_BS SGLANG_TEST_SCRIPTED_RUNTIME
            SGLANG_TEST_SCRIPTED_RUNTIME_IPC_ADDR SGLANG_TEST_SCRIPTED_RUNTIME_OUT_OF_BAND_ERROR_PATH
            SGLANG_TEST_SCRIPTED_RUNTIME_SYS_PATH_ENTRY SGLANG_TEST_SKIP_CACHE_HIT_ASSERT
            SGLANG_TEST_STUCK_DETOKENIZER SGLANG_TEST_STUCK_DP_CONTROLLER SGLANG_TEST_STUCK_SCHEDULER_INIT
            SGLANG_TEST_STUCK_TOKENIZER SGLANG_TEST_TI2I_INPUT_IMAGE SGLANG_TIMEOUT_KEEP_ALIVE
            SGLANG_TOOL_STRICT_LEVEL SGLANG_TORCH_PROFILER_DIR SGLANG_TRACE_ASYNC
            SGLANG_TRACE_ASYNC_FLUSH_THRESHOLD SGLANG_TRACE_LOGITS_E2E SGLANG_TRACE_LOGITS_E2E_SYNC
            SGLANG_TRACE_QWEN_MOE_DEEPEP_E2E SGLANG_TRACE_SAMPLER_E2E SGLANG_USE_MESSAGE_QUEUE_BROADCASTER
            SGLANG_USE_MODELSCOPE SGLANG_USE_PICKLE_IPC SGLANG_UVICORN_WORKER_HEALTHCHECK_TIMEOUT
            SGLANG_WARMUP_TIMEOUT SGLANG_WEIGHT_CACHE_READY_TEMPLATE SGLANG_WEIGHT_CACHE_SOCKET_TEMPLATE
            SGLANG_ZMQ_ALLOWED_PEERS SGLANG_ZMQ_SOURCE_IP
        """.split()
    ),
    "where compiled kernels are kept: Foundry redirects these into its carried caches (they differ between launcher and scheduler)": tuple(
        """
            SGLANG_CACHE_DIR SGLANG_CUTE_AOT_CACHE_DIR SGLANG_DG_CACHE_DIR SGLANG_JIT_CACHE_DIR
        """.split()
    ),
    "read only with a feature Foundry refuses (speculative decoding, PD/encoder disaggregation, KV transfer, LoRA)": tuple(
        """
            SGLANG_DFLASH_EAGER_DRAFT_SAMPLER SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH
            SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER
            SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT
            SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE
            SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT
            SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK
            SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
            SGLANG_DISAGGREGATION_NIXL_BACKEND SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS
            SGLANG_DISAGGREGATION_QUEUE_SIZE SGLANG_DISAGGREGATION_SAMPLING_MASK_MAX_TOKENS
            SGLANG_DISAGGREGATION_THREAD_POOL_SIZE SGLANG_DISAGGREGATION_WAITING_TIMEOUT
            SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT
            SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX SGLANG_DISAGG_STAGING_BUFFER
            SGLANG_DISAGG_STAGING_POOL_SIZE_MB SGLANG_DSPARK_ACCEPT_TAIL_MAX_BS
            SGLANG_DSPARK_ACCEPT_TAIL_MIN_BS SGLANG_DSPARK_BLOCK_ACCEPT_ESTIMATE_PATH
            SGLANG_DSPARK_BLOCK_ACCEPT_ONLINE_INTERVAL SGLANG_DSPARK_CONFIDENCE_RELAY_LAG_STEPS
            SGLANG_DSPARK_DEBUG_CONFIDENCE_METRICS SGLANG_DSPARK_DEBUG_CONFIDENCE_PREFIX_SCHEDULER
            SGLANG_DSPARK_DEBUG_DUMP SGLANG_DSPARK_DEFER_CONTEXT_KV SGLANG_DSPARK_EMBED_IN_GRAPH
            SGLANG_DSPARK_ENABLE_MULTI_STREAM SGLANG_DSPARK_ENABLE_SPS_RECORD SGLANG_DSPARK_FAST_KERNEL
            SGLANG_DSPARK_FOLDED_PROPOSAL SGLANG_DSPARK_FP32_LM_HEAD SGLANG_DSPARK_FUSED_ACCEPT_TAIL
            SGLANG_DSPARK_LOG_SPS_PRED_INTERVAL SGLANG_DSPARK_NVLINK_VOCAB_GATHER
            SGLANG_DSPARK_OPT_MARKOV_W2_BF16 SGLANG_DSPARK_OPT_MARKOV_W2_TP_SHARD
            SGLANG_DSPARK_STACKED_CTX_KV SGLANG_DSPARK_STS_COLLECT_PATH SGLANG_DSPARK_USE_GREEDY_DRAFT
            SGLANG_EMBEDDING_POOL_SIZE_MB SGLANG_ENABLE_DISAGG_SAMPLING_MASK
            SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION SGLANG_ENABLE_FAILED_SESSION_PROBE
            SGLANG_ENABLE_LILICORR_SAMPLING SGLANG_ENABLE_METADATA_GLUE_GRAPH
            SGLANG_ENABLE_OVERLAP_PLAN_STREAM SGLANG_ENABLE_PP_SPEC SGLANG_ENABLE_SPLITKV_VERIFY
            SGLANG_ENCODER_BOOTSTRAP_EVICTED_TTL SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_INTERVAL
            SGLANG_ENCODER_BOOTSTRAP_HEALTH_CHECK_TIMEOUT SGLANG_ENCODER_DISPATCH_MIN_ITEMS
            SGLANG_ENCODER_DP_WORKER_MAX_INFLIGHT SGLANG_ENCODER_GRPC_TIMEOUT_SECS
            SGLANG_ENCODER_HTTP_TIMEOUT SGLANG_ENCODER_IMAGE_PROCESSOR_USE_GPU SGLANG_ENCODER_MAX_BATCH_SIZE
            SGLANG_ENCODER_MM_LOAD_WORKERS SGLANG_ENCODER_MM_RECEIVER_MODE SGLANG_ENCODER_PREPROC_WORKERS
            SGLANG_ENCODER_RECV_TIMEOUT SGLANG_ENCODER_REQ_TIMEOUT SGLANG_ENCODER_SEND_TIMEOUT
            SGLANG_FAILED_SESSION_IDLE_TIMEOUT_S SGLANG_FAILED_SESSION_PROBE_INTERVAL_S
            SGLANG_FAILED_SESSION_PROBE_MAX_INTERVAL_S SGLANG_HICACHE_MOONCAKE_CONFIG_PATH
            SGLANG_HICACHE_MOONCAKE_REUSE_TE SGLANG_LILICORR_REQUIRE_SAMPLING SGLANG_LORA_DENSE_CONFIG_DIR
            SGLANG_LORA_MOE_CONFIG_DIR SGLANG_MOONCAKE_CUSTOM_MEM_POOL
            SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES SGLANG_MOONCAKE_SEND_AUX_TCP
            SGLANG_NGRAM_FORCE_GREEDY_VERIFY SGLANG_OPT_DSV41_BLOCKWISE_REJECTION
            SGLANG_OPT_DSV41_DSPARK_DRAFT_PREP_FORK SGLANG_OPT_DSV41_DSPARK_ONE_LAUNCH_COMMIT_STAGE
            SGLANG_OPT_DSV41_DSPARK_POST_FOLD SGLANG_OPT_DSV41_DSPARK_SIM_DRAW_AHEAD
            SGLANG_OPT_DSV41_DSPARK_SKIP_PREFILLED_INPUTS SGLANG_OPT_FLASHINFER_DRAFT_HOST_INDPTR
            SGLANG_OPT_FLASHINFER_VERIFY_HOST_PLAN SGLANG_OPT_FUSED_KDA_VERIFY SGLANG_RAGGED_VERIFY_MODE
            SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND SGLANG_SPEC_TP_SYNC SGLANG_STAGING_USE_TORCH
            SGLANG_TEST_RAGGED_VERIFY_FORCE_UNIFORM_CAPTURE
        """.split()
    ),
    "read only on a platform other than CUDA (ROCm/AITER, MLX, Ascend, MUSA, XPU, MoRI), which Foundry refuses": tuple(
        """
            SGLANG_AITER_FUSE_RMSNORM_PAD SGLANG_AITER_GFX942_BLOCKSCALE_USE_CK
            SGLANG_AITER_HONOR_EXPLICIT_MEM_FRACTION SGLANG_AITER_INTREE_GEMM_TUNE
            SGLANG_AITER_INTREE_MHC_TILE_M16 SGLANG_AITER_KV_CACHE_LAYOUT
            SGLANG_AITER_MEGA_EPLB_FUSED_MAP_RECORD SGLANG_AITER_MEGA_EPLB_PREFILL_ONLY
            SGLANG_AITER_MEGA_RANK_SYNC SGLANG_AITER_MLA_AUTO_KV_SPLITS SGLANG_AITER_MLA_DECODE_BACKEND
            SGLANG_AITER_MLA_GLUON SGLANG_AITER_MLA_VERIFY_BACKEND SGLANG_AITER_MOE_SORTING_DISPATCH_POLICY
            SGLANG_AMD_FLYDSL_MEGA_MOE_DECODE_MTPR SGLANG_AMD_FLYDSL_MEGA_MOE_MTPR
            SGLANG_AMD_FLYDSL_MEGA_QUANT SGLANG_AMD_USE_FLYDSL_MEGA_MOE SGLANG_DEEPEP_V2_FORCE_MAX_LEN
            SGLANG_DISABLE_GFX1250_FP8_GEMM SGLANG_DP_USE_REDUCE_SCATTER SGLANG_DSV4_FP4_LOGITS_BUDGET_MB
            SGLANG_ENABLE_DP_GATHER_FP8 SGLANG_GFX1250_W4A8_BACKEND SGLANG_GFX1250_W4A8_KERNEL_GATHER
            SGLANG_HACK_FLASHMLA_BACKEND SGLANG_HICACHE_MEMCACHE_CONFIG_PATH SGLANG_M3_USE_AITER_FUSED_QKNORM
            SGLANG_MLA_HCA_KV_SPLITS SGLANG_MLX_CACHE_LIMIT_GB SGLANG_MLX_CLEAR_CACHE_STEPS
            SGLANG_MLX_FUSE_SWIGLU SGLANG_MLX_USE_CUSTOM_ROPE SGLANG_MORI_COMBINE_DTYPE
            SGLANG_MORI_DISPATCH_DTYPE SGLANG_MORI_EP_V2 SGLANG_MORI_MOE_MAX_INPUT_TOKENS
            SGLANG_MORI_NUM_MAX_DISPATCH_TOKENS_PER_RANK SGLANG_MORI_NUM_WORKERS SGLANG_MORI_POST_BATCH_SIZE
            SGLANG_MORI_PREALLOC_MAX_RECV_TOKENS SGLANG_MORI_QP_PER_TRANSFER SGLANG_MORI_RECV_BOUND
            SGLANG_MORI_SEND_AUX_RDMA SGLANG_MORI_TRANSFER_SHARDS SGLANG_MORI_TRANSFER_TIMEOUT_MS
            SGLANG_MORI_WAIT_POLL_MS SGLANG_MUSA_FA3_FORCE_UPDATE_METADATA
            SGLANG_NPU_ARCH35_REQUANT_BLOCK_FP8 SGLANG_NPU_ATTN_BACKEND_NEEDS_CPU_SEQ_LENS
            SGLANG_NPU_DISABLE_ACL_FORMAT_WEIGHT SGLANG_NPU_ENABLE_SPARSE_KV_OFFLOAD
            SGLANG_NPU_FINE_GRAINED_MOE_DUAL_STREAM SGLANG_NPU_FORWARD_NATIVE_GELUTANH
            SGLANG_NPU_FORWARD_NATIVE_GEMMA_RMS_NORM SGLANG_NPU_MEMCACHE_ENABLE_WARMUP
            SGLANG_NPU_MOE_SITU_MXFP8_FUSED SGLANG_NPU_USE_FIAS_V2_BSND SGLANG_NPU_USE_MLAPO
            SGLANG_NPU_USE_MULTI_STREAM SGLANG_NPU_USE_SCATTER_PA_KV_CACHE
            SGLANG_NPU_USE_TRITON_PREFIX_KV_CACHE_STORE SGLANG_NPU_W4A4_NEW_PACKING
            SGLANG_OPT_BEAM_DECODE_GEMV SGLANG_OPT_FUSED_QK_NORM_ROPE_VERIFY
            SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED SGLANG_OPT_MXFP4_DEFERRED_FINALIZED_SHAPE
            SGLANG_OPT_NPU_BF16_WO_A_GEMM SGLANG_OPT_USE_AITER_INDEXER SGLANG_OPT_USE_AITER_SILU_MUL
            SGLANG_OPT_USE_FUSED_QK_NORM_ROPE SGLANG_ROCM_DISABLE_LINEARQUANT SGLANG_ROCM_FUSED_DECODE_MLA
            SGLANG_ROCM_K3_FUSE_KDA_INPROJ SGLANG_ROCM_K3_FUSE_KDA_INPROJ_MAX_TOKENS
            SGLANG_ROCM_OPT_DSPARK_FP8_LM_HEAD SGLANG_ROCM_SMALLM_FP8_PROJ SGLANG_ROCM_SMALLM_MOE
            SGLANG_ROCM_SMALLM_ROUTER SGLANG_ROCM_USE_AITER_FP4_ASM_GEMM SGLANG_ROCM_USE_MULTI_STREAM
            SGLANG_USE_AG_AFTER_QLORA SGLANG_USE_AITER SGLANG_USE_AITER_AG SGLANG_USE_AITER_FP8_PER_TOKEN
            SGLANG_USE_AITER_MOE_GU_ITLV SGLANG_USE_AITER_UNIFIED_ATTN SGLANG_USE_MLX
            SGLANG_XPU_LN_MOD_NUM_WARPS SGLANG_ZBAL_BOOTSTRAP_URL SGLANG_ZBAL_LOCAL_MEM_SIZE
        """.split()
    ),
}


def _names(groups: dict[str, tuple[str, ...]]) -> frozenset[str]:
    return frozenset(n for names in groups.values() for n in names)


SERVER_CLASSIFIED = (
    SERVER_FINGERPRINTED | SERVER_REFUSED_BY_RULE | _names(SERVER_REFUSED) | _names(SERVER_IRRELEVANT)
)
ENV_CLASSIFIED = ENV_FINGERPRINTED | _names(ENV_REFUSED) | _names(ENV_IRRELEVANT)


def server_fields_to_fingerprint(fields: tuple[str, ...] | frozenset[str]) -> list[str]:
    """The fields of this release's ``ServerArgs`` that go into the fingerprint: the fingerprinted
    ones, and every field this module does not classify."""
    return sorted(n for n in fields if n in SERVER_FINGERPRINTED or n not in SERVER_CLASSIFIED)


def env_switches_to_fingerprint(declared: list[str] | frozenset[str]) -> list[str]:
    """The declared ``SGLANG_*`` switches that go into the fingerprint (where set): the fingerprinted
    ones, and every switch this module does not classify."""
    return sorted(n for n in declared if n in ENV_FINGERPRINTED or n not in ENV_CLASSIFIED)
