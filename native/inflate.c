/* Inflating archive chunks straight into their place in the member's final buffer.
 *
 * Python's zlib returns each chunk as a new object that must then be joined: two fresh copies of
 * every byte, and as many page faults. Here each chunk is inflated once, in place, by whichever
 * thread runs it, with the GIL released (ctypes). libz is found at run time (dlopen) like libcuda,
 * so the library still builds with no zlib headers; the z_stream layout below is zlib's public,
 * stable ABI.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef struct {
  const uint8_t *next_in;
  unsigned avail_in;
  unsigned long total_in;
  uint8_t *next_out;
  unsigned avail_out;
  unsigned long total_out;
  const char *msg;
  void *state;
  void *zalloc;
  void *zfree;
  void *opaque;
  int data_type;
  unsigned long adler;
  unsigned long reserved;
} z_stream_abi;

#define Z_OK 0
#define Z_STREAM_END 1
#define Z_FINISH 4

static int (*z_inflate_init)(z_stream_abi *, const char *, int);
static int (*z_inflate)(z_stream_abi *, int);
static int (*z_inflate_end)(z_stream_abi *);
static pthread_once_t z_once = PTHREAD_ONCE_INIT;
static int z_ok;

static void load_zlib(void) {
  void *h = dlopen("libz.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) return;
  *(void **)&z_inflate_init = dlsym(h, "inflateInit_");
  *(void **)&z_inflate = dlsym(h, "inflate");
  *(void **)&z_inflate_end = dlsym(h, "inflateEnd");
  z_ok = z_inflate_init && z_inflate && z_inflate_end;
}

/* 1 when libz could be loaded (the other entry point is usable), else 0. */
EXPORT int foundry_inflate_available(void) {
  pthread_once(&z_once, load_zlib);
  return z_ok;
}

/* Inflates the one complete zlib stream in src[0:src_len] into dst[0:dst_len]. Returns 0 when it
 * yields exactly dst_len bytes and ends exactly at src_len; -1 when the stream is damaged, longer or
 * shorter than that (dst may then hold anything); -2 when libz is not available. */
EXPORT int foundry_inflate(const void *src, size_t src_len, void *dst, size_t dst_len) {
  if (!foundry_inflate_available()) return -2;
  if (src_len > UINT_MAX || dst_len >= UINT_MAX) return -1;
  z_stream_abi s;
  memset(&s, 0, sizeof s);
  /* zlib checks only the major version digit and the struct size. */
  if (z_inflate_init(&s, "1.2.11", (int)sizeof s) != Z_OK) return -1;
  uint8_t spare; /* one byte past dst_len, so that a stream longer than expected is caught */
  s.next_in = src;
  s.avail_in = (unsigned)src_len;
  s.next_out = dst;
  s.avail_out = (unsigned)dst_len;
  int rc = z_inflate(&s, Z_FINISH);
  if (rc != Z_STREAM_END && s.avail_out == 0) {
    s.next_out = &spare;
    s.avail_out = 1;
    rc = z_inflate(&s, Z_FINISH);
  }
  int ok = rc == Z_STREAM_END && s.total_out == dst_len && s.avail_in == 0;
  z_inflate_end(&s);
  return ok ? 0 : -1;
}
