/*
 * The public header as a strict C99 program sees it: compiled with
 * -std=c99 -pedantic -Werror -Wall -Wextra (see meson.build), included twice
 * (include guards), then used for real.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <kvinject.h>
#include <kvinject.h>

#include "header_check_body.h"

#if !defined(KVI_VERSION_MAJOR) || !defined(KVI_VERSION_MINOR) || !defined(KVI_VERSION_PATCH)
#error "kvinject.h does not define the version macros"
#endif

/* C99 has no _Static_assert: a negative array size fails the build. */
typedef char hc_version_number_ok[(KVI_VERSION_NUMBER ==
                                   KVI_VERSION_MAJOR * 10000 + KVI_VERSION_MINOR * 100 + KVI_VERSION_PATCH)
                                      ? 1
                                      : -1];
typedef char hc_status_values_ok[(KVI_OK == 0 && KVI_ERR_INVALID_ARGUMENT == -1 && KVI_ERR_INTERNAL == -13 &&
                                  KVI_ERR_IO == -16 && KVI_ERR_PEER == -17)
                                     ? 1
                                     : -1];

int main(void) { return hc_run("C99"); }
