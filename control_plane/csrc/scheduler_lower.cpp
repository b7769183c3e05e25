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

// Four int32 lanes (wrapping adds): one 16-byte register and store where SSE2 exists (the lowering is bound by
// stores and instructions).
#if defined(__SSE2__)
using Lanes = __m128i;
inline Lanes lanes(int32_t a, int32_t b, int32_t c, int32_t d) { return _mm_setr_epi32(a, b, c, d); }
inline Lanes load_lanes(const int32_t* at) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)); }
inline Lanes add_lanes(Lanes x, Lanes y) { return _mm_add_epi32(x, y); }
inline void store_lanes(int32_t* at, Lanes x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(at), x); }
inline int32_t lane0(Lanes x) { return _mm_cvtsi128_si32(x); }
#else
struct Lanes {
  uint32_t v[4];
};
inline Lanes lanes(int32_t a, int32_t b, int32_t c, int32_t d) { return {{uint32_t(a), uint32_t(b), uint32_t(c), uint32_t(d)}}; }
inline Lanes load_lanes(const int32_t* at) {
  Lanes x;
  std::memcpy(x.v, at, sizeof(x.v));
  return x;
}
inline Lanes add_lanes(Lanes x, Lanes y) { return {{x.v[0] + y.v[0], x.v[1] + y.v[1], x.v[2] + y.v[2], x.v[3] + y.v[3]}}; }
inline void store_lanes(int32_t* at, Lanes x) { std::memcpy(at, x.v, sizeof(x.v)); }
inline int32_t lane0(Lanes x) { return int32_t(x.v[0]); }
#endif

// One 4-int row.
inline void store_row(int32_t* at, int32_t a, int32_t b, int32_t c, int32_t d) { store_lanes(at, lanes(a, b, c, d)); }

}  // namespace

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

// Write instance i's header at `base` (max_blocks follows after the pass) and point its cursors at the sections.
void SchedulerCore::start_table(int i, int32_t* base, size_t total, bool full, Cursors& c) const {
  const int64_t moe = moe_batch_[i], shards = num_shards_[i], updates = table_updates(i, full);
  const int64_t remote_out = remote_out_[i], remote_in = shards - moe;
  const int32_t base_seq = full ? -1 : int32_t(lowered_seq_[i]);
  const int32_t header[kHeaderInts] = {kMagic,          kVersion,          int32_t(i),          int32_t(iteration_),
                                       int32_t(moe),    int32_t(shards),   int32_t(updates),    int32_t(remote_out),
                                       int32_t(remote_in), int32_t(remote_in), int32_t(remote_out), int32_t(total),
                                       int32_t(num_steps_), base_seq,       int32_t(full),       0};
  std::memcpy(base, header, sizeof(header));
  c.header[i] = base;
  c.moe[i] = base + kHeaderInts;
  c.shards[i] = c.moe[i] + 4 * moe;
  c.updates[i] = c.shards[i] + 4 * shards;
  c.q_send[i] = c.updates[i] + 3 * updates;
  c.q_recv[i] = c.q_send[i] + 3 * remote_out;
  c.res_send[i] = c.q_recv[i] + 2 * remote_in;
  c.res_recv[i] = c.res_send[i] + 3 * remote_in;
}

// The run of single-shard records (every frame listed, every slot known) and holes from batch entry k on, lowered
// from the records alone: each row is its record's template plus a vector of the pass's values (batch index g, the
// clock, the shard row index). Returns the first entry past the run; g moves past it. Inlined, and no call inside:
// the loop's values stay in registers.
template <bool kAll>
__attribute__((always_inline)) inline size_t SchedulerCore::write_singles(size_t k, int32_t& g, Cursors& c, int only) {
  const size_t n = running_.size();
  const BatchRec* const recs = rec_.data();
  const int32_t clock = int32_t(uint32_t(uint64_t(growth_clock_)));  // low 32 bits (the lanes wrap)
  const int32_t grow_iter = int32_t(grow_iter_), grow_steps = grow_steps_;
  int32_t* const* const moe_at = c.moe.data();
  int32_t* const* const shards_at = c.shards.data();
  uint64_t* const rows = reinterpret_cast<uint64_t*>(c.rows.data());  // per instance: MoE rows | shard rows << 32
  int32_t* const max_blocks = c.max_blocks.data();
  const Lanes one_g = lanes(1, 0, 0, 0);
  // lane 0 of shard_row holds kLowerSingle (1): the shard row adds g - 1 there
  Lanes shard_add = lanes(g - kLowerSingle, 0, clock, 0), moe_add = lanes(g, clock, 0, 0);
  for (; k < n; ++k) {
    const BatchRec& b = recs[k];
    if (b.lower_fast() != kLowerSingle) {
      if (b.lower_fast() == kLowerHole) continue;
      break;
    }
    const int m = b.moe;
    const uint64_t at = rows[m];
    rows[m] = at + (uint64_t(1) << 32 | 1);
    if (!kAll && m != only) {
      shard_add = add_lanes(shard_add, one_g);
      moe_add = add_lanes(moe_add, one_g);
      continue;
    }
    if (wide_tokens_ && b.tokens_off() + growth_clock_ > INT32_MAX)
      throw std::overflow_error("context length does not fit the int32 routing table");
    const uint32_t moe_rows = uint32_t(at), shard_rows = uint32_t(at >> 32);
    const Lanes shard_row = add_lanes(load_lanes(b.shard_row), shard_add);
    Lanes moe_row = add_lanes(add_lanes(load_lanes(b.moe_row), moe_add), lanes(0, 0, int32_t(shard_rows), 0));
    if (b.moe_row[3] != grow_steps && b.window_at != grow_iter) {  // a stale window: this iteration's is num_steps
      const int32_t w = b.moe_row[3];
      moe_row = add_lanes(moe_row, lanes(0, w - grow_steps, 0, grow_steps - w));
    }
    // [g, position, shard index, window] and [g, source (-1: local), tokens, slot]
    store_lanes(moe_at[m] + 4 * size_t(moe_rows), moe_row);
    store_lanes(shards_at[m] + 4 * size_t(shard_rows), shard_row);
    shard_add = add_lanes(shard_add, one_g);
    moe_add = add_lanes(moe_add, one_g);
    if (b.blocks > max_blocks[m]) max_blocks[m] = b.blocks;  // rarely taken: a store only when the max grows
  }
  g = lane0(moe_add);
  return k;
}

// One pass over the batch (lowering.py lower_reference). kAll: write every instance; else only `only`, while still
// counting rows everywhere (receive rows are numbered across instances). kFull: list every frame of every shard.
// A request whose record says every frame is listed is lowered from its record alone (one shard) or from its record
// and its dense MultiRec (several shards: multi_ is in batch order, so a cursor walks it alongside the batch).
template <bool kAll, bool kFull>
void SchedulerCore::write_tables(Cursors& c, int only) {
  const size_t n = running_.size();
  const int32_t* const run = running_.data();
  const BatchRec* const recs = rec_.data();
  const MultiRec* multi = multi_.data();
  int32_t g = 0;  // batch index: holes do not count
  size_t k = 0;
  while (k < n) {
    if (!kFull) k = write_singles<kAll>(k, g, c, only);  // (a run of single-shard records)
    if (k == n) break;
    if (!kFull && recs[k].lower_fast() == kLowerMulti) {
      while (multi->slot != run[k]) ++multi;  // multi-shard requests whose frames are listed below are skipped
      write_multi<kAll>(recs[k], *multi++, g++, c, only);
    } else if (run[k] >= 0) {
      write_request<kAll, kFull>(k, g++, c, only);  // frames to list, or no slot yet
    }
    ++k;  // (a hole, in a full pass: skipped)
  }
}

// The shard row of a shard on `inst` of the request at batch index g bound at m (MoE row moe_row), and its query and
// result rows when the shard is remote. Returns the shard's row index on inst. Inlined: a call per shard spills the
// caller's registers (stores, which bound the lowering).
template <bool kAll>
__attribute__((always_inline)) inline int32_t SchedulerCore::write_shard(Cursors& c, int m, int32_t moe_row, int inst,
                                                                         int32_t g, int32_t tokens, int32_t slot,
                                                                         int only) {
  const bool write_t = kAll || inst == only;
  const int32_t shard_idx = c.rows[inst].shards++;
  int32_t source = -1;
  if (inst != m) {
    source = c.n_remote_in[inst]++;
    const int32_t res_row = c.n_remote_out[m]++;
    if (write_t) {
      const int32_t q_recv[2] = {m, shard_idx}, res_send[3] = {shard_idx, m, res_row};
      std::memcpy(c.q_recv[inst] + 2 * size_t(source), q_recv, sizeof(q_recv));
      std::memcpy(c.res_send[inst] + 3 * size_t(source), res_send, sizeof(res_send));
    }
    if (kAll || m == only) {
      const int32_t q_send[3] = {moe_row, inst, source}, res_recv[2] = {inst, moe_row};
      std::memcpy(c.q_send[m] + 3 * size_t(res_row), q_send, sizeof(q_send));
      std::memcpy(c.res_recv[m] + 2 * size_t(res_row), res_recv, sizeof(res_recv));
    }
  }
  if (write_t) store_row(c.shards[inst] + 4 * size_t(shard_idx), g, source, tokens, slot);
  return shard_idx;
}

// A multi-shard request with every frame listed: its rows from its record (the tail shard) and its MultiRec.
template <bool kAll>
void SchedulerCore::write_multi(const BatchRec& b, const MultiRec& e, int32_t g, Cursors& c, int only) {
  const int64_t tail_tokens = b.tokens_off() + growth_clock_, context_len = e.other_tokens + tail_tokens;
  if (context_len > INT32_MAX) throw std::overflow_error("context length does not fit the int32 routing table");
  const int32_t window = rec_window(b);
  const int m = b.moe;
  const int32_t moe_row = c.rows[m].moe++;
  int32_t local = -1;
  for (int32_t j = 0; j < e.nshards; ++j) {
    const MultiShard& s = e.shards[j];
    const bool tail = j == e.moe_shard;
    const int32_t idx = write_shard<kAll>(c, m, moe_row, s.instance, g, tail ? int32_t(tail_tokens) : s.tokens, s.slot,
                                          only);
    if (s.instance == m) local = idx;
    const int32_t frames = tail ? b.blocks : s.frames;
    if ((kAll || s.instance == only) && frames > c.max_blocks[s.instance]) c.max_blocks[s.instance] = frames;
  }
  if (kAll || m == only)
    store_row(c.moe[m] + 4 * size_t(moe_row), g, int32_t(context_len - window), local, window);
}

// The rows of batch entry k (batch index g) from the request itself (frames to list, or a shard without a slot yet);
// the frames it lists are marked as listed and its record is refreshed.
template <bool kAll, bool kFull>
void SchedulerCore::write_request(size_t k, int32_t g, Cursors& c, int only) {
  sync(k);
  Request& r = reqs_[running_[k]];
  const int64_t context_len = r.context_len();
  if (context_len > INT32_MAX) throw std::overflow_error("context length does not fit the int32 routing table");
  const int m = r.moe;
  const int32_t moe_row = c.rows[m].moe++;
  int32_t local = -1;
  for (int32_t j = 0; j < r.nshards; ++j) {
    Shard& s = r.shard(j);
    const int inst = s.instance;
    const int32_t idx = write_shard<kAll>(c, m, moe_row, inst, g, int32_t(s.tokens), s.slot, only);
    if (inst == m) local = idx;
    if (!kAll && inst != only) continue;
    const int32_t n_frames = s.frames.size(), first = kFull ? 0 : s.emitted, slot = s.slot;
    const int32_t* frames = s.frames.data();  // locals: the stores below may alias the shard for the compiler
    int32_t* update = c.updates[inst] + 3 * size_t(c.n_updates[inst]);
    for (int32_t b = first; b < n_frames; ++b, update += 3) {
      update[0] = slot;
      update[1] = b;
      update[2] = frames[b];
    }
    c.n_updates[inst] += n_frames - first;
    s.emitted = n_frames;
    if (n_frames > c.max_blocks[inst]) c.max_blocks[inst] = n_frames;
  }
  if (kAll || m == only) store_row(c.moe[m] + 4 * size_t(moe_row), g, int32_t(context_len - r.window), local, r.window);
  refresh_rec(k);
}

// After the pass: every written table gets its longest shard's block count, and its instance's store state moves
// to this iteration (nothing left to list).
void SchedulerCore::finish_tables(Cursors& c, int only) {
  for (int i = 0; i < shape_.num_instances; ++i) {
    if (only >= 0 && i != only) continue;
    if (c.n_updates[i] != c.header[i][6]) throw InvariantError("lowering listed a different number of block updates");
    c.header[i][kMaxBlocksSlot] = c.max_blocks[i];
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
  Cursors& c = cursors_;
  c.reset(n);
  for (int i = 0; i < n; ++i) start_table(i, buf->data.get() + offsets[i], offsets[i + 1] - offsets[i], full, c);
  if (full)
    write_tables<true, true>(c, -1);
  else
    write_tables<true, false>(c, -1);
  finish_tables(c, -1);
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
  // Every other instance keeps null section pointers: its rows are counted, never written.
  Cursors& c = cursors_;
  c.reset(shape_.num_instances);
  start_table(instance, buf->data.get(), size, full, c);
  if (full)
    write_tables<false, true>(c, instance);
  else
    write_tables<false, false>(c, instance);
  finish_tables(c, instance);
  last_lower_ns_ = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
  return buf;
}

}  // namespace nanocp::sched
