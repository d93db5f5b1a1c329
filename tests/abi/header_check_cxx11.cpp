/*
 * The public header as a strict C++11 program sees it: compiled with
 * -std=c++11 -pedantic -Werror -Wall -Wextra (see meson.build). The shared
 * body checks the C API; this file adds what a C++ user relies on: C linkage,
 * standard-layout structs usable with RAII wrappers and constexpr macros.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <kvinject.h>
#include <kvinject.h>

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "header_check_body.h"

static_assert(KVI_VERSION_NUMBER == KVI_VERSION_MAJOR * 10000 + KVI_VERSION_MINOR * 100 + KVI_VERSION_PATCH,
              "KVI_VERSION_NUMBER");
static_assert(KVI_OK == 0 && KVI_ERR_INTERNAL == -13 && KVI_ERR_IO == -16, "status values are fixed");
static_assert(std::is_standard_layout<kvi_model_options>::value && std::is_trivial<kvi_model_options>::value,
              "options structs are plain C structs");
static_assert(std::is_standard_layout<kvi_kv_view>::value && std::is_trivial<kvi_kv_view>::value, "kvi_kv_view");
static_assert(std::is_standard_layout<kvi_store_stats>::value && std::is_trivial<kvi_store_stats>::value,
              "kvi_store_stats");

namespace {

struct model_deleter {
  void operator()(kvi_model *m) const { kvi_model_destroy(m); }
};
struct store_deleter {
  void operator()(kvi_store *s) const { kvi_store_destroy(s); }
};
using model_ptr = std::unique_ptr<kvi_model, model_deleter>;
using store_ptr = std::unique_ptr<kvi_store, store_deleter>;

/* Options built inside a C++ function and a lambda, as wrappers do. */
int cxx_checks() {
  int failures = 0;
  auto fail = [&failures](const char *what) {
    fprintf(stderr, "C++ check failed: %s (%s)\n", what, kvi_last_error());
    failures++;
  };

  const std::string version = kvi_version_string();
  if (version != KVI_VERSION_STRING) fail("kvi_version_string");

  model_ptr model;
  {
    kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
    mo.num_layers = 1;
    mo.num_kv_heads = 4;
    mo.head_size = 16;
    mo.tp_size = 2;
    mo.tp_rank = 1;
    kvi_model *raw = nullptr;
    if (kvi_model_create(&raw, &mo) != KVI_OK) fail("kvi_model_create");
    model.reset(raw);
  }
  if (!model) return failures;
  kvi_model_info info = KVI_MODEL_INFO_INIT;
  if (kvi_model_info_get(model.get(), &info) != KVI_OK || info.local_heads != 2 || info.local_head_first != 2)
    fail("tensor-parallel slice: rank 1 of 2 holds heads 2..3");

  store_ptr store;
  {
    kvi_store_options so = KVI_STORE_OPTIONS_INIT;
    so.backend = KVI_BACKEND_CPU;
    so.dtype = KVI_DTYPE_FP32;
    so.budget_bytes = 1u << 20;
    kvi_store *raw = nullptr;
    if (kvi_store_create(&raw, model.get(), &so) != KVI_OK) fail("kvi_store_create");
    store.reset(raw);
  }
  model.reset();
  if (!store) return failures;

  const int tokens = 5, elems = 1 * tokens * 2 * 16;
  std::vector<float> k(elems), v(elems), k2(elems, 0.0f), v2(elems, 0.0f);
  for (int i = 0; i < elems; i++) {
    k[i] = static_cast<float>(i) - 17.5f;
    v[i] = static_cast<float>(i % 7) * 0.5f;
  }
  kvi_kv_view src = KVI_KV_VIEW_INIT, dst = KVI_KV_VIEW_INIT;
  kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, tokens, 2, 16, k.data(), v.data());
  kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, tokens, 2, 16, k2.data(), v2.data());
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  if (kvi_store_put(store.get(), 1, 0xfeedfacecafeULL, &src, &po, nullptr) != KVI_OK) fail("kvi_store_put");
  const kvi_store *cs = store.get();
  if (kvi_store_read(cs, 1, 0xfeedfacecafeULL, &dst, nullptr) != KVI_OK) fail("kvi_store_read");
  if (k != k2 || v != v2) fail("read back differs from what was put");
  kvi_store_stats stats = KVI_STORE_STATS_INIT;
  if (kvi_store_stats_get(cs, &stats) != KVI_OK || stats.facts != 1 || stats.backend != KVI_BACKEND_CPU)
    fail("kvi_store_stats_get");
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT;
  if (rope.style != KVI_ROPE_NEOX) fail("KVI_ROPE_SPEC_INIT");
  /* the transfer structs' INIT macros in C++ (no narrowing, no old-style casts) */
  const kvi_cache_layout layout = KVI_CACHE_LAYOUT_INIT;
  const kvi_transfer_options topts = KVI_TRANSFER_OPTIONS_INIT;
  const kvi_inject_request req = KVI_INJECT_REQUEST_INIT;
  const kvi_inject_options iopts = KVI_INJECT_OPTIONS_INIT;
  const kvi_inject_batch ibatch = KVI_INJECT_BATCH_INIT;
  const kvi_encode_batch ebatch = KVI_ENCODE_BATCH_INIT;
  if (ebatch.struct_size != sizeof ebatch || ebatch.embedding_dtype != KVI_DTYPE_FP32) fail("KVI_ENCODE_BATCH_INIT");
  if (ibatch.struct_size != sizeof ibatch || ibatch.position_bits != 32 || ibatch.out_tokens != nullptr)
    fail("KVI_INJECT_BATCH_INIT");
  const kvi_capture cap = KVI_CAPTURE_INIT;
  const kvi_save_options svopts = KVI_SAVE_OPTIONS_INIT;
  const kvi_load_options lopts = KVI_LOAD_OPTIONS_INIT;
  const kvi_search_options sopts = KVI_SEARCH_OPTIONS_INIT;
  const kvi_scatter_item sitem = KVI_SCATTER_ITEM_INIT;
  const kvi_gather_item gitem = KVI_GATHER_ITEM_INIT;
  const kvi_retrieve_request rreq = KVI_RETRIEVE_REQUEST_INIT;
  if (rreq.struct_size != sizeof rreq || rreq.flags != 0u) fail("KVI_RETRIEVE_REQUEST_INIT");
  const kvi_llama_state_info linfo = KVI_LLAMA_STATE_INFO_INIT;
  const kvi_llama_state_spec lspec = KVI_LLAMA_STATE_SPEC_INIT;
  if (linfo.struct_size != sizeof linfo || linfo.sections[1].num_cells != 0) fail("KVI_LLAMA_STATE_INFO_INIT");
  if (lspec.struct_size != sizeof lspec || lspec.num_streams != 1 || lspec.positions != nullptr)
    fail("KVI_LLAMA_STATE_SPEC_INIT");
  if (sitem.struct_size != sizeof sitem || sitem.full != nullptr) fail("KVI_SCATTER_ITEM_INIT");
  if (gitem.struct_size != sizeof gitem || gitem.full != nullptr) fail("KVI_GATHER_ITEM_INIT");
  if (layout.struct_size != sizeof layout || layout.scale_mode != KVI_SCALE_NONE) fail("KVI_CACHE_LAYOUT_INIT");
  if (topts.max_requests_per_call < 1) fail("KVI_TRANSFER_OPTIONS_INIT");
  if (req.block_table_memory != KVI_MEMORY_HOST) fail("KVI_INJECT_REQUEST_INIT");
  if (iopts.layer_end != 0) fail("KVI_INJECT_OPTIONS_INIT");
  if (cap.embedding_dtype != KVI_DTYPE_FP32) fail("KVI_CAPTURE_INIT");
  const kvi_recompute_options ropts = KVI_RECOMPUTE_OPTIONS_INIT;
  if (ropts.struct_size != sizeof ropts || ropts.boundary != 0 || ropts.per_fact != 0)
    fail("KVI_RECOMPUTE_OPTIONS_INIT");
  if (svopts.struct_size != sizeof svopts || svopts.flags != 0) fail("KVI_SAVE_OPTIONS_INIT");
  if (lopts.struct_size != sizeof lopts || lopts.flags != 0) fail("KVI_LOAD_OPTIONS_INIT");
  if (sopts.out_memory != KVI_MEMORY_HOST || sopts.workspace_bytes != KVI_SEARCH_DEFAULT_WORKSPACE)
    fail("KVI_SEARCH_OPTIONS_INIT");
  {
    std::vector<float> emb(4, 0.5f), q(4, 1.0f);
    kvi_store_options so = KVI_STORE_OPTIONS_INIT;
    so.backend = KVI_BACKEND_CPU;
    so.budget_bytes = 1u << 20;
    so.embedding_dim = 4;
    so.metric = KVI_METRIC_COSINE;
    model_ptr m2;
    kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
    mo.num_layers = 1;
    mo.num_kv_heads = 2;
    mo.head_size = 16;
    kvi_model *rawm = nullptr;
    if (kvi_model_create(&rawm, &mo) != KVI_OK) fail("kvi_model_create (search)");
    m2.reset(rawm);
    kvi_store *raws = nullptr;
    if (m2 && kvi_store_create(&raws, m2.get(), &so) != KVI_OK) fail("kvi_store_create (search)");
    store_ptr s2(raws);
    kvi_put_options po2 = KVI_PUT_OPTIONS_INIT;
    po2.embedding = emb.data();
    if (s2 && kvi_store_put(s2.get(), 3, 77, &src, &po2, nullptr) != KVI_OK) fail("kvi_store_put (search)");
    std::vector<uint64_t> ids(3);
    std::vector<float> scores(3);
    int32_t count = -1;
    const uint64_t tenant = 3;
    if (s2 && kvi_store_search(s2.get(), q.data(), 1, 4, &tenant, 3, ids.data(), scores.data(), &count, &sopts,
                               nullptr) != KVI_OK)
      fail("kvi_store_search");
    /* cosine of two parallel vectors: 1 */
    if (s2 && (count != 1 || ids[0] != 77 || scores[0] < 0.999f || scores[0] > 1.001f || ids[1] != KVI_SEARCH_NO_ID))
      fail("kvi_store_search results");
  }
  return failures;
}

} // namespace

int main() {
  const int rc = hc_run("C++11");
  const int cxx = cxx_checks();
  if (cxx) fprintf(stderr, "C++11 header check: %d C++ failure(s)\n", cxx);
  return rc || cxx ? 1 : 0;
}
