// Lowering of the current batch into per-instance int32 routing tables (layout: control_plane/lowering.py).
// Block tables are incremental: a shard lists only its frames past `emitted` (those no table of its instance has
// listed yet), so the cost of a table follows the requests and the new pages, not the KV held.
#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "scheduler.h"

namespace nanocp::sched {
namespace {

constexpr int32_t kMagic = 0x4E435031;  // "NCP1"
constexpr int32_t kVersion = 2;
constexpr size_t kHeaderInts = 16;
constexpr size_t kMaxBlocksSlot = 15;
constexpr size_t kPoolSize = 4;  // output buffers kept for reuse

// One 4-int row: a single 16-byte store where SSE2 exists (the lowering is bound by stores, one per cycle).
inline void store_row(int32_t* at, int32_t a, int32_t b, int32_t c, int32_t d) {
#if defined(__SSE2__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(at), _mm_setr_epi32(a, b, c, d));
#else
  at[0] = a;
  at[1] = b;
  at[2] = c;
  at[3] = d;
#endif
}

}  // namespace

// Row counts per section follow from the incremental per-instance counters: every MoE row is a request bound here,
// every shard row a shard held here, every update a frame not yet listed here (all used frames for a snapshot);
// q_recv/res_send = shards held here for a request bound elsewhere; q_send/res_recv = remote shards of the requests
// bound here.
struct SchedulerCore::Cursor {
  int32_t* header = nullptr;    // [16]
  int32_t* moe = nullptr;       // [n_moe, 4]
  int32_t* shards = nullptr;    // [n_shards, 4]
  int32_t* updates = nullptr;   // [n_updates, 3]
  int32_t* q_send = nullptr;    // [n_q_send, 3]
  int32_t* q_recv = nullptr;    // [n_q_recv, 2]
  int32_t* res_send = nullptr;  // [n_res_send, 3]
  int32_t* res_recv = nullptr;  // [n_res_recv, 2]
  int32_t n_moe = 0, n_shards = 0, n_updates = 0, n_remote_in = 0, n_remote_out = 0, max_blocks = 0;
};

int64_t SchedulerCore::table_updates(int i, bool full) const {
  return full ? shape_.frames_per_instance - pages_.free_frames(i) : pending_updates_[i];
}

size_t SchedulerCore::table_size(int i, bool full) const {
  const int64_t moe = moe_batch_[i], shards = num_shards_[i], updates = table_updates(i, full);
  const int64_t remote_in = shards - moe, remote_out = remote_out_[i];
  return kHeaderInts + 4 * moe + 4 * shards + 3 * updates + 5 * remote_out + 5 * remote_in;
}

std::shared_ptr<TableBuffer> SchedulerCore::pooled_buffer(size_t size) {
  std::shared_ptr<TableBuffer> buf;
  for (auto& cand : pool_)  // free = only the pool holds it (Python dropped every array viewing it)
    if (cand.use_count() == 1 && (!buf || cand->capacity > buf->capacity)) buf = cand;
  if (!buf) {
    buf = std::make_shared<TableBuffer>();
    if (pool_.size() < kPoolSize) pool_.push_back(buf);
  }
  if (buf->capacity < size) {
    buf->capacity = std::max(size, buf->capacity + buf->capacity / 2);
    buf->data.reset(new int32_t[buf->capacity]);
  }
  return buf;
}

// Write instance i's header at `base` (max_blocks follows after the pass) and point its cursor at the sections.
void SchedulerCore::start_table(int i, int32_t* base, size_t total, bool full, Cursor& c) const {
  const int64_t moe = moe_batch_[i], shards = num_shards_[i], updates = table_updates(i, full);
  const int64_t remote_out = remote_out_[i], remote_in = shards - moe;
  const int32_t base_seq = full ? -1 : int32_t(lowered_seq_[i]);
  const int32_t header[kHeaderInts] = {kMagic,          kVersion,          int32_t(i),          int32_t(iteration_),
                                       int32_t(moe),    int32_t(shards),   int32_t(updates),    int32_t(remote_out),
                                       int32_t(remote_in), int32_t(remote_in), int32_t(remote_out), int32_t(total),
                                       int32_t(num_steps_), base_seq,       int32_t(full),       0};
  std::memcpy(base, header, sizeof(header));
  c.header = base;
  c.moe = base + kHeaderInts;
  c.shards = c.moe + 4 * moe;
  c.updates = c.shards + 4 * shards;
  c.q_send = c.updates + 3 * updates;
  c.q_recv = c.q_send + 3 * remote_out;
  c.res_send = c.q_recv + 2 * remote_in;
  c.res_recv = c.res_send + 3 * remote_in;
}

// One pass over the batch (lowering.py lower_reference). kAll: write every instance; else only `only`, while still
// counting rows everywhere (receive rows are numbered across instances). kFull: list every frame of every shard.
// A request whose record says it has one shard with every frame listed is lowered from its record alone.
template <bool kAll, bool kFull>
void SchedulerCore::write_tables(std::vector<Cursor>& cur, int only) {
  Cursor* const cursors = cur.data();
  const size_t n = running_.size();
  const int32_t* const run = running_.data();
  const BatchRec* const recs = rec_.data();
  const int64_t clock = growth_clock_;
  const int32_t grow_iter = int32_t(grow_iter_), grow_steps = grow_steps_;
  // A single shard's tokens fit int32 unless one instance holds more than that: then every row is checked.
  const bool check_tokens = int64_t(shape_.frames_per_instance) * shape_.page_size > INT32_MAX;
  int32_t g = 0;  // batch index: holes do not count
  size_t k = 0;
  while (k < n) {
    // A run of records lowered from the record alone: no call inside keeps the loop's values in registers.
    for (; k < n && (!kFull && recs[k].lower_fast); ++k) {
      const BatchRec& b = recs[k];
      Cursor& c = cursors[b.moe];
      const int32_t moe_row = c.n_moe++, shard_idx = c.n_shards++;
      if (!kAll && b.moe != only) {
        ++g;
        continue;
      }
      const int64_t tokens64 = b.tokens_off + clock;
      if (check_tokens && tokens64 > INT32_MAX)
        throw std::overflow_error("context length does not fit the int32 routing table");
      const int32_t tokens = int32_t(tokens64), window = b.window_at == grow_iter ? b.window : grow_steps;
      // [g, position, shard index, window] and [g, source (-1: local), tokens, slot]
      store_row(c.moe + 4 * size_t(moe_row), g, tokens - window, shard_idx, window);
      store_row(c.shards + 4 * size_t(shard_idx), g++, -1, tokens, b.slot);
      c.max_blocks = std::max(c.max_blocks, b.blocks);
    }
    if (k == n) break;
    if (run[k] >= 0) write_request<kAll, kFull>(k, g++, cursors, only);  // several shards, frames to list
    ++k;  // (a hole: skipped)
  }
}

// The rows of batch entry k (batch index g) from the request itself (several shards, frames to list, no slot in the
// record yet); the frames it lists are marked as listed and its record is refreshed.
template <bool kAll, bool kFull>
void SchedulerCore::write_request(size_t k, int32_t g, Cursor* cursors, int only) {
  sync(k);
  Request& r = reqs_[running_[k]];
  const int64_t context_len = r.context_len();
  if (context_len > INT32_MAX) throw std::overflow_error("context length does not fit the int32 routing table");
  const int m = r.moe;
  Cursor& cm = cursors[m];
  const bool write_m = kAll || m == only;
  const int32_t moe_row = cm.n_moe++;
  int32_t moe_entry[4] = {g, int32_t(context_len - r.window), -1, r.window};
  for (int32_t j = 0; j < r.nshards; ++j) {
    Shard& s = r.shard(j);
    const int inst = s.instance;
    Cursor& ct = cursors[inst];
    const bool write_t = kAll || inst == only;
    const int32_t shard_idx = ct.n_shards++;
    int32_t source = -1;
    if (inst == m) {
      moe_entry[2] = shard_idx;
    } else {
      source = ct.n_remote_in++;
      const int32_t res_row = cm.n_remote_out++;
      if (write_t) {
        const int32_t q_recv[2] = {m, shard_idx}, res_send[3] = {shard_idx, m, res_row};
        std::memcpy(ct.q_recv + 2 * size_t(source), q_recv, sizeof(q_recv));
        std::memcpy(ct.res_send + 3 * size_t(source), res_send, sizeof(res_send));
      }
      if (write_m) {
        const int32_t q_send[3] = {moe_row, inst, source}, res_recv[2] = {inst, moe_row};
        std::memcpy(cm.q_send + 3 * size_t(res_row), q_send, sizeof(q_send));
        std::memcpy(cm.res_recv + 2 * size_t(res_row), res_recv, sizeof(res_recv));
      }
    }
    if (!write_t) continue;
    const int32_t row[4] = {g, source, int32_t(s.tokens), s.slot};
    std::memcpy(ct.shards + 4 * size_t(shard_idx), row, sizeof(row));
    const int32_t n_frames = s.frames.size(), first = kFull ? 0 : s.emitted, slot = s.slot;
    const int32_t* frames = s.frames.data();  // locals: the stores below may alias the shard for the compiler
    int32_t* update = ct.updates + 3 * size_t(ct.n_updates);
    for (int32_t b = first; b < n_frames; ++b, update += 3) {
      update[0] = slot;
      update[1] = b;
      update[2] = frames[b];
    }
    ct.n_updates += n_frames - first;
    s.emitted = n_frames;
    if (n_frames > ct.max_blocks) ct.max_blocks = n_frames;
  }
  if (write_m) std::memcpy(cm.moe + 4 * size_t(moe_row), moe_entry, sizeof(moe_entry));
  rec_[k] = make_rec(r);
}

// After the pass: every written table gets its longest shard's block count, and its instance's store state moves
// to this iteration (nothing left to list).
void SchedulerCore::finish_tables(std::vector<Cursor>& cur, int only) {
  for (int i = 0; i < shape_.num_instances; ++i) {
    if (only >= 0 && i != only) continue;
    Cursor& c = cur[i];
    if (c.n_updates != c.header[6]) throw InvariantError("lowering listed a different number of block updates");
    c.header[kMaxBlocksSlot] = c.max_blocks;
    lowered_seq_[i] = iteration_;
    pending_updates_[i] = 0;
  }
}

std::shared_ptr<TableBuffer> SchedulerCore::lower_all(std::vector<size_t>& offsets, bool full) {
  const auto t0 = std::chrono::steady_clock::now();
  compact_running();
  const int n = shape_.num_instances;
  offsets.resize(n + 1);
  offsets[0] = 0;
  for (int i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + table_size(i, full);
  auto buf = pooled_buffer(offsets[n]);
  std::vector<Cursor> cur(n);
  for (int i = 0; i < n; ++i) start_table(i, buf->data.get() + offsets[i], offsets[i + 1] - offsets[i], full, cur[i]);
  if (full)
    write_tables<true, true>(cur, -1);
  else
    write_tables<true, false>(cur, -1);
  finish_tables(cur, -1);
  last_lower_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return buf;
}

std::shared_ptr<TableBuffer> SchedulerCore::lower(int instance, size_t& size, bool full) {
  if (instance < 0 || instance >= shape_.num_instances)
    throw std::out_of_range("instance " + std::to_string(instance) + " out of range [0, " +
                            std::to_string(shape_.num_instances) + ")");
  const auto t0 = std::chrono::steady_clock::now();
  compact_running();
  size = table_size(instance, full);
  auto buf = std::make_shared<TableBuffer>();  // not pooled: a single table is small and callers may keep it
  buf->capacity = size;
  buf->data.reset(new int32_t[size]);
  // Every other instance gets a null cursor base: its rows are counted, never written.
  std::vector<Cursor> cur(shape_.num_instances);
  start_table(instance, buf->data.get(), size, full, cur[instance]);
  if (full)
    write_tables<false, true>(cur, instance);
  else
    write_tables<false, false>(cur, instance);
  finish_tables(cur, instance);
  last_lower_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return buf;
}

}  // namespace nanocp::sched
