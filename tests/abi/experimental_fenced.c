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

int main(void) {
#ifdef KVI_RECOMPUTE_OPTIONS_INIT
  return 1; /* the fenced section's macros leaked */
#else
  return kvi_inject_deviation + kvi_recompute_options_init + kvi_recompute_select == 6 ? 0 : 1;
#endif
}
