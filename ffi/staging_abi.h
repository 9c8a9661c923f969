// The C ABI between fthsdp's host control plane (compiled into fthsdp._ffi)
// and its CUDA handler library (fthsdp_cuda, dlopened only on a GPU host).
//
// The GPU path of FTAR is host-staged (FT-HSDP paper, section 4.2: the GPU
// moves the data, the CPU control thread drives the ring). Per GPU stream
// there is one staging queue: a host-pinned control block of flags plus a
// host-pinned data buffer. For one all-reduce the stream
//   1. copies the five int32 quorum scalars into `args` and raises
//      `args_ready` (so the quorum reaches the control plane without any
//      host thread reading device memory),
//   2. copies the gradient block by block into the data buffer, raising
//      `ready[b]` after each block,
//   3. waits (a tiny spin kernel on pinned memory) until `done[b]` is raised,
//      copies block b back into the output, and finally copies
//      `status[seq & 1]` into the status output.
// Beside them, forked onto a side stream after step 1, one reduce worker
// kernel (2 thread blocks) runs the op's reduce jobs: the control thread
// receives a reduce-scatter chunk into a pinned receive slot, writes a job
// into the ring `jobs` and raises its key; the worker computes
// out = input + slot (the CUDA reduce kernel's loop, on the device, in the
// CPU FTAR's order of additions) into the staging buffer, from where the
// control thread sends it on, and raises `consumed`. The worker does not know
// how many jobs come (that depends on the ring size, which lives on the
// device); it ends when the host raises `reduce_stop` to the op's seq, which
// it does once every job is consumed, or at once on failure, abort or
// deadline.
// The host side (ffi/staging.cc) reads the args, runs the ring over the
// staged bytes as soon as the blocks it needs are ready, and raises `done`
// block by block; on failure, abort or deadline it raises `reduce_stop` and
// every remaining `done` at once with status RECOVERABLE (or FATAL), so a
// waiting stream is always released. Flags carry the op's sequence number
// (never reset), so a stale flag of an earlier op can never satisfy a later
// wait. Every device-side wait also has a backstop (FTHSDP_DEVICE_BACKSTOP_S,
// a bug guard: the host always releases it long before).
//
// C only: both sides may be built by different compilers.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FTHSDP_STAGING_ABI 2
#define FTHSDP_MAX_BLOCKS 64
// Copy blocks are at least this large (fewer flags and kernel launches).
#define FTHSDP_MIN_BLOCK_BYTES (4 << 20)

// Entries of the job ring (job j in jobs[j % FTHSDP_REDUCE_SLOTS]) and the
// most receive slots a queue uses (min(this, 2 x chunks in flight)): jobs in
// flight never outnumber slots, so the job ring never overflows.
#define FTHSDP_REDUCE_SLOTS 16
// Thread blocks of the reduce worker (the paper used 2).
#define FTHSDP_REDUCE_BLOCKS 2
// Device-side waits give up after this long (then FATAL): a bug guard only.
#define FTHSDP_DEVICE_BACKSTOP_S 7200

// Status values written to the device (FTAR's status output).
#define FTHSDP_STATUS_OK 0
#define FTHSDP_STATUS_RECOVERABLE 1
#define FTHSDP_STATUS_FATAL 2

enum { kFthsdpArgComm = 0, kFthsdpArgShard, kFthsdpArgQuorumId, kFthsdpArgRank, kFthsdpArgNumMembers,
       kFthsdpNumArgs };

// One reduce job: out[i] = a[i] + b[i] for i < count (device addresses; b and
// out are host-pinned, device-mapped). Written by the host, then `key` raised.
typedef struct FthsdpReduceJob {
  volatile uint64_t key;  // (seq << 32) | (job index + 1) once the fields hold that job
  uint64_t a;             // the local operand: the op's input on the device
  uint64_t b;             // the received chunk (a pinned receive slot)
  uint64_t out;           // the sum (the pinned staging buffer, sent on by the host)
  int64_t count;          // elements
  int32_t dtype;          // fthsdp::DType
  int32_t pad;
} FthsdpReduceJob;

// Host-pinned, device-visible. Each field has exactly one writer.
typedef struct FthsdpStagingControl {
  volatile uint32_t args_ready;                 // stream: seq once args hold op seq's scalars
  volatile int32_t args[kFthsdpNumArgs];        // stream
  volatile uint32_t ready[FTHSDP_MAX_BLOCKS];   // stream: seq once block b's input is staged
  volatile uint32_t done[FTHSDP_MAX_BLOCKS];    // host: seq once block b's output is staged (or released)
  volatile int32_t status[2];                   // host: op seq's status at [seq & 1], before its last done
  FthsdpReduceJob jobs[FTHSDP_REDUCE_SLOTS];    // host: job j of the op in jobs[j % FTHSDP_REDUCE_SLOTS]
  volatile uint64_t consumed[FTHSDP_REDUCE_SLOTS][FTHSDP_REDUCE_BLOCKS];  // worker block: job key once summed
  volatile uint32_t reduce_stop;                // host: seq once op seq's worker must end
  volatile uint32_t device_timeout;             // device: seq when a wait of op seq hit the backstop
} FthsdpStagingControl;

// One copy block: a contiguous piece of one gradient bucket in the data buffer.
typedef struct FthsdpStagedBlock {
  int32_t bucket;   // which bucket (buffer) of the op
  int32_t dtype;    // fthsdp::DType
  int64_t offset;   // first element of the block inside its bucket
  int64_t count;    // elements
} FthsdpStagedBlock;

typedef struct FthsdpStagedOp {
  uint32_t seq;
  int32_t num_blocks;
  int32_t num_buckets;
  void* bucket_host[FTHSDP_MAX_BLOCKS];  // staged bytes of bucket i (in the data buffer)
  uint64_t bucket_device_in[FTHSDP_MAX_BLOCKS];  // device address of bucket i's input
  FthsdpStagedBlock blocks[FTHSDP_MAX_BLOCKS];  // bucket by bucket, in order, covering each bucket
} FthsdpStagedOp;

// Host memory for a queue (pinned and device-mapped on the GPU; plain on CPU tests).
typedef struct FthsdpAllocator {
  void* (*alloc)(size_t bytes, void* user);  // zero-filled memory or NULL
  void (*release)(void* p, void* user);
  // Releases the queue's device state (see FthsdpHostApi::device_state); may be NULL.
  void (*release_device)(void* state, void* user);
  void* user;
} FthsdpAllocator;

typedef struct FthsdpHostApi {
  uint32_t abi;  // FTHSDP_STAGING_ABI
  // The queue of `key` (one per GPU stream), created on first use with `alloc`
  // (which must stay valid for the process). NULL with err set on failure.
  void* (*queue)(uint64_t key, const FthsdpAllocator* alloc, char* err, size_t err_len);
  FthsdpStagingControl* (*control)(void* queue);
  // A data buffer of at least `bytes` for the next op. Grows by reallocation;
  // earlier buffers stay valid (ops queued before may still use them).
  void* (*reserve)(void* queue, size_t bytes, char* err, size_t err_len);
  // The sequence number the next submitted op must carry.
  uint32_t (*next_seq)(void* queue);
  // Queues `op` (copied). Returns 0, or 1 with err set when an earlier op of
  // this queue failed FATALLY (reported once, here: the handler raises it).
  int (*submit)(void* queue, const FthsdpStagedOp* op, char* err, size_t err_len);
  // The queue's device state slot (the CUDA library keeps its side stream
  // and events there; the queue releases it with alloc->release_device).
  void** (*device_state)(void* queue);
  // Copy-block plan of buckets of counts[i] elements of dtypes[i]: at most
  // FTHSDP_MAX_BLOCKS blocks, none smaller than min_block_bytes unless its
  // bucket is. Returns the number of blocks written to `out` (>= 1 per
  // non-empty bucket), or -1 when there are more buckets than blocks.
  int32_t (*plan)(int32_t num_buckets, const int64_t* counts, const int32_t* dtypes,
                  int64_t min_block_bytes, FthsdpStagedBlock* out);
} FthsdpHostApi;

#ifdef __cplusplus
}  // extern "C"
#endif
