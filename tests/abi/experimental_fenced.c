/*
 * The experimental declarations (common.h, "Stability") are hidden unless the
 * program defines KVI_ENABLE_EXPERIMENTAL: this file, built without it,
 * defines objects with their names, which would not compile if the umbrella
 * header declared them.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <kvinject.h>

static int kvi_inject_deviation = 1;
static int kvi_recompute_options_init = 2;
static int kvi_recompute_select = 3;
static int kvi_store_remove_ex = 4;
static int kvi_store_fact_context = 5;
static int kvi_store_stale = 6;

int main(void) {
#if defined(KVI_RECOMPUTE_OPTIONS_INIT) || defined(KVI_REMOVE_KEEP_DEPENDENTS)
  return 1; /* the fenced section's macros leaked */
#else
  return kvi_inject_deviation + kvi_recompute_options_init + kvi_recompute_select + kvi_store_remove_ex +
                     kvi_store_fact_context + kvi_store_stale ==
                 21
             ? 0
             : 1;
#endif
}
