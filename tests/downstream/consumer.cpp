/*
 * A downstream C++ program, built against the installed libkvinject with
 * nothing but `pkg-config --cflags --libs kvinject` (see check-install.sh).
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <kvinject.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef EXPECTED_VERSION
#error "build with -DEXPECTED_VERSION=\"<pkg-config --modversion kvinject>\""
#endif

namespace {

void check(kvi_status st, const char *what) {
  if (st != KVI_OK) throw std::runtime_error(std::string(what) + ": " + kvi_status_string(st) + ": " + kvi_last_error());
}

struct store_deleter {
  void operator()(kvi_store *s) const { kvi_store_destroy(s); }
};

} // namespace

int main() {
  try {
    if (std::string(kvi_version_string()) != EXPECTED_VERSION) throw std::runtime_error("version mismatch");

    kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
    mo.num_layers = 2;
    mo.num_kv_heads = 8;
    mo.head_size = 16;
    mo.tp_size = 4;
    mo.tp_rank = 3; // holds heads 6 and 7
    kvi_model *model = nullptr;
    check(kvi_model_create(&model, &mo), "kvi_model_create");
    kvi_store_options so = KVI_STORE_OPTIONS_INIT;
    so.backend = KVI_BACKEND_CPU;
    so.dtype = KVI_DTYPE_FP32;
    so.budget_bytes = 1 << 20;
    kvi_store *raw = nullptr;
    const kvi_status st = kvi_store_create(&raw, model, &so);
    kvi_model_destroy(model);
    check(st, "kvi_store_create");
    std::unique_ptr<kvi_store, store_deleter> store(raw);

    const int layers = 2, tokens = 7, heads = 2, dim = 16, n = layers * tokens * heads * dim;
    std::vector<float> k(n), v(n), k2(n), v2(n);
    for (int i = 0; i < n; i++) {
      k[i] = static_cast<float>(i) * 0.5f;
      v[i] = static_cast<float>(n - i);
    }
    kvi_kv_view src = KVI_KV_VIEW_INIT, dst = KVI_KV_VIEW_INIT;
    kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, layers, tokens, heads, dim, k.data(), v.data());
    kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, layers, tokens, heads, dim, k2.data(), v2.data());
    check(kvi_store_put(store.get(), 9, 77, &src, nullptr, nullptr), "kvi_store_put");
    check(kvi_store_read(store.get(), 9, 77, &dst, nullptr), "kvi_store_read");
    if (k != k2 || v != v2) throw std::runtime_error("the fact read back differs");
    std::printf("C++ consumer: libkvinject %s: put and read back %d tokens on TP rank 3 of 4\n", kvi_version_string(),
                tokens);
    return 0;
  } catch (const std::exception &e) {
    std::fprintf(stderr, "consumer.cpp: %s\n", e.what());
    return 1;
  }
}
