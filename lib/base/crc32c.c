/*
 * CRC32C (Castagnoli, reflected polynomial 0x82F63B78), as iSCSI, ext4 and
 * LevelDB use it: crc32c("123456789") = 0xE3069283. Slicing-by-8 tables,
 * built once; several GB/s per core, above what a disk writes.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>
#include <string.h>

#include "base/base.h"

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void build_table(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++) table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xffu];
}

uint32_t kvi__crc32c(uint32_t crc, const void *data, size_t n) {
  pthread_once(&table_once, build_table);
  const unsigned char *p = data;
  uint32_t c = ~crc;
  while (n > 0 && ((uintptr_t)p & 7u)) {
    c = (c >> 8) ^ table[0][(c ^ *p++) & 0xffu];
    n--;
  }
  while (n >= 8) {
    /* little-endian words; the format is defined for little-endian hosts */
    uint32_t lo, hi;
    memcpy(&lo, p, 4);
    memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = table[7][lo & 0xffu] ^ table[6][(lo >> 8) & 0xffu] ^ table[5][(lo >> 16) & 0xffu] ^ table[4][lo >> 24] ^
        table[3][hi & 0xffu] ^ table[2][(hi >> 8) & 0xffu] ^ table[1][(hi >> 16) & 0xffu] ^ table[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = (c >> 8) ^ table[0][(c ^ *p++) & 0xffu];
  return ~c;
}
