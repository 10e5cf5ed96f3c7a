/* Runtime static allocator: the C ABI that torch.cuda.memory.CUDAPluggableAllocator loads, plus
 * a small control API (backend, arena, plans, arm/disarm, statistics, recording) that
 * xema_ray/allocator/runtime.py drives through ctypes.
 *
 * No CUDA headers: cudaStream_t is `struct CUstream_st*`, so an opaque pointer has the same ABI,
 * and cudaMalloc/cudaFree are reached through dlopen/dlsym of libcudart at run time. The same
 * library runs against a host arena (aligned_alloc) so every path is testable without a GPU.
 *
 * No C++ exception crosses this boundary: functions return XEMA_OK / a negative code (details in
 * xema_last_error()) or nullptr.
 */
#ifndef XEMA_ALLOC_H_
#define XEMA_ALLOC_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define XEMA_API __attribute__((visibility("default")))
#define XEMA_ABI_VERSION 4
#define XEMA_MAX_DEVICES 64

typedef void* xema_stream_t;

enum xema_backend { XEMA_BACKEND_CUDA = 0, XEMA_BACKEND_HOST = 1 };

enum xema_status {
  XEMA_OK = 0,
  XEMA_E_INVALID = -1, /* bad argument (device out of range, plan outside the arena, ...) */
  XEMA_E_STATE = -2,   /* not allowed now (memory still live, already armed, ...) */
  XEMA_E_NOMEM = -3,   /* the backend could not provide the memory */
  XEMA_E_BACKEND = -4, /* libcudart could not be loaded or a CUDA call failed */
  XEMA_E_INTERNAL = -5 /* an unexpected C++ exception, caught at the boundary */
};

enum xema_region { XEMA_REGION_STATIC = 0, XEMA_REGION_DYNAMIC = 1, XEMA_REGION_DRIVER = 2 };

/* All fields are uint64 so the ctypes mirror cannot get padding wrong. Byte counts are of
 * requests rounded up to 512 (what the caching allocator and the trace count). */
typedef struct xema_stats {
  uint64_t active_bytes;         /* live bytes handed out */
  uint64_t peak_active_bytes;
  uint64_t reserved_bytes;       /* arena (static + dynamic region) + driver blocks held */
  uint64_t peak_reserved_bytes;
  uint64_t static_region_bytes;
  uint64_t dynamic_region_bytes;
  uint64_t static_active_bytes;
  uint64_t dynamic_active_bytes;
  uint64_t driver_active_bytes;
  uint64_t planned_hits;         /* allocations served at their planned offset */
  uint64_t planned_misses;       /* allocations the plan covered but that fell back */
  uint64_t unplanned_allocs;     /* disarmed, other streams, or past the end of the plan */
  uint64_t fallback_bytes;       /* cumulative bytes of planned_misses */
  uint64_t dynamic_allocs;       /* served by the dynamic region's free list */
  uint64_t driver_allocs;        /* served by the driver (cudaMalloc / host aligned_alloc) */
  uint64_t requests_armed;
  uint64_t requests_fell_back;
  uint64_t unknown_frees;        /* frees of pointers this allocator never handed out */
  uint64_t live_blocks;
  uint64_t armed;                /* 1 while a plan is armed */
  uint64_t fell_back;            /* 1 once the armed request stopped trusting its plan */
  uint64_t plan_cursor;          /* planned-stream allocations seen since arming */
  uint64_t plan_length;
  uint64_t arena_base;           /* address of the static region (0 if none reserved) */
  uint64_t dynamic_base;         /* address of the dynamic region (0 if none reserved) */
  uint64_t static_resizes;       /* xema_resize_static calls that changed the static region */
  uint64_t pending_free_bytes;   /* freed by torch, held until the streams that used them pass */
  uint64_t peak_pending_free_bytes;
  uint64_t pending_blocks;       /* blocks held so now */
  uint64_t deferred_frees;       /* frees deferred so far (stream-ordered frees) */
  uint64_t marked_uses;          /* xema_mark_used calls on live blocks */
} xema_stats;

/* The device's last out-of-memory: an allocation that the static region, the dynamic region and
 * the driver (cudaMalloc / host memory, within the device's limit) all refused. All uint64. */
typedef struct xema_oom {
  uint64_t events;                    /* allocations refused so far on this device */
  uint64_t requested_bytes;           /* bytes the last refused allocation asked for */
  uint64_t rounded_bytes;             /* the same, rounded up to 512 */
  uint64_t stream;                    /* its stream */
  uint64_t static_free_bytes;         /* static region bytes not held by a live block then */
  uint64_t static_region_bytes;
  uint64_t dynamic_free_bytes;        /* dynamic region bytes free then (any stream) */
  uint64_t dynamic_largest_free_bytes;/* the largest free dynamic block then */
  uint64_t dynamic_region_bytes;
  uint64_t reserved_bytes;            /* arena + driver blocks held then */
  uint64_t limit_bytes;               /* the device's limit then (0: none, the driver decides) */
  uint64_t armed;                     /* 1 if a plan was armed */
  uint64_t plan_cursor;               /* planned-stream allocations seen since arming */
} xema_oom;

/* One recorded allocator event (xema_record_*), for turning a real run into a MemoryTrace. */
typedef struct xema_event {
  uint64_t ptr;
  uint64_t size;      /* rounded up to 512 */
  uint64_t requested; /* bytes asked for */
  uint64_t stream;
  uint64_t kind;      /* 0 = alloc, 1 = free */
  uint64_t region;    /* enum xema_region */
} xema_event;

/* torch/csrc/cuda/CUDAPluggableAllocator.h: alloc_fn is void*(size_t, int, cudaStream_t) and
 * free_fn is void(void*, size_t, int, cudaStream_t). A zero-byte request returns NULL and
 * consumes no plan index (the tracer records no allocation for it either). */
XEMA_API void* xema_malloc(size_t size, int device, xema_stream_t stream);
XEMA_API void xema_free(void* ptr, size_t size, int device, xema_stream_t stream);

/* Stream-ordered frees (what Tensor.record_stream does for the caching allocator, which the
 * pluggable-allocator API never forwards): `stream` uses the live block that starts at `ptr`
 * (a tensor's storage). When torch frees that block, it stays out of reuse until every such
 * stream has passed an event recorded at the free; allocations (and xema_poll) return the blocks
 * whose streams have. Their bytes are pending_free_bytes (they count in active_bytes: the memory
 * is still taken). XEMA_E_INVALID when no live block starts at `ptr`. */
XEMA_API int xema_mark_used(int device, void* ptr, xema_stream_t stream);
/* `waiter` waited on an event recorded on `other` after all the work issued there so far: the
 * pending blocks allocated on `waiter` stop waiting for `other` (their next tenant, on `waiter`,
 * runs after that work). What lets a static plan reuse an offset as soon as compute is ordered
 * after the copy that read it, not only once the copy is known to have finished. */
XEMA_API int xema_stream_ordered(int device, xema_stream_t waiter, xema_stream_t other);
/* Returns the pending blocks whose streams have moved on; the number returned, or a status. */
XEMA_API int xema_poll(int device);
/* Host backend only: the CPU emulation of streams reports how much work it issued on `stream`
 * and how much of it ran, which is what the host backend's events are measured against. */
XEMA_API int xema_host_stream_progress(xema_stream_t stream, uint64_t issued, uint64_t completed);
/* What torch's CUDAPluggableAllocator is given as its alloc_fn: xema_malloc, except that a refused
 * allocation throws a std::runtime_error (the message of xema_last_error) instead of returning
 * NULL. torch wraps alloc_fn's pointer unchecked (CUDAPluggableAllocator::malloc/allocate), so a
 * NULL would reach the first kernel as an illegal address and lose the CUDA context; an exception
 * thrown from alloc_fn unwinds through torch's C++ (which calls it through std::function) and
 * its Python bindings raise it as a RuntimeError: one batch fails, the process lives. This is the
 * one entry point that throws; it is only for a C++ caller that catches (never ctypes). */
XEMA_API void* xema_torch_malloc(size_t size, int device, xema_stream_t stream);

XEMA_API int xema_abi_version(void);
XEMA_API const char* xema_last_error(void);

/* Selects where memory comes from. cudart_path may be NULL (search the loaded / usual sonames).
 * Switching backends is refused while any device holds memory. */
XEMA_API int xema_init(int backend, const char* cudart_path);

/* Allocates the device's arena: a static region and a dynamic region, two backend allocations
 * (either may be 0 bytes, not both). */
XEMA_API int xema_reserve(int device, uint64_t static_bytes, uint64_t dynamic_bytes);
/* Returns the arena to the backend; refused while a block in it is live. */
XEMA_API int xema_release(int device);
/* Replaces the static region by one of static_bytes (0: none), freeing the old one first; the
 * dynamic region and its live blocks are untouched. Refused (XEMA_E_STATE) without an arena,
 * while a static block is live or while a plan is armed. XEMA_E_NOMEM: the backend refused the
 * new size; the region is back at its old size (or 0 bytes if even that failed: see the error). */
XEMA_API int xema_resize_static(int device, uint64_t static_bytes);

/* Copies a plan (per planned allocation, in allocation order: rounded size and static offset) and
 * returns its id (>= 0) or a negative status. */
XEMA_API int64_t xema_load_plan(int device, const uint64_t* sizes, const uint64_t* offsets,
                                uint64_t n);
XEMA_API int xema_unload_plan(int device, int64_t plan_id);
/* Allocations on `stream` follow the plan from index 0; others go to the dynamic region. */
XEMA_API int xema_arm(int device, int64_t plan_id, xema_stream_t stream);
XEMA_API int xema_disarm(int device);

XEMA_API int xema_get_stats(int device, xema_stats* out, uint64_t out_size);
/* The device's out-of-memory record (see xema_oom); events == 0: none so far. */
XEMA_API int xema_get_oom(int device, xema_oom* out, uint64_t out_size);
/* Caps what the backend may hold for the device (arena regions + driver blocks), as the device's
 * memory would: a driver fallback, reserve or static resize beyond it is refused (0: no cap; the
 * driver alone decides). The host backend's way to be a device of a given size; on CUDA, a
 * smaller budget than the GPU has. */
XEMA_API int xema_set_limit(int device, uint64_t limit_bytes);
XEMA_API int xema_reset_peaks(int device);

XEMA_API int xema_record_start(int device);
XEMA_API int xema_record_stop(int device);
/* Copies up to `capacity` recorded events (from the start) into `out`; returns how many were
 * recorded in total, or a negative status. */
XEMA_API int64_t xema_record_read(int device, xema_event* out, uint64_t capacity);

#ifdef __cplusplus
}
#endif

#endif /* XEMA_ALLOC_H_ */
