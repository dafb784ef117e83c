/* Segment allocator for torch.cuda.MemPool(CUDAPluggableAllocator(...)).
 *
 * Hands out 512-byte-aligned segments from one fixed region of the arena
 * (the tail after the planned buffers). torch's caching allocator sub-allocates
 * and reuses blocks inside these segments; we never give memory back, so every
 * address a graph captured stays valid and unique. No CUDA calls here: malloc
 * is legal during stream capture. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

static uintptr_t g_base = 0;
static size_t g_size = 0;
static size_t g_off = 0;
static size_t g_nalloc = 0, g_nfree = 0, g_failed = 0;

void flare_pool_set(uintptr_t base, size_t size) {
  g_base = base; g_size = size; g_off = 0; g_nalloc = g_nfree = g_failed = 0;
}
size_t flare_pool_used(void) { return __atomic_load_n(&g_off, __ATOMIC_SEQ_CST); }
size_t flare_pool_nalloc(void) { return __atomic_load_n(&g_nalloc, __ATOMIC_SEQ_CST); }
size_t flare_pool_nfree(void) { return __atomic_load_n(&g_nfree, __ATOMIC_SEQ_CST); }
size_t flare_pool_failed(void) { return __atomic_load_n(&g_failed, __ATOMIC_SEQ_CST); }

void* flare_pool_malloc(ssize_t size, int device, void* stream) {
  (void)device; (void)stream;
  size_t sz = ((size_t)(size > 0 ? size : 1) + 511) & ~(size_t)511;
  size_t off = __atomic_fetch_add(&g_off, sz, __ATOMIC_SEQ_CST);
  if (g_base == 0 || off + sz > g_size) {
    __atomic_fetch_sub(&g_off, sz, __ATOMIC_SEQ_CST);
    __atomic_fetch_add(&g_failed, 1, __ATOMIC_SEQ_CST);
    fprintf(stderr, "flare pool: out of scratch (size=%zu used=%zu request=%zd)\n", g_size, off, size);
    return NULL;
  }
  __atomic_fetch_add(&g_nalloc, 1, __ATOMIC_SEQ_CST);
  return (void*)(g_base + off);
}

void flare_pool_free(void* ptr, ssize_t size, int device, void* stream) {
  (void)ptr; (void)size; (void)device; (void)stream;
  __atomic_fetch_add(&g_nfree, 1, __ATOMIC_SEQ_CST);
}
