/*
 * libkvinject — durable stores: save a store (or one tenant) to a file, load
 * it back, and a journal that makes every change durable when it is made.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * A store file holds a header (model geometry, tensor-parallel slice, the
 * resolved RoPE of every layer, storage dtype, embedding size), a snapshot of
 * facts closed by an end record, and optionally a log of later changes. Every
 * part carries a CRC32C; facts keep their token ids (kvinject/store.h,
 * "Token ids"), their context and stale flag (kvinject/store.h, "Context and
 * stale facts": a loaded store refuses the facts the saved one refused).
 * docs/store-format.md describes the format byte by byte; the format version
 * is 4, and files of versions 1 (facts without token ids), 2 (without
 * contexts) and 3 (fp8 pages without their keys' offsets: kvinject/store.h,
 * "fp8 storage") still load; KVI_LOAD_JOURNAL makes such a file version 4,
 * except an fp8 file before version 4, which takes no appends (load it
 * without the flag and save it, or open a journal: both write version 4).
 * An fp8 file before version 4 loads with every key offset -0: its facts
 * read back exactly as they did (e4m3 * scale).
 *
 * Two ways to make a store durable:
 * - kvi_store_save writes a snapshot to a new file and renames it over the
 *   path: the path holds either the previous file or the new one, never a mix,
 *   whenever the process or the machine stops.
 * - kvi_store_journal_open does the same and keeps the file open as the
 *   store's journal: from then on every put, remove and encode on the store
 *   appends its change and flushes it to disk (fsync) before the call returns.
 *   A change is durable when its call returned KVI_OK: a crash after that
 *   never loses it. A crash during a call leaves either the state before the
 *   call or the state after it. Calling kvi_store_journal_open again rewrites
 *   the file as a snapshot of the current state (compaction).
 * kvi_store_load reads either kind of file into a new store: the snapshot,
 * then every complete change of the log. A final change cut short by a crash
 * is ignored (its call had not returned); any other damage refuses the whole
 * file with KVI_ERR_CORRUPT. With KVI_LOAD_JOURNAL the loaded file becomes
 * the new store's journal without being rewritten.
 *
 * Memory: every function here takes and returns host memory only; CUDA
 * stores are read and written through host buffers (pinned staging).
 *
 * Thread rules: every function here may run on several threads at once, on
 * the same store too (they take the store's lock), but not concurrently with
 * kvi_store_destroy of that store. kvi_store_load creates a new store that no
 * other thread can see before it returns. Known limit: two different stores
 * saving to one path at the same moment can make one save fail with
 * KVI_ERR_IO ("... is the journal of an open store": another save's
 * temporary, renamed over the path, is still locked by a stale-temporary
 * check); the file is then whole from the other save, and a retry succeeds.
 *
 * Locking and cost: save and journal_open hold the store's lock while they
 * write the file, so other calls on the store wait for about the time it
 * takes to write the store's facts. A journaled put, remove or encode holds
 * the lock while it writes and flushes its change (one fdatasync per call).
 * On a CUDA store a journaled put from device memory, or encode, first waits
 * for the stream it was given (its copy must be complete to be written), so
 * it returns only when that stream has drained.
 *
 * Files are created with mode 0600 whatever the umask (owner only: facts are
 * user data). Saving writes "<path>.tmp.<16 random hex digits>" in the same
 * directory, created with O_EXCL | O_NOFOLLOW (never an existing file, nor
 * through a symlink planted at the name) and locked (flock) while it is
 * written, then renames it over the path. A process killed mid-save leaves
 * that temporary behind (never the path itself damaged); the next save or
 * journal open of the same path removes such temporaries (regular files of
 * the caller's user that no one holds locked), and they may be deleted by
 * hand. See docs/security.md. The file's byte order is the host's;
 * the format is defined for little-endian hosts (others get
 * KVI_ERR_UNSUPPORTED).
 *
 * A journal appends to the file it opened only while that file is still the
 * one at its path: once the file was unlinked, or another file renamed over
 * the path, every journaled call fails with KVI_ERR_IO (nothing changed)
 * until kvi_store_journal_open writes a fresh file, so a change is never
 * acknowledged into a file no load will read.
 *
 * A file that is some store's journal is locked (flock) by that store: saving
 * over it, opening it as another journal or loading it with KVI_LOAD_JOURNAL
 * fails with KVI_ERR_IO until that journal is closed. Loading it without
 * KVI_LOAD_JOURNAL is allowed and gives the changes acknowledged so far.
 */
#ifndef KVINJECT_PERSIST_H
#define KVINJECT_PERSIST_H

#include "kvinject/common.h"
#include "kvinject/model.h"
#include "kvinject/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Save                                                                     */
/* ------------------------------------------------------------------------ */

/* kvi_save_options.flags */
#define KVI_SAVE_ONE_TENANT 0x1u /* save only the facts of `tenant` */

typedef struct kvi_save_options {
  size_t struct_size; /* sizeof(kvi_save_options) */
  uint32_t flags;     /* KVI_SAVE_* bits, default 0: every tenant */
  uint64_t tenant;    /* with KVI_SAVE_ONE_TENANT: the tenant to save */
} kvi_save_options;

#define KVI_SAVE_OPTIONS_INIT {sizeof(kvi_save_options), 0u, 0u}

/* Fills *opts with KVI_SAVE_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_save_options_init(kvi_save_options *opts, size_t size);

/*
 * Writes a snapshot of `store` (every fact, or one tenant's) to the file
 * `path` (host memory, a NUL-terminated path): to "<path>.tmp.<pid>.<n>"
 * first, flushed (fsync), then renamed over `path`, then the directory
 * flushed. When this returns KVI_OK the file is durable. On an error `path`
 * is as it was and the temporary file is removed, except when only the
 * final directory flush failed (KVI_ERR_IO naming the directory): `path` then
 * already is the new, complete file, which a crash may still undo.
 * The snapshot is of one moment: the store's lock is held throughout. On a
 * CUDA store, device work that writes facts (puts from device memory,
 * kvi_encode) is waited for before the facts are read.
 * A tenant with no facts gives a valid file with no facts.
 * opts: host memory, or NULL for KVI_SAVE_OPTIONS_INIT.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or path, an empty path, unknown
 * flags), KVI_ERR_STRUCT_SIZE, KVI_ERR_IO (creating, writing, flushing or
 * renaming failed, or `path` is an open store's journal: kvi_last_error()
 * names the call and the system error), KVI_ERR_OUT_OF_MEMORY, KVI_ERR_CUDA,
 * KVI_ERR_UNSUPPORTED (a big-endian host).
 */
KVI_API kvi_status kvi_store_save(const kvi_store *store, const char *path, const kvi_save_options *opts);

/* ------------------------------------------------------------------------ */
/* Load                                                                     */
/* ------------------------------------------------------------------------ */

/* kvi_load_options.flags */
#define KVI_LOAD_JOURNAL 0x1u /* keep the file open as the new store's journal
                                 (as kvi_store_journal_open, without rewriting
                                 it); a torn final change is cut off the file */

typedef struct kvi_load_options {
  size_t struct_size; /* sizeof(kvi_load_options) */
  uint32_t flags;     /* KVI_LOAD_* bits, default 0 */
} kvi_load_options;

#define KVI_LOAD_OPTIONS_INIT {sizeof(kvi_load_options), 0u}

/* Fills *opts with KVI_LOAD_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_load_options_init(kvi_load_options *opts, size_t size);

/*
 * Creates a store as kvi_store_create(out, model, opts) would and fills it
 * with the facts of the file `path`: its snapshot, then its log of changes.
 * All or nothing: the whole file is read and checked before the store is
 * returned; on any error no store is created and *out is unchanged.
 * model:     host memory. Its geometry (layers, KV heads, head size), its
 *            tensor-parallel slice (tp rank and size) and every layer's
 *            resolved RoPE must equal the file's.
 * opts:      host memory, required (as for kvi_store_create). opts->dtype and
 *            opts->embedding_dim must equal the file's; page_tokens, backend,
 *            device and budget_bytes are free (the budget must hold the
 *            facts), except that an fp8 or 4-bit file (scales per page)
 *            loads only with the page_tokens it was saved with.
 * path:      host memory, a NUL-terminated path.
 * load_opts: host memory, or NULL for KVI_LOAD_OPTIONS_INIT.
 * The file is read with ordinary reads; nothing is allocated before the size
 * that needs it has been checked against the file's size and the geometry.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, an empty path, unknown flags),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_NOT_FOUND (no file at `path`), KVI_ERR_IO
 * (another read error; with KVI_LOAD_JOURNAL, the file is another store's
 * journal or cannot be written), KVI_ERR_CORRUPT (not a store file,
 * truncated, a checksum mismatch, an inconsistent record: a damaged final
 * change of the log is not an error, see above), KVI_ERR_INCOMPATIBLE (the
 * file was made for another geometry, tp slice, RoPE, dtype or embedding
 * size, or has an unknown format version or byte order, or is an fp8 file
 * before format version 4 loaded with KVI_LOAD_JOURNAL; kvi_last_error()
 * names the field and both values), KVI_ERR_CAPACITY (the facts do not fit
 * opts->budget_bytes), and the errors of kvi_store_create.
 */
KVI_API kvi_status kvi_store_load(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                                  const char *path, const kvi_load_options *load_opts);

/* ------------------------------------------------------------------------ */
/* Journal                                                                  */
/* ------------------------------------------------------------------------ */

/*
 * Makes `store` durable in the file `path` (host memory, a NUL-terminated
 * path): writes a snapshot of its current state as kvi_store_save does, then
 * keeps the file open and locked as the store's journal. From then on each
 * successful kvi_store_put, kvi_store_remove (kvi_store_remove_ex) and kvi_encode on the store
 * appends its change (one record per fact; an encode call's captures as one
 * all-or-nothing group) and flushes it before returning KVI_OK. If appending
 * or flushing fails, that call fails with KVI_ERR_IO and changes nothing in
 * the store (the change may still be in the file when the flush itself
 * failed); after a failed flush (or a failed write that could not be cut
 * back off the file) the journal refuses further changes with KVI_ERR_IO
 * until it is opened again.
 * A store already journaling (to this path or another) switches to the new
 * file; calling this again with the same path compacts the file. The store's
 * lock is held throughout (see the top of this header).
 * flags: 0 (reserved).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, an empty path, unknown flags),
 * KVI_ERR_IO (as kvi_store_save; `path` is another store's journal),
 * KVI_ERR_OUT_OF_MEMORY, KVI_ERR_CUDA, KVI_ERR_UNSUPPORTED (big-endian host).
 * On error the store keeps its previous journal, if any.
 */
KVI_API kvi_status kvi_store_journal_open(kvi_store *store, const char *path, uint32_t flags);

/*
 * Stops journaling: later changes are no longer written. Everything already
 * acknowledged is in the file, which stays a valid store file. A store
 * without a journal is left as it is (KVI_OK). kvi_store_destroy closes the
 * journal too. Errors: KVI_ERR_INVALID_ARGUMENT (NULL store).
 */
KVI_API kvi_status kvi_store_journal_close(kvi_store *store);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_PERSIST_H */
