/*
 * Prints what the C compiler makes of the public headers, for the Python
 * binding's ABI test (python/tests/test_abi.py): the size and every field
 * offset of each public struct, the enum and macro constants, the version.
 * Output lines:
 *   size STRUCT BYTES
 *   field STRUCT FIELD OFFSET SIZE
 *   const NAME VALUE
 *   version STRING
 * SPDX-License-Identifier: Apache-2.0
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>

#include <kvinject.h>

#define SIZE(T) printf("size %s %zu\n", #T, sizeof(T))
#define FIELD(T, f) printf("field %s %s %zu %zu\n", #T, #f, offsetof(T, f), sizeof(((T *)0)->f))
#define CONST(c) printf("const %s %lld\n", #c, (long long)(c))
#define UCONST(c) printf("const %s %llu\n", #c, (unsigned long long)(c))

int main(void) {
  SIZE(kvi_model_options);
  FIELD(kvi_model_options, struct_size);
  FIELD(kvi_model_options, num_layers);
  FIELD(kvi_model_options, num_kv_heads);
  FIELD(kvi_model_options, head_size);
  FIELD(kvi_model_options, tp_rank);
  FIELD(kvi_model_options, tp_size);

  SIZE(kvi_model_info);
  FIELD(kvi_model_info, struct_size);
  FIELD(kvi_model_info, num_layers);
  FIELD(kvi_model_info, num_kv_heads);
  FIELD(kvi_model_info, head_size);
  FIELD(kvi_model_info, tp_rank);
  FIELD(kvi_model_info, tp_size);
  FIELD(kvi_model_info, local_head_first);
  FIELD(kvi_model_info, local_heads);
  FIELD(kvi_model_info, head_replicas);

  SIZE(kvi_rope_spec);
  FIELD(kvi_rope_spec, struct_size);
  FIELD(kvi_rope_spec, style);
  FIELD(kvi_rope_spec, rotary_dim);
  FIELD(kvi_rope_spec, theta);
  FIELD(kvi_rope_spec, scaling);
  FIELD(kvi_rope_spec, original_max_position);
  FIELD(kvi_rope_spec, factor);
  FIELD(kvi_rope_spec, low_freq_factor);
  FIELD(kvi_rope_spec, high_freq_factor);
  FIELD(kvi_rope_spec, beta_fast);
  FIELD(kvi_rope_spec, beta_slow);
  FIELD(kvi_rope_spec, attention_factor);
  FIELD(kvi_rope_spec, yarn_truncate);
  FIELD(kvi_rope_spec, table_dtype);
  FIELD(kvi_rope_spec, cos_sin_table);
  FIELD(kvi_rope_spec, table_positions);

  SIZE(kvi_kv_view);
  FIELD(kvi_kv_view, struct_size);
  FIELD(kvi_kv_view, memory);
  FIELD(kvi_kv_view, dtype);
  FIELD(kvi_kv_view, num_layers);
  FIELD(kvi_kv_view, num_tokens);
  FIELD(kvi_kv_view, num_heads);
  FIELD(kvi_kv_view, head_size);
  FIELD(kvi_kv_view, layer_stride);
  FIELD(kvi_kv_view, token_stride);
  FIELD(kvi_kv_view, head_stride);
  FIELD(kvi_kv_view, k);
  FIELD(kvi_kv_view, v);

  SIZE(kvi_save_options);
  FIELD(kvi_save_options, struct_size);
  FIELD(kvi_save_options, flags);
  FIELD(kvi_save_options, tenant);

  SIZE(kvi_load_options);
  FIELD(kvi_load_options, struct_size);
  FIELD(kvi_load_options, flags);

  SIZE(kvi_store_options);
  FIELD(kvi_store_options, struct_size);
  FIELD(kvi_store_options, backend);
  FIELD(kvi_store_options, device);
  FIELD(kvi_store_options, dtype);
  FIELD(kvi_store_options, page_tokens);
  FIELD(kvi_store_options, budget_bytes);
  FIELD(kvi_store_options, embedding_dim);
  FIELD(kvi_store_options, embedding_dtype);
  FIELD(kvi_store_options, metric);
  FIELD(kvi_store_options, comm);
  FIELD(kvi_store_options, embedding_placement);
  FIELD(kvi_store_options, host_budget_bytes);
  FIELD(kvi_store_options, disk_dir);
  FIELD(kvi_store_options, disk_budget_bytes);
  FIELD(kvi_store_options, disk_owner);
  FIELD(kvi_store_options, disk_lease_ms);

  SIZE(kvi_put_options);
  FIELD(kvi_put_options, struct_size);
  FIELD(kvi_put_options, flags);
  FIELD(kvi_put_options, embedding);
  FIELD(kvi_put_options, embedding_dtype);
  FIELD(kvi_put_options, embedding_memory);
  FIELD(kvi_put_options, token_ids);
  FIELD(kvi_put_options, context_ids);
  FIELD(kvi_put_options, num_context_ids);

  SIZE(kvi_store_stats);
  FIELD(kvi_store_stats, struct_size);
  FIELD(kvi_store_stats, backend);
  FIELD(kvi_store_stats, device);
  FIELD(kvi_store_stats, dtype);
  FIELD(kvi_store_stats, page_tokens);
  FIELD(kvi_store_stats, embedding_dim);
  FIELD(kvi_store_stats, page_bytes);
  FIELD(kvi_store_stats, pages_total);
  FIELD(kvi_store_stats, pages_used);
  FIELD(kvi_store_stats, bytes_reserved);
  FIELD(kvi_store_stats, bytes_used);
  FIELD(kvi_store_stats, bytes_payload);
  FIELD(kvi_store_stats, facts);
  FIELD(kvi_store_stats, tenants);
  FIELD(kvi_store_stats, bytes_embeddings);
  FIELD(kvi_store_stats, pages_host_total);
  FIELD(kvi_store_stats, pages_host_used);
  FIELD(kvi_store_stats, promotions);
  FIELD(kvi_store_stats, demotions);
  FIELD(kvi_store_stats, facts_stale);
  FIELD(kvi_store_stats, facts_on_disk_only);
  FIELD(kvi_store_stats, disk_bytes);
  FIELD(kvi_store_stats, disk_reads);
  FIELD(kvi_store_stats, disk_read_bytes);
  FIELD(kvi_store_stats, disk_writes);
  FIELD(kvi_store_stats, disk_write_bytes);
  FIELD(kvi_store_stats, drops_to_disk);

  SIZE(kvi_search_options);
  FIELD(kvi_search_options, struct_size);
  FIELD(kvi_search_options, query_dtype);
  FIELD(kvi_search_options, query_memory);
  FIELD(kvi_search_options, out_memory);
  FIELD(kvi_search_options, workspace_bytes);

  SIZE(kvi_cache_layout);
  FIELD(kvi_cache_layout, struct_size);
  FIELD(kvi_cache_layout, memory);
  FIELD(kvi_cache_layout, dtype);
  FIELD(kvi_cache_layout, num_layers);
  FIELD(kvi_cache_layout, num_heads);
  FIELD(kvi_cache_layout, head_size);
  FIELD(kvi_cache_layout, block_size);
  FIELD(kvi_cache_layout, num_blocks);
  FIELD(kvi_cache_layout, block_stride);
  FIELD(kvi_cache_layout, token_stride);
  FIELD(kvi_cache_layout, head_stride);
  FIELD(kvi_cache_layout, layer_stride);
  FIELD(kvi_cache_layout, v_offset);
  FIELD(kvi_cache_layout, k_layers);
  FIELD(kvi_cache_layout, v_layers);
  FIELD(kvi_cache_layout, k_base);
  FIELD(kvi_cache_layout, v_base);
  FIELD(kvi_cache_layout, scale_mode);
  FIELD(kvi_cache_layout, k_scales);
  FIELD(kvi_cache_layout, v_scales);
  FIELD(kvi_cache_layout, dim_stride);
  FIELD(kvi_cache_layout, v_block_stride);
  FIELD(kvi_cache_layout, v_token_stride);
  FIELD(kvi_cache_layout, v_head_stride);
  FIELD(kvi_cache_layout, v_dim_stride);

  SIZE(kvi_transfer_options);
  FIELD(kvi_transfer_options, struct_size);
  FIELD(kvi_transfer_options, max_tokens_per_call);
  FIELD(kvi_transfer_options, max_requests_per_call);
  FIELD(kvi_transfer_options, max_table_entries_per_call);

  SIZE(kvi_retrieve_request);
  FIELD(kvi_retrieve_request, struct_size);
  FIELD(kvi_retrieve_request, tenant);
  FIELD(kvi_retrieve_request, block_table);
  FIELD(kvi_retrieve_request, block_table_len);
  FIELD(kvi_retrieve_request, block_table_memory);
  FIELD(kvi_retrieve_request, first_slot);
  FIELD(kvi_retrieve_request, start_position);
  FIELD(kvi_retrieve_request, flags);
  SIZE(kvi_scatter_item);
  FIELD(kvi_scatter_item, struct_size);
  FIELD(kvi_scatter_item, tenant);
  FIELD(kvi_scatter_item, fact_id);
  FIELD(kvi_scatter_item, full);
  FIELD(kvi_scatter_item, opts);
  SIZE(kvi_gather_item);
  FIELD(kvi_gather_item, struct_size);
  FIELD(kvi_gather_item, tenant);
  FIELD(kvi_gather_item, fact_id);
  FIELD(kvi_gather_item, full);
  SIZE(kvi_inject_request);
  FIELD(kvi_inject_request, struct_size);
  FIELD(kvi_inject_request, tenant);
  FIELD(kvi_inject_request, fact_ids);
  FIELD(kvi_inject_request, num_facts);
  FIELD(kvi_inject_request, block_table);
  FIELD(kvi_inject_request, block_table_len);
  FIELD(kvi_inject_request, block_table_memory);
  FIELD(kvi_inject_request, first_slot);
  FIELD(kvi_inject_request, positions);
  FIELD(kvi_inject_request, start_position);
  FIELD(kvi_inject_request, num_positions);
  FIELD(kvi_inject_request, expect_token_ids);
  FIELD(kvi_inject_request, num_expect_token_ids);

  SIZE(kvi_encode_batch);
  FIELD(kvi_encode_batch, struct_size);
  FIELD(kvi_encode_batch, num_captures);
  FIELD(kvi_encode_batch, tenant);
  FIELD(kvi_encode_batch, tenants);
  FIELD(kvi_encode_batch, fact_ids);
  FIELD(kvi_encode_batch, num_tokens);
  FIELD(kvi_encode_batch, block_tables);
  FIELD(kvi_encode_batch, block_table_stride);
  FIELD(kvi_encode_batch, block_table_len);
  FIELD(kvi_encode_batch, block_table_offsets);
  FIELD(kvi_encode_batch, first_slots);
  FIELD(kvi_encode_batch, position_bits);
  FIELD(kvi_encode_batch, start_positions);
  FIELD(kvi_encode_batch, positions);
  FIELD(kvi_encode_batch, num_positions);
  FIELD(kvi_encode_batch, flags);
  FIELD(kvi_encode_batch, embeddings);
  FIELD(kvi_encode_batch, embedding_dtype);
  FIELD(kvi_encode_batch, embedding_memory);
  FIELD(kvi_encode_batch, embedding_stride);
  FIELD(kvi_encode_batch, token_ids);
  FIELD(kvi_encode_batch, context_ids);
  FIELD(kvi_encode_batch, context_offsets);

  SIZE(kvi_inject_batch);
  FIELD(kvi_inject_batch, struct_size);
  FIELD(kvi_inject_batch, num_requests);
  FIELD(kvi_inject_batch, tenant);
  FIELD(kvi_inject_batch, tenants);
  FIELD(kvi_inject_batch, fact_ids);
  FIELD(kvi_inject_batch, fact_ids_memory);
  FIELD(kvi_inject_batch, fact_offsets);
  FIELD(kvi_inject_batch, block_tables);
  FIELD(kvi_inject_batch, block_tables_memory);
  FIELD(kvi_inject_batch, block_table_stride);
  FIELD(kvi_inject_batch, block_table_len);
  FIELD(kvi_inject_batch, block_table_offsets);
  FIELD(kvi_inject_batch, first_slots);
  FIELD(kvi_inject_batch, position_bits);
  FIELD(kvi_inject_batch, start_positions);
  FIELD(kvi_inject_batch, positions);
  FIELD(kvi_inject_batch, num_positions);
  FIELD(kvi_inject_batch, index_memory);
  FIELD(kvi_inject_batch, out_tokens);
  FIELD(kvi_inject_batch, expect_token_ids);
  FIELD(kvi_inject_batch, expect_token_offsets);

  SIZE(kvi_recompute_options);
  FIELD(kvi_recompute_options, struct_size);
  FIELD(kvi_recompute_options, fraction);
  FIELD(kvi_recompute_options, per_fact);
  FIELD(kvi_recompute_options, boundary);

  SIZE(kvi_inject_options);
  FIELD(kvi_inject_options, struct_size);
  FIELD(kvi_inject_options, layer_begin);
  FIELD(kvi_inject_options, layer_end);
  FIELD(kvi_inject_options, host_pages);

  SIZE(kvi_capture);
  FIELD(kvi_capture, struct_size);
  FIELD(kvi_capture, tenant);
  FIELD(kvi_capture, fact_id);
  FIELD(kvi_capture, block_table);
  FIELD(kvi_capture, block_table_len);
  FIELD(kvi_capture, first_slot);
  FIELD(kvi_capture, num_tokens);
  FIELD(kvi_capture, positions);
  FIELD(kvi_capture, start_position);
  FIELD(kvi_capture, flags);
  FIELD(kvi_capture, embedding);
  FIELD(kvi_capture, embedding_dtype);
  FIELD(kvi_capture, embedding_memory);
  FIELD(kvi_capture, token_ids);
  FIELD(kvi_capture, context_ids);
  FIELD(kvi_capture, num_context_ids);

  /* enum sizes: ctypes declares every kvi_ enum as int */
  printf("enumsize kvi_status %zu\n", sizeof(kvi_status));
  printf("enumsize kvi_dtype %zu\n", sizeof(kvi_dtype));
  printf("enumsize kvi_memory %zu\n", sizeof(kvi_memory));
  printf("enumsize kvi_backend %zu\n", sizeof(kvi_backend));
  printf("enumsize kvi_rope_style %zu\n", sizeof(kvi_rope_style));
  printf("enumsize kvi_rope_scaling %zu\n", sizeof(kvi_rope_scaling));
  printf("enumsize kvi_metric %zu\n", sizeof(kvi_metric));
  printf("enumsize kvi_scale_mode %zu\n", sizeof(kvi_scale_mode));
  printf("enumsize kvi_cache_preset %zu\n", sizeof(kvi_cache_preset));

  CONST(KVI_OK);
  CONST(KVI_ERR_INVALID_ARGUMENT);
  CONST(KVI_ERR_STRUCT_SIZE);
  CONST(KVI_ERR_OUT_OF_MEMORY);
  CONST(KVI_ERR_CAPACITY);
  CONST(KVI_ERR_EXISTS);
  CONST(KVI_ERR_NOT_FOUND);
  CONST(KVI_ERR_MISMATCH);
  CONST(KVI_ERR_MEMORY_KIND);
  CONST(KVI_ERR_NOT_BUILT);
  CONST(KVI_ERR_NO_DEVICE);
  CONST(KVI_ERR_CUDA);
  CONST(KVI_ERR_UNSUPPORTED);
  CONST(KVI_ERR_INTERNAL);
  CONST(KVI_ERR_CORRUPT);
  CONST(KVI_ERR_INCOMPATIBLE);
  CONST(KVI_ERR_IO);
  CONST(KVI_ERR_PEER);
  CONST(KVI_ERR_TOKEN_MISMATCH);
  CONST(KVI_ERR_STALE);
  CONST(KVI_ERR_LEASED);
  CONST(KVI_EMBEDDINGS_REPLICATED);
  CONST(KVI_EMBEDDINGS_SHARDED);
  CONST(KVI_RETRIEVE_BEST_LAST);
  CONST(KVI_DTYPE_FP32);
  CONST(KVI_DTYPE_FP16);
  CONST(KVI_DTYPE_BF16);
  CONST(KVI_DTYPE_FP8_E4M3);
  CONST(KVI_DTYPE_FP8_E5M2);
  CONST(KVI_DTYPE_Q4);
  CONST(KVI_MEMORY_HOST);
  CONST(KVI_MEMORY_DEVICE);
  CONST(KVI_BACKEND_AUTO);
  CONST(KVI_BACKEND_CPU);
  CONST(KVI_BACKEND_CUDA);
  CONST(KVI_ROPE_UNSET);
  CONST(KVI_ROPE_NONE);
  CONST(KVI_ROPE_NEOX);
  CONST(KVI_ROPE_GPTJ);
  CONST(KVI_ROPE_SCALING_NONE);
  CONST(KVI_ROPE_SCALING_LINEAR);
  CONST(KVI_ROPE_SCALING_LLAMA3);
  CONST(KVI_ROPE_SCALING_YARN);
  CONST(KVI_ROPE_SCALING_NTK);
  CONST(KVI_METRIC_INNER_PRODUCT);
  CONST(KVI_METRIC_COSINE);
  CONST(KVI_TIER_DEVICE);
  CONST(KVI_TIER_HOST);
  CONST(KVI_TIER_DISK);
  CONST(KVI_SCALE_NONE);
  CONST(KVI_SCALE_PER_TENSOR);
  CONST(KVI_SCALE_PER_HEAD);
  CONST(KVI_CACHE_VLLM_FLASH_ATTN);
  CONST(KVI_CACHE_VLLM_FLASH_ATTN_HND);
  CONST(KVI_CACHE_VLLM_FLASHINFER);
  CONST(KVI_CACHE_VLLM_FLASHINFER_HND);
  CONST(KVI_CACHE_VLLM_PACKED);
  CONST(KVI_CACHE_VLLM_PACKED_HND);
  CONST(KVI_CACHE_SGLANG);
  CONST(KVI_CACHE_TRTLLM);
  CONST(KVI_CACHE_HF_CONTIGUOUS);
  CONST(KVI_CACHE_VLLM_CPU);
  CONST(KVI_STRIDE_SAME);
  CONST(KVI_FEATURE_CUDA);
  CONST(KVI_FEATURE_CUBLASLT);
  CONST(KVI_FEATURE_NCCL);
  CONST(KVI_PUT_REPLACE);
  CONST(KVI_REMOVE_KEEP_DEPENDENTS);
  CONST(KVI_SAVE_ONE_TENANT);
  CONST(KVI_LOAD_JOURNAL);
  CONST(KVI_SEARCH_MAX_K);
  UCONST(KVI_SEARCH_NO_ID);
  UCONST(KVI_SEARCH_DEFAULT_WORKSPACE);
  CONST(KVI_VERSION_NUMBER);
  printf("version %s\n", KVI_VERSION_STRING);
  return 0;
}
