/*
 * Body of the header checks, included by header_check_c99.c (compiled as
 * strict C99) and header_check_cxx11.cpp (strict C++11): it must stay valid
 * in both languages. It uses every KVI_*_INIT macro (test_abi checks that)
 * and exercises a CPU model and store through the public API only.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef HEADER_CHECK_BODY_H
#define HEADER_CHECK_BODY_H

#include <stdio.h>
#include <string.h>

static int hc_failures;

#define HC_CHECK(cond)                                                         \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      hc_failures++;                                                           \
    }                                                                          \
  } while (0)

#define HC_CHECK_OK(call)                                                                       \
  do {                                                                                          \
    kvi_status hc_st_ = (call);                                                                 \
    if (hc_st_ != KVI_OK) {                                                                     \
      fprintf(stderr, "%s:%d: %s returned %d (%s): %s\n", __FILE__, __LINE__, #call, (int)hc_st_, \
              kvi_status_string(hc_st_), kvi_last_error());                                     \
      hc_failures++;                                                                            \
    }                                                                                           \
  } while (0)

enum {
  HC_LAYERS = 2,
  HC_HEADS = 2,
  HC_DIM = 8,
  HC_TOKENS = 3,
  HC_PAGE = 4,
  HC_ELEMS = HC_LAYERS * HC_TOKENS * HC_HEADS * HC_DIM
};

/* The *_INIT macros and the *_init() functions give the same values. */
static void hc_check_init_macros(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT, mo2;
  kvi_model_info mi = KVI_MODEL_INFO_INIT;
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT, rs2;
  kvi_kv_view kv = KVI_KV_VIEW_INIT, kv2;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT, so2;
  kvi_put_options po = KVI_PUT_OPTIONS_INIT, po2;
  kvi_store_stats ss = KVI_STORE_STATS_INIT;
  kvi_search_options sr = KVI_SEARCH_OPTIONS_INIT, sr2;

  memset(&mo2, 0x5a, sizeof mo2);
  kvi_model_options_init(&mo2, sizeof mo2);
  HC_CHECK(mo.struct_size == sizeof(kvi_model_options) && mo2.struct_size == mo.struct_size);
  HC_CHECK(mo2.num_layers == mo.num_layers && mo2.num_kv_heads == mo.num_kv_heads &&
           mo2.head_size == mo.head_size && mo2.tp_rank == mo.tp_rank && mo2.tp_size == mo.tp_size);
  HC_CHECK(mo.tp_size == 1 && mo.tp_rank == 0);

  HC_CHECK(mi.struct_size == sizeof(kvi_model_info));

  memset(&rs2, 0x5a, sizeof rs2);
  kvi_rope_spec_init(&rs2, sizeof rs2);
  HC_CHECK(rs.struct_size == sizeof(kvi_rope_spec) && rs2.struct_size == rs.struct_size);
  HC_CHECK(rs2.style == rs.style && rs.style == KVI_ROPE_NEOX && rs2.rotary_dim == rs.rotary_dim &&
           rs2.theta == rs.theta && rs.theta == 10000.0);

  memset(&kv2, 0x5a, sizeof kv2);
  kvi_kv_view_init(&kv2, sizeof kv2);
  HC_CHECK(kv.struct_size == sizeof(kvi_kv_view) && kv2.struct_size == kv.struct_size);
  HC_CHECK(kv2.memory == kv.memory && kv2.dtype == kv.dtype && kv2.num_layers == kv.num_layers &&
           kv2.num_tokens == kv.num_tokens && kv2.num_heads == kv.num_heads && kv2.head_size == kv.head_size &&
           kv2.layer_stride == kv.layer_stride && kv2.token_stride == kv.token_stride &&
           kv2.head_stride == kv.head_stride && kv2.k == kv.k && kv2.v == kv.v && kv.k == NULL);

  memset(&so2, 0x5a, sizeof so2);
  kvi_store_options_init(&so2, sizeof so2);
  HC_CHECK(so.struct_size == sizeof(kvi_store_options) && so2.struct_size == so.struct_size);
  HC_CHECK(so2.backend == so.backend && so2.device == so.device && so2.dtype == so.dtype &&
           so2.page_tokens == so.page_tokens && so2.budget_bytes == so.budget_bytes &&
           so2.embedding_dim == so.embedding_dim);
  HC_CHECK(so.backend == KVI_BACKEND_AUTO && so.device == -1 && so.dtype == KVI_DTYPE_BF16 && so.page_tokens == 16);
  HC_CHECK(so2.embedding_dtype == so.embedding_dtype && so.embedding_dtype == KVI_DTYPE_FP32 &&
           so2.metric == so.metric && so.metric == KVI_METRIC_INNER_PRODUCT);

  memset(&sr2, 0x5a, sizeof sr2);
  kvi_search_options_init(&sr2, sizeof sr2);
  HC_CHECK(sr.struct_size == sizeof(kvi_search_options) && sr2.struct_size == sr.struct_size);
  HC_CHECK(sr2.query_dtype == sr.query_dtype && sr.query_dtype == KVI_DTYPE_FP32 &&
           sr2.query_memory == sr.query_memory && sr.query_memory == KVI_MEMORY_HOST &&
           sr2.out_memory == sr.out_memory && sr.out_memory == KVI_MEMORY_HOST &&
           sr2.workspace_bytes == sr.workspace_bytes && sr.workspace_bytes == KVI_SEARCH_DEFAULT_WORKSPACE);

  memset(&po2, 0x5a, sizeof po2);
  kvi_put_options_init(&po2, sizeof po2);
  HC_CHECK(po.struct_size == sizeof(kvi_put_options) && po2.struct_size == po.struct_size);
  HC_CHECK(po2.flags == po.flags && po2.embedding == po.embedding && po2.embedding_dtype == po.embedding_dtype &&
           po2.embedding_memory == po.embedding_memory && po.embedding_memory == KVI_MEMORY_HOST);

  HC_CHECK(ss.struct_size == sizeof(kvi_store_stats));

  {
    kvi_cache_layout cl = KVI_CACHE_LAYOUT_INIT, cl2;
    kvi_transfer_options to = KVI_TRANSFER_OPTIONS_INIT, to2;
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT, rq2;
    kvi_inject_options io = KVI_INJECT_OPTIONS_INIT, io2;
    kvi_capture cp = KVI_CAPTURE_INIT, cp2;
    memset(&cl2, 0x5a, sizeof cl2);
    kvi_cache_layout_init(&cl2, sizeof cl2);
    HC_CHECK(cl.struct_size == sizeof(kvi_cache_layout) && cl2.struct_size == cl.struct_size &&
             cl2.scale_mode == cl.scale_mode && cl.scale_mode == KVI_SCALE_NONE && cl2.k_layers == NULL &&
             cl2.dtype == cl.dtype && cl2.memory == cl.memory && cl2.v_offset == 0);
    memset(&to2, 0x5a, sizeof to2);
    kvi_transfer_options_init(&to2, sizeof to2);
    HC_CHECK(to.struct_size == sizeof(kvi_transfer_options) && to2.max_tokens_per_call == to.max_tokens_per_call &&
             to2.max_requests_per_call == to.max_requests_per_call &&
             to2.max_table_entries_per_call == to.max_table_entries_per_call && to.max_tokens_per_call > 0);
    {
      kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT, eb2;
      memset(&eb2, 0x5a, sizeof eb2);
      kvi_encode_batch_init(&eb2, sizeof eb2);
      HC_CHECK(eb.struct_size == sizeof(kvi_encode_batch) && eb2.struct_size == eb.struct_size &&
               eb2.position_bits == 32 && eb2.embedding_dtype == KVI_DTYPE_FP32 &&
               eb2.embedding_memory == KVI_MEMORY_HOST && eb2.embeddings == NULL && eb2.flags == 0u);
    }
    {
      kvi_inject_batch ib = KVI_INJECT_BATCH_INIT, ib2;
      memset(&ib2, 0x5a, sizeof ib2);
      kvi_inject_batch_init(&ib2, sizeof ib2);
      HC_CHECK(ib.struct_size == sizeof(kvi_inject_batch) && ib2.struct_size == ib.struct_size &&
               ib2.position_bits == 32 && ib.position_bits == 32 && ib2.fact_ids_memory == KVI_MEMORY_HOST &&
               ib.index_memory == KVI_MEMORY_HOST && ib2.block_tables == NULL && ib2.out_tokens == NULL &&
               ib2.num_requests == 0);
    }
    memset(&rq2, 0x5a, sizeof rq2);
    kvi_inject_request_init(&rq2, sizeof rq2);
    HC_CHECK(rq.struct_size == sizeof(kvi_inject_request) && rq2.struct_size == rq.struct_size &&
             rq2.block_table_memory == rq.block_table_memory && rq.block_table_memory == KVI_MEMORY_HOST &&
             rq2.fact_ids == NULL && rq2.positions == NULL && rq2.num_facts == 0);
    memset(&io2, 0x5a, sizeof io2);
    kvi_inject_options_init(&io2, sizeof io2);
    HC_CHECK(io.struct_size == sizeof(kvi_inject_options) && io2.layer_begin == 0 && io2.layer_end == 0);
    memset(&cp2, 0x5a, sizeof cp2);
    kvi_capture_init(&cp2, sizeof cp2);
    HC_CHECK(cp.struct_size == sizeof(kvi_capture) && cp2.struct_size == cp.struct_size && cp2.flags == 0 &&
             cp2.embedding == NULL && cp2.embedding_dtype == cp.embedding_dtype && cp.embedding_dtype == KVI_DTYPE_FP32 &&
             cp2.embedding_memory == KVI_MEMORY_HOST);
    {
      kvi_llama_state_info li = KVI_LLAMA_STATE_INFO_INIT;
      kvi_llama_state_spec ls = KVI_LLAMA_STATE_SPEC_INIT, ls2;
      memset(&ls2, 0x5a, sizeof ls2);
      HC_CHECK(kvi_llama_state_spec_init(&ls2, sizeof ls2) == KVI_OK);
      HC_CHECK(li.struct_size == sizeof(kvi_llama_state_info) && li.num_sections == 0 &&
               ls.struct_size == sizeof(kvi_llama_state_spec) && ls2.struct_size == ls.struct_size &&
               ls2.num_streams == 1 && ls.num_streams == 1 && ls2.positions == NULL && ls2.v_trans == 0 &&
               ls2.dtype == ls.dtype);
      HC_CHECK(kvi_llama_state_spec_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    }
    HC_CHECK(kvi_cache_layout_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    HC_CHECK(kvi_transfer_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    HC_CHECK(kvi_inject_request_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    HC_CHECK(kvi_inject_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    HC_CHECK(kvi_capture_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    {
      kvi_recompute_options ro = KVI_RECOMPUTE_OPTIONS_INIT, ro2;
      memset(&ro2, 0x5a, sizeof ro2);
      HC_CHECK(kvi_recompute_options_init(&ro2, sizeof ro2) == KVI_OK);
      HC_CHECK(ro.struct_size == sizeof(kvi_recompute_options) && ro2.struct_size == ro.struct_size &&
               ro2.fraction == 0.0 && ro2.per_fact == 0 && ro2.boundary == 0 && ro.boundary == 0);
      HC_CHECK(kvi_recompute_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
    }
  }

  /* NULL is refused by every *_init() */
  HC_CHECK(kvi_model_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_rope_spec_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_kv_view_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_store_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_put_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_search_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
}

static void hc_check_common(void) {
  HC_CHECK(strcmp(kvi_version_string(), KVI_VERSION_STRING) == 0);
  HC_CHECK(kvi_version_number() == (unsigned)KVI_VERSION_NUMBER);
  HC_CHECK(kvi_last_error() != NULL);
  HC_CHECK(strcmp(kvi_status_string(KVI_OK), kvi_status_string(KVI_ERR_NOT_FOUND)) != 0);
  HC_CHECK(strcmp(kvi_status_string((kvi_status)7), "unknown status") == 0);
  HC_CHECK(kvi_dtype_size(KVI_DTYPE_FP32) == 4 && kvi_dtype_size(KVI_DTYPE_FP16) == 2 &&
           kvi_dtype_size(KVI_DTYPE_BF16) == 2 && kvi_dtype_size(KVI_DTYPE_FP8_E4M3) == 1 &&
           kvi_dtype_size(KVI_DTYPE_FP8_E5M2) == 1 && kvi_dtype_size(KVI_DTYPE_Q4) == 0 &&
           kvi_dtype_size((kvi_dtype)0) == 0 && KVI_DTYPE_Q4 == 6);
  {
    const unsigned f = kvi_features();
    int count = -1;
    const kvi_status st = kvi_cuda_device_count(&count);
    HC_CHECK((f & ~(KVI_FEATURE_CUDA | KVI_FEATURE_CUBLASLT | KVI_FEATURE_NCCL)) == 0);
    if (f & KVI_FEATURE_CUDA)
      HC_CHECK(st == KVI_OK && count >= 0);
    else
      HC_CHECK(st == KVI_ERR_NOT_BUILT && count == 0);
  }
}

/* A CPU model and store: put a fact, read it back bit-exactly (fp32 store). */
static void hc_check_store(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  kvi_model_info info = KVI_MODEL_INFO_INIT;
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT, rope_out = KVI_ROPE_SPEC_INIT;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  kvi_kv_view src = KVI_KV_VIEW_INIT, dst = KVI_KV_VIEW_INIT;
  kvi_store_stats stats = KVI_STORE_STATS_INIT;
  kvi_model *model = NULL;
  kvi_store *store = NULL;
  const kvi_store *cstore;
  static float k[HC_ELEMS], v[HC_ELEMS], k2[HC_ELEMS], v2[HC_ELEMS];
  uint64_t ids[4] = {0, 0, 0, 0};
  size_t n = 99, total = 99;
  int32_t tokens = 0;
  int i;

  mo.num_layers = HC_LAYERS;
  mo.num_kv_heads = HC_HEADS;
  mo.head_size = HC_DIM;
  HC_CHECK_OK(kvi_model_create(&model, &mo));
  if (!model) return;
  HC_CHECK_OK(kvi_model_info_get(model, &info));
  HC_CHECK(info.num_layers == HC_LAYERS && info.local_heads == HC_HEADS && info.head_size == HC_DIM &&
           info.local_head_first == 0 && info.head_replicas == 1 && info.tp_size == 1);

  rope.theta = 500000.0;
  HC_CHECK_OK(kvi_model_set_rope(model, -1, &rope));
  HC_CHECK_OK(kvi_model_get_rope(model, HC_LAYERS - 1, &rope_out));
  HC_CHECK(rope_out.style == KVI_ROPE_NEOX && rope_out.rotary_dim == HC_DIM && rope_out.theta == 500000.0);

  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32;
  so.page_tokens = HC_PAGE;
  so.budget_bytes = 64u * 1024u;
  HC_CHECK_OK(kvi_store_create(&store, model, &so));
  kvi_model_destroy(model); /* the store keeps what it needs */
  if (!store) return;
  cstore = store;

  for (i = 0; i < HC_ELEMS; i++) {
    k[i] = (float)i * 0.25f - 3.0f;
    v[i] = 1.0f / (float)(i + 1);
    k2[i] = v2[i] = -1.0f;
  }
  kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k, v);
  HC_CHECK(src.struct_size == sizeof(kvi_kv_view) && src.head_stride == HC_DIM &&
           src.token_stride == HC_HEADS * HC_DIM && src.layer_stride == HC_TOKENS * HC_HEADS * HC_DIM);
  HC_CHECK_OK(kvi_store_put(store, 7u, 42u, &src, &po, NULL));
  HC_CHECK(kvi_store_put(store, 7u, 42u, &src, NULL, NULL) == KVI_ERR_EXISTS);
  HC_CHECK(kvi_last_error()[0] != '\0');
  po.flags = KVI_PUT_REPLACE;
  HC_CHECK_OK(kvi_store_put(store, 7u, 42u, &src, &po, NULL));

  HC_CHECK_OK(kvi_store_fact_tokens(cstore, 7u, 42u, &tokens));
  HC_CHECK(tokens == HC_TOKENS);
  HC_CHECK_OK(kvi_store_count(cstore, 7u, &n));
  HC_CHECK(n == 1);
  HC_CHECK_OK(kvi_store_count(cstore, 8u, &n));
  HC_CHECK(n == 0);
  HC_CHECK_OK(kvi_store_list(cstore, 7u, ids, 4, &total));
  HC_CHECK(total == 1 && ids[0] == 42u);

  kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k2, v2);
  HC_CHECK_OK(kvi_store_read(cstore, 7u, 42u, &dst, NULL));
  HC_CHECK(memcmp(k, k2, sizeof k) == 0);
  HC_CHECK(memcmp(v, v2, sizeof v) == 0);

  HC_CHECK_OK(kvi_store_stats_get(cstore, &stats));
  HC_CHECK(stats.backend == KVI_BACKEND_CPU && stats.device == -1 && stats.dtype == KVI_DTYPE_FP32);
  HC_CHECK(stats.page_tokens == HC_PAGE && stats.embedding_dim == 0);
  HC_CHECK(stats.page_bytes == (uint64_t)2 * HC_LAYERS * HC_HEADS * HC_PAGE * HC_DIM * sizeof(float));
  HC_CHECK(stats.pages_used == 1 && stats.facts == 1 && stats.tenants == 1);
  HC_CHECK(stats.bytes_payload == (uint64_t)2 * HC_LAYERS * HC_HEADS * HC_TOKENS * HC_DIM * sizeof(float));

  {
    float emb[1] = {0.0f};
    HC_CHECK(kvi_store_get_embedding(cstore, 7u, 42u, emb) == KVI_ERR_INVALID_ARGUMENT);
  }
  HC_CHECK_OK(kvi_store_remove(store, 7u, 42u));
  HC_CHECK(kvi_store_remove(store, 7u, 42u) == KVI_ERR_NOT_FOUND);
  HC_CHECK(kvi_store_read(cstore, 7u, 42u, &dst, NULL) == KVI_ERR_NOT_FOUND);
  kvi_store_destroy(store);

  kvi_store_destroy(NULL);
  kvi_model_destroy(NULL);
}

/* Save a CPU store's tenant to a file and load it back (persist.h). */
static void hc_check_persist(const char *lang) {
  kvi_save_options sv = KVI_SAVE_OPTIONS_INIT, sv2;
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT, lo2;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  kvi_kv_view src = KVI_KV_VIEW_INIT, dst = KVI_KV_VIEW_INIT;
  kvi_model *model = NULL, *other = NULL;
  kvi_store *store = NULL, *loaded = NULL;
  static float k[HC_ELEMS], v[HC_ELEMS], k2[HC_ELEMS], v2[HC_ELEMS];
  char path[64];
  size_t n = 99;
  int i;

  memset(&sv2, 0x5a, sizeof sv2);
  kvi_save_options_init(&sv2, sizeof sv2);
  HC_CHECK(sv.struct_size == sizeof(kvi_save_options) && sv2.struct_size == sv.struct_size && sv2.flags == 0 &&
           sv.flags == 0 && sv2.tenant == 0);
  memset(&lo2, 0x5a, sizeof lo2);
  kvi_load_options_init(&lo2, sizeof lo2);
  HC_CHECK(lo.struct_size == sizeof(kvi_load_options) && lo2.struct_size == lo.struct_size && lo2.flags == 0);
  HC_CHECK(kvi_save_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(kvi_load_options_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK(KVI_ERR_CORRUPT == -14 && KVI_ERR_INCOMPATIBLE == -15 && KVI_ERR_IO == -16);
  HC_CHECK(strcmp(kvi_status_string(KVI_ERR_CORRUPT), kvi_status_string(KVI_ERR_INCOMPATIBLE)) != 0);

  mo.num_layers = HC_LAYERS;
  mo.num_kv_heads = HC_HEADS;
  mo.head_size = HC_DIM;
  HC_CHECK_OK(kvi_model_create(&model, &mo));
  mo.head_size = HC_DIM * 2;
  HC_CHECK_OK(kvi_model_create(&other, &mo));
  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32;
  so.page_tokens = HC_PAGE;
  so.budget_bytes = 64u * 1024u;
  if (model) HC_CHECK_OK(kvi_store_create(&store, model, &so));
  if (!store || !other) {
    kvi_model_destroy(model);
    kvi_model_destroy(other);
    return;
  }
  for (i = 0; i < HC_ELEMS; i++) {
    k[i] = (float)i * 0.5f - 7.0f;
    v[i] = (float)(i % 5) - 2.0f;
  }
  kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k, v);
  HC_CHECK_OK(kvi_store_put(store, 3u, 30u, &src, NULL, NULL));
  HC_CHECK_OK(kvi_store_put(store, 4u, 40u, &src, NULL, NULL));

  snprintf(path, sizeof path, "hc-persist-%s.kvi", lang);
  sv.flags = KVI_SAVE_ONE_TENANT;
  sv.tenant = 3u;
  HC_CHECK_OK(kvi_store_save(store, path, &sv));
  HC_CHECK_OK(kvi_store_load(&loaded, model, &so, path, &lo));
  if (loaded) {
    kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k2, v2);
    HC_CHECK_OK(kvi_store_read(loaded, 3u, 30u, &dst, NULL));
    HC_CHECK(memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0);
    HC_CHECK_OK(kvi_store_count(loaded, 4u, &n));
    HC_CHECK(n == 0);
    kvi_store_destroy(loaded);
    loaded = NULL;
  }
  HC_CHECK(kvi_store_load(&loaded, other, &so, path, NULL) == KVI_ERR_INCOMPATIBLE && loaded == NULL);
  HC_CHECK_OK(kvi_store_journal_open(store, path, 0u));
  HC_CHECK_OK(kvi_store_remove(store, 4u, 40u));
  HC_CHECK_OK(kvi_store_journal_close(store));
  HC_CHECK_OK(kvi_store_load(&loaded, model, &so, path, NULL));
  if (loaded) {
    HC_CHECK_OK(kvi_store_count(loaded, 3u, &n));
    HC_CHECK(n == 1);
    HC_CHECK_OK(kvi_store_count(loaded, 4u, &n));
    HC_CHECK(n == 0);
  }
  kvi_store_destroy(loaded);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  kvi_model_destroy(other);
  HC_CHECK(remove(path) == 0);
}

/* A CPU store with 3-element embeddings: put three facts, search two tenants. */
static void hc_check_search(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  kvi_search_options sr = KVI_SEARCH_OPTIONS_INIT;
  kvi_kv_view src = KVI_KV_VIEW_INIT;
  kvi_model *model = NULL;
  kvi_store *store = NULL;
  static float k[HC_ELEMS], v[HC_ELEMS];
  const float emb[3][3] = {{1.0f, 0.0f, 0.0f}, {0.0f, 2.0f, 0.0f}, {1.0f, 1.0f, 1.0f}};
  const float queries[2][3] = {{1.0f, 1.0f, 0.0f}, {0.0f, 0.0f, 1.0f}};
  const uint64_t tenants[2] = {5u, 6u};
  uint64_t ids[2][2];
  float scores[2][2];
  int32_t counts[2] = {-1, -1};
  int64_t bad = -1;
  int i;

  mo.num_layers = HC_LAYERS;
  mo.num_kv_heads = HC_HEADS;
  mo.head_size = HC_DIM;
  HC_CHECK_OK(kvi_model_create(&model, &mo));
  if (!model) return;
  so.backend = KVI_BACKEND_CPU;
  so.budget_bytes = 64u * 1024u;
  so.embedding_dim = 3;
  so.embedding_dtype = KVI_DTYPE_FP16;
  HC_CHECK_OK(kvi_store_create(&store, model, &so));
  kvi_model_destroy(model);
  if (!store) return;
  kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k, v);
  for (i = 0; i < 3; i++) {
    po.embedding = emb[i];
    HC_CHECK_OK(kvi_store_put(store, 5u, (uint64_t)(10 + i), &src, &po, NULL));
  }
  HC_CHECK_OK(kvi_store_search(store, queries, 2, 3, tenants, 2, &ids[0][0], &scores[0][0], counts, &sr, NULL));
  /* query 0 scores 1, 2, 2: facts 11 and 12 tie at 2, the smaller id first */
  HC_CHECK(counts[0] == 2 && ids[0][0] == 11u && ids[0][1] == 12u && scores[0][0] == 2.0f && scores[0][1] == 2.0f);
  /* tenant 6 has no facts */
  HC_CHECK(counts[1] == 0 && ids[1][0] == KVI_SEARCH_NO_ID && ids[1][1] == KVI_SEARCH_NO_ID && scores[1][0] < -1e38f);
  HC_CHECK(kvi_store_search(store, queries, 2, 4, tenants, 2, &ids[0][0], &scores[0][0], counts, NULL, NULL) ==
           KVI_ERR_MISMATCH);
  HC_CHECK(kvi_store_search(store, queries, 2, 3, tenants, 0, &ids[0][0], &scores[0][0], counts, NULL, NULL) ==
           KVI_ERR_INVALID_ARGUMENT);
  HC_CHECK_OK(kvi_store_async_errors(store, &bad));
  HC_CHECK(bad == 0);
  kvi_store_destroy(store);
}

/* A tensor-parallel store of one in-process rank (comm.h): put a fact with
 * all heads through put_scatter, gather it back, check agreement. */
static void hc_check_comm(void) {
  kvi_scatter_item si = KVI_SCATTER_ITEM_INIT;
  kvi_gather_item gi = KVI_GATHER_ITEM_INIT;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  kvi_kv_view src = KVI_KV_VIEW_INIT, dst = KVI_KV_VIEW_INIT;
  kvi_comm_group *group = NULL;
  kvi_comm *comm = NULL;
  kvi_model *model = NULL;
  kvi_store *store = NULL;
  static float k[HC_ELEMS], v[HC_ELEMS], k2[HC_ELEMS], v2[HC_ELEMS];
  int32_t rank = -1, size = -1;
  int i;

  HC_CHECK(si.struct_size == sizeof(kvi_scatter_item) && si.full == NULL && si.opts == NULL);
  {
    kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT, rr2;
    memset(&rr2, 0x5a, sizeof rr2);
    kvi_retrieve_request_init(&rr2, sizeof rr2);
    HC_CHECK(rr.struct_size == sizeof(kvi_retrieve_request) && rr2.struct_size == rr.struct_size &&
             rr2.flags == 0 && rr.flags == 0 && rr2.block_table_memory == KVI_MEMORY_HOST && rr2.block_table == NULL);
    HC_CHECK(kvi_retrieve_request_init(NULL, 64) == KVI_ERR_INVALID_ARGUMENT);
  }
  HC_CHECK(gi.struct_size == sizeof(kvi_gather_item) && gi.full == NULL);
  HC_CHECK(so.comm == NULL && so.embedding_placement == KVI_EMBEDDINGS_REPLICATED && KVI_ERR_PEER == -17);
  HC_CHECK(kvi_store_embedding_rank(1, 2, 1) == 0 && kvi_store_embedding_rank(1, 2, 0) == -1);
  HC_CHECK_OK(kvi_comm_group_create(&group, 1));
  if (group) HC_CHECK_OK(kvi_comm_create_local(&comm, group, 0));
  if (comm) HC_CHECK_OK(kvi_comm_rank(comm, &rank, &size));
  HC_CHECK(rank == 0 && size == 1);
  mo.num_layers = HC_LAYERS;
  mo.num_kv_heads = HC_HEADS;
  mo.head_size = HC_DIM;
  HC_CHECK_OK(kvi_model_create(&model, &mo));
  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32;
  so.page_tokens = HC_PAGE;
  so.budget_bytes = 64u * 1024u;
  so.comm = comm;
  if (model && comm) HC_CHECK_OK(kvi_store_create(&store, model, &so));
  if (store) {
    for (i = 0; i < HC_ELEMS; i++) {
      k[i] = (float)i * 0.25f;
      v[i] = (float)-i;
    }
    kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k, v);
    kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, HC_LAYERS, HC_TOKENS, HC_HEADS, HC_DIM, k2, v2);
    si.tenant = gi.tenant = 3;
    si.fact_id = gi.fact_id = 4;
    si.full = &src;
    gi.full = &dst;
    HC_CHECK_OK(kvi_store_put_scatter(store, 0, &si, 1, NULL));
    HC_CHECK_OK(kvi_store_gather(store, 0, &gi, 1, NULL));
    HC_CHECK(memcmp(k, k2, sizeof k) == 0 && memcmp(v, v2, sizeof v) == 0);
    HC_CHECK_OK(kvi_store_check_agreement(store));
    HC_CHECK_OK(kvi_comm_async_errors(comm, NULL));
  }
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  kvi_comm_destroy(comm);
  kvi_comm_group_destroy(group);
}

static int hc_run(const char *lang) {
  hc_check_init_macros();
  hc_check_common();
  hc_check_store();
  hc_check_persist(lang);
  hc_check_comm();
  hc_check_search();
  if (hc_failures) {
    fprintf(stderr, "%s header check: %d failure(s)\n", lang, hc_failures);
    return 1;
  }
  printf("%s header check: kvinject %s, all checks passed\n", lang, kvi_version_string());
  return 0;
}

#endif /* HEADER_CHECK_BODY_H */
